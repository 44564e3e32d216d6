package planner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"time"
)

// Pool is a set of interchangeable workers the planner sizes: by role.
type Pool string

// Pools, named as worker roles.
const (
	PoolBoth    Pool = "both"
	PoolPrefill Pool = "prefill"
	PoolDecode  Pool = "decode"
)

// PoolLimits bound one pool.
type PoolLimits struct {
	// Min and Max replicas (Max 0: no maximum but the GPU budget).
	Min int `json:"min"`
	Max int `json:"max"`
	// GPUs per replica, for the budget (0 counts as 1).
	GPUs int `json:"gpus"`
}

func (l PoolLimits) gpus() int { return max(l.GPUs, 1) }

// Config configures a Planner. DefaultConfig fills every field; Validate checks one.
type Config struct {
	// Pools are the pools to size with their limits: PoolBoth alone (aggregated serving) or
	// PoolPrefill and PoolDecode (disaggregated).
	Pools map[Pool]PoolLimits
	// Profiles per pool: PoolBoth needs prefill and decode points, PoolPrefill prefill
	// points, PoolDecode decode points.
	Profiles map[Pool]*Profile
	// TTFT and ITL are the targets, in the profiles' time.
	TTFT, ITL time.Duration
	// Interval is the throughput-mode period (default 60 s); LoadInterval the load-mode
	// period (default 5 s), which is also how often the observer is read.
	Interval, LoadInterval time.Duration
	// Predictor names the forecast of the rate and lengths (PredictorNames, or
	// PredictorAuto to re-choose among them on held-back history); Season its period in
	// Intervals (Holt-Winters).
	Predictor string
	Season    int
	// GPUBudget caps the GPUs of all pools together (0: no cap).
	GPUBudget int
	// ScaleDownCooldown is how long after any change of a pool it may not shrink.
	ScaleDownCooldown time.Duration
	// ScaleDownWindow is the stabilisation window of scale-downs (Kubernetes HPA's
	// behaviour.scaleDown.stabilizationWindowSeconds): a pool shrinks only to the largest
	// size any decision wanted within this window, so a lull shorter than the window (a
	// pause between bursts, an interval that saw little traffic) does not give up replicas
	// the next burst needs. 0: ScaleDownCooldown.
	ScaleDownWindow time.Duration
	// Headroom is spare capacity planned on top of the forecast: pools are sized for
	// need × (1+Headroom). A pool sized exactly for its load runs at the profiled
	// throughput at the target latency, where any burst or step in the arrivals queues and
	// a queue never drains; headroom buys the time a scale-up takes (default 0).
	Headroom float64
	// DisableFastScaleUp turns off load mode's demand check: between intervals, load mode
	// also scales a pool straight up to what the short window's arrivals need (with
	// Headroom), without waiting for every worker to miss its target.
	DisableFastScaleUp bool
	// Hysteresis: throughput mode shrinks a pool only when ceil(needed × (1+Hysteresis))
	// is below its size (grows as soon as ceil(needed) is above it).
	Hysteresis float64
	// LoadLowWater: load mode removes a replica when every worker's estimate is below
	// LoadLowWater × target.
	LoadLowWater float64
	// DisableLoadMode turns load mode off.
	DisableLoadMode bool
	// DryRun decides and records without actuating.
	DryRun bool
	// Leader, when set, is asked before each change: while it answers an error (a control
	// plane replica that follows another), the planner decides and records as in a dry
	// run, with the error as the reason, and the leader's planner acts.
	Leader func() error
	// ScaleAttempts and ScaleBackoff retry a failed actuation within one decision (the next
	// decision retries again).
	ScaleAttempts int
	ScaleBackoff  time.Duration
	// KeepDecisions bounds the decision log (default 256).
	KeepDecisions int
	Logger        *slog.Logger
}

// DefaultConfig is an aggregated pool of 1 to 8 replicas, TTFT 2 s, ITL 50 ms, a 60 s
// interval with 5 s load checks, the constant predictor, a 2 minute cool-down and 20%
// hysteresis.
func DefaultConfig() Config {
	return Config{
		Pools:             map[Pool]PoolLimits{PoolBoth: {Min: 1, Max: 8}},
		TTFT:              2 * time.Second,
		ITL:               50 * time.Millisecond,
		Interval:          60 * time.Second,
		LoadInterval:      5 * time.Second,
		Predictor:         PredictorConstant,
		Season:            24,
		ScaleDownCooldown: 2 * time.Minute,
		Hysteresis:        0.2,
		LoadLowWater:      0.5,
		ScaleAttempts:     3,
		ScaleBackoff:      500 * time.Millisecond,
		KeepDecisions:     256,
	}
}

