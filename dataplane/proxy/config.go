package proxy

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/decide"
	"github.com/kvrelay/kvrelay/dataplane/http1"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/xds"
	"github.com/kvrelay/kvrelay/xds/auth"
)

// Tokenizer modes besides a tokenizer spec (see engines/tokenizer.New).
const (
	// TokenizerRemote posts each prompt to a worker's /tokenize (chat messages as they are,
	// so the engine applies its own template).
	TokenizerRemote = decide.TokenizerRemote
	// TokenizerEstimate counts about four bytes per token and hashes the rendered text in
	// fixed byte blocks: approximate, but needs no tokenizer at all.
	TokenizerEstimate = decide.TokenizerEstimate
)

// Upstream is one engine the proxy sends requests to.
type Upstream struct {
	// ID names the worker in metrics and in x-kvrelay-worker (default: its host:port).
	ID string `yaml:"id"`
	// URL is the engine's base URL, http://host:port.
	URL string `yaml:"url"`
	// Model is the model it serves; empty means ask the engine (/v1/models) at start.
	Model string `yaml:"model"`
	// BlockSize overrides Config.BlockSize for this worker.
	BlockSize int `yaml:"block_size"`
	// Capacity is its KV cache size in blocks, if known (for busy thresholds and least-KV).
	Capacity int `yaml:"capacity"`
	// Role is "both" (default: it serves whole requests), "prefill" or "decode" (one pool
	// of a disaggregated deployment, vLLM's NixlConnector kv_producer / kv_consumer).
	Role string `yaml:"role"`
	// MaxNumSeqs and MaxNumBatchedTokens are the engine's scheduler limits (vLLM's
	// --max-num-seqs and --max-num-batched-tokens), 0 when unknown: the latency policy
	// predicts queueing from them.
	MaxNumSeqs          int `yaml:"max_num_seqs"`
	MaxNumBatchedTokens int `yaml:"max_num_batched_tokens"`
	// LoRAModules are the LoRA adapters it serves beside Model (vLLM's --lora-modules
	// names); empty with an empty Model means ask the engine, whose /v1/models lists them.
	LoRAModules []string `yaml:"lora_modules"`
	// MaxModelLen is its context length in tokens (vLLM's --max-model-len; 0: unknown, or
	// asked of the engine with Model): longer prompts are refused with 400 before any
	// engine sees them.
	MaxModelLen int `yaml:"max_model_len"`
	// KVBytesPerToken, HostBandwidth, DiskBandwidth and SharedBandwidth (bytes per second)
	// describe its KV offloading tiers, 0 when unknown: the latency policy prices bringing
	// blocks back from host memory, disk and storage several workers mount with them (the
	// index's tier weights stand in without).
	KVBytesPerToken int     `yaml:"kv_bytes_per_token"`
	HostBandwidth   float64 `yaml:"host_bandwidth"`
	DiskBandwidth   float64 `yaml:"disk_bandwidth"`
	SharedBandwidth float64 `yaml:"shared_bandwidth"`
	// Engine is the engine kind (vllm, sglang, trtllm, sim; "" unknown): what it keeps of a
	// pinned prompt (engines.Kind.Pins).
	Engine string `yaml:"engine"`
	// PeerBandwidth is how fast it pulls a prefix another worker caches (kvrelay's peer
	// fetch); 0: it cannot.
	PeerBandwidth float64 `yaml:"peer_bandwidth"`
	// P2PPort is the engine's P2P side channel (vLLM's OffloadingConnector p2p tier): peer
	// pulls name it, and disaggregated requests take the p2p form (route.Worker.P2PPort).
	P2PPort int `yaml:"p2p_port"`
}

// Disaggregation modes (Config.Disagg).
const (
	// DisaggAuto splits chat and text completions into a prefill leg and a decode leg
	// whenever the pool has prefill-role and decode-role workers for the model.
	DisaggAuto = decide.DisaggAuto
	// DisaggOff never splits: prefill and decode workers take no requests.
	DisaggOff = decide.DisaggOff
)

