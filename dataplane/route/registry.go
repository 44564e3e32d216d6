package route

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"github.com/kvrelay/kvrelay/xds/policy"
)

// Params are a plugin's named parameters (policy.Plugin.Params).
type Params map[string]float64

// Get returns the parameter name, or def when it is absent.
func (p Params) Get(name string, def float64) float64 {
	if v, ok := p[name]; ok {
		return v
	}
	return def
}

// FilterPlugin, ScorerPlugin and PickerPlugin are what a Registry knows of a plugin: how to
// build it from its parameters (each in Params, the only ones it accepts) and, for a
// scorer, its weight; and whether a scorer needs the prompt matched against the index
// (UsesIndex) or predicts latency (Predicts, see Policy). A scorer registered with Predicts
// must fill the request's latency predictions, as PredictedTTFT does; Build refuses one
// that builds anything else.
type (
	FilterPlugin struct {
		Params []string
		New    func(Params) (Filter, error)
	}
	ScorerPlugin struct {
		Params              []string
		UsesIndex, Predicts bool
		New                 func(weight float64, p Params) (Scorer, error)
	}
	PickerPlugin struct {
		Params []string
		New    func(Params) (Picker, error)
	}
)

// Registry resolves a policy.Profile's plugin names to filters, scorers and pickers. Adding
// a scorer is its file in this package plus one line in RegisterBuiltins (or the caller's
// own registration). The program builds one registry (cmd/kvrelay: Builtins) and hands it to
// the proxies, which build pushed profiles with it, and to the control plane, which
// validates a profile with it before pushing it. A Registry is safe for concurrent use once
// registration is done.
type Registry struct {
	filters map[string]FilterPlugin
	scorers map[string]ScorerPlugin
	pickers map[string]PickerPlugin
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{filters: map[string]FilterPlugin{}, scorers: map[string]ScorerPlugin{}, pickers: map[string]PickerPlugin{}}
}

// Filter, Scorer and Picker register a plugin under name; a name registered twice is a
// programming error and panics.
func (r *Registry) Filter(name string, p FilterPlugin) { register(r.filters, "filter", name, p) }
func (r *Registry) Scorer(name string, p ScorerPlugin) { register(r.scorers, "scorer", name, p) }
func (r *Registry) Picker(name string, p PickerPlugin) { register(r.pickers, "picker", name, p) }

func register[P any](m map[string]P, kind, name string, p P) {
	if _, dup := m[name]; dup {
		panic(fmt.Sprintf("route: %s %q registered twice", kind, name))
	}
	m[name] = p
}

// Names lists the registered plugins of each kind, sorted.
func (r *Registry) Names() (filters, scorers, pickers []string) {
	return slices.Sorted(maps.Keys(r.filters)), slices.Sorted(maps.Keys(r.scorers)), slices.Sorted(maps.Keys(r.pickers))
}

// Validate reports why p cannot be built: a malformed profile (policy.Profile.Check), a
// plugin this registry does not have, a parameter it does not take or a value it refuses.
// The control plane calls it before it stores and pushes a profile.
func (r *Registry) Validate(p policy.Profile) error {
	_, err := r.Build(p, Config{})
	return err
}

