package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/planner"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// upPlannerFlags are `kvrelay up`'s --planner flags.
type upPlannerFlags struct {
	enabled      bool
	profile      string
	interval     time.Duration
	loadInterval time.Duration
	ttft, itl    time.Duration
	max          int
	budget       int
	predictor    string
	season       int
	dryRun       bool
	cooldown     time.Duration
	downWindow   time.Duration
	hysteresis   float64
	headroom     float64
	noLoadMode   bool
	noFastUp     bool
	verbose      bool
}

func (f *upPlannerFlags) register(fs *pflag.FlagSet) {
	d := planner.DefaultConfig()
	fs.BoolVar(&f.enabled, "planner", false, "run the SLA planner: it adds and removes simulated worker processes (kvrelay sim) to meet --planner-ttft and --planner-itl; the workers up starts are each pool's minimum")
	fs.StringVar(&f.profile, "planner-profile", "", "planner: the workers' profile (kvrelay profile --out); default: measure the first worker at start")
	fs.DurationVar(&f.interval, "planner-interval", d.Interval, "planner: throughput-mode interval")
	fs.DurationVar(&f.loadInterval, "planner-load-interval", d.LoadInterval, "planner: load-mode interval (how often the workers are read)")
	fs.DurationVar(&f.ttft, "planner-ttft", d.TTFT, "planner: TTFT target, in the engines' own time (divided by --speedup-ratio)")
	fs.DurationVar(&f.itl, "planner-itl", d.ITL, "planner: ITL target, in the engines' own time (divided by --speedup-ratio)")
	fs.IntVar(&f.max, "planner-max", 8, "planner: most replicas per pool")
	fs.IntVar(&f.budget, "planner-gpu-budget", 0, "planner: most replicas of all pools together (one GPU each; 0: no budget)")
	fs.StringVar(&f.predictor, "planner-predictor", d.Predictor, "planner: load predictor: constant, holt-winters or kalman")
	fs.IntVar(&f.season, "planner-season", d.Season, "planner: Holt-Winters season, in intervals")
	fs.BoolVar(&f.dryRun, "planner-dry-run", false, "planner: decide and report only, never start or stop workers")
	fs.DurationVar(&f.cooldown, "planner-cooldown", d.ScaleDownCooldown, "planner: no scale-down of a pool this long after it changed")
	fs.DurationVar(&f.downWindow, "planner-scale-down-window", d.ScaleDownWindow, "planner: scale down only to the largest size wanted within this window (0: the cool-down)")
	fs.Float64Var(&f.hysteresis, "planner-hysteresis", d.Hysteresis, "planner: scale down only when the need with this margin fits fewer replicas")
	fs.Float64Var(&f.headroom, "planner-headroom", d.Headroom, "planner: size pools for the forecast need × (1 + this), spare capacity for bursts and for the time a scale-up takes")
	fs.BoolVar(&f.noLoadMode, "planner-no-load-mode", false, "planner: throughput mode only")
	fs.BoolVar(&f.noFastUp, "planner-no-fast-scale-up", false, "planner: load mode scales up only on latency, not on the short window's demand")
	fs.BoolVar(&f.verbose, "planner-verbose", false, "planner: log every decision, also those that hold")
}

// upPlannerEnv is what the planner needs from `kvrelay up`.
type upPlannerEnv struct {
	cp        *controlplane.Server
	workers   []upWorker
	model     string
	blockSize int
	gpuBlocks int
	speedup   float64
	host      string
}