// Validate checks the config.
func (c *Config) Validate() error {
	if len(c.Pools) == 0 {
		return errors.New("planner config: no pools")
	}
	_, both := c.Pools[PoolBoth]
	_, pre := c.Pools[PoolPrefill]
	_, dec := c.Pools[PoolDecode]
	if both && (pre || dec) || !both && pre != dec {
		return errors.New("planner config: pools must be both, or prefill and decode")
	}
	for pool, l := range c.Pools {
		if l.Min < 0 || l.Max != 0 && l.Max < l.Min {
			return fmt.Errorf("planner config: pool %s: min %d, max %d", pool, l.Min, l.Max)
		}
		prof := c.Profiles[pool]
		if (pool != PoolDecode && !prof.HasPrefill()) || (pool != PoolPrefill && !prof.HasDecode()) {
			return fmt.Errorf("planner config: pool %s has no profile with the points it needs", pool)
		}
	}
	if c.TTFT <= 0 || c.ITL <= 0 {
		return errors.New("planner config: TTFT and ITL targets must be positive")
	}
	if c.Interval <= 0 || c.LoadInterval <= 0 || c.LoadInterval > c.Interval {
		return fmt.Errorf("planner config: intervals %s (throughput) and %s (load) must be positive, load at most throughput", c.Interval, c.LoadInterval)
	}
	if _, err := NewPredictor(c.Predictor, c.Season); err != nil {
		return fmt.Errorf("planner config: %w", err)
	}
	if c.Hysteresis < 0 || c.LoadLowWater < 0 || c.LoadLowWater >= 1 {
		return errors.New("planner config: hysteresis must be ≥ 0 and the low water in [0, 1)")
	}
	if c.Headroom < 0 || c.Headroom > 10 || math.IsNaN(c.Headroom) {
		return fmt.Errorf("planner config: headroom %v must be in [0, 10]", c.Headroom)
	}
	if c.ScaleDownCooldown < 0 || c.ScaleDownWindow < 0 {
		return errors.New("planner config: the scale-down cool-down and window must not be negative")
	}
	return nil
}

// WorkerLoad is one worker as an observation sees it.
type WorkerLoad struct {
	ID       string  `json:"id"`
	Pool     Pool    `json:"pool"`
	Draining bool    `json:"draining,omitempty"`
	Running  int     `json:"running"`
	Waiting  int     `json:"waiting"`
	KVUsage  float64 `json:"kv_usage"`
	// TTFT and ITL are the worker's mean latencies over the observation's window; zero
	// when nothing was measured in it.
	TTFT time.Duration `json:"ttft"`
	ITL  time.Duration `json:"itl"`
}

// Observation is the fleet's traffic over a window (counter deltas) and its state at the end.
type Observation struct {
	At     time.Time     `json:"at"`
	Window time.Duration `json:"window"`
	// Requests finished, and their prompt and output tokens, in the window.
	Requests, PromptTokens, OutputTokens float64
	// Arrivals estimates the requests that arrived in the window: those finished plus the
	// growth of the requests in flight (running and waiting) over the fleet. While a fleet
	// is overloaded it finishes fewer requests than arrive, so Requests alone understates
	// the demand exactly when it matters. 0 when the observer cannot tell.
	Arrivals float64
	// PromptLenSum and OutputLenSum are the prompt and output lengths of LenCount finished
	// requests (vLLM's request_prompt_tokens and request_generation_tokens histograms): the
	// mean lengths. Without them (LenCount 0) the token counters over Requests stand in,
	// which overstate the lengths while a queue builds (tokens are counted as they are
	// processed, requests as they finish).
	PromptLenSum, OutputLenSum, LenCount float64
	// TTFTSum/TTFTCount and ITLSum/ITLCount give mean latencies (seconds).
	TTFTSum, TTFTCount, ITLSum, ITLCount float64
	Workers                              []WorkerLoad
}

// lengths returns the mean prompt and output lengths of the requests finished in the
// window; zeros when none finished.
func (a *Observation) lengths() (isl, osl float64) {
	switch {
	case a.LenCount > 0:
		return a.PromptLenSum / a.LenCount, a.OutputLenSum / a.LenCount
	case a.Requests > 0:
		n := max(a.Requests, a.Arrivals)
		return a.PromptTokens / n, a.OutputTokens / n
	}
	return 0, 0
}

// add accumulates o's counts into a.
func (a *Observation) add(o Observation) {
	a.Window += o.Window
	a.Requests += o.Requests
	a.Arrivals += o.Arrivals
	a.PromptLenSum += o.PromptLenSum
	a.OutputLenSum += o.OutputLenSum
	a.LenCount += o.LenCount
	a.PromptTokens += o.PromptTokens
	a.OutputTokens += o.OutputTokens
	a.TTFTSum += o.TTFTSum
	a.TTFTCount += o.TTFTCount
	a.ITLSum += o.ITLSum
	a.ITLCount += o.ITLCount
	a.At, a.Workers = o.At, o.Workers
}

// Observer reads the fleet. The planner calls it from its goroutine every LoadInterval; each
// call returns the counts since the previous one.
type Observer interface {
	Observe(ctx context.Context) (Observation, error)
}

