package main

import (
	"log/slog"
	"os"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrelay/kvrelay/controlplane/planner"
)

// plannerFlags are the SLA planner's flags that `kvrelay up --planner` and `kvrelay
// controlplane --planner` share: targets, intervals, predictor and constraints.
type plannerFlags struct {
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

// register adds the shared flags; targetsHelp says in which time the targets are.
func (f *plannerFlags) register(fs *pflag.FlagSet, targetsHelp string) {
	d := planner.DefaultConfig()
	fs.DurationVar(&f.interval, "planner-interval", d.Interval, "planner: throughput-mode interval")
	fs.DurationVar(&f.loadInterval, "planner-load-interval", d.LoadInterval, "planner: load-mode interval (how often the workers are read)")
	fs.DurationVar(&f.ttft, "planner-ttft", d.TTFT, "planner: TTFT target"+targetsHelp)
	fs.DurationVar(&f.itl, "planner-itl", d.ITL, "planner: ITL target"+targetsHelp)
	fs.IntVar(&f.max, "planner-max", 8, "planner: most replicas per pool")
	fs.IntVar(&f.budget, "planner-gpu-budget", 0, "planner: most replicas of all pools together (one GPU each; 0: no budget)")
	fs.StringVar(&f.predictor, "planner-predictor", d.Predictor, "planner: load predictor: constant, holt-winters, kalman, or auto (whichever forecast the held-back recent history best)")
	fs.IntVar(&f.season, "planner-season", d.Season, "planner: Holt-Winters season, in intervals")
	fs.BoolVar(&f.dryRun, "planner-dry-run", false, "planner: decide and report only, never change the fleet")
	_ = fs.MarkDeprecated("planner-dry-run", "use --planner-actuator dry-run")
	fs.DurationVar(&f.cooldown, "planner-cooldown", d.ScaleDownCooldown, "planner: no scale-down of a pool this long after it changed")
	fs.DurationVar(&f.downWindow, "planner-scale-down-window", d.ScaleDownWindow, "planner: scale down only to the largest size wanted within this window (0: the cool-down)")
	fs.Float64Var(&f.hysteresis, "planner-hysteresis", d.Hysteresis, "planner: scale down only when the need with this margin fits fewer replicas")
	fs.Float64Var(&f.headroom, "planner-headroom", d.Headroom, "planner: size pools for the forecast need × (1 + this), spare capacity for bursts and for the time a scale-up takes")
	fs.BoolVar(&f.noLoadMode, "planner-no-load-mode", false, "planner: throughput mode only")
	fs.BoolVar(&f.noFastUp, "planner-no-fast-scale-up", false, "planner: load mode scales up only on latency, not on the short window's demand")
	fs.BoolVar(&f.verbose, "planner-verbose", false, "planner: log every decision, also those that hold")
}

// config fills cfg's planning fields from the flags; targets are divided by speedup (1 for
// real engines).
func (f *plannerFlags) config(cfg *planner.Config, speedup float64) {
	speedup = max(speedup, 1e-9)
	cfg.TTFT = time.Duration(float64(f.ttft) / speedup)
	cfg.ITL = time.Duration(float64(f.itl) / speedup)
	cfg.Interval, cfg.LoadInterval = f.interval, f.loadInterval
	cfg.Predictor, cfg.Season = f.predictor, f.season
	cfg.GPUBudget, cfg.DryRun, cfg.ScaleDownCooldown, cfg.Hysteresis = f.budget, f.dryRun, f.cooldown, f.hysteresis
	cfg.DisableLoadMode, cfg.DisableFastScaleUp = f.noLoadMode, f.noFastUp
	cfg.ScaleDownWindow, cfg.Headroom = f.downWindow, f.headroom
}

// logger is the planner's logger: decisions that hold only with --planner-verbose.
func (f *plannerFlags) logger() *slog.Logger {
	level := slog.LevelInfo
	if f.verbose {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}
