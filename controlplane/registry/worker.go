package registry

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/xds"
)

// Roles a worker can serve, in Worker.Role.
const (
	RoleBoth    = "both"
	RolePrefill = "prefill"
	RoleDecode  = "decode"
)

// Sources a worker can come from, in Worker.Source. See the package documentation for
// their precedence.
const (
	SourceAPI  = "api"
	SourceFile = "file"
	SourceFlag = "flag"
	SourceK8s  = "k8s"
)

// Errors returned by this package; test for them with errors.Is.
var (
	// ErrInvalid is wrapped by every error about a malformed worker, workers file or policy.
	ErrInvalid = errors.New("invalid")
	// ErrNotFound: no worker has the id.
	ErrNotFound = errors.New("no such worker")
	// ErrNotRemovable: the worker comes from the flags, the workers file or Kubernetes, and
	// only its source can remove it.
	ErrNotRemovable = errors.New("worker not removable through the API")
	// ErrVersionConflict: SetPolicy was given a version that is not the current one.
	ErrVersionConflict = errors.New("policy version conflict")
)

// Worker is one engine the control plane knows. Field names in YAML (and in the JSON the
// Store keeps) are the keys of the `--worker` flag form.
type Worker struct {
	// ID names the worker everywhere (metrics, index, x-kvrelay-worker): up to
	// xds.MaxNameLen printable ASCII characters without spaces or commas.
	ID string `yaml:"id" json:"id"`
	// URL is the engine's base URL, exactly http://host:port.
	URL string `yaml:"url" json:"url"`
	// Model is the model it serves; empty means discover it (/v1/models).
	Model string `yaml:"model,omitempty" json:"model,omitempty"`
	// Role is RoleBoth (the default), RolePrefill or RoleDecode.
	Role string `yaml:"role,omitempty" json:"role,omitempty"`
	// BlockSize is the engine's KV block size in tokens; 0 means discover it.
	BlockSize int `yaml:"block-size,omitempty" json:"block-size,omitempty"`
	// KVEvents is the engine's ZMQ PUB endpoint to dial (tcp://host:port, ipc://path).
	KVEvents string `yaml:"kv-events,omitempty" json:"kv-events,omitempty"`
	// KVEventsBind is an endpoint to bind for an engine whose publisher connects out
	// (tcp://*:port); many workers may share one. At most one of KVEvents and KVEventsBind
	// is set.
	KVEventsBind string `yaml:"kv-events-bind,omitempty" json:"kv-events-bind,omitempty"`
	// KVEventsTopic is the topic frame of the engine's KV event messages. Several workers may
	// name one KVEventsBind endpoint; their messages are told apart by topic, by default
	// kv@<host:port>@<model> from URL and Model (llm-d's convention). With KVEvents it is the
	// subscription prefix.
	KVEventsTopic string `yaml:"kv-events-topic,omitempty" json:"kv-events-topic,omitempty"`
	// KVEventsReplay is the engine's ROUTER replay endpoint, if it has one.
	KVEventsReplay string `yaml:"kv-events-replay,omitempty" json:"kv-events-replay,omitempty"`
	// Metrics is the engine's Prometheus metrics URL; the default is URL + "/metrics".
	Metrics string `yaml:"metrics,omitempty" json:"metrics,omitempty"`
	// Engine is the engine kind, one of engines.Kinds(); the default is vllm.
	Engine string `yaml:"engine,omitempty" json:"engine,omitempty"`
	// MaxNumSeqs and MaxNumBatchedTokens are the engine's scheduler limits (vLLM's
	// --max-num-seqs and --max-num-batched-tokens), 0 when unknown; the latency policy
	// predicts queueing from them.
	MaxNumSeqs          int `yaml:"max-num-seqs,omitempty" json:"max-num-seqs,omitempty"`
	MaxNumBatchedTokens int `yaml:"max-num-batched-tokens,omitempty" json:"max-num-batched-tokens,omitempty"`
	// LoRAModules are the LoRA adapters the engine serves beside Model (vLLM's
	// --lora-modules names; in the flag form separated by ';'): proxies send requests naming
	// one to the workers that list it, and key its blocks by the adapter.
	LoRAModules []string `yaml:"lora-modules,omitempty" json:"lora-modules,omitempty"`
	// KVBytesPerToken, HostBandwidth and DiskBandwidth describe the engine's KV offloading
	// tiers (bytes of KV per token; host→GPU and disk→GPU bytes per second, in the flag form
	// "25GB/s"), 0 when unknown: the latency policy prices bringing blocks back from host
	// memory and disk with them, and falls back on the policy's tier weights without.
	KVBytesPerToken int     `yaml:"kv-bytes-per-token,omitempty" json:"kv-bytes-per-token,omitempty"`
	HostBandwidth   float64 `yaml:"host-bandwidth,omitempty" json:"host-bandwidth,omitempty"`
	DiskBandwidth   float64 `yaml:"disk-bandwidth,omitempty" json:"disk-bandwidth,omitempty"`
	// SharedBandwidth is how fast the engine loads blocks from storage several workers
	// mount (vLLM's fs or object tier with locality REMOTE) into GPU memory; 0 when unknown.
	SharedBandwidth float64 `yaml:"shared-bandwidth,omitempty" json:"shared-bandwidth,omitempty"`
	// PeerBandwidth is how fast the engine pulls a prefix another worker caches (kvrelay's
	// peer fetch, the simulated engine's --kv-peer-fetch); 0: it cannot, and the latency
	// policy never asks it to.
	PeerBandwidth float64 `yaml:"peer-bandwidth,omitempty" json:"peer-bandwidth,omitempty"`
	// P2PPort is the port of the engine's P2P side channel (vLLM's OffloadingConnector with
	// its p2p tier: VLLM_P2P_SIDE_CHANNEL_PORT, 5710 by default; the simulated engine's is its
	// HTTP port). Set, the engine speaks that tier's protocol: a peer pull from it names
	// this port, and a disaggregated request's legs take the p2p form (remote_decoder,
	// remote_prefiller) instead of NixlConnector's. 0: NixlConnector, and peers are pulled
	// from at their HTTP address.
	P2PPort int `yaml:"p2p-port,omitempty" json:"p2p-port,omitempty"`
	// Draining keeps new requests away from the worker. Registry.SetDraining overrides it.
	Draining bool `yaml:"draining,omitempty" json:"draining,omitempty"`
	// Source is where the worker came from (SourceFlag, …). It is set by the registry and
	// is not part of the flag form, the file or the stored record.
	Source string `yaml:"-" json:"-"`
}

