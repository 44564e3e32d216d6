package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"

	"github.com/kvrelay/kvrelay/controlplane/planner"
)

// Actuators `kvrelay controlplane --planner-actuator` knows.
const (
	actuatorKube   = "kube"
	actuatorLocal  = "local"
	actuatorDryRun = "dry-run"
)

// cpPlannerFlags are `kvrelay controlplane`'s --planner flags: the shared planning flags and
// the actuator: Kubernetes Deployments (client-go, with --kubeconfig or in-cluster), local
// `kvrelay sim` processes, or none (decisions only).
type cpPlannerFlags struct {
	plannerFlags
	actuator     string
	deployments  []string // pool=name
	namespace    string
	pools        string
	min          int
	drainTimeout time.Duration
	simArgs      string
	model        string
}

func (f *cpPlannerFlags) register(fs *pflag.FlagSet) {
	fs.BoolVar(&f.enabled, "planner", false, "run the SLA planner: size the worker pools to meet --planner-ttft and --planner-itl (see --planner-actuator)")
	fs.StringVar(&f.profile, "planner-profile", "", "planner: the workers' profile (kvrelay profile --file; required with --planner)")
	fs.StringVar(&f.actuator, "planner-actuator", actuatorKube, "planner: what changes the fleet: kube (scale --planner-deployment through the scale subresource), local (start and stop kvrelay sim processes on this machine) or dry-run (decide and report only)")
	fs.StringArrayVar(&f.deployments, "planner-deployment", nil, "planner: POOL=DEPLOYMENT, the Deployment (or resource with a scale subresource) of a pool: both=vllm, or prefill=… and decode=… (kube; with dry-run, read for the pools' sizes)")
	fs.StringVar(&f.namespace, "planner-namespace", "", "planner: namespace of the Deployments (default: --k8s-namespace)")
	fs.StringVar(&f.pools, "planner-pools", "both", "planner: the pools to size without --planner-deployment: both, or prefill,decode")
	fs.IntVar(&f.min, "planner-min", 1, "planner: fewest replicas per pool (local: the registered workers count, and are never stopped)")
	fs.DurationVar(&f.drainTimeout, "planner-drain-timeout", 2*time.Minute, "planner: the longest a worker is drained before it is removed")
	fs.StringVar(&f.simArgs, "planner-sim-args", "", "planner, local: extra kvrelay sim flags for the workers it starts (e.g. \"--speedup-ratio 2\")")
	fs.StringVar(&f.model, "planner-model", "", "planner, local: the model the started workers serve (default: the simulated engine's)")
	f.plannerFlags.register(fs, "")
}

// plannerEnv is what the control plane command gives the planner.
type plannerEnv struct {
	reg interface {
		planner.WorkerLister
		planner.Registrar
	}
	// kube builds the Kubernetes client (--kubeconfig or in-cluster); tests give a fake.
	kube      func() (kubernetes.Interface, error)
	namespace string // --k8s-namespace
	log       *slog.Logger
	// leader, when set, says whether this control plane replica may scale (--leader-elect).
	leader func() error
}

// parsePools returns the pools to size and, for kube, each pool's Deployment.
func (f *cpPlannerFlags) parsePools() (map[planner.Pool]string, error) {
	out := map[planner.Pool]string{}
	known := []planner.Pool{planner.PoolBoth, planner.PoolPrefill, planner.PoolDecode}
	if len(f.deployments) > 0 {
		for _, d := range f.deployments {
			pool, name, ok := strings.Cut(d, "=")
			if !ok || name == "" || !slices.Contains(known, planner.Pool(pool)) {
				return nil, fmt.Errorf("--planner-deployment %q: want POOL=DEPLOYMENT with POOL both, prefill or decode", d)
			}
			if _, dup := out[planner.Pool(pool)]; dup {
				return nil, fmt.Errorf("--planner-deployment: pool %s given twice", pool)
			}
			out[planner.Pool(pool)] = name
		}
		return out, nil
	}
	if f.actuator == actuatorKube {
		return nil, fmt.Errorf("--planner-actuator kube needs --planner-deployment POOL=DEPLOYMENT")
	}
	for _, p := range strings.Split(f.pools, ",") {
		p = strings.TrimSpace(p)
		if !slices.Contains(known, planner.Pool(p)) {
			return nil, fmt.Errorf("--planner-pools %q: want both, or prefill,decode", f.pools)
		}
		out[planner.Pool(p)] = ""
	}
	return out, nil
}