// Build makes the policy p describes, with cfg's busy thresholds and cache threshold.
func (r *Registry) Build(p policy.Profile, cfg Config) (*Policy, error) {
	if err := p.Check(); err != nil {
		return nil, err
	}
	out := &Policy{Name: cmpName(cfg.Policy), Busy: cfg.Busy, CacheThreshold: cfg.CacheThreshold}
	for _, f := range p.Filters {
		pl, ok := r.filters[f.Name]
		if !ok {
			return nil, unknown("filter", f.Name, r.filters)
		}
		if err := params("filter", f, pl.Params); err != nil {
			return nil, err
		}
		v, err := pl.New(f.Params)
		if err != nil {
			return nil, fmt.Errorf("profile: filter %s: %w", f.Name, err)
		}
		out.Filters = append(out.Filters, v)
	}
	for _, s := range p.Scorers {
		pl, ok := r.scorers[s.Name]
		if !ok {
			return nil, unknown("scorer", s.Name, r.scorers)
		}
		if err := params("scorer", s, pl.Params); err != nil {
			return nil, err
		}
		v, err := pl.New(s.Weight, s.Params)
		if err != nil {
			return nil, fmt.Errorf("profile: scorer %s: %w", s.Name, err)
		}
		if _, ok := v.(predictor); pl.Predicts && !ok {
			return nil, fmt.Errorf("profile: scorer %s is registered as predicting latency, but its %T fills no latency predictions (only predicted-ttft's PredictedTTFT does)", s.Name, v)
		}
		out.Scorers = append(out.Scorers, v)
		out.UsesIndex = out.UsesIndex || pl.UsesIndex
		out.Predicts = out.Predicts || pl.Predicts
	}
	picker := func(kind string, pp policy.Plugin) (Picker, error) {
		pl, ok := r.pickers[pp.Name]
		if !ok {
			return nil, unknown(kind, pp.Name, r.pickers)
		}
		if err := params(kind, pp, pl.Params); err != nil {
			return nil, err
		}
		v, err := pl.New(pp.Params)
		if err != nil {
			return nil, fmt.Errorf("profile: %s %s: %w", kind, pp.Name, err)
		}
		return v, nil
	}
	var err error
	if out.Picker, err = picker("picker", p.Picker); err != nil {
		return nil, err
	}
	if p.Spread != nil {
		if out.Predicts {
			return nil, fmt.Errorf("profile: a spread picker beside a predicting scorer (the prediction spreads by itself below the cache threshold)")
		}
		if out.Spread, err = picker("spread picker", *p.Spread); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func cmpName(name string) string {
	if name == "" {
		return policy.Custom
	}
	return name
}

func unknown[P any](kind, name string, m map[string]P) error {
	return fmt.Errorf("profile: no %s %q (this proxy has %s)", kind, name, strings.Join(slices.Sorted(maps.Keys(m)), ", "))
}

func params(kind string, pl policy.Plugin, accepted []string) error {
	for _, k := range slices.Sorted(maps.Keys(pl.Params)) {
		if !slices.Contains(accepted, k) {
			return fmt.Errorf("profile: %s %s takes no parameter %q (it takes %v)", kind, pl.Name, k, accepted)
		}
	}
	return nil
}

// RegisterBuiltins registers kvrelay's own plugins: the filters model, role and health (which
// repeats what the router applies to every profile, so a profile may name it or not); the
// scorers prefill (params overlap_weight, queue_weight), decode, load and predicted-ttft
// (params compute_weight, background_weight, batch_weight, wait_weight, tail_weight,
// balance_weight, cache_credit); the pickers
// min-cost and latency (param temperature), least-loaded, least-prefill, round-robin,
// random and power-of-two. A scorer's weight multiplies its cost.
func RegisterBuiltins(r *Registry) {
	fixedFilter := func(f Filter) FilterPlugin {
		return FilterPlugin{New: func(Params) (Filter, error) { return f, nil }}
	}
	r.Filter("model", fixedFilter(ModelFilter{}))
	r.Filter("role", fixedFilter(RoleFilter{}))
	r.Filter("health", fixedFilter(HealthFilter{}))
	r.Scorer("prefill", ScorerPlugin{Params: []string{"overlap_weight", "queue_weight"}, UsesIndex: true,
		New: func(w float64, p Params) (Scorer, error) {
			return PrefillCost{Weight: w * p.Get("overlap_weight", DefaultOverlapWeight), QueueWeight: w * p.Get("queue_weight", DefaultQueueWeight)}, nil
		}})
	r.Scorer("decode", ScorerPlugin{New: func(w float64, _ Params) (Scorer, error) { return DecodeCost{Weight: w}, nil }})
	r.Scorer("load", ScorerPlugin{New: func(w float64, _ Params) (Scorer, error) { return LoadCost{Weight: w}, nil }})
	r.Scorer("predicted-ttft", ScorerPlugin{Params: []string{"compute_weight", "background_weight", "batch_weight", "wait_weight", "tail_weight", "balance_weight", "cache_credit", "onboard"}, UsesIndex: true, Predicts: true,
		New: func(w float64, p Params) (Scorer, error) {
			if w != 1 {
				return nil, fmt.Errorf("weight %g: a latency prediction is in seconds and takes weight 1 (tune it with its parameters)", w)
			}
			credit := p.Get("cache_credit", 1)
			if credit > 1 {
				return nil, fmt.Errorf("cache_credit %g outside [0, 1]", credit)
			}
			onboard := p.Get("onboard", 0)
			if onboard != 0 && onboard != onboardAlways && onboard != onboardNever {
				return nil, fmt.Errorf("onboard %g: want 0 (weigh loading against computing), %d (always load) or %d (never load)", onboard, onboardAlways, onboardNever)
			}
			return PredictedTTFT{ComputeWeight: p.Get("compute_weight", DefaultComputeWeight), BackgroundWeight: p.Get("background_weight", DefaultBackgroundWeight),
				BatchWeight: p.Get("batch_weight", DefaultBatchWeight), WaitWeight: p.Get("wait_weight", DefaultWaitWeight), CacheCredit: credit,
				TailWeight: p.Get("tail_weight", DefaultTailWeight), BalanceWeight: p.Get("balance_weight", DefaultBalanceWeight),
				Onboard: int(onboard)}, nil
		}})
	temperature := func(mk func(t float64) Picker) PickerPlugin {
		return PickerPlugin{Params: []string{"temperature"}, New: func(p Params) (Picker, error) {
			t := p.Get("temperature", 0)
			if t > maxTemperature {
				return nil, fmt.Errorf("temperature %g above %g", t, float64(maxTemperature))
			}
			return mk(t), nil
		}}
	}
	noParams := func(mk func() Picker) PickerPlugin {
		return PickerPlugin{New: func(Params) (Picker, error) { return mk(), nil }}
	}
	r.Picker("min-cost", temperature(func(t float64) Picker { return MinCost{Temperature: t} }))
	r.Picker("latency", PickerPlugin{Params: []string{"temperature", "explore"}, New: func(p Params) (Picker, error) {
		t, e := p.Get("temperature", 0), p.Get("explore", DefaultExplore)
		if t > maxTemperature {
			return nil, fmt.Errorf("temperature %g above %g", t, float64(maxTemperature))
		}
		if !(e >= 0 && e <= 1) {
			return nil, fmt.Errorf("explore %g outside [0, 1]", e)
		}
		return LatencyPick{Temperature: t, Explore: e}, nil
	}})
	r.Picker("least-loaded", noParams(func() Picker { return LeastLoaded{} }))
	r.Picker("least-prefill", noParams(func() Picker { return LeastPrefill{} }))
	r.Picker("round-robin", noParams(func() Picker { return &RoundRobin{} })) // its own counter per policy
	r.Picker("random", noParams(func() Picker { return Random{} }))
	r.Picker("power-of-two", noParams(func() Picker { return PowerOfTwo{} }))
}

// maxTemperature bounds a picker's temperature (xds.MaxTemperature).
const maxTemperature = 1e3

// Builtins returns a registry holding RegisterBuiltins' plugins and no others, built once:
// what a proxy or control plane uses when its program hands it none.
var Builtins = sync.OnceValue(func() *Registry {
	r := NewRegistry()
	RegisterBuiltins(r)
	return r
})

// Preset is the profile of a built-in policy name with cfg's weights: what NewPolicy builds.
// Every name routes through the same filters (model, role), after the router's own
// (health and exclusions, see Router.Route).
func Preset(cfg Config) (policy.Profile, error) {
	cfg = cfg.withDefaults()
	p := policy.Profile{Filters: []policy.Plugin{{Name: "model"}, {Name: "role"}}}
	switch cfg.Policy {
	case PolicyKV:
		p.Scorers = []policy.Plugin{
			{Name: "prefill", Weight: 1, Params: map[string]float64{"overlap_weight": cfg.OverlapWeight, "queue_weight": cfg.QueueWeight}},
			{Name: "decode", Weight: DefaultDecodeWeight},
		}
		p.Picker = policy.Plugin{Name: "min-cost", Params: map[string]float64{"temperature": cfg.Temperature}}
		p.Spread = &policy.Plugin{Name: "least-prefill"}
	case PolicyLatency:
		p.Scorers = []policy.Plugin{{Name: "predicted-ttft", Weight: 1, Params: map[string]float64{
			"compute_weight": cfg.ComputeWeight, "background_weight": cfg.BackgroundWeight, "batch_weight": cfg.BatchWeight,
			"wait_weight": cfg.WaitWeight, "tail_weight": cfg.TailWeight, "balance_weight": cfg.BalanceWeight,
			"cache_credit": min(cfg.OverlapWeight/DefaultOverlapWeight, 1), "onboard": onboardCode(cfg.Onboard)}}}
		p.Picker = policy.Plugin{Name: "latency", Params: map[string]float64{"temperature": cfg.Temperature, "explore": cfg.Explore}}
	case PolicyRoundRobin:
		p.Picker = policy.Plugin{Name: "round-robin"}
	case PolicyLeastLoaded, PolicySession:
		p.Picker = policy.Plugin{Name: "least-loaded"}
	case PolicyRandom:
		p.Picker = policy.Plugin{Name: "random"}
	case PolicyPowerOfTwo:
		p.Picker = policy.Plugin{Name: "power-of-two"}
	default:
		return p, fmt.Errorf("unknown routing policy %q (want one of %v, or %s with a profile)", cfg.Policy, PolicyNames(), policy.Custom)
	}
	return p, nil
}