// start starts the planner over up's control plane, if --planner; stop stops it and the
// workers it started.
func (f *upPlannerFlags) start(ctx context.Context, out io.Writer, env upPlannerEnv) (stop func(), err error) {
	if !f.enabled {
		return func() {}, nil
	}
	if env.cp == nil {
		return nil, fmt.Errorf("--planner needs the control plane: drop --static")
	}
	level := slog.LevelInfo
	if f.verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	fixed := map[planner.Pool]int{}
	first := map[planner.Pool]upWorker{}
	for _, w := range env.workers {
		pool := planner.Pool(w.role)
		if _, ok := first[pool]; !ok {
			first[pool] = w
		}
		fixed[pool]++
	}
	// The workers run once up's setup returns: profile them and plan in the background.
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	var act *planner.LocalActuator
	go func() {
		defer close(done)
		p, a, err := f.build(ctx, out, env, fixed, first, log)
		act = a
		if err != nil {
			if ctx.Err() == nil {
				log.Error("planner not started", "err", err)
			}
			return
		}
		_ = p.Run(ctx)
	}()
	what := "scaling with simulated worker processes"
	if f.dryRun {
		what = "dry run: decisions only"
	}
	fmt.Fprintf(out, "planner   TTFT ≤ %s, ITL ≤ %s (engine time), every %s (load checks every %s), up to %d per pool; %s; decisions at http://%s/v1/planner/decisions\n",
		f.ttft, f.itl, f.interval, f.loadInterval, f.max, what, env.cp.APIAddr())
	return func() {
		cancel()
		<-done
		if act != nil {
			_ = act.Close()
		}
	}, nil
}

// build profiles the workers (unless --planner-profile) and builds the planner and its
// local actuator.
func (f *upPlannerFlags) build(ctx context.Context, out io.Writer, env upPlannerEnv, fixed map[planner.Pool]int, first map[planner.Pool]upWorker, log *slog.Logger) (*planner.Planner, *planner.LocalActuator, error) {
	var err error
	cfg := planner.DefaultConfig()
	cfg.Pools = map[planner.Pool]planner.PoolLimits{}
	cfg.Profiles = map[planner.Pool]*planner.Profile{}
	speedup := max(env.speedup, 1e-9)
	for pool, n := range fixed {
		cfg.Pools[pool] = planner.PoolLimits{Min: n, Max: max(f.max, n)}
		var p *planner.Profile
		if f.profile != "" {
			if p, err = planner.LoadProfile(f.profile); err != nil {
				return nil, nil, err
			}
		} else {
			w := first[pool]
			fmt.Fprintf(out, "planner   profiling %s (%s) …\n", w.id, w.role)
			mc := planner.DefaultMeasureConfig()
			mc.Target, mc.Role, mc.Model = w.w.URL()+"/v1", string(w.role), env.model
			mc.ISLs, mc.PrefillConcurrency, mc.DecodeConcurrency = []int{256, 1024, 3072}, []int{1, 2, 4, 8}, []int{1, 8, 32, 64}
			if w.role == sim.RoleDecode {
				mc.Role = "decode"
			}
			if p, err = planner.Measure(ctx, mc); err != nil {
				return nil, nil, fmt.Errorf("planner: profiling %s: %w", w.id, err)
			}
		}
		cfg.Profiles[pool] = p
	}
	cfg.TTFT = time.Duration(float64(f.ttft) / speedup)
	cfg.ITL = time.Duration(float64(f.itl) / speedup)
	cfg.Interval, cfg.LoadInterval = f.interval, f.loadInterval
	cfg.Predictor, cfg.Season = f.predictor, f.season
	cfg.GPUBudget, cfg.DryRun, cfg.ScaleDownCooldown, cfg.Hysteresis = f.budget, f.dryRun, f.cooldown, f.hysteresis
	cfg.DisableLoadMode, cfg.DisableFastScaleUp = f.noLoadMode, f.noFastUp
	cfg.ScaleDownWindow, cfg.Headroom = f.downWindow, f.headroom
	cfg.Logger = log
	act := &planner.LocalActuator{
		Registry: env.cp.Registry(), Host: env.host, Model: env.model, BlockSize: env.blockSize, Fixed: fixed, IDPrefix: "s",
		Args: []string{"--model", env.model, "--speedup-ratio", strconv.FormatFloat(env.speedup, 'g', -1, 64),
			"--num-gpu-blocks", strconv.Itoa(env.gpuBlocks), "--block-size", strconv.Itoa(env.blockSize)},
		Logger: log,
	}
	p, err := planner.New(cfg, &planner.MetricsObserver{Workers: env.cp.Registry()}, act)
	if err != nil {
		return nil, nil, err
	}
	if err := env.cp.SetPlanner(p.Handler(), p.Collector()); err != nil {
		return nil, nil, err
	}
	return p, act, nil
}