// Config configures a proxy. Field names are those of the YAML file (--config).
type Config struct {
	// Plugins resolves the routing plugins a pushed profile names (nil: route.Builtins). The
	// program sets it; it has no YAML form.
	Plugins *route.Registry `yaml:"-"`
	// Listen is the client-facing address.
	Listen string `yaml:"listen"`
	// APIKeysFile, when set, is a file of API keys (package tenant: one a line, "<key>
	// tenant=<name>[,weight=<w>][,rps=<n>][,prompt_tps=<n>][,output_tpm=<n>][,cache=<region>]"),
	// read again when it changes: a request to the OpenAI API without a key it lists gets 401,
	// a tenant past one of its budgets 429 with Retry-After. Empty: no keys, every request
	// served.
	APIKeysFile string `yaml:"api_keys_file"`
	// PickOnly runs the proxy without a client listener (Listen is ignored): requests
	// come through Server.Pick, from an endpoint picker in front of which a gateway carries
	// them (kvrelay epp). Everything else (workers, index, policy, load, the latency models,
	// the admission queue) works as for a proxy.
	PickOnly  bool       `yaml:"-"`
	Upstreams []Upstream `yaml:"upstreams"`
	// XDS is the control plane's xDS address (host:port). With it the workers, their load,
	// the routing policy and the KV index replica come from the control plane, and
	// Upstreams must be empty.
	XDS string `yaml:"xds"`
	// ServeModels, with a control plane, are the models this proxy routes: it takes the
	// workers that serve one of them (and those that name no model) and follows only their
	// part of the KV index, so that its journal bytes and replica follow what it routes,
	// not the fleet. Empty: every model.
	ServeModels []string `yaml:"serve_models"`
	// IndexQuery, with a control plane, keeps no replica of the KV index: the proxy asks the
	// control plane's index about each prompt before routing it (one round trip off the
	// event loop, at most IndexQueryTimeout; a prompt whose answer fails routes as
	// uncached). For a pool whose index is too large to replicate in every proxy.
	IndexQuery        bool          `yaml:"index_query"`
	IndexQueryTimeout time.Duration `yaml:"index_query_timeout"`
	// XDSAuth is how the proxy proves itself to the control plane: TLS (the control
	// plane's CA, a client certificate) and a bearer token. Without TLS the xDS address must
	// be loopback, or XDSAuth.Insecure set.
	XDSAuth auth.ClientConfig `yaml:"xds_auth"`
	// NodeID names this proxy to the control plane (default: hostname-pid). A control plane
	// that checks credentials accepts only the node id the proxy's token or certificate was
	// issued for.
	NodeID string `yaml:"node_id"`
	// XDSSyncTimeout bounds how long Start waits for the control plane's first workers;
	// past it the proxy serves anyway (503 until workers arrive).
	XDSSyncTimeout time.Duration `yaml:"xds_sync_timeout"`
	// LoadStaleAfter: a worker's pushed load (its engine's running and waiting requests and
	// KV usage, other proxies' requests there) older than this fades linearly to nothing
	// over as long again, leaving this proxy's own view, so that a control plane that went
	// away does not leave a worker looking busy forever. A running control plane republishes
	// at least every second.
	LoadStaleAfter time.Duration `yaml:"load_stale_after"`
	// EngineMetrics, without a control plane, has the command that runs the proxy poll each
	// upstream's Prometheus metrics (package dataplane/telemetry) for its running and waiting
	// requests and KV usage, as a control plane's load view would: the router then sees the
	// load other clients put on the engines, and learns each one's concurrency limit.
	EngineMetrics bool `yaml:"engine_metrics"`
	// RecentTTL is how long, with a control plane, the proxy remembers where it routed a
	// prompt on its own, until the engine's KV events say so (see prefix.Overlay).
	RecentTTL time.Duration `yaml:"recent_ttl"`
	// DisableLoadReports stops reporting this proxy's in-flight requests to the control
	// plane (and so their sharing with other proxies). For measuring what sharing buys.
	DisableLoadReports bool `yaml:"disable_load_reports"`
	// Route tunes the router (policy, weights, thresholds, sessions).
	Policy        string  `yaml:"policy"`
	OverlapWeight float64 `yaml:"overlap_weight"`
	QueueWeight   float64 `yaml:"queue_weight"`
	Temperature   float64 `yaml:"temperature"`
	// ComputeWeight and BackgroundWeight tune the latency policy (route.PredictedTTFT).
	ComputeWeight    float64 `yaml:"compute_weight"`
	BackgroundWeight float64 `yaml:"background_weight"`
	// BatchWeight weighs the decode slowdown a request's joining a worker's batch causes
	// (route.PredictedTTFT); not part of the pushed policy.
	BatchWeight float64 `yaml:"batch_weight"`
	// WaitWeight weighs a request's wait for a sequence slot once more beside its TTFT
	// (route.PredictedTTFT); not part of the pushed policy.
	WaitWeight float64 `yaml:"wait_weight"`
	// TailWeight weighs the spread of a prediction beside its mean and BalanceWeight the
	// slots a request takes from a worker short of them (route.Config; latency policy).
	TailWeight    float64 `yaml:"tail_weight"`
	BalanceWeight float64 `yaml:"balance_weight"`
	// Explore is the share of the latency policy's decisions that try a worker its model
	// has learned nothing of lately (route.Config.Explore).
	Explore float64 `yaml:"explore"`
	// Onboard is how the latency policy treats blocks a worker caches below GPU memory:
	// weigh (the default), always (load them) or never (compute them) (route.Config.Onboard).
	Onboard        string        `yaml:"onboard"`
	CacheThreshold float64       `yaml:"cache_threshold"`
	SessionTTL     time.Duration `yaml:"session_ttl"`
	// Busy thresholds per worker: uncached prompt tokens still prefilling, KV blocks held,
	// share of a known KV capacity. Zero turns a threshold off.
	BusyPrefillTokens int64   `yaml:"busy_prefill_tokens"`
	BusyDecodeBlocks  int64   `yaml:"busy_decode_blocks"`
	BusyKVFraction    float64 `yaml:"busy_kv_fraction"`
	// BusyRequests is the requests a worker takes at once before it counts as busy (its
	// slots, or fewer; 0: no such threshold). With API keys, TenantHeadroom of them on each
	// worker stay free of a tenant already running its weighted share of the fleet's, for the
	// tenants below theirs, and such a tenant starts no prefill on a worker still prefilling
	// nor on any while half the workers prefill: an interactive tenant finds a slot at once
	// while another floods, on a worker whose next step is not the flood's prefill.
	BusyRequests   int64 `yaml:"busy_requests"`
	TenantHeadroom int64 `yaml:"tenant_headroom"`
	// Disagg is DisaggAuto (default) or DisaggOff. DisaggThreshold is conditional
	// disaggregation: a prompt whose part the chosen decode worker does not cache is at most
	// this many tokens prefills on the decode worker itself (default 512; negative: always
	// prefill remotely). A prompt also prefills locally when every prefill worker is busy.
	// PrefillTimeout bounds the prefill leg; past it the decode worker prefills itself.
	// DisaggMaxQueue is when the prefill pool counts as saturated under conditional
	// disaggregation: the chosen prefill worker has more than this many prompt tokens
	// prefilling or waiting to (0: never).
	Disagg          string        `yaml:"disagg"`
	DisaggThreshold int           `yaml:"disagg_threshold"`
	DisaggMaxQueue  int64         `yaml:"disagg_max_queue"`
	PrefillTimeout  time.Duration `yaml:"prefill_timeout"`
	// BlockSize is the engines' KV block size in tokens.
	BlockSize int `yaml:"block_size"`
	// Tokenizer is a tokenizer spec (o200k_harmony, o200k_base, cl100k_base, a tokenizer.json
	// path), "remote" or "estimate"; empty picks by model. ChatTemplate is a template spec
	// (harmony, chatml, llama3, a tokenizer_config.json or .jinja path); empty picks by model.
	Tokenizer    string `yaml:"tokenizer"`
	ChatTemplate string `yaml:"chat_template"`
	// TokenCacheTokens bounds the cache of tokenized prompt segments.
	TokenCacheTokens int `yaml:"token_cache_tokens"`
	// Index bounds the approximate prefix index.
	IndexBlocks int           `yaml:"index_blocks"`
	IndexTTL    time.Duration `yaml:"index_ttl"`
	// ExposeWorkerHeader adds x-kvrelay-worker to responses (off: it reveals topology).
	ExposeWorkerHeader bool `yaml:"expose_worker_header"`
	// ExposeDecisionHeader adds x-kvrelay-decision to responses of a predicting policy:
	// every candidate worker's predicted TTFT, queue and prefill, and cached blocks.
	ExposeDecisionHeader bool `yaml:"expose_decision_header"`
	// ForwardPriority rewrites a request's priority hint into the engine's own top-level
	// "priority" (vLLM runs lower values first, and refuses priorities unless started with
	// --scheduling-policy priority, hence off by default).
	ForwardPriority bool `yaml:"forward_priority"`

	// Limits on what clients send.
	MaxHeaderBytes int   `yaml:"max_header_bytes"`
	MaxBodyBytes   int64 `yaml:"max_body_bytes"`
	// Timeouts: a request head and body must arrive within ReadTimeout; an idle keep-alive
	// connection closes after IdleTimeout; an engine must start answering within
	// UpstreamTimeout and connect within ConnectTimeout; Drain bounds the graceful stop.
	ReadTimeout     time.Duration `yaml:"read_timeout"`
	IdleTimeout     time.Duration `yaml:"idle_timeout"`
	ConnectTimeout  time.Duration `yaml:"connect_timeout"`
	UpstreamTimeout time.Duration `yaml:"upstream_timeout"`
	DrainTimeout    time.Duration `yaml:"drain_timeout"`
	// ClientStallTimeout cuts off a streamed answer's client that takes nothing for this
	// long (its kernel acknowledges nothing sent to it, while something is owed; or it takes
	// nothing of what the proxy holds past its high-water mark), and cancels the engine
	// request, freeing its slot and KV.
	ClientStallTimeout time.Duration `yaml:"client_stall_timeout"`
	// FirstByteTimeout is how long an engine may take to start answering a request it was
	// sent: ten times the request's predicted TTFT (latency policy) when that is longer,
	// never past UpstreamTimeout. The request then tries another worker; a worker that sent
	// nothing on any connection for as long is taken out for EjectFor at once (it has
	// stopped answering: hung, or frozen).
	FirstByteTimeout time.Duration `yaml:"first_byte_timeout"`
	// StreamIdleTimeout ends an answer the engine has sent nothing more of for this long: the
	// worker is taken out at once and the client's stream ends with an error event.
	StreamIdleTimeout time.Duration `yaml:"stream_idle_timeout"`
	// FrozenAfter takes a worker out at once when a stream it was sending has had nothing
	// for this long and neither has any other connection to it: a decoding engine sends a
	// token every few tens of milliseconds, so one silent everywhere is frozen (stopped,
	// hung), not busy. Its requests still waiting for their first byte try another worker
	// then, instead of at FirstByteTimeout, and its streams move as at StreamIdleTimeout.
	// 0: off (only the two timeouts).
	FrozenAfter time.Duration `yaml:"frozen_after"`
	// ResponseAffinity remembers up to this many stored Responses API responses (which
	// worker served each, for ResponseTTL), so that previous_response_id and GET
	// /v1/responses/{id} reach the engine holding them; 0 turns it off.
	ResponseAffinity int `yaml:"response_affinity"`
	// MigrationLimit is how many times a streamed completion whose engine fails after the
	// first token continues on another worker (0: never); a request opts out with the
	// header x-kvrelay-migrate: off.
	MigrationLimit int           `yaml:"migration_limit"`
	ResponseTTL    time.Duration `yaml:"response_ttl"`
	// Retries is how many other workers a request may try after a connect failure or a 5xx
	// before its first byte.
	Retries int `yaml:"retries"`
	// EjectAfter consecutive failures take a worker out for EjectFor, after which one
	// request probes it.
	EjectAfter int           `yaml:"eject_after"`
	EjectFor   time.Duration `yaml:"eject_for"`
	// Admission queue: requests wait when every worker is busy, up to QueueSize of them for
	// QueueTimeout each.
	QueueSize    int           `yaml:"queue_size"`
	QueueTimeout time.Duration `yaml:"queue_timeout"`
	// MaxBufferedResponse bounds the bytes held for a client that reads slower than its
	// engine writes; past it the request is aborted.
	MaxBufferedResponse int `yaml:"max_buffered_response"`
	// EventLoops is the number of gnet event loops (0: GOMAXPROCS-1, at least one; each
	// loop is locked to its own thread).
	EventLoops int `yaml:"event_loops"`
}