// build makes the planner and its actuator (not started); close releases what the actuator
// started. The caller serves the planner (SetPlanner) and runs it.
func (f *cpPlannerFlags) build(env plannerEnv) (p *planner.Planner, close func() error, err error) {
	close = func() error { return nil }
	if f.profile == "" {
		return nil, close, fmt.Errorf("--planner needs --planner-profile (measure a worker with kvrelay profile --file)")
	}
	prof, err := planner.LoadProfile(f.profile)
	if err != nil {
		return nil, close, err
	}
	pools, err := f.parsePools()
	if err != nil {
		return nil, close, err
	}
	cfg := planner.DefaultConfig()
	cfg.Pools = map[planner.Pool]planner.PoolLimits{}
	cfg.Profiles = map[planner.Pool]*planner.Profile{}
	for pool := range pools {
		cfg.Pools[pool] = planner.PoolLimits{Min: f.min, Max: max(f.max, f.min)}
		cfg.Profiles[pool] = prof
	}
	f.config(&cfg, 1)
	cfg.Logger = env.log
	cfg.Leader = env.leader
	ns := f.namespace
	if ns == "" {
		ns = env.namespace
	}
	var act planner.Actuator
	switch f.actuator {
	case actuatorKube, actuatorDryRun:
		if f.actuator == actuatorDryRun {
			cfg.DryRun = true
		}
		if len(f.deployments) == 0 {
			act = planner.Registered{Workers: env.reg}
			break
		}
		client, err := env.kube()
		if err != nil {
			return nil, close, fmt.Errorf("planner: %w", err)
		}
		k := &planner.KubeActuator{
			Client: client, Namespace: ns, Deployments: map[planner.Pool]string{},
			Drainer: env.reg, Inflight: planner.Inflight(env.reg, nil), DrainTimeout: f.drainTimeout, Logger: env.log,
		}
		for pool, name := range pools {
			k.Deployments[pool] = name
		}
		act = k
	case actuatorLocal:
		if len(f.deployments) > 0 {
			return nil, close, fmt.Errorf("--planner-deployment is for the kube actuator, not local")
		}
		fixed := map[planner.Pool]int{}
		for _, w := range env.reg.Workers() {
			pool := planner.Pool(w.Role)
			if pool == "" {
				pool = planner.PoolBoth
			}
			fixed[pool]++
		}
		args := strings.Fields(f.simArgs)
		if f.model != "" {
			args = append(args, "--model", f.model)
		}
		l := &planner.LocalActuator{Registry: env.reg, Model: f.model, Fixed: fixed, IDPrefix: "planner-", Args: args,
			DrainTimeout: f.drainTimeout, Logger: env.log}
		for pool := range pools {
			// The registered workers are the floor: the supervisor cannot stop them.
			lim := cfg.Pools[pool]
			lim.Min = max(lim.Min, fixed[pool])
			lim.Max = max(lim.Max, lim.Min)
			cfg.Pools[pool] = lim
		}
		act, close = l, l.Close
	default:
		return nil, close, fmt.Errorf("--planner-actuator %q: want kube, local or dry-run", f.actuator)
	}
	p, err = planner.New(cfg, &planner.MetricsObserver{Workers: env.reg}, act)
	if err != nil {
		_ = close()
		return nil, func() error { return nil }, err
	}
	return p, close, nil
}

// describe is the line the command prints about the planner.
func (f *cpPlannerFlags) describe(out io.Writer, p *planner.Planner, api string) {
	cfg := p.Config()
	what := f.actuator
	if f.actuator == actuatorKube && len(f.deployments) > 0 {
		what += " (" + strings.Join(f.deployments, ", ") + ")"
	}
	fmt.Fprintf(out, "planner   TTFT ≤ %s, ITL ≤ %s, every %s (load checks every %s), actuator %s; decisions at http://%s/v1/planner/decisions\n",
		cfg.TTFT, cfg.ITL, cfg.Interval, cfg.LoadInterval, what, api)
}

// runPlanner runs p until ctx ends, then closes its actuator.
func runPlanner(ctx context.Context, p *planner.Planner, close func() error) error {
	err := p.Run(ctx)
	if cerr := close(); err == nil {
		err = cerr
	}
	return err
}
