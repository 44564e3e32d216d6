package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"

	"github.com/spf13/pflag"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/planner"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// upPlannerFlags are `kvrelay up`'s --planner flags.
type upPlannerFlags struct {
	plannerFlags
	actuator string
}

func (f *upPlannerFlags) register(fs *pflag.FlagSet) {
	fs.BoolVar(&f.enabled, "planner", false, "run the SLA planner: it adds and removes simulated worker processes (kvrelay sim) to meet --planner-ttft and --planner-itl; the workers up starts are each pool's minimum")
	fs.StringVar(&f.actuator, "planner-actuator", actuatorLocal, "planner: what changes the fleet: local (start and stop kvrelay sim processes) or dry-run (decide and report only)")
	fs.StringVar(&f.profile, "planner-profile", "", "planner: the workers' profile (kvrelay profile --file); default: measure the first worker at start")
	f.plannerFlags.register(fs, ", in the engines' own time (divided by --speedup-ratio)")
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
	switch f.actuator {
	case actuatorLocal:
	case actuatorDryRun:
		f.dryRun = true
	default:
		return nil, fmt.Errorf("--planner-actuator must be %s or %s, got %q", actuatorLocal, actuatorDryRun, f.actuator)
	}
	log := f.logger()
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
	f.config(&cfg, env.speedup)
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