// DefaultConfig returns the defaults of `kvrelay proxy`.
func DefaultConfig() Config {
	return Config{
		Listen:              "127.0.0.1:8080",
		Policy:              route.PolicyDefault,
		OverlapWeight:       route.DefaultOverlapWeight,
		QueueWeight:         route.DefaultQueueWeight,
		CacheThreshold:      route.DefaultCacheThreshold,
		ComputeWeight:       route.DefaultComputeWeight,
		BackgroundWeight:    route.DefaultBackgroundWeight,
		BatchWeight:         route.DefaultBatchWeight,
		WaitWeight:          route.DefaultWaitWeight,
		TailWeight:          route.DefaultTailWeight,
		BalanceWeight:       route.DefaultBalanceWeight,
		Explore:             route.DefaultExplore,
		SessionTTL:          30 * time.Minute,
		BusyPrefillTokens:   0,
		BlockSize:           16,
		Disagg:              DisaggAuto,
		DisaggThreshold:     512,
		DisaggMaxQueue:      16384,
		PrefillTimeout:      30 * time.Second,
		TokenCacheTokens:    8 << 20,
		IndexBlocks:         1 << 20,
		IndexTTL:            120 * time.Second,
		XDSSyncTimeout:      5 * time.Second,
		LoadStaleAfter:      3 * time.Second,
		EngineMetrics:       true,
		RecentTTL:           10 * time.Second,
		IndexQueryTimeout:   20 * time.Millisecond,
		MaxHeaderBytes:      http1.DefaultMaxHeadBytes,
		MaxBodyBytes:        http1.DefaultMaxBodyBytes,
		ReadTimeout:         30 * time.Second,
		IdleTimeout:         90 * time.Second,
		ConnectTimeout:      3 * time.Second,
		UpstreamTimeout:     10 * time.Minute,
		DrainTimeout:        30 * time.Second,
		ClientStallTimeout:  30 * time.Second,
		FirstByteTimeout:    30 * time.Second,
		StreamIdleTimeout:   30 * time.Second,
		FrozenAfter:         5 * time.Second,
		ResponseAffinity:    100000,
		MigrationLimit:      1,
		ResponseTTL:         time.Hour,
		Retries:             2,
		EjectAfter:          3,
		EjectFor:            10 * time.Second,
		QueueSize:           1024,
		QueueTimeout:        60 * time.Second,
		MaxBufferedResponse: 8 << 20,
	}
}