// Actuator changes the fleet. Calls come from the planner's goroutine, one at a time.
type Actuator interface {
	// Replicas returns each pool's current size (as asked for; replicas still starting
	// count).
	Replicas(ctx context.Context) (map[Pool]int, error)
	// Scale makes pool run n replicas, draining any it removes first. It returns when the
	// change is made (not necessarily when new replicas are ready).
	Scale(ctx context.Context, pool Pool, n int) error
}

// Inputs are what a decision was made from.
type Inputs struct {
	RequestRate   float64 `json:"request_rate"`
	ISL           float64 `json:"isl"`
	OSL           float64 `json:"osl"`
	PredictedRate float64 `json:"predicted_rate"`
	PredictedISL  float64 `json:"predicted_isl"`
	PredictedOSL  float64 `json:"predicted_osl"`
	// Predictor is the rate's predictor when Config.Predictor is auto: the one it chose.
	Predictor string `json:"predictor,omitempty"`
	// ObservedTTFTMs and ObservedITLMs are fleet means over the interval (0: none).
	ObservedTTFTMs float64 `json:"observed_ttft_ms"`
	ObservedITLMs  float64 `json:"observed_itl_ms"`
	// PrefillCorrection and DecodeCorrection are observed ÷ profiled latency, as applied.
	PrefillCorrection float64 `json:"prefill_correction"`
	DecodeCorrection  float64 `json:"decode_correction"`
	// ReplicaPrefillTPS and ReplicaDecodeTPS are one replica's throughputs at the
	// (corrected) targets.
	ReplicaPrefillTPS float64 `json:"replica_prefill_tps,omitempty"`
	ReplicaDecodeTPS  float64 `json:"replica_decode_tps,omitempty"`
	// Needed is the fractional replica count throughput mode computed.
	Needed float64 `json:"needed,omitempty"`
	// Workers' estimated latencies (load mode), ms, by worker id.
	WorkerTTFTMs map[string]float64 `json:"worker_ttft_ms,omitempty"`
	WorkerITLMs  map[string]float64 `json:"worker_itl_ms,omitempty"`
}

// Decision is one planning outcome for one pool, kept whether or not it changed anything.
type Decision struct {
	Seq  uint64    `json:"seq"`
	At   time.Time `json:"at"`
	Pool Pool      `json:"pool"`
	// Mode is "throughput" or "load".
	Mode string `json:"mode"`
	From int    `json:"from"`
	To   int    `json:"to"`
	// Reason says why To, in words.
	Reason string `json:"reason"`
	Inputs Inputs `json:"inputs"`
	DryRun bool   `json:"dry_run,omitempty"`
	// Applied is true when the actuator made the change; Error is its failure.
	Applied bool   `json:"applied"`
	Error   string `json:"error,omitempty"`
	// Attempts counts actuator calls.
	Attempts int `json:"attempts,omitempty"`
}

// Modes of a decision.
const (
	ModeThroughput = "throughput"
	ModeLoad       = "load"
)

// poolState is what the planner remembers of one pool.
type poolState struct {
	current    int       // last known size
	floor      int       // throughput mode's last answer
	lastChange time.Time // any change
	pending    int       // a size not yet applied (failed actuation), -1 none
	wants      []want    // sizes decisions wanted within the scale-down window, oldest first
}

// want is a size a decision wanted for a pool (before hysteresis and cool-down), kept for
// the scale-down window.
type want struct {
	at time.Time
	n  int
}

// wanted records that a decision at now wanted n replicas and drops what fell out of the
// scale-down window.
func (p *Planner) wanted(st *poolState, now time.Time, n int) {
	w := p.scaleDownWindow()
	i := 0
	for i < len(st.wants) && now.Sub(st.wants[i].at) > w {
		i++
	}
	st.wants = append(st.wants[i:], want{now, n})
}

// stableSize is the largest size wanted within the scale-down window: the least a pool may
// shrink to now.
func (p *Planner) stableSize(st *poolState, now time.Time) int {
	w, n := p.scaleDownWindow(), 0
	for _, x := range st.wants {
		if now.Sub(x.at) <= w {
			n = max(n, x.n)
		}
	}
	return n
}

func (p *Planner) scaleDownWindow() time.Duration {
	if p.cfg.ScaleDownWindow > 0 {
		return p.cfg.ScaleDownWindow
	}
	return p.cfg.ScaleDownCooldown
}

// ceilNeed rounds a fractional replica count up, forgiving float noise.
func ceilNeed(n float64) int { return int(math.Ceil(n - 1e-9)) }

// Planner sizes pools; see the package documentation. Its exported methods other than Run
// are safe for concurrent use.
type Planner struct {
	cfg Config
	obs Observer
	act Actuator
	log *slog.Logger
	now func() time.Time

	rate, isl, osl Predictor
	corrP, corrD   float64
	acc            Observation // the current interval's accumulated counts
	lastFull       time.Time
	pools          map[Pool]*poolState

	mu        sync.Mutex
	decisions []Decision
	seq       uint64
	last      Inputs
	snap      map[Pool][2]int // current and floor per pool, for readers other than Run
	m         *metrics
}