// maxLoRAModules bounds the adapters one worker lists (what a proxy accepts).
const maxLoRAModules = xds.MaxLoRAAdapters

// Equal reports whether w and o are the same worker in every field.
func (w Worker) Equal(o Worker) bool {
	a, b := w, o
	a.LoRAModules, b.LoRAModules = nil, nil
	return reflect.DeepEqual(a, b) && slices.Equal(w.LoRAModules, o.LoRAModules)
}

// Flag-form keys, in the order String writes them.
const (
	keyID             = "id"
	keyURL            = "url"
	keyModel          = "model"
	keyRole           = "role"
	keyBlockSize      = "block-size"
	keyKVEvents       = "kv-events"
	keyKVEventsBind   = "kv-events-bind"
	keyKVEventsTopic  = "kv-events-topic"
	keyKVEventsReplay = "kv-events-replay"
	keyMetrics        = "metrics"
	keyEngine         = "engine"
	keyMaxNumSeqs     = "max-num-seqs"
	keyMaxBatched     = "max-num-batched-tokens"
	keyLoRAModules    = "lora-modules"
	keyKVBytes        = "kv-bytes-per-token"
	keyHostBandwidth  = "host-bandwidth"
	keyDiskBandwidth  = "disk-bandwidth"
	keySharedBW       = "shared-bandwidth"
	keyPeerBandwidth  = "peer-bandwidth"
	keyP2PPort        = "p2p-port"
)

var flagKeys = []string{keyID, keyURL, keyModel, keyRole, keyBlockSize, keyKVEvents,
	keyKVEventsBind, keyKVEventsTopic, keyKVEventsReplay, keyMetrics, keyEngine, keyMaxNumSeqs, keyMaxBatched, keyLoRAModules,
	keyKVBytes, keyHostBandwidth, keyDiskBandwidth, keySharedBW, keyPeerBandwidth, keyP2PPort}

