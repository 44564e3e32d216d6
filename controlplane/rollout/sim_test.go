package rollout

import (
	"math"
	"math/rand/v2"
	"slices"
	"time"
)

// A virtual-clock fleet for the analysis: conversations (sessions) arrive at random, each
// sends 10 to 20 requests with think times between them, and everything about a
// conversation is shared by its requests, as in agentic traffic: its latency (one worker,
// one prompt), its cache hit rate, its errors. Each proxy report is the arms' cumulative
// figures by conversation group, as proxies send them (64 groups, a conversation's group
// and its place in the split drawn once).

// ttftBounds and itlBounds are the proxies' arm buckets.
var (
	ttftBounds = []float64{0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96}
	itlBounds  = []float64{0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024}
)

const simGroups = 64

// effect is what the candidate arm does to a request.
type effect struct {
	ttft       float64 // TTFT × this (1 when 0)
	slowShare  float64 // a share of requests slowed by slowFactor, the rest × fastFactor
	slowFactor float64
	fastFactor float64
	errorRate  float64 // router errors added
	failAll    bool    // every request a router error
	hitRate    float64 // cached share × this (1 when 0)
}

// traffic is a fleet's workload.
type traffic struct {
	rate        float64 // requests per second
	minN, maxN  int     // requests per conversation
	think       float64 // mean seconds between a conversation's requests
	median      float64 // TTFT median, seconds
	sessionSD   float64 // log-normal spread of a conversation's latency
	requestSD   float64 // log-normal spread of a request's latency within it
	errorRate   float64 // router errors, mean over conversations (a tenth of them err 40 × more often)
	clientError float64 // 4xx answers
	clientGone  float64 // clients that leave
	cand        effect
	// interference slows every request of both arms by this × the candidate's share (a
	// candidate that herds requests onto workers both arms use).
	interference float64
}

func defaultTraffic(rate float64) traffic {
	return traffic{rate: rate, minN: 10, maxN: 20, think: 4, median: 0.15, sessionSD: 0.5, requestSD: 0.5,
		errorRate: 0.005, clientError: 0.005, clientGone: 0.005}
}

type session struct {
	next      float64 // when its next request is sent, seconds
	left      int
	group     int
	split     float64
	latency   float64 // its latency multiplier
	errorRate float64
	hit       float64
}

// fleet is two arms' cumulative figures and the conversations feeding them.
type fleet struct {
	rng          *rand.Rand
	tr           traffic
	now          float64
	sessions     []*session
	stable, cand Arm
}

func newFleet(seed uint64, tr traffic) *fleet {
	f := &fleet{rng: rand.New(rand.NewPCG(seed, 0x5e55)), tr: tr}
	for _, a := range []*Arm{&f.stable, &f.cand} {
		a.TTFT = Histogram{Bounds: ttftBounds, Counts: make([]uint64, len(ttftBounds)+1)}
		a.ITL = Histogram{Bounds: itlBounds, Counts: make([]uint64, len(itlBounds)+1)}
		a.Groups = make([]Group, simGroups)
		for i := range a.Groups {
			a.Groups[i] = Group{ID: uint32(i), TTFT: make([]uint64, len(ttftBounds)+1), ITL: make([]uint64, len(itlBounds)+1)}
		}
	}
	// Start in the steady state: the conversations already running when the rollout begins.
	mean := float64(tr.minN+tr.maxN) / 2
	for range int(tr.rate / mean * mean * tr.think) {
		s := f.newSession(0)
		s.left = 1 + f.rng.IntN(s.left)
		s.next = f.rng.Float64() * tr.think
	}
	return f
}

func (f *fleet) newSession(at float64) *session {
	tr := f.tr
	s := &session{next: at, left: tr.minN + f.rng.IntN(tr.maxN-tr.minN+1), group: f.rng.IntN(simGroups), split: f.rng.Float64(),
		latency: math.Exp(tr.sessionSD * f.rng.NormFloat64()), errorRate: tr.errorRate * 0.25, hit: 0.75 + 0.2*f.rng.Float64()}
	if f.rng.Float64() < 0.1 {
		s.errorRate = tr.errorRate * 7.75 // a tenth of the conversations: mean kept at errorRate
	}
	f.sessions = append(f.sessions, s)
	return s
}