// New returns a planner. act may be nil with cfg.DryRun.
func New(cfg Config, obs Observer, act Actuator) (*Planner, error) {
	d := DefaultConfig()
	if cfg.KeepDecisions <= 0 {
		cfg.KeepDecisions = d.KeepDecisions
	}
	if cfg.ScaleAttempts <= 0 {
		cfg.ScaleAttempts = 1
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if act == nil && !cfg.DryRun {
		return nil, errors.New("planner: no actuator (use DryRun to only decide)")
	}
	p := &Planner{cfg: cfg, obs: obs, act: act, log: cfg.Logger, now: time.Now, corrP: 1, corrD: 1, pools: map[Pool]*poolState{}}
	p.rate, _ = NewPredictor(cfg.Predictor, cfg.Season)
	p.isl, _ = NewPredictor(cfg.Predictor, cfg.Season)
	p.osl, _ = NewPredictor(cfg.Predictor, cfg.Season)
	for pool := range cfg.Pools {
		p.pools[pool] = &poolState{pending: -1}
	}
	p.m = newMetrics(p)
	return p, nil
}

// Config returns the planner's configuration.
func (p *Planner) Config() Config { return p.cfg }

// Run reads the observer every LoadInterval and plans until ctx ends; it returns nil then.
// Observer errors are logged and the step skipped.
func (p *Planner) Run(ctx context.Context) error {
	if p.act != nil {
		if err := p.syncReplicas(ctx); err != nil {
			p.log.Warn("planner: reading the pools' sizes", "err", err)
		}
	}
	p.lastFull = p.now()
	t := time.NewTicker(p.cfg.LoadInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		o, err := p.obs.Observe(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			p.log.Warn("planner: observing the fleet", "err", err)
			continue
		}
		p.Step(ctx, o)
	}
}

func (p *Planner) syncReplicas(ctx context.Context) error {
	r, err := p.act.Replicas(ctx)
	if err != nil {
		return err
	}
	for pool, st := range p.pools {
		if n, ok := r[pool]; ok {
			st.current = n
		}
	}
	p.snapshot()
	return nil
}

// snapshot publishes the pools' sizes to Replicas and the metrics.
func (p *Planner) snapshot() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.snap = map[Pool][2]int{}
	for pool, st := range p.pools {
		p.snap[pool] = [2]int{st.current, st.floor}
	}
}

// Step takes one observation: load mode on it, and throughput mode when an Interval has
// passed since the last. It returns the decisions made (also kept in the log).
func (p *Planner) Step(ctx context.Context, o Observation) []Decision {
	now := o.At
	if now.IsZero() {
		now = p.now()
	}
	if p.lastFull.IsZero() {
		p.lastFull = now.Add(-o.Window)
	}
	if p.act != nil {
		if err := p.syncReplicas(ctx); err != nil {
			p.log.Warn("planner: reading the pools' sizes", "err", err)
		}
	}
	p.acc.add(o)
	var out []Decision
	if now.Sub(p.lastFull) >= p.cfg.Interval-p.cfg.LoadInterval/2 {
		out = p.throughputStep(ctx, now, p.acc)
		p.acc = Observation{}
		p.lastFull = now
	} else if !p.cfg.DisableLoadMode {
		out = p.loadStep(ctx, now, o)
	}
	p.retryPending(ctx, now, &out)
	return out
}

// demand is the observed and predicted traffic of an interval.
func (p *Planner) demand(a Observation) Inputs {
	var in Inputs
	secs := a.Window.Seconds()
	if secs > 0 {
		// The fleet has to serve what arrives and what it is still finishing: the larger of
		// the two is the demand (arrivals while a queue builds, completions while it drains).
		in.RequestRate = max(a.Requests, a.Arrivals) / secs
	}
	in.ISL, in.OSL = a.lengths()
	if a.TTFTCount > 0 {
		in.ObservedTTFTMs = a.TTFTSum / a.TTFTCount * 1e3
	}
	if a.ITLCount > 0 {
		in.ObservedITLMs = a.ITLSum / a.ITLCount * 1e3
	}
	p.rate.Observe(in.RequestRate)
	if in.ISL > 0 {
		p.isl.Observe(in.ISL)
		p.osl.Observe(in.OSL)
	}
	in.PredictedRate = max(0, p.rate.Predict())
	if a, ok := p.rate.(*Auto); ok {
		in.Predictor = a.Chosen()
	}
	in.PredictedISL = max(1, p.isl.Predict())
	in.PredictedOSL = max(1, p.osl.Predict())
	return in
}

// profileFor returns the profile with the phase's points for a pool.
func (p *Planner) profileFor(pool Pool) *Profile { return p.cfg.Profiles[pool] }