// ParseWorker parses the `--worker` flag form: comma-separated key=value pairs with the keys
// id, url, model, role, block-size, kv-events, kv-events-bind, kv-events-topic,
// kv-events-replay, metrics, engine, max-num-seqs, max-num-batched-tokens, lora-modules
// (adapter names separated by ';'), kv-bytes-per-token, host-bandwidth, disk-bandwidth,
// shared-bandwidth and peer-bandwidth (a bandwidth like 25GB/s) and p2p-port. Spaces around keys and values are dropped, empty pairs are skipped, a value may
// contain '=' but not ','. id and url are required. The result has its defaults filled in
// (WithDefaults), is valid, and has Source SourceFlag. Errors wrap ErrInvalid.
func ParseWorker(s string) (Worker, error) {
	w, err := parseWorker(s)
	if err != nil {
		return Worker{}, fmt.Errorf("parsing worker %q: %w", s, err)
	}
	return w, nil
}

func parseWorker(s string) (Worker, error) {
	var w Worker
	if err := applyPairs(&w, s); err != nil {
		return Worker{}, err
	}
	if w.ID == "" {
		return Worker{}, fmt.Errorf("%w: missing id", ErrInvalid)
	}
	if w.URL == "" {
		return Worker{}, fmt.Errorf("%w: worker %q: missing url", ErrInvalid, w.ID)
	}
	w = w.WithDefaults()
	w.Source = SourceFlag
	if err := w.Validate(); err != nil {
		return Worker{}, err
	}
	return w, nil
}

// ParseTemplate reads the fields that discovered workers share, in the flag form without id
// and url (engine=vllm,kv-events=tcp://*:5557,...). Endpoint hosts are not checked here: the
// discovery replaces them by each worker's address (and checks the result).
func ParseTemplate(s string) (Worker, error) {
	t, err := overlay(Worker{}, s)
	if err != nil {
		return Worker{}, fmt.Errorf("parsing worker template %q: %w", s, err)
	}
	return t.w, nil
}

// overlay sets the fields s names (the flag form without id and url) over base and makes
// the template discovered addresses fill in: the --k8s-worker template over nothing, a
// pod's annotation over the pool's template.
func overlay(base Worker, s string) (sliceTemplate, error) {
	w := base
	if err := applyPairs(&w, s); err != nil {
		return sliceTemplate{}, err
	}
	if w.ID != "" || w.URL != "" {
		return sliceTemplate{}, fmt.Errorf("%w: id and url come from each discovered address", ErrInvalid)
	}
	return newSliceTemplate(w)
}

// applyPairs sets the fields that s, comma-separated key=value pairs of the flag form,
// names on w, leaving the others as they are.
func applyPairs(w *Worker, s string) error {
	seen := make(map[string]bool, len(flagKeys))
	for pair := range strings.SplitSeq(s, ",") {
		pair = strings.TrimSpace(pair)
		if pair == "" {
			continue
		}
		k, v, ok := strings.Cut(pair, "=")
		if !ok {
			return fmt.Errorf("%w: %q is not key=value", ErrInvalid, pair)
		}
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if !slices.Contains(flagKeys, k) {
			return fmt.Errorf("%w: unknown key %q (known: %s)", ErrInvalid, k, strings.Join(flagKeys, ", "))
		}
		if seen[k] {
			return fmt.Errorf("%w: key %q given twice", ErrInvalid, k)
		}
		seen[k] = true
		switch k {
		case keyID:
			w.ID = v
		case keyURL:
			w.URL = v
		case keyModel:
			w.Model = v
		case keyRole:
			w.Role = v
		case keyHostBandwidth, keyDiskBandwidth, keySharedBW, keyPeerBandwidth:
			bw, err := engines.ParseBandwidth(v)
			if err != nil {
				return fmt.Errorf("%w: %s: %v", ErrInvalid, k, err)
			}
			switch k {
			case keyHostBandwidth:
				w.HostBandwidth = bw
			case keyDiskBandwidth:
				w.DiskBandwidth = bw
			case keySharedBW:
				w.SharedBandwidth = bw
			default:
				w.PeerBandwidth = bw
			}
		case keyBlockSize, keyMaxNumSeqs, keyMaxBatched, keyKVBytes, keyP2PPort:
			n, err := strconv.Atoi(v)
			if err != nil {
				return fmt.Errorf("%w: %s %q is not an integer", ErrInvalid, k, v)
			}
			switch k {
			case keyBlockSize:
				w.BlockSize = n
			case keyMaxNumSeqs:
				w.MaxNumSeqs = n
			case keyKVBytes:
				w.KVBytesPerToken = n
			case keyP2PPort:
				w.P2PPort = n
			default:
				w.MaxNumBatchedTokens = n
			}
		case keyKVEvents:
			w.KVEvents = v
		case keyKVEventsBind:
			w.KVEventsBind = v
		case keyKVEventsTopic:
			w.KVEventsTopic = v
		case keyKVEventsReplay:
			w.KVEventsReplay = v
		case keyMetrics:
			w.Metrics = v
		case keyEngine:
			w.Engine = v
		case keyLoRAModules:
			// A fresh list: the key replaces what w had (a template's, for a pod).
			var mods []string
			for name := range strings.SplitSeq(v, ";") {
				if name = strings.TrimSpace(name); name != "" {
					mods = append(mods, name)
				}
			}
			w.LoRAModules = mods
		}
	}
	return nil
}