// run advances the fleet to until (seconds), the candidate taking share of the
// conversations (none in shadow).
func (f *fleet) run(until, share float64) {
	tr := f.tr
	mean := float64(tr.minN+tr.maxN) / 2
	for t := f.now; ; {
		t += f.rng.ExpFloat64() / (tr.rate / mean)
		if t >= until {
			break
		}
		f.newSession(t)
	}
	for _, s := range f.sessions {
		for s.left > 0 && s.next < until {
			f.serve(s, share)
			s.left--
			s.next += f.rng.ExpFloat64() * tr.think
		}
	}
	f.sessions = slices.DeleteFunc(f.sessions, func(s *session) bool { return s.left == 0 })
	f.now = until
}

func (f *fleet) serve(s *session, share float64) {
	tr, rng := f.tr, f.rng
	a, cand := &f.stable, s.split < share
	if cand {
		a = &f.cand
	}
	g := &a.Groups[s.group]
	a.Requests++
	g.Requests++
	e := effect{}
	if cand {
		e = tr.cand
	}
	switch u := rng.Float64(); {
	case e.failAll || u < s.errorRate+e.errorRate:
		a.RouterErrors++
		a.Errors++
		g.RouterErrors++
		return
	case u < s.errorRate+e.errorRate+tr.clientError:
		a.ClientErrors++
		a.Errors++
		g.ClientErrors++
		return
	case u < s.errorRate+e.errorRate+tr.clientError+tr.clientGone:
		a.ClientGone++
		g.ClientGone++
	}
	ttft := tr.median * s.latency * math.Exp(tr.requestSD*rng.NormFloat64()) * (1 + tr.interference*share)
	if e.ttft > 0 {
		ttft *= e.ttft
	}
	if e.slowShare > 0 {
		if rng.Float64() < e.slowShare {
			ttft *= e.slowFactor
		} else {
			ttft *= e.fastFactor
		}
	}
	b := bucketOf(ttftBounds, ttft)
	a.TTFT.Counts[b]++
	g.TTFT[b]++
	for range 4 {
		itl := 0.02 * s.latency * math.Exp(0.3*rng.NormFloat64())
		b := bucketOf(itlBounds, itl)
		a.ITL.Counts[b]++
		g.ITL[b]++
	}
	hit := s.hit
	if e.hitRate > 0 {
		hit *= e.hitRate
	}
	cached := uint64(math.Round(100 * min(hit*(0.9+0.2*rng.Float64()), 1)))
	a.PromptBlocks += 100
	a.CachedBlocks += cached
	g.PromptBlocks += 100
	g.CachedBlocks += cached
}

func bucketOf(bounds []float64, v float64) int {
	i := 0
	for i < len(bounds) && v > bounds[i] {
		i++
	}
	return i
}

// simResult is how a simulated rollout ended: its state, when (seconds after its start)
// and the shares it asked for on the way.
type simResult struct {
	r         *Rollout
	at        float64
	shares    []float64
	firstCand float64 // when the candidate got its first request (0: never)
}

// simulate runs a rollout on f every tick (1 s, the control plane's default) until it
// ends, pauses or limit passes; baseline (seconds, 0: none) is the stable arm's window
// before it begins.
func simulate(spec Spec, f *fleet, baseline float64, limit time.Duration) simResult {
	t0 := time.Unix(1_800_000_000, 0)
	var base Arm
	if baseline > 0 {
		before := f.stable.clone()
		f.run(baseline, 0)
		base = f.stable.Sub(before)
	}
	start := f.now
	r, err := New(spec, t0, f.stable.clone(), f.cand.clone())
	if err != nil {
		panic(err)
	}
	r.Baseline = base
	res := simResult{r: r}
	for tick := 1; !r.Done() && r.State != StatePaused && time.Duration(tick)*time.Second <= limit; tick++ {
		share, shadow := r.Share()
		if len(res.shares) == 0 || res.shares[len(res.shares)-1] != share {
			res.shares = append(res.shares, share)
		}
		if shadow {
			share = 0
		}
		f.run(start+float64(tick), share)
		if res.firstCand == 0 && f.cand.Requests > 0 {
			res.firstCand = float64(tick)
		}
		r.Advance(t0.Add(time.Duration(tick)*time.Second), f.stable, f.cand)
		res.at = float64(tick)
	}
	return res
}