// updateCorrections compares the interval's observed latencies with the profiles'.
func (p *Planner) updateCorrections(in Inputs, a Observation) {
	const smooth = 0.5
	clamp := func(v float64) float64 { return min(max(v, 0.5), 3) }
	prePool, decPool := PoolBoth, PoolBoth
	if _, ok := p.cfg.Pools[PoolPrefill]; ok {
		prePool, decPool = PoolPrefill, PoolDecode
	}
	if in.ObservedTTFTMs > 0 && in.ISL > 0 {
		if exp := ms(p.profileFor(prePool).TTFT(in.ISL, 1)); exp > 0 {
			p.corrP = smooth*p.corrP + (1-smooth)*clamp(in.ObservedTTFTMs/exp)
		}
	}
	if in.ObservedITLMs > 0 {
		var running float64
		n := 0
		for _, w := range a.Workers {
			if w.Pool == decPool && !w.Draining {
				running += float64(w.Running)
				n++
			}
		}
		if n > 0 {
			ctx := in.ISL + in.OSL/2
			if exp := ms(p.profileFor(decPool).ITL(ctx, max(1, running/float64(n)))); exp > 0 {
				p.corrD = smooth*p.corrD + (1-smooth)*clamp(in.ObservedITLMs/exp)
			}
		}
	}
}

// Needed returns the fractional replicas each pool needs for a request rate with mean input
// and output lengths, at the targets divided by the correction factors. It also returns
// one replica's throughputs.
func (p *Planner) Needed(rate, isl, osl, corrP, corrD float64) (need map[Pool]float64, preTPS, decTPS float64) {
	need = map[Pool]float64{}
	ttft := time.Duration(float64(p.cfg.TTFT) / max(corrP, 1e-9))
	itl := time.Duration(float64(p.cfg.ITL) / max(corrD, 1e-9))
	ctxLen := isl + osl/2
	prePool, decPool := PoolBoth, PoolBoth
	if _, ok := p.cfg.Pools[PoolPrefill]; ok {
		prePool, decPool = PoolPrefill, PoolDecode
	}
	preTPS, _ = p.profileFor(prePool).PrefillThroughput(ttft, isl)
	decTPS, _ = p.profileFor(decPool).DecodeThroughput(itl, ctxLen)
	var pre, dec float64
	if preTPS > 0 {
		pre = rate * isl / preTPS
	}
	if decTPS > 0 {
		dec = rate * osl / decTPS
	}
	if prePool == PoolBoth {
		// An aggregated replica shares its time between the phases.
		need[PoolBoth] = pre + dec
	} else {
		need[PoolPrefill], need[PoolDecode] = pre, dec
	}
	return need, preTPS, decTPS
}

// throughputStep is throughput mode over one interval's accumulated observation.
func (p *Planner) throughputStep(ctx context.Context, now time.Time, a Observation) []Decision {
	in := p.demand(a)
	p.updateCorrections(in, a)
	in.PrefillCorrection, in.DecodeCorrection = p.corrP, p.corrD
	// Scale up for the larger of the forecast and what was just observed: a predictor that
	// lags a rise, or smooths it away, must not hold a pool below the load it is serving
	// now. Scale down only on the forecast (a trend predictor can see a fall coming).
	upRate := max(in.PredictedRate, in.RequestRate)
	need, preTPS, decTPS := p.Needed(upRate, in.PredictedISL, in.PredictedOSL, p.corrP, p.corrD)
	needDown, _, _ := p.Needed(in.PredictedRate, in.PredictedISL, in.PredictedOSL, p.corrP, p.corrD)
	in.ReplicaPrefillTPS, in.ReplicaDecodeTPS = preTPS, decTPS
	head := 1 + p.cfg.Headroom
	p.mu.Lock()
	p.last = in
	p.mu.Unlock()

	targets := map[Pool]int{}
	reasons := map[Pool]string{}
	for _, pool := range p.poolOrder() {
		st, lim := p.pools[pool], p.cfg.Pools[pool]
		n := need[pool]
		up := ceilNeed(n * head)
		down := ceilNeed(needDown[pool] * head * (1 + p.cfg.Hysteresis))
		t := st.current
		reason := fmt.Sprintf("needs %.2f replicas (%.1f req/s × %.0f in, %.0f out tokens; %.1f req/s observed)", n, upRate, in.PredictedISL, in.PredictedOSL, in.RequestRate)
		if p.cfg.Headroom > 0 {
			reason += fmt.Sprintf(", %d with %.0f%% headroom", up, p.cfg.Headroom*100)
		}
		stable := p.stableSize(st, now)
		p.wanted(st, now, clampPool(up, lim))
		switch {
		case up > st.current:
			t = up
			reason += ": scale up"
		case down < st.current:
			if cd := p.cooldownLeft(st, now); cd > 0 {
				reason += fmt.Sprintf(": would scale down to %d, cool-down %s left", down, cd.Round(time.Second))
			} else if down < stable {
				t = min(stable, st.current)
				reason += fmt.Sprintf(": would scale down to %d, but %d was wanted within the last %s", down, stable, p.scaleDownWindow())
				if t == st.current {
					reason += ": hold"
				} else {
					reason += fmt.Sprintf(": scale down to %d", t)
				}
			} else {
				t = down
				reason += fmt.Sprintf(": scale down (with %.0f%% hysteresis)", p.cfg.Hysteresis*100)
			}
		default:
			reason += ": within hysteresis, hold"
		}
		t2 := clampPool(t, lim)
		if t2 != t {
			reason += fmt.Sprintf("; limited to [%d, %d]", lim.Min, lim.Max)
			if t2 == st.current {
				reason += ": hold"
			}
		}
		targets[pool], reasons[pool] = t2, reason
		// The floor load mode keeps to is what throughput mode needs (with its headroom),
		// not the held size.
		st.floor = clampPool(up, lim)
	}
	p.applyBudget(targets, reasons)
	var out []Decision
	for _, pool := range p.poolOrder() {
		pin := in
		pin.Needed = need[pool]
		out = append(out, p.decide(ctx, now, pool, ModeThroughput, targets[pool], reasons[pool], pin))
	}
	return out
}