func (c *Config) routeConfig() route.Config {
	return route.Config{
		// DefaultConfig sets every weight and the YAML file and flags change them: a zero
		// here was asked for.
		Explicit:         true,
		Plugins:          c.Plugins,
		Policy:           c.Policy,
		OverlapWeight:    c.OverlapWeight,
		QueueWeight:      c.QueueWeight,
		Temperature:      c.Temperature,
		ComputeWeight:    c.ComputeWeight,
		BackgroundWeight: c.BackgroundWeight,
		BatchWeight:      c.BatchWeight,
		WaitWeight:       c.WaitWeight,
		TailWeight:       c.TailWeight,
		BalanceWeight:    c.BalanceWeight,
		Explore:          c.Explore,
		Onboard:          c.Onboard,
		CacheThreshold:   c.CacheThreshold,
		SessionTTL:       c.SessionTTL,
		Busy: route.BusyFilter{
			MaxPrefillTokens: c.BusyPrefillTokens,
			MaxDecodeBlocks:  c.BusyDecodeBlocks,
			MaxKVFraction:    c.BusyKVFraction,
			MaxRequests:      c.BusyRequests,
		},
	}
}

// decideConfig is what the routing core takes of the proxy's configuration.
func (c *Config) decideConfig() decide.Config {
	indexTTL := c.IndexTTL
	if c.XDS != "" {
		// With a control plane, the proxy's own index only remembers recent decisions.
		indexTTL = c.RecentTTL
	}
	return decide.Config{
		BlockSize:        c.BlockSize,
		Tokenizer:        c.Tokenizer,
		ChatTemplate:     c.ChatTemplate,
		TokenCacheTokens: c.TokenCacheTokens,
		RemoteTimeout:    c.ConnectTimeout + 5*time.Second,
		IndexBlocks:      c.IndexBlocks,
		IndexTTL:         indexTTL,
		QueueSize:        c.QueueSize,
		QueueTimeout:     c.QueueTimeout,
		Disagg:           c.Disagg,
		DisaggThreshold:  c.DisaggThreshold,
		DisaggMaxQueue:   c.DisaggMaxQueue,
		EjectAfter:       c.EjectAfter,
		EjectFor:         c.EjectFor,
		ForwardPriority:  c.ForwardPriority,
		BusyRequests:     c.BusyRequests,
		TenantHeadroom:   c.TenantHeadroom,
	}
}

