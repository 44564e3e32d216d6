package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench"
	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

func newBenchCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Replay workloads against an endpoint, or compare routing policies on a local cluster",
		Long: `bench measures what clients feel (TTFT, inter-token latency, end-to-end latency, goodput
under SLOs) and what the fleet does (prefix hit rate against the ideal, per-worker load) for a
workload: a Mooncake JSONL trace (a path), or prefix-groups, multi-turn, agentic, mooncake or
fixed with parameters, e.g. "prefix-groups:groups=16,prompt=2048,requests=400,rate=20".
compare also compares aggregated and disaggregated (prefill/decode) clusters: --setups.`,
	}
	cmd.AddCommand(newBenchRunCmd(), newBenchCompareCmd())
	return cmd
}

// benchFlags are the options run and compare share.
type benchFlags struct {
	workload  string
	seed      uint64
	out       string
	model     string
	sloTTFT   time.Duration
	sloITL    time.Duration
	blockSize int
	opts      bench.Options
}

func (f *benchFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.workload, "workload", "prefix-groups", "workload: a Mooncake trace path or a built-in ("+strings.Join(workload.Names(), ", ")+") with parameters")
	fs.Uint64Var(&f.seed, "seed", 1, "seed of the workload generator")
	fs.StringVar(&f.out, "out", "bench-results", "directory for results.json, results.md and plots")
	fs.StringVar(&f.model, "model", "", "model to request (run: default the endpoint's first; compare: gpt-oss-120b)")
	fs.DurationVar(&f.sloTTFT, "slo-ttft", bench.DefaultSLO.TTFT, "TTFT a request must meet to count toward goodput")
	fs.DurationVar(&f.sloITL, "slo-itl", bench.DefaultSLO.ITL, "mean inter-token gap a request must meet to count toward goodput")
	fs.IntVar(&f.blockSize, "block-size", 16, "KV block size for the ideal hit rate (and the cluster, in compare)")
	fs.Float64Var(&f.opts.Rate, "rate", 0, "Poisson arrivals at this many requests/s instead of the workload's own times (like them, divided by --speedup)")
	fs.IntVar(&f.opts.Concurrency, "concurrency", 0, "keep at most this many requests in flight (closed loop)")
	fs.DurationVar(&f.opts.Duration, "duration", 0, "stop sending after this long")
	fs.IntVar(&f.opts.Requests, "requests", 0, "stop after this many requests")
	fs.Float64Var(&f.opts.Speedup, "replay-speedup", 1, "divide the workload's arrival and think times by this (in compare also the engines' step times, unless --speedup-ratio)")
	deprecatedAlias(fs, "speedup", "replay-speedup")
	fs.Float64Var(&f.opts.TimeScale, "time-scale", 1, "multiply measured times before summarising: the target engines' speedup, to report in their own time (compare sets it to the engine speedup)")
}

func (f *benchFlags) tokenizerFor(model string) (workload.Tokenizer, error) {
	tokSpec, _ := tokenizer.ModelSpecs(model)
	return tokenizer.New(tokSpec)
}

func newBenchRunCmd() *cobra.Command {
	var f benchFlags
	var target string
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Replay a workload against an OpenAI endpoint",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			opts := f.opts
			opts.Target = strings.TrimSuffix(target, "/")
			opts.Model = f.model
			model := f.model
			if model == "" {
				model = "gpt-oss-120b"
			}
			tok, err := f.tokenizerFor(model)
			if err != nil {
				return err
			}
			w, err := workload.Parse(f.workload, f.seed, tok)
			if err != nil {
				return err
			}
			opts.Progress = bench.NewProgress(os.Stderr, "run", len(w.Open))
			res, err := bench.Measure(ctx, target, opts, w, f.seed, bench.SLO{TTFT: f.sloTTFT, ITL: f.sloITL}, f.blockSize)
			opts.Progress.Stop()
			if err != nil {
				return err
			}
			return report(cmd.OutOrStdout(), f.out, []*bench.Result{res}, fmt.Sprintf("kvrelay bench run: %s against %s (seed %d)", w.Spec, target, f.seed))
		},
	}
	cmd.Flags().StringVar(&target, "target", "http://127.0.0.1:8080/v1", "the endpoint's OpenAI base URL")
	cmd.Flags().IntVar(&f.opts.CacheBlocks, "cache-blocks", 0, "the endpoint's KV cache across all its engines, in blocks of --block-size tokens, when known: also report the hit rate one shared LRU cache of that size would reach (a reference for routing)")
	f.register(cmd.Flags())
	return cmd
}