func clampPool(n int, l PoolLimits) int {
	n = max(n, l.Min)
	if l.Max > 0 {
		n = min(n, l.Max)
	}
	return n
}

func (p *Planner) cooldownLeft(st *poolState, now time.Time) time.Duration {
	if st.lastChange.IsZero() {
		return 0
	}
	return st.lastChange.Add(p.cfg.ScaleDownCooldown).Sub(now)
}

// applyBudget shrinks targets proportionally until the GPU budget holds (never below mins).
func (p *Planner) applyBudget(targets map[Pool]int, reasons map[Pool]string) {
	b := p.cfg.GPUBudget
	if b <= 0 {
		return
	}
	total := func() int {
		t := 0
		for pool, n := range targets {
			t += n * p.cfg.Pools[pool].gpus()
		}
		return t
	}
	over := total()
	if over <= b {
		return
	}
	scale := float64(b) / float64(over)
	for pool, n := range targets {
		l := p.cfg.Pools[pool]
		targets[pool] = max(l.Min, int(math.Floor(float64(n)*scale)))
	}
	// Rounding down may leave room: give it back, largest pool first.
	for changed := true; changed; {
		changed = false
		for _, pool := range p.poolOrder() {
			l := p.cfg.Pools[pool]
			if total()+l.gpus() <= b && (l.Max == 0 || targets[pool] < l.Max) && float64(targets[pool]) < float64(over)/float64(l.gpus()) {
				targets[pool]++
				changed = true
			}
		}
	}
	for pool := range targets {
		reasons[pool] += fmt.Sprintf("; GPU budget %d (wanted %d GPUs)", b, over)
	}
}

func (p *Planner) poolOrder() []Pool {
	out := make([]Pool, 0, len(p.pools))
	for _, pool := range []Pool{PoolBoth, PoolPrefill, PoolDecode} {
		if _, ok := p.pools[pool]; ok {
			out = append(out, pool)
		}
	}
	return out
}

// loadStep is load mode on one short observation. Per pool, in order:
//
//  1. Demand (unless DisableFastScaleUp): the window's arrivals, taken at a one-sigma
//     Poisson lower bound (n − √n requests) so that noise alone rarely moves it, plus the
//     rate that clears the pool's backlog within the TTFT target (queueExcess), sized as
//     throughput mode sizes the forecast. A pool that cannot serve that without headroom
//     grows at once to what it needs with Headroom, several replicas at a time if need be:
//     a step in the load is served within one LoadInterval instead of one Interval. The
//     size is kept for the scale-down window.
//  2. Latency: every worker over its target (measured, or estimated from its queue) adds
//     one replica; every worker well below it removes one, never under the throughput
//     floor, within the cool-down, or under a size wanted within the scale-down window.
func (p *Planner) loadStep(ctx context.Context, now time.Time, o Observation) []Decision {
	p.mu.Lock()
	last := p.last
	p.mu.Unlock()
	// Lengths: the window's requests' when it measured them per request, else the last
	// interval's (a short window's token counters over its few finished requests are
	// noisy), else the window's counters.
	isl, osl := last.ISL, last.OSL
	if o.LenCount > 0 || isl <= 0 {
		isl, osl = o.lengths()
	}
	if isl <= 0 {
		return nil // no traffic seen yet
	}
	var out []Decision
	for _, pool := range p.poolOrder() {
		st, lim := p.pools[pool], p.cfg.Pools[pool]
		in := last
		if d, ok := p.fastScaleUp(ctx, now, pool, o, isl, osl, in); ok {
			out = append(out, d)
			continue
		}
		in.WorkerTTFTMs, in.WorkerITLMs = map[string]float64{}, map[string]float64{}
		allOver, allUnder, n := true, true, 0
		for _, w := range o.Workers {
			if w.Pool != pool || w.Draining {
				continue
			}
			n++
			over, under := false, true
			if pool != PoolDecode {
				// The window's mean TTFT lags a queue that is building (its requests have
				// not reached their first token yet): take the larger of it and the
				// queue's estimate, each waiting request a prefill ahead.
				t := ms(w.TTFT)
				if t == 0 || w.Waiting > 0 {
					t = max(t, ms(p.profileFor(pool).TTFT(isl, 1))*float64(1+w.Waiting))
				}
				in.WorkerTTFTMs[w.ID] = t
				over = over || t > ms(p.cfg.TTFT)
				under = under && t < p.cfg.LoadLowWater*ms(p.cfg.TTFT)
			}
			if pool != PoolPrefill {
				t := ms(w.ITL)
				if t == 0 {
					t = ms(p.profileFor(pool).ITL(isl+osl/2, float64(max(w.Running, 1))))
				}
				in.WorkerITLMs[w.ID] = t
				over = over || t > ms(p.cfg.ITL)
				under = under && t < p.cfg.LoadLowWater*ms(p.cfg.ITL)
			}
			allOver = allOver && over
			allUnder = allUnder && under
		}
		if n == 0 {
			continue
		}
		switch {
		case allOver && (lim.Max == 0 || st.current < lim.Max) && p.budgetAllows(pool):
			p.wanted(st, now, st.current+1)
			out = append(out, p.decide(ctx, now, pool, ModeLoad, st.current+1, fmt.Sprintf("every one of %d workers over its target: scale up one", n), in))
		case allUnder && st.current > max(st.floor, lim.Min, p.stableSize(st, now)) && p.cooldownLeft(st, now) <= 0:
			out = append(out, p.decide(ctx, now, pool, ModeLoad, st.current-1, fmt.Sprintf("every one of %d workers below %.0f%% of its target: scale down one (throughput floor %d)", n, p.cfg.LoadLowWater*100, st.floor), in))
		}
	}
	return out
}