// ErrInvalidConfig wraps every Validate error.
var ErrInvalidConfig = errors.New("invalid proxy config")

// Validate reports the first setting that cannot work.
func (c *Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	if c.Listen == "" && !c.PickOnly {
		return bad("listen address is empty")
	}
	modelsErr := xds.CheckNodeModels(c.ServeModels)
	switch {
	case c.XDS != "" && len(c.Upstreams) > 0:
		return bad("upstreams and a control plane (xds) are exclusive: workers come from the control plane")
	case c.XDS == "" && len(c.Upstreams) == 0:
		return bad("no upstreams (give --upstream or --xds)")
	case c.XDS == "" && len(c.ServeModels) > 0:
		return bad("serve_models chooses among a control plane's workers: it needs xds")
	case c.XDS == "" && c.IndexQuery:
		return bad("index_query asks a control plane's index: it needs xds")
	case c.IndexQuery && c.IndexQueryTimeout <= 0:
		return bad("index_query_timeout must be positive")
	case slices.Contains(c.ServeModels, ""):
		return bad("serve_models names an empty model")
	case modelsErr != nil:
		return bad("serve_models: %v", modelsErr)
	case c.XDS != "":
		if _, _, err := net.SplitHostPort(c.XDS); err != nil {
			return bad("xds address %q is not host:port", c.XDS)
		}
		if c.XDSSyncTimeout < 0 || c.RecentTTL <= 0 || c.LoadStaleAfter <= 0 {
			return bad("xds sync timeout must not be negative, recent ttl and load_stale_after must be positive")
		}
	}
	ids := map[string]bool{}
	for i, u := range c.Upstreams {
		p, err := url.Parse(u.URL)
		if err != nil || p.Scheme != "http" || p.Host == "" || (p.Path != "" && p.Path != "/") {
			return bad("upstream %d: %q is not http://host:port", i, u.URL)
		}
		id := u.ID
		if id == "" {
			id = p.Host
		}
		if ids[id] {
			return bad("upstream id %q appears twice", id)
		}
		ids[id] = true
		if u.Engine != "" && !slices.Contains(engines.Kinds(), engines.Kind(u.Engine)) {
			return bad("upstream %q: engine %q is not one of %v", id, u.Engine, engines.Kinds())
		}
		if _, err := ParseRole(u.Role); err != nil {
			return bad("upstream %q: %v", id, err)
		}
		if u.MaxModelLen < 0 {
			return bad("upstream %s: max_model_len %d is negative", u.URL, u.MaxModelLen)
		}
		if u.P2PPort < 0 || u.P2PPort > 65535 {
			return bad("upstream %q: p2p_port %d outside [0, 65535]", id, u.P2PPort)
		}
		if u.KVBytesPerToken < 0 || !bandwidthOK(u.HostBandwidth) || !bandwidthOK(u.DiskBandwidth) || !bandwidthOK(u.SharedBandwidth) || !bandwidthOK(u.PeerBandwidth) {
			return bad("upstream %q: kv_bytes_per_token, host_bandwidth, disk_bandwidth, shared_bandwidth and peer_bandwidth must be finite and not negative", id)
		}
		if u.MaxNumSeqs < 0 || u.MaxNumBatchedTokens < 0 {
			return bad("upstream %q: max_num_seqs and max_num_batched_tokens must not be negative", id)
		}
	}
	if err := c.routeConfig().Validate(); err != nil {
		return bad("%v", err)
	}
	switch {
	case c.BlockSize <= 0:
		return bad("block size %d must be positive", c.BlockSize)
	case c.MaxHeaderBytes < 1024:
		return bad("max header bytes %d is under 1 KiB", c.MaxHeaderBytes)
	case c.MaxBodyBytes <= 0:
		return bad("max body bytes must be positive")
	case c.Retries < 0 || c.EjectAfter < 1 || c.QueueSize < 0:
		return bad("retries and queue size must not be negative, eject_after must be at least 1")
	case c.ReadTimeout <= 0 || c.IdleTimeout <= 0 || c.ConnectTimeout <= 0 || c.UpstreamTimeout <= 0 || c.QueueTimeout <= 0 || c.DrainTimeout <= 0 || c.ClientStallTimeout <= 0 || c.FirstByteTimeout <= 0 || c.StreamIdleTimeout <= 0:
		return bad("timeouts must be positive")
	case c.FrozenAfter < 0:
		return bad("frozen_after must not be negative (0: off)")
	case c.MaxBufferedResponse < 64<<10:
		return bad("max buffered response %d is under 64 KiB", c.MaxBufferedResponse)
	case c.Disagg != DisaggAuto && c.Disagg != DisaggOff:
		return bad("disagg %q is not %s or %s", c.Disagg, DisaggAuto, DisaggOff)
	case c.PrefillTimeout <= 0:
		return bad("prefill timeout must be positive")
	}
	return nil
}

// ParseRole parses a worker role as operators write it: "both" (or empty), "prefill" or
// "decode".
func ParseRole(s string) (route.Role, error) {
	switch s {
	case "", "both":
		return route.RoleBoth, nil
	case "prefill":
		return route.RolePrefill, nil
	case "decode":
		return route.RoleDecode, nil
	}
	return 0, fmt.Errorf("role %q is not both, prefill or decode", s)
}

// upstreamHost is host:port of an upstream URL.
func upstreamHost(u string) string {
	s := strings.TrimPrefix(u, "http://")
	return strings.TrimSuffix(s, "/")
}
