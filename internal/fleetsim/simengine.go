package fleetsim

import (
	"math"
	"strconv"
	"time"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// simEngine drives an engines/sim Engine on the fleet's clock: one StepAt per step, its
// outputs read when the step ends.
type simEngine struct {
	fl      *fleet
	idx     int
	e       *sim.Engine
	busy    bool
	stepEnd int64 // virtual time the step in progress ends
	active  []*simFlight
	buf     []uint32
}

type simFlight struct {
	f *flight
	r *sim.Request
}

func newSimEngine(fl *fleet, idx int, cfg sim.Config) (*simEngine, error) {
	cfg.Model = fl.cfg.Model
	cfg.BlockSize = fl.cfg.BlockSize
	se := &simEngine{fl: fl, idx: idx}
	var sink sim.EventSink
	if x, ok := fl.index.(*exactIndex); ok {
		sink = cacheSink{x: x, w: idx}
	}
	e, err := sim.NewEngine(cfg, fl.filler, sink, nil)
	if err != nil {
		return nil, err
	}
	se.e = e
	return se, nil
}

func (se *simEngine) submit(f *flight) error {
	p := sim.Params{MaxTokens: f.req.MaxTokens, IgnoreEOS: f.req.IgnoreEOS}
	r, err := se.e.NewRequest(strconv.Itoa(f.rec), f.tokens, blockhash.Keys{}, p)
	if err != nil {
		return err
	}
	se.e.Submit(r)
	se.active = append(se.active, &simFlight{f: f, r: r})
	if !se.busy {
		se.step(se.fl.vt)
	}
	return nil
}

func (se *simEngine) next() int64 {
	if !se.busy {
		return math.MaxInt64
	}
	return se.stepEnd
}

func (se *simEngine) advance(t int64) {
	for se.busy && se.stepEnd <= t {
		at := se.stepEnd
		saved := se.fl.vt
		se.fl.vt = at
		se.collect()
		se.step(at)
		se.fl.vt = max(saved, at)
	}
}

// step starts the engine's next step at virtual time t.
func (se *simEngine) step(t int64) {
	end, busy := se.e.StepAt(time.Unix(0, se.fl.base+t))
	se.busy = busy
	if busy {
		se.stepEnd = max(end.UnixNano()-se.fl.base, t+1)
	}
}

// collect reads what the step that just ended gave each request. Callbacks may submit new
// requests to this engine (a session's next call): they join se.active for the next step.
func (se *simEngine) collect() {
	snapshot := se.active
	se.active = nil
	for _, sf := range snapshot {
		before := len(sf.f.out)
		toks, done, _, cached := sf.r.Output(sf.f.out, before)
		sf.f.out = toks
		if len(toks) > 0 && sf.f.first == 0 {
			sf.f.firstToken()
		}
		if len(toks) > before {
			sf.f.usage.Generated(len(toks))
		}
		if done {
			sf.f.done(toks, cached)
			continue
		}
		se.active = append(se.active, sf)
	}
}

func (se *simEngine) load() (int, int, float64) {
	l := se.e.Load()
	return l.Running, l.Waiting, l.KVUsage
}

// cacheSink keeps the exact index from the engine's cache events (GPU tier only).
type cacheSink struct {
	x *exactIndex
	w int
}

func (c cacheSink) CacheEvents(_ time.Time, events []sim.CacheEvent) {
	for _, ev := range events {
		if ev.Medium != "" && ev.Medium != sim.MediumGPU {
			continue
		}
		switch ev.Kind {
		case sim.BlocksStored:
			c.x.store(c.w, ev.Hashes)
		case sim.BlocksRemoved:
			c.x.remove(c.w, ev.Hashes)
		case sim.AllBlocksCleared:
			c.x.clear(c.w)
		}
	}
}