// fastScaleUp is step 1 of loadStep: it returns a decision when the window's demand needs
// more replicas than pool has.
func (p *Planner) fastScaleUp(ctx context.Context, now time.Time, pool Pool, o Observation, isl, osl float64, in Inputs) (Decision, bool) {
	secs := o.Window.Seconds()
	n := max(o.Requests, o.Arrivals)
	if p.cfg.DisableFastScaleUp || secs <= 0 {
		return Decision{}, false
	}
	queued, queueRate := p.queueExcess(pool, o, isl)
	if n <= 0 && queued == 0 {
		return Decision{}, false
	}
	st, lim := p.pools[pool], p.cfg.Pools[pool]
	rate := max(0, n-math.Sqrt(n))/secs + queueRate
	need, preTPS, decTPS := p.Needed(rate, isl, osl, p.corrP, p.corrD)
	want := clampPool(ceilNeed(need[pool]*(1+p.cfg.Headroom)), lim)
	p.wanted(st, now, want)
	// Only a pool that cannot serve even the lower bound (without headroom) grows here:
	// headroom over a noisy short window is throughput mode's business, over the interval.
	if ceilNeed(need[pool]) <= st.current {
		return Decision{}, false
	}
	if want = p.budgetCap(pool, want); want <= st.current {
		return Decision{}, false
	}
	in.RequestRate, in.ISL, in.OSL = n/secs, isl, osl
	in.ReplicaPrefillTPS, in.ReplicaDecodeTPS, in.Needed = preTPS, decTPS, need[pool]
	reason := fmt.Sprintf("demand: %.0f requests in %s", n, o.Window.Round(time.Millisecond))
	if queued > 0 {
		reason += fmt.Sprintf(" and %.0f queued past the TTFT target", queued)
	}
	reason += fmt.Sprintf(" (at least %.1f req/s) × %.0f in, %.0f out tokens need %.2f replicas, %d with %.0f%% headroom: scale up",
		rate, isl, osl, need[pool], want, p.cfg.Headroom*100)
	return p.decide(ctx, now, pool, ModeLoad, want, reason, in), true
}

// queueExcess is the backlog of a pool that prefills: on each worker, the waiting requests
// beyond those it can start within the TTFT target (each a prefill of the profiled TTFT at
// concurrency 1 ahead, as load mode's latency estimate counts them), and the rate that
// clears them within one TTFT target. A fleet sized exactly for its arrivals never drains a
// backlog (no worker has capacity to spare), and every request behind it misses the target;
// the backlog is demand too.
func (p *Planner) queueExcess(pool Pool, o Observation, isl float64) (queued, rate float64) {
	if pool == PoolDecode {
		return 0, 0
	}
	one := ms(p.profileFor(pool).TTFT(isl, 1))
	target := ms(p.cfg.TTFT)
	if one <= 0 || target <= 0 {
		return 0, 0
	}
	fit := target / one
	for _, w := range o.Workers {
		if w.Pool == pool && !w.Draining {
			queued += max(0, float64(w.Waiting+1)-fit)
		}
	}
	return queued, queued / p.cfg.TTFT.Seconds()
}