func newBenchCompareCmd() *cobra.Command {
	var f benchFlags
	cc := bench.DefaultClusterConfig()
	var policies, setups, kvScale, kvBandwidth, diskBandwidth string
	var engineSpeedup float64
	cmd := &cobra.Command{
		Use:   "compare",
		Short: "Compare routing policies or cluster setups on a fresh local cluster each, with the identical request stream",
		Long: `compare replays the identical request stream against a fresh local cluster (simulated
workers, control plane, proxy) for each routing policy in --policies, or for each cluster
setup in --setups (each with every policy given by --policies, default latency only), and prints
one table with a column per run and ratios to the first.

A setup is MODE[@THRESHOLD][:POOLS]: agg:N (N workers doing both phases), disagg:P+D (P
prefill and D decode workers; every request prefills on a prefill worker and its KV blocks
move to a decode worker over nixl), conditional:P+D (the same pools; only requests whose
uncached prompt reaches --disagg-threshold tokens prefill remotely, the others on their
decode worker) or conditional@T:P+D (threshold T). For example

  kvrelay bench compare --setups agg:4,disagg:2+2,conditional:2+2 \
    --workload fixed:isl=3000,osl=150,requests=300 --rate 4 --replay-speedup 4

Without --setups, --mode with --workers (agg) or --prefill-workers and --decode-workers
(disagg, conditional) describes the one cluster every policy runs on.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if f.model != "" {
				cc.Model = f.model
			}
			cc.BlockSize = f.blockSize
			cc.Speedup = engineSpeedup
			var err error
			if cc.KVBytesScale, err = sim.ParseScale(kvScale); err != nil {
				return fmt.Errorf("--kv-bytes-scale: %w", err)
			}
			if cc.KVTransferBandwidth, err = engines.ParseBandwidth(kvBandwidth); err != nil {
				return fmt.Errorf("--kv-transfer-bandwidth: %w", err)
			}
			if diskBandwidth != "" {
				if cc.Tiers.DiskBandwidth, err = engines.ParseBandwidth(diskBandwidth); err != nil {
					return fmt.Errorf("--disk-bandwidth: %w", err)
				}
			}
			tok, err := f.tokenizerFor(cc.Model)
			if err != nil {
				return err
			}
			co := bench.CompareOptions{
				Workload: f.workload, Seed: f.seed, Cluster: cc, Run: f.opts,
				SLO: bench.SLO{TTFT: f.sloTTFT, ITL: f.sloITL}, Progress: os.Stderr,
			}
			if setups != "" {
				if co.Setups, err = bench.ParseSetups(setups); err != nil {
					return fmt.Errorf("--setups: %w", err)
				}
				if !cmd.Flags().Changed("policies") {
					policies = route.PolicyDefault
				}
			}
			for _, p := range strings.Split(policies, ",") {
				if p = strings.TrimSpace(p); p != "" {
					co.Policies = append(co.Policies, p)
				}
			}
			rs, err := bench.Compare(ctx, co, tok)
			if err != nil {
				return err
			}
			spec := f.workload
			if len(rs) > 0 {
				spec = rs[0].Workload
			}
			es := engineSpeedup
			if es <= 0 {
				es = f.opts.Speedup
			}
			clusters := cc.Describe()
			if len(co.Setups) > 0 {
				var ds []string
				for _, r := range rs {
					ds = append(ds, r.Label+" = "+r.Cluster)
				}
				clusters = strings.Join(ds, "; ")
			}
			if f.opts.Rate > 0 {
				spec += fmt.Sprintf(" at --rate %g requests/s (Poisson)", f.opts.Rate)
			}
			header := fmt.Sprintf("kvrelay bench compare: %s, %s, arrival speedup %g, engine speedup %g (times below ×%g: the engines' own time), seed %d", spec, clusters, f.opts.Speedup, es, es, f.seed)
			return report(cmd.OutOrStdout(), f.out, rs, header)
		},
	}
	f.register(cmd.Flags())
	fs := cmd.Flags()
	fs.StringVar(&policies, "policies", "latency,kv,round-robin,least-loaded,random", "routing policies to compare; ratios are to the first (with --setups: default latency)")
	fs.StringVar(&setups, "setups", "", "cluster setups to compare, e.g. agg:4,disagg:2+2,conditional:2+2 (MODE[@THRESHOLD][:N or P+D]); ratios are to the first")
	fs.IntVar(&cc.Workers, "workers", cc.Workers, "simulated workers (agg), or the total split in half between prefill and decode (disagg, conditional)")
	fs.StringVar(&cc.Mode, "mode", bench.ModeAgg, "agg (every worker does both phases), disagg (prefill and decode pools, every request prefilled remotely) or conditional (the same pools, remote prefill from --disagg-threshold uncached tokens)")
	fs.IntVar(&cc.PrefillWorkers, "prefill-workers", 0, "prefill workers in modes disagg and conditional (default: half of --workers)")
	fs.IntVar(&cc.DecodeWorkers, "decode-workers", 0, "decode workers in modes disagg and conditional (default: the other half of --workers)")
	fs.IntVar(&cc.DisaggThreshold, "disagg-threshold", bench.DefaultDisaggThreshold, "conditional mode: a request prefills on a prefill worker when more of its prompt tokens than this are not cached on its decode worker")
	fs.StringVar(&kvScale, "kv-bytes-scale", "1/64", "prefill/decode and peer-fetching workers: share of the modelled KV bytes really stored and moved over loopback (lower spares the machine; the modelled transfer time stays)")
	fs.StringVar(&kvBandwidth, "kv-transfer-bandwidth", "50GB/s", "prefill/decode workers: modelled P→D KV transfer bandwidth")
	fs.IntVar(&cc.NumGPUBlocks, "num-gpu-blocks", cc.NumGPUBlocks, "KV blocks per simulated worker")
	fs.IntVar(&cc.MaxNumSeqs, "max-num-seqs", cc.MaxNumSeqs, "sequences per batch of each simulated worker")
	fs.BoolVar(&cc.Static, "static", false, "no control plane: the proxy routes on its own approximate index")
	fs.Float64Var(&cc.CacheThreshold, "cache-threshold", 0, "override the kv policy's cache threshold (0: the default)")
	fs.Float64Var(&cc.OverlapWeight, "overlap-weight", 0, "override the kv policy's overlap weight (0: the default)")
	fs.Float64Var(&cc.QueueWeight, "queue-weight", 0, "override the kv policy's queue weight (0: the default)")
	fs.Float64Var(&cc.ComputeWeight, "compute-weight", -1, "override the latency policy's compute weight (negative: the default)")
	fs.Float64Var(&cc.BatchWeight, "batch-weight", -1, "the proxy's --batch-weight under the latency policy (negative: the proxy's default; 0: off)")
	fs.StringVar((*string)(&cc.Tiers.Eviction), "eviction", "", "the simulated engines' GPU-tier eviction: lru (default) or worm")
	fs.IntVar(&cc.Tiers.CPUOffloadBlocks, "cpu-offload-blocks", 0, "host-memory KV tier of each simulated engine, in blocks (0: none)")
	fs.IntVar(&cc.Tiers.DiskBlocks, "disk-offload-blocks", 0, "disk KV tier of each simulated engine, in blocks, its files under a temporary directory (0: none)")
	fs.IntVar(&cc.Tiers.ReasoningTokens, "reasoning-tokens", 0, "the simulated engines are reasoning models: the first N tokens of each chat completion are reasoning (reasoning_content), and the engines mark such requests' output write-once")
	fs.BoolVar(&cc.Tiers.LearnWriteOnce, "learn-write-once", false, "with --eviction worm: the simulated engines learn whether generated blocks are write-once from what later requests resend")
	fs.BoolVar(&cc.Tiers.SharedDisk, "disk-offload-shared", false, "the disk tier is one directory every simulated engine mounts (shared storage): a block one engine wrote, each loads")
	fs.StringVar((*string)(&cc.Tiers.OffloadOn), "offload-on", "", "when the simulated engines copy blocks to host: store (default) or evict")
	fs.StringVar(&diskBandwidth, "disk-bandwidth", "", "the simulated engines' disk (or shared) tier's modelled read bandwidth, e.g. 500MB/s (default: the simulator's, 5GB/s)")
	fs.IntVar(&cc.Tiers.DiskAdmitMinHits, "disk-admit-min-hits", 0, "reuses a block needs before the disk tier takes it (0: the simulator's default, 2)")
	fs.StringVar(&cc.Onboard, "onboard", "", "latency policy: blocks a worker caches below GPU memory are weighed against computing them (weigh, the default), always loaded or never loaded")
	fs.BoolVar(&cc.Tiers.PeerFetch, "peer-fetch", false, "the simulated engines pull prefixes their peers cache when the latency policy predicts it beats computing them")
	fs.Float64Var(&cc.Tiers.MaxPinnedFraction, "max-pinned-fraction", 0, "most of the GPU tier pins may hold (0: the simulator's default, 0.5)")
	fs.Float64Var(&engineSpeedup, "speedup-ratio", 0, "divide the simulated engines' step times by this, as kvrelay sim --speedup-ratio (default: --replay-speedup; lower raises the load by --replay-speedup/--speedup-ratio)")
	deprecatedAlias(fs, "engine-speedup", "speedup-ratio")
	return cmd
}

// report prints the table and writes the result files.
func report(out io.Writer, dir string, rs []*bench.Result, header string) error {
	fmt.Fprintf(out, "%s\n\n%s%s", header, bench.Table(rs), bench.StallWarnings(rs))
	if dir == "" {
		return nil
	}
	if err := bench.Write(dir, rs, header); err != nil {
		return err
	}
	fmt.Fprintf(out, "\nwrote %s/results.json, results.md and plots\n", dir)
	return nil
}