// String returns w in the flag form that ParseWorker reads. Empty fields and fields at their
// default (role both, engine vllm, metrics URL/metrics) are left out; Draining and Source
// are not part of the form.
func (w Worker) String() string {
	var b strings.Builder
	add := func(k, v string) {
		if v == "" {
			return
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(k)
		b.WriteByte('=')
		b.WriteString(v)
	}
	add(keyID, w.ID)
	add(keyURL, w.URL)
	add(keyModel, w.Model)
	if w.Role != RoleBoth {
		add(keyRole, w.Role)
	}
	if w.BlockSize != 0 {
		add(keyBlockSize, strconv.Itoa(w.BlockSize))
	}
	add(keyKVEvents, w.KVEvents)
	add(keyKVEventsBind, w.KVEventsBind)
	add(keyKVEventsTopic, w.KVEventsTopic)
	add(keyKVEventsReplay, w.KVEventsReplay)
	if w.Metrics != defaultMetrics(w.URL) {
		add(keyMetrics, w.Metrics)
	}
	if w.Engine != string(engines.KindVLLM) {
		add(keyEngine, w.Engine)
	}
	if w.MaxNumSeqs != 0 {
		add(keyMaxNumSeqs, strconv.Itoa(w.MaxNumSeqs))
	}
	if w.MaxNumBatchedTokens != 0 {
		add(keyMaxBatched, strconv.Itoa(w.MaxNumBatchedTokens))
	}
	add(keyLoRAModules, strings.Join(w.LoRAModules, ";"))
	if w.KVBytesPerToken != 0 {
		add(keyKVBytes, strconv.Itoa(w.KVBytesPerToken))
	}
	if w.HostBandwidth != 0 {
		add(keyHostBandwidth, engines.FormatBandwidth(w.HostBandwidth))
	}
	if w.DiskBandwidth != 0 {
		add(keyDiskBandwidth, engines.FormatBandwidth(w.DiskBandwidth))
	}
	if w.SharedBandwidth != 0 {
		add(keySharedBW, engines.FormatBandwidth(w.SharedBandwidth))
	}
	if w.PeerBandwidth != 0 {
		add(keyPeerBandwidth, engines.FormatBandwidth(w.PeerBandwidth))
	}
	if w.P2PPort != 0 {
		add(keyP2PPort, strconv.Itoa(w.P2PPort))
	}
	return b.String()
}

// WithDefaults returns w with a trailing slash dropped from URL and its defaults filled in:
// role both, engine vllm, metrics URL + "/metrics".
func (w Worker) WithDefaults() Worker {
	if len(w.URL) > len("http://") {
		w.URL = strings.TrimSuffix(w.URL, "/")
	}
	if w.Role == "" {
		w.Role = RoleBoth
	}
	if w.Engine == "" {
		w.Engine = string(engines.KindVLLM)
	}
	if w.Metrics == "" && w.URL != "" {
		w.Metrics = defaultMetrics(w.URL)
	}
	return w
}

func defaultMetrics(baseURL string) string {
	return strings.TrimSuffix(baseURL, "/") + "/metrics"
}

// Validate reports what is wrong with w, or nil. Empty Role, Engine and Metrics are valid
// (they mean the defaults). The checks are at least as strict as what a proxy accepts
// (xds.ValidateWorker). Errors wrap ErrInvalid.
func (w Worker) Validate() error {
	if err := w.validate(); err != nil {
		if w.ID == "" || !validID(w.ID) {
			return fmt.Errorf("%w: worker: %w", ErrInvalid, err)
		}
		return fmt.Errorf("%w: worker %q: %w", ErrInvalid, w.ID, err)
	}
	return nil
}

func (w Worker) validate() error {
	if w.ID == "" {
		return errors.New("missing id")
	}
	if !validID(w.ID) {
		return fmt.Errorf("id %q: want 1 to %d printable ASCII characters without spaces or commas", w.ID, xds.MaxNameLen)
	}
	if w.ID == "*" {
		return errors.New(`id "*" is reserved`)
	}
	if err := checkBaseURL(w.URL); err != nil {
		return err
	}
	if err := checkText(keyModel, w.Model); err != nil {
		return err
	}
	if strings.ContainsFunc(w.Model, unicode.IsSpace) {
		return fmt.Errorf("model %q has a space", w.Model)
	}
	if len(w.LoRAModules) > maxLoRAModules {
		return fmt.Errorf("%d lora-modules: at most %d", len(w.LoRAModules), maxLoRAModules)
	}
	for i, a := range w.LoRAModules {
		if err := checkText(keyLoRAModules, a); err != nil {
			return err
		}
		switch {
		case a == "" || strings.ContainsFunc(a, unicode.IsSpace) || strings.ContainsAny(a, ",;"):
			return fmt.Errorf("lora-modules: adapter %q must be non-empty, without spaces, ',' or ';'", a)
		case a == w.Model:
			return fmt.Errorf("lora-modules: adapter %q is the worker's model", a)
		case slices.Contains(w.LoRAModules[:i], a):
			return fmt.Errorf("lora-modules: adapter %q given twice", a)
		}
	}
	switch w.Role {
	case "", RoleBoth, RolePrefill, RoleDecode:
	default:
		return fmt.Errorf("role %q: want %s, %s or %s", w.Role, RoleBoth, RolePrefill, RoleDecode)
	}
	if w.BlockSize < 0 || w.BlockSize > xds.MaxBlockSize {
		return fmt.Errorf("block-size %d outside [0, %d]", w.BlockSize, xds.MaxBlockSize)
	}
	if w.MaxNumSeqs < 0 || w.MaxNumSeqs > maxLimit || w.MaxNumBatchedTokens < 0 || w.MaxNumBatchedTokens > maxLimit {
		return fmt.Errorf("max-num-seqs %d and max-num-batched-tokens %d must be within [0, %d]", w.MaxNumSeqs, w.MaxNumBatchedTokens, maxLimit)
	}
	if w.P2PPort < 0 || w.P2PPort > 65535 {
		return fmt.Errorf("p2p-port %d outside [0, 65535]", w.P2PPort)
	}
	if w.KVBytesPerToken < 0 || w.KVBytesPerToken > maxLimit {
		return fmt.Errorf("kv-bytes-per-token %d must be within [0, %d]", w.KVBytesPerToken, maxLimit)
	}
	for _, bw := range []float64{w.HostBandwidth, w.DiskBandwidth, w.SharedBandwidth, w.PeerBandwidth} {
		if !(bw >= 0) || math.IsInf(bw, 0) {
			return fmt.Errorf("host-bandwidth %g, disk-bandwidth %g, shared-bandwidth %g and peer-bandwidth %g must be finite and not negative", w.HostBandwidth, w.DiskBandwidth, w.SharedBandwidth, w.PeerBandwidth)
		}
	}
	if w.KVEvents != "" && w.KVEventsBind != "" {
		return errors.New("both kv-events (dial) and kv-events-bind (bind) are set; choose one")
	}
	if w.KVEvents != "" {
		if err := checkZMQ(keyKVEvents, w.KVEvents, false); err != nil {
			return err
		}
	}
	if w.KVEventsBind != "" {
		if err := checkZMQ(keyKVEventsBind, w.KVEventsBind, true); err != nil {
			return err
		}
	}
	if w.KVEventsTopic != "" {
		if w.KVEvents == "" && w.KVEventsBind == "" {
			return errors.New("kv-events-topic without kv-events or kv-events-bind")
		}
		if err := checkText(keyKVEventsTopic, w.KVEventsTopic); err != nil {
			return err
		}
	}
	if w.KVEventsReplay != "" {
		if w.KVEvents == "" && w.KVEventsBind == "" {
			return errors.New("kv-events-replay without kv-events or kv-events-bind")
		}
		if err := checkZMQ(keyKVEventsReplay, w.KVEventsReplay, false); err != nil {
			return err
		}
	}
	if w.Metrics != "" {
		if err := checkMetricsURL(w.Metrics); err != nil {
			return err
		}
	}
	if w.Engine != "" && !slices.Contains(engines.Kinds(), engines.Kind(w.Engine)) {
		return fmt.Errorf("engine %q: want one of %s", w.Engine, kindList())
	}
	return nil
}

// maxLimit bounds an engine's scheduler limits (they travel as 32-bit integers).
const maxLimit = 1 << 30

func kindList() string {
	var names []string
	for _, k := range engines.Kinds() {
		names = append(names, string(k))
	}
	return strings.Join(names, ", ")
}

// validID: printable ASCII, no space, no comma.
func validID(id string) bool {
	if id == "" || len(id) > xds.MaxNameLen {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; c <= ' ' || c >= 0x7f || c == ',' {
			return false
		}
	}
	return true
}

// checkText accepts what the flag form and YAML carry back unchanged: valid UTF-8 of
// printable characters, no comma, no leading or trailing space, at most xds.MaxNameLen bytes
// (xds.MaxURLLen for URLs and endpoints).
func checkText(what, s string) error {
	limit := xds.MaxNameLen
	if what != keyModel {
		limit = xds.MaxURLLen
	}
	if len(s) > limit {
		return fmt.Errorf("%s of %d bytes, at most %d", what, len(s), limit)
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("%s %q is not valid UTF-8", what, s)
	}
	for _, r := range s {
		if !unicode.IsPrint(r) || r == ',' {
			return fmt.Errorf("%s %q has a comma or a control or invalid character", what, s)
		}
	}
	if strings.TrimSpace(s) != s {
		return fmt.Errorf("%s %q has leading or trailing space", what, s)
	}
	return nil
}

// checkBaseURL accepts exactly http://host:port.
func checkBaseURL(s string) error {
	if s == "" {
		return errors.New("missing url")
	}
	if err := checkText(keyURL, s); err != nil {
		return err
	}
	bad := fmt.Errorf("url %q: want http://host:port", s)
	u, err := url.Parse(s)
	if err != nil || u.Scheme != "http" || u.Host == "" || s != "http://"+u.Host {
		return bad
	}
	host, port, err := net.SplitHostPort(u.Host)
	if err != nil || !validHost(host, false) {
		return bad
	}
	if err := checkPort(port); err != nil {
		return fmt.Errorf("url %q: %w", s, err)
	}
	return nil
}

// checkMetricsURL accepts an http or https URL with a host.
func checkMetricsURL(s string) error {
	if err := checkText(keyMetrics, s); err != nil {
		return err
	}
	u, err := url.Parse(s)
	if err != nil {
		return fmt.Errorf("metrics %q: %w", s, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" || u.User != nil || u.Fragment != "" {
		return fmt.Errorf("metrics %q: want an http:// or https:// URL", s)
	}
	if p := u.Port(); p != "" {
		if err := checkPort(p); err != nil {
			return fmt.Errorf("metrics %q: %w", s, err)
		}
	} else if strings.HasSuffix(u.Host, ":") {
		return fmt.Errorf("metrics %q: empty port", s)
	}
	if !validHost(u.Hostname(), false) {
		return fmt.Errorf("metrics %q: bad host", s)
	}
	return nil
}

// checkZMQ accepts tcp://host:port, ipc://path and inproc://name; the host may be the
// wildcard "*" only when binding.
func checkZMQ(what, s string, bind bool) error {
	if err := checkText(what, s); err != nil {
		return err
	}
	scheme, rest, ok := strings.Cut(s, "://")
	switch {
	case !ok:
	case scheme == "tcp":
		host, port, err := net.SplitHostPort(rest)
		if err != nil || !validHost(host, bind) {
			break
		}
		if err := checkPort(port); err != nil {
			return fmt.Errorf("%s %q: %w", what, s, err)
		}
		return nil
	case scheme == "ipc" || scheme == "inproc":
		if rest != "" {
			return nil
		}
	}
	if bind {
		return fmt.Errorf("%s %q: want tcp://host:port (host may be *), ipc://path or inproc://name", what, s)
	}
	return fmt.Errorf("%s %q: want tcp://host:port, ipc://path or inproc://name", what, s)
}

func validHost(h string, wildcard bool) bool {
	if h == "*" {
		return wildcard
	}
	if h == "" || strings.ContainsAny(h, " /?#@[]") {
		return false
	}
	if strings.Contains(h, ":") {
		return net.ParseIP(h) != nil
	}
	return true
}

func checkPort(p string) error {
	n, err := strconv.Atoi(p)
	if err != nil || n < 1 || n > 65535 || strconv.Itoa(n) != p {
		return fmt.Errorf("port %q: want 1 to 65535", p)
	}
	return nil
}