// budgetCap lowers a wanted size of pool to what the GPU budget leaves it beside the other
// pools' current sizes (never below its current size).
func (p *Planner) budgetCap(pool Pool, n int) int {
	if p.cfg.GPUBudget <= 0 {
		return n
	}
	others := 0
	for q, st := range p.pools {
		if q != pool {
			others += st.current * p.cfg.Pools[q].gpus()
		}
	}
	return max(p.pools[pool].current, min(n, (p.cfg.GPUBudget-others)/p.cfg.Pools[pool].gpus()))
}

func (p *Planner) budgetAllows(pool Pool) bool {
	if p.cfg.GPUBudget <= 0 {
		return true
	}
	t := 0
	for q, st := range p.pools {
		t += st.current * p.cfg.Pools[q].gpus()
	}
	return t+p.cfg.Pools[pool].gpus() <= p.cfg.GPUBudget
}

// decide records a decision and actuates it when it changes the pool.
func (p *Planner) decide(ctx context.Context, now time.Time, pool Pool, mode string, to int, reason string, in Inputs) Decision {
	st := p.pools[pool]
	d := Decision{At: now, Pool: pool, Mode: mode, From: st.current, To: to, Reason: reason, Inputs: in, DryRun: p.cfg.DryRun}
	if to != st.current {
		if p.cfg.DryRun {
			d.Reason += " (dry run: not applied)"
		} else if err := p.leads(); err != nil {
			d.Reason += " (not applied: " + err.Error() + ")"
		} else {
			p.actuate(ctx, now, st, pool, &d)
		}
	}
	p.record(d)
	return d
}

// leads returns nil where this planner may act.
func (p *Planner) leads() error {
	if p.cfg.Leader == nil {
		return nil
	}
	return p.cfg.Leader()
}

// actuate calls the actuator with retries; a failure is kept as pending and retried at the
// next step.
func (p *Planner) actuate(ctx context.Context, now time.Time, st *poolState, pool Pool, d *Decision) {
	var err error
	for d.Attempts = 1; ; d.Attempts++ {
		if err = p.act.Scale(ctx, pool, d.To); err == nil {
			break
		}
		p.m.actuationErrors.WithLabelValues(string(pool)).Inc()
		p.log.Error("planner: scaling failed", "pool", pool, "to", d.To, "attempt", d.Attempts, "err", err)
		if d.Attempts >= p.cfg.ScaleAttempts || ctx.Err() != nil {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(p.cfg.ScaleBackoff << (d.Attempts - 1)):
		}
	}
	if err != nil {
		d.Error = err.Error()
		st.pending = d.To
		return
	}
	d.Applied = true
	st.current, st.lastChange, st.pending = d.To, now, -1
}

// retryPending retries sizes whose actuation failed and that no decision has replaced.
func (p *Planner) retryPending(ctx context.Context, now time.Time, out *[]Decision) {
	for _, pool := range p.poolOrder() {
		st := p.pools[pool]
		if st.pending < 0 || st.pending == st.current || p.cfg.DryRun {
			st.pending = -1
			continue
		}
		if slices.ContainsFunc(*out, func(d Decision) bool { return d.Pool == pool }) {
			continue
		}
		*out = append(*out, p.decide(ctx, now, pool, "retry", st.pending, "retrying a failed scale", p.last))
	}
}

func (p *Planner) record(d Decision) {
	p.mu.Lock()
	p.seq++
	d.Seq = p.seq
	p.decisions = append(p.decisions, d)
	if len(p.decisions) > p.cfg.KeepDecisions {
		p.decisions = slices.Delete(p.decisions, 0, len(p.decisions)-p.cfg.KeepDecisions)
	}
	p.mu.Unlock()
	p.snapshot()
	p.m.observe(d)
	attrs := []any{"seq", d.Seq, "pool", d.Pool, "mode", d.Mode, "from", d.From, "to", d.To, "reason", d.Reason,
		"rate", round2(d.Inputs.RequestRate), "predicted_rate", round2(d.Inputs.PredictedRate),
		"isl", round2(d.Inputs.PredictedISL), "osl", round2(d.Inputs.PredictedOSL),
		"corr_prefill", round2(d.Inputs.PrefillCorrection), "corr_decode", round2(d.Inputs.DecodeCorrection)}
	switch {
	case d.Error != "":
		p.log.Error("planner decision failed", append(attrs, "err", d.Error, "attempts", d.Attempts)...)
	case d.From != d.To:
		p.log.Info("planner decision", append(attrs, "applied", d.Applied, "dry_run", d.DryRun)...)
	default:
		p.log.Debug("planner decision", attrs...)
	}
}

func round2(v float64) float64 { return math.Round(v*100) / 100 }

// Decisions returns the kept decisions, oldest first (the slice is the caller's).
func (p *Planner) Decisions() []Decision {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.decisions)
}

// Replicas returns each pool's size as the planner last knew it.
func (p *Planner) Replicas() map[Pool]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[Pool]int{}
	for pool, v := range p.snap {
		out[pool] = v[0]
	}
	return out
}
