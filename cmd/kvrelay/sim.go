package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/nixl"
)

// simFlags are the flags of `kvrelay sim`, named as vLLM names its engine arguments.
type simFlags struct {
	listen           string
	workers          int
	loras            []string
	tokenizer        string
	chatTemplate     string
	eventsEndpoint   string
	eventsFormat     string
	eventsConnect    bool
	eventsTopic      string
	replayEndpoint   string
	blockHash        string
	offloadEvents    string
	role             string
	schedulingPolicy string
	kvBandwidth      string
	kvScale          string
	kvListen         string
	kvAdvertiseHost  string
	kvBackends       string
	eviction         string
	offloadOn        string
	hostBandwidth    string
	diskBandwidth    string
	engine           sim.Config
}

func newSimCmd() *cobra.Command {
	f := simFlags{engine: sim.DefaultConfig()}
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Run simulated vLLM-compatible engine workers (no GPU needed)",
		Long: `sim runs one or more simulated engine workers. Each serves vLLM's OpenAI API, keeps a
paged KV cache with prefix caching, schedules with continuous batching on a modelled step
time, publishes vLLM-format KV events over ZMQ and exports vLLM's Prometheus metrics.

With --workers N the workers listen on consecutive ports from --listen, and their KV event
(and replay) endpoints count up from --kv-events-endpoint (and --kv-events-replay-endpoint).

With --role prefill or decode each worker also runs a nixl agent on --kv-transfer-listen
(consecutive ports, or each its own free port with port 0) and speaks vLLM's NixlConnector
protocol: a request with kv_transfer_params {"do_remote_decode": true} is prefilled and
answered with the kv_transfer_params its decode leg needs (its blocks kept until the decode
worker read them, or --kv-transfer-timeout); a request with {"do_remote_prefill": true, ...}
READs those blocks over nixl (--kv-bytes-per-token × --kv-bytes-scale real bytes per token,
checked) and waits the modelled transfer time (--kv-bytes-per-token bytes per token at
--kv-transfer-bandwidth, divided by --speedup-ratio) instead of computing the prompt.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfgs, err := f.workerConfigs()
			if err != nil {
				return err
			}
			return runWorkers(cmd.Context(), cmd.OutOrStdout(), cfgs, func(_ context.Context, out io.Writer, ws []*sim.Worker) (func() error, error) {
				printWorkers(out, ws)
				return nil, nil
			})
		},
	}
	fs := cmd.Flags()
	e := &f.engine
	fs.StringVar(&f.listen, "listen", "127.0.0.1:8001", "address of the first worker's OpenAI API")
	fs.StringVar(&e.Model, "model", e.Model, "model name served (also picks the default tokenizer and chat template)")
	fs.IntVar(&f.workers, "workers", 1, "number of workers in this process, on consecutive ports")
	fs.StringSliceVar(&f.loras, "lora-modules", nil, "LoRA adapters served beside --model, as vLLM's name=path (the path is not read; repeat or comma-separate): a request naming one is keyed apart from the base model's blocks")
	fs.IntVar(&e.BlockSize, "block-size", e.BlockSize, "tokens per KV cache block")
	fs.IntVar(&e.NumGPUBlocks, "num-gpu-blocks", e.NumGPUBlocks, "KV cache blocks per worker")
	fs.IntVar(&e.MaxNumSeqs, "max-num-seqs", e.MaxNumSeqs, "maximum sequences in a batch")
	fs.IntVar(&e.MaxNumBatchedTokens, "max-num-batched-tokens", e.MaxNumBatchedTokens, "token budget of one scheduler step (chunked prefill)")
	fs.IntVar(&e.MaxModelLen, "max-model-len", e.MaxModelLen, "maximum prompt plus output length")
	fs.BoolVar(&e.EnablePrefixCaching, "enable-prefix-caching", e.EnablePrefixCaching, "reuse cached KV blocks of shared prefixes")
	fs.Float64Var(&e.Timing.Speedup, "speedup-ratio", e.Timing.Speedup, "divide every modelled step time by this")
	fs.Float64Var(&e.Timing.PrefillAttention, "prefill-attention-ms", e.Timing.PrefillAttention, "attention cost of prefill: milliseconds per new token per 1000 tokens it attends to (its cached context and the chunk's earlier tokens); 0: prefill cost independent of context")
	fs.Float64Var(&e.Timing.DecodeAttention, "decode-attention-ms", e.Timing.DecodeAttention, "attention cost of decode: milliseconds per 1000 tokens of context summed over a step's decoding sequences; 0: decode cost independent of context")
	fs.StringVar(&f.schedulingPolicy, "scheduling-policy", string(sim.FCFS), "fcfs or priority (lower request priority values run first)")
	fs.StringVar(&f.role, "role", string(sim.RoleBoth), "both, prefill or decode")
	fs.Int64Var(&e.MaxRequestBytes, "max-body-bytes", e.MaxRequestBytes, "largest request body accepted (larger gets 413)")
	deprecatedAlias(fs, "max-request-bytes", "max-body-bytes")
	fs.StringVar(&f.tokenizer, "tokenizer", "", "o200k_harmony, o200k_base, cl100k_base or a tokenizer.json path (default: by model)")
	fs.StringVar(&f.chatTemplate, "chat-template", "", "harmony, chatml, llama3, or a tokenizer_config.json / .jinja path (default: by model)")
	fs.StringVar(&f.eventsEndpoint, "kv-events-endpoint", "", "ZMQ endpoint to publish KV events on, e.g. tcp://127.0.0.1:5557 (empty: off)")
	fs.StringVar(&f.eventsFormat, "kv-events-format", "map", "map (current vLLM) or array (older vLLM) event encoding")
	fs.BoolVar(&f.eventsConnect, "kv-events-connect", false, "connect the PUB socket to a subscriber that binds, instead of binding")
	fs.StringVar(&f.eventsTopic, "kv-events-topic", "", "topic frame of every event message")
	fs.StringVar(&f.replayEndpoint, "kv-events-replay-endpoint", "", "ZMQ ROUTER endpoint that replays buffered events (empty: off)")
	fs.StringVar(&f.blockHash, "kv-block-hash", "int", "form of the engine's block hashes in events: int (uint64) or bytes")
	fs.IntVar(&e.KVBytesPerToken, "kv-bytes-per-token", e.KVBytesPerToken, "KV cache bytes per token of the modelled model (default: gpt-oss-120b in bf16, 36 layers × 8 KV heads × 64 × K,V × 2 bytes); sets the modelled P→D transfer time")
	fs.StringVar(&f.kvBandwidth, "kv-transfer-bandwidth", "50GB/s", "modelled P→D KV transfer bandwidth: GB/s, or a size per second like 800MB/s")
	fs.StringVar(&f.kvScale, "kv-bytes-scale", "1/64", "fraction of --kv-bytes-per-token really stored and moved per token (\"1/64\" or 0.015625)")
	fs.StringVar(&f.kvListen, "kv-transfer-listen", "127.0.0.1:0", "nixl agent address of the first prefill/decode worker (port 0: each worker its own free port), advertised as remote_host/remote_port")
	fs.StringVar(&f.kvAdvertiseHost, "kv-transfer-advertise-host", "", "remote_host to advertise in kv_transfer_params instead of the bound host (needed with a wildcard --kv-transfer-listen)")
	fs.DurationVar(&e.KVTransferTimeout, "kv-transfer-timeout", e.KVTransferTimeout, "how long a prefill worker keeps a request's blocks for its decode worker to read (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT); also bounds one pull")
	fs.StringVar(&f.kvBackends, "kv-transfer-backends", "", "nixl backends in order of preference, e.g. tcp or shm,tcp (default: shared memory with same-host peers, then TCP)")
	fs.Int64Var(&e.KVRegionMaxBytes, "kv-region-max-bytes", e.KVRegionMaxBytes, "cap of a worker's KV transfer region; beyond it block ids share slots modulo the slot count")
	fs.StringVar(&f.eviction, "eviction", string(sim.EvictLRU), "how the GPU tier evicts cached blocks: lru, or worm (generated chat output first, reused blocks outrank once-seen ones of the same age, pinned last)")
	fs.Float64Var(&e.MaxPinnedFraction, "max-pinned-fraction", e.MaxPinnedFraction, "most of the GPU tier that nvext.cache_control pins may hold")
	fs.IntVar(&e.CPUOffloadBlocks, "cpu-offload-blocks", 0, "capacity of the host-memory KV tier in blocks (0: none)")
	fs.StringVar(&e.DiskOffloadDir, "disk-offload-dir", "", "directory of the disk KV tier, a file per block (each worker of the process in its own worker-N subdirectory)")
	fs.IntVar(&e.DiskOffloadBlocks, "disk-offload-blocks", 0, "capacity of the disk KV tier in blocks")
	fs.BoolVar(&e.DiskFsync, "disk-fsync", false, "fsync every block file the disk tier writes")
	fs.IntVar(&e.ReasoningTokens, "reasoning-tokens", 0, "a reasoning model behind vLLM's --reasoning-parser: the first N tokens of each chat completion are reasoning, answered as reasoning_content, and the blocks of such a request's output are write-once (the next turn's prompt drops the reasoning), evicted first under --eviction worm (0: no reasoning)")
	fs.BoolVar(&e.LearnWriteOnce, "learn-write-once", false, "with --eviction worm: learn from what later requests resend whether generated blocks are write-once, and evict them first while they are (no client hint needed)")
	fs.BoolVar(&e.DiskShared, "disk-offload-shared", false, "the disk tier's directory is storage every worker mounts (one directory for all the process's workers; several processes may share it): a block any worker wrote there, every worker loads; published as vLLM's fs tier on shared storage (STORAGE, locality REMOTE)")
	fs.StringVar(&f.offloadEvents, "kv-offload-events", "self-describing", "how the host and disk tiers' stores are published: self-describing (tokens and parent, vLLM's self_describing_kv_events) or placeholder (the hash alone, block_size 0: vLLM's default)")
	fs.BoolVar(&e.PeerFetch, "kv-peer-fetch", false, "give a worker of role both a KV connector: it exports its cached prefixes (POST /kvrelay/kv/export) and pulls a prompt's prefix from the peer kv_transfer_params {\"remote_kv_source\": {\"remote_host\", \"remote_port\"}} names (vLLM's p2p offloading parameter)")
	fs.StringVar(&f.offloadOn, "offload-on", string(sim.OffloadOnStore), "when blocks are copied to host: store (write-through) or evict")
	fs.IntVar(&e.DiskAdmitMinHits, "disk-admit-min-hits", e.DiskAdmitMinHits, "reuses a block needs before it is written to disk")
	fs.StringVar(&f.hostBandwidth, "host-bandwidth", "25GB/s", "modelled host→GPU bandwidth of onboarding a block from the host tier")
	fs.StringVar(&f.diskBandwidth, "disk-bandwidth", "5GB/s", "floor of onboarding from disk: a block takes its real read time or its modelled bytes at this bandwidth, whichever is longer")
	return cmd
}

// workerConfigs expands the flags into one config per worker.
func (f *simFlags) workerConfigs() ([]sim.WorkerConfig, error) {
	if f.workers < 1 {
		return nil, fmt.Errorf("--workers must be at least 1, got %d", f.workers)
	}
	e := f.engine
	e.Role = sim.Role(f.role)
	e.SchedulingPolicy = sim.SchedulingPolicy(f.schedulingPolicy)
	var err error
	if e.KVTransferBandwidth, err = engines.ParseBandwidth(f.kvBandwidth); err != nil {
		return nil, fmt.Errorf("--kv-transfer-bandwidth: %w", err)
	}
	if e.KVBytesScale, err = sim.ParseScale(f.kvScale); err != nil {
		return nil, fmt.Errorf("--kv-bytes-scale: %w", err)
	}
	// Callers that build simFlags without its flags (kvrelay up) keep the engine's defaults.
	if f.eviction != "" {
		e.Eviction = sim.Eviction(f.eviction)
	}
	if f.offloadOn != "" {
		e.OffloadOn = sim.Offload(f.offloadOn)
	}
	if f.hostBandwidth != "" {
		if e.HostBandwidth, err = engines.ParseBandwidth(f.hostBandwidth); err != nil {
			return nil, fmt.Errorf("--host-bandwidth: %w", err)
		}
	}
	if f.diskBandwidth != "" {
		if e.DiskBandwidth, err = engines.ParseBandwidth(f.diskBandwidth); err != nil {
			return nil, fmt.Errorf("--disk-bandwidth: %w", err)
		}
	}
	switch f.offloadEvents {
	case "", "self-describing":
	case "placeholder":
		e.OffloadPlaceholders = true
	default:
		return nil, fmt.Errorf("--kv-offload-events must be self-describing or placeholder, got %q", f.offloadEvents)
	}
	switch f.blockHash {
	case "int":
	case "bytes":
		e.EngineHashBytes = true
	default:
		return nil, fmt.Errorf("--kv-block-hash must be int or bytes, got %q", f.blockHash)
	}
	for _, m := range f.loras {
		name, _, _ := strings.Cut(m, "=")
		e.LoRAModules = append(e.LoRAModules, name)
	}
	if err := e.Validate(); err != nil {
		return nil, err
	}
	format, err := kvevents.ParseFormat(f.eventsFormat)
	if err != nil {
		return nil, fmt.Errorf("--kv-events-format: %w", err)
	}
	codec, err := sim.NewCodec(e.Model, f.tokenizer, f.chatTemplate)
	if err != nil {
		return nil, err
	}
	cfgs := make([]sim.WorkerConfig, f.workers)
	for i := range cfgs {
		listen, err := offsetHostPort(f.listen, i)
		if err != nil {
			return nil, fmt.Errorf("--listen: %w", err)
		}
		c := sim.WorkerConfig{Engine: e, Listen: listen, Codec: codec, KVTransferAdvertiseHost: f.kvAdvertiseHost}
		if e.DiskOffloadDir != "" && f.workers > 1 && !e.DiskShared {
			c.Engine.DiskOffloadDir = filepath.Join(e.DiskOffloadDir, fmt.Sprintf("worker-%d", i))
		}
		for _, b := range strings.Split(f.kvBackends, ",") {
			if b = strings.TrimSpace(b); b != "" {
				c.KVTransferBackends = append(c.KVTransferBackends, nixl.BackendKind(b))
			}
		}
		if e.Role != sim.RoleBoth || e.PeerFetch {
			if c.KVTransferListen, err = offsetHostPort(f.kvListen, i); err != nil {
				return nil, fmt.Errorf("--kv-transfer-listen: %w", err)
			}
		}
		if f.eventsEndpoint != "" {
			ep, err := offsetEndpoint(f.eventsEndpoint, i)
			if err != nil {
				return nil, fmt.Errorf("--kv-events-endpoint: %w", err)
			}
			c.Events = kvevents.PublisherConfig{Endpoint: ep, Connect: f.eventsConnect, Topic: f.eventsTopic, Format: format}
			if f.replayEndpoint != "" {
				if c.Events.ReplayEndpoint, err = offsetEndpoint(f.replayEndpoint, i); err != nil {
					return nil, fmt.Errorf("--kv-events-replay-endpoint: %w", err)
				}
			}
		}
		cfgs[i] = c
	}
	return cfgs, nil
}

// offsetHostPort adds i to the port of host:port; port 0 stays 0 (each worker gets its own
// free port).
func offsetHostPort(hostport string, i int) (string, error) {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return "", err
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p+i > 65535 {
		return "", fmt.Errorf("bad port in %q", hostport)
	}
	if p == 0 {
		return hostport, nil
	}
	return net.JoinHostPort(host, strconv.Itoa(p+i)), nil
}

// offsetEndpoint adds i to the port of a tcp:// ZMQ endpoint; other transports get a suffix.
func offsetEndpoint(ep string, i int) (string, error) {
	if i == 0 {
		return ep, nil
	}
	u, err := url.Parse(ep)
	if err != nil || u.Scheme == "" {
		return "", fmt.Errorf("endpoint %q is not transport://address", ep)
	}
	if u.Scheme != "tcp" {
		return ep + "-" + strconv.Itoa(i), nil
	}
	hp, err := offsetHostPort(strings.TrimPrefix(ep, "tcp://"), i)
	if err != nil {
		return "", err
	}
	return "tcp://" + hp, nil
}

// runWorkers starts every worker, hands them to announce once all are listening (which may
// start more components and return how to run them), and serves until ctx ends (Ctrl-C) or
// one part fails.
func runWorkers(ctx context.Context, out io.Writer, cfgs []sim.WorkerConfig, announce func(context.Context, io.Writer, []*sim.Worker) (func() error, error)) error {
	workers := make([]*sim.Worker, 0, len(cfgs))
	defer func() {
		for _, w := range workers {
			_ = w.Close()
		}
	}()
	for i, c := range cfgs {
		w, err := sim.NewWorker(c)
		if err != nil {
			return fmt.Errorf("worker %d: %w", i, err)
		}
		if err := w.Start(ctx); err != nil {
			_ = w.Close()
			return fmt.Errorf("worker %d: %w", i, err)
		}
		workers = append(workers, w)
	}
	g, gctx := errgroup.WithContext(ctx)
	extra, err := announce(gctx, out, workers)
	if err != nil {
		return err
	}
	// With a proxy in front (extra), the workers outlive it: on a stop the proxy drains the
	// requests in flight, and only then do the engines answering them stop.
	wctx := gctx
	if extra != nil {
		var stopWorkers context.CancelFunc
		wctx, stopWorkers = context.WithCancel(context.WithoutCancel(ctx))
		g.Go(func() error {
			defer stopWorkers()
			return extra()
		})
	}
	for _, w := range workers {
		g.Go(func() error {
			err := w.Run(wctx)
			if err != nil && wctx.Err() == nil {
				return err // a worker that fails on its own stops everything
			}
			return nil
		})
	}
	err = g.Wait()
	fmt.Fprintln(out, "stopped")
	return err
}

func printWorkers(out io.Writer, workers []*sim.Worker) {
	for i, w := range workers {
		line := fmt.Sprintf("worker %d  openai %s/v1", i, w.URL())
		if ep := w.EventsEndpoint(); ep != "" {
			line += "  kv-events " + ep
		}
		if ep := w.ReplayEndpoint(); ep != "" {
			line += "  replay " + ep
		}
		if a := w.KVTransferAddr(); a != "" {
			line += "  kv-transfer " + a + " engine-id " + w.EngineID()
		}
		fmt.Fprintln(out, line)
	}
}
