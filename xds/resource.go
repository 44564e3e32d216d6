package xds

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"net/url"
	"strconv"
	"strings"
	"unicode"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/policy"
)

// Type URLs of kvrelay's xDS resources. Each is served by its own LinearCache on the control
// plane and subscribed to (wildcard) by every proxy.
const (
	// WorkerType is the type URL of xdsv1.Worker; a worker's resource name is its id.
	WorkerType = "type.googleapis.com/kvrelay.xds.v1.Worker"
	// PolicyType is the type URL of xdsv1.RoutingPolicy; its one resource is named PolicyName.
	PolicyType = "type.googleapis.com/kvrelay.xds.v1.RoutingPolicy"
	// KeysType is the type URL of xdsv1.TenantKeys; its one resource is named KeysName.
	KeysType = "type.googleapis.com/kvrelay.xds.v1.TenantKeys"
)

// KeysName is the resource name of the API keys every proxy takes.
const KeysName = "keys"

// MaxKeysLen bounds the keys resource's text.
const MaxKeysLen = 4 << 20

// PolicyName is the resource name of the routing policy every proxy applies.
const PolicyName = "default"

// TypeURLs returns the type URLs a proxy subscribes to, in the order it subscribes. The
// returned slice is new on each call.
func TypeURLs() []string { return []string{WorkerType, LoadsType, PolicyType, KeysType} }

// Limits a resource must respect; a proxy refuses (NACKs) a resource past them.
const (
	// MaxNameLen bounds worker ids, models, engine kinds and policy names.
	MaxNameLen = 256
	// MaxURLLen bounds a worker's URL.
	MaxURLLen = 2048
	// MaxBlockSize is the largest block size in tokens a worker may announce.
	MaxBlockSize = 1 << 16
	// MaxSlot bounds a worker's slot in the index journal (slots are dense, one per worker).
	MaxSlot = 1 << 16
	// MaxLoRAAdapters bounds the LoRA adapters one worker lists.
	MaxLoRAAdapters = 256
	// MaxWeight bounds the routing policy's overlap weight.
	MaxWeight = policy.MaxWeight
	// MaxTemperature bounds the routing policy's sampling temperature.
	MaxTemperature = 1e3
	// MaxSessionTTLMillis bounds how long a session may stay bound to a worker: one week.
	MaxSessionTTLMillis = 7 * 24 * 3600 * 1000
	// NumTiers is the number of KV storage tiers a policy may weigh: GPU, host, disk,
	// shared storage.
	NumTiers = 4
)

// ErrInvalid is wrapped by every error ValidateWorker and ValidatePolicy return.
var ErrInvalid = errors.New("invalid resource")

// NewWorker builds a healthy worker resource with the given id, URL and model; callers set
// the other fields on the result. It does not validate: see ValidateWorker.
func NewWorker(id, rawURL, model string) *xdsv1.Worker {
	return &xdsv1.Worker{Id: id, Url: rawURL, Model: model, Healthy: true}
}

// DefaultPolicy returns the routing policy a control plane serves until an operator sets
// one: policy.Default (latency) with package policy's defaults (overlap, queue and cache threshold),
// greedy pick, tier weights GPU 1, host 0.75, disk 0.25 (docs/routing-cost.md), sessions kept
// 30 minutes.
func DefaultPolicy() *xdsv1.RoutingPolicy {
	return &xdsv1.RoutingPolicy{
		Version:        1,
		Policy:         policy.Default,
		OverlapWeight:  policy.DefaultOverlapWeight,
		QueueWeight:    policy.DefaultQueueWeight,
		CacheThreshold: policy.DefaultCacheThreshold,
		TierWeights:    policy.DefaultTierWeights(),
		SessionTtlMs:   policy.DefaultSessionTTL.Milliseconds(),
	}
}

// ParseRole parses a role as operators write it: "both" (or ""), "prefill" or "decode"; the
// enum names (ROLE_PREFILL, …) are accepted too.
func ParseRole(s string) (xdsv1.Role, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "both", "role_both":
		return xdsv1.Role_ROLE_BOTH, nil
	case "prefill", "role_prefill":
		return xdsv1.Role_ROLE_PREFILL, nil
	case "decode", "role_decode":
		return xdsv1.Role_ROLE_DECODE, nil
	}
	return 0, fmt.Errorf("parsing role %q: want both, prefill or decode", s)
}

// RoleName is the operator's name of r: "both", "prefill" or "decode" ("role(N)" for a
// value this build does not know).
func RoleName(r xdsv1.Role) string {
	switch r {
	case xdsv1.Role_ROLE_BOTH:
		return "both"
	case xdsv1.Role_ROLE_PREFILL:
		return "prefill"
	case xdsv1.Role_ROLE_DECODE:
		return "decode"
	}
	return "role(" + strconv.Itoa(int(r)) + ")"
}

// ResourceName is the xDS resource name of m: a worker's id, or PolicyName for a routing
// policy. It returns "" for any other message, Loads included (its name is its shard's,
// LoadsName).
func ResourceName(m proto.Message) string {
	switch v := m.(type) {
	case *xdsv1.Worker:
		return v.GetId()
	case *xdsv1.RoutingPolicy:
		return PolicyName
	case *xdsv1.TenantKeys:
		return KeysName
	}
	return ""
}

// TypeURL is the type URL of m, or "" when m is not one of kvrelay's resources.
func TypeURL(m proto.Message) string {
	switch m.(type) {
	case *xdsv1.Worker:
		return WorkerType
	case *xdsv1.Loads:
		return LoadsType
	case *xdsv1.RoutingPolicy:
		return PolicyType
	case *xdsv1.TenantKeys:
		return KeysType
	}
	return ""
}

// DecodeKeys unmarshals a TenantKeys resource received under the given name and checks its
// name and size; the proxy parses the text itself. It never panics on arbitrary input; every
// error wraps ErrInvalid.
func DecodeKeys(name string, res *anypb.Any) (*xdsv1.TenantKeys, error) {
	k := &xdsv1.TenantKeys{}
	if err := decode(KeysType, res, k); err != nil {
		return nil, err
	}
	switch {
	case name != KeysName:
		return nil, fmt.Errorf("%w: API keys resource named %q, want %q", ErrInvalid, name, KeysName)
	case len(k.GetKeys()) > MaxKeysLen:
		return nil, fmt.Errorf("%w: API keys of %d bytes, at most %d", ErrInvalid, len(k.GetKeys()), MaxKeysLen)
	}
	return k, nil
}

// DecodeWorker unmarshals and validates a Worker resource received under the given name. It
// never panics on arbitrary input; every error wraps ErrInvalid.
func DecodeWorker(name string, res *anypb.Any) (*xdsv1.Worker, error) {
	w := &xdsv1.Worker{}
	if err := decode(WorkerType, res, w); err != nil {
		return nil, err
	}
	if err := ValidateWorker(w); err != nil {
		return nil, err
	}
	if w.GetId() != name {
		return nil, fmt.Errorf("%w: worker %q sent under resource name %q", ErrInvalid, w.GetId(), name)
	}
	return w, nil
}

// DecodePolicy unmarshals and validates a RoutingPolicy resource received under the given
// name, which must be PolicyName. It never panics on arbitrary input; every error wraps
// ErrInvalid.
func DecodePolicy(name string, res *anypb.Any) (*xdsv1.RoutingPolicy, error) {
	if name != PolicyName {
		return nil, fmt.Errorf("%w: routing policy named %q, want %q", ErrInvalid, name, PolicyName)
	}
	p := &xdsv1.RoutingPolicy{}
	if err := decode(PolicyType, res, p); err != nil {
		return nil, err
	}
	if err := ValidatePolicy(p); err != nil {
		return nil, err
	}
	return p, nil
}

func decode(typeURL string, res *anypb.Any, m proto.Message) error {
	if res == nil {
		return fmt.Errorf("%w: decoding %s: no resource body", ErrInvalid, typeURL)
	}
	if res.GetTypeUrl() != typeURL {
		return fmt.Errorf("%w: decoding %s: body has type %q", ErrInvalid, typeURL, res.GetTypeUrl())
	}
	if err := proto.Unmarshal(res.GetValue(), m); err != nil {
		return fmt.Errorf("%w: decoding %s: %w", ErrInvalid, typeURL, err)
	}
	return nil
}

// ValidateWorker reports why a proxy must refuse w, or nil. It checks: a non-empty id of
// printable characters without spaces (and not the wildcard "*"), an http or https URL with
// a host and a valid port, a known role, printable model and engine names, a block size of
// at most MaxBlockSize tokens (0: not yet known), a slot below MaxSlot, and a load whose KV
// usage is a fraction. Errors wrap ErrInvalid.
func ValidateWorker(w *xdsv1.Worker) error {
	if w == nil {
		return fmt.Errorf("%w: nil worker", ErrInvalid)
	}
	if err := checkName("worker id", w.GetId(), true); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if w.GetId() == "*" {
		return fmt.Errorf("%w: worker id %q is the xDS wildcard", ErrInvalid, w.GetId())
	}
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%w: worker %q: %s", ErrInvalid, w.GetId(), fmt.Sprintf(format, args...))
	}
	if err := checkURL(w.GetUrl()); err != nil {
		return fail("%v", err)
	}
	if _, known := xdsv1.Role_name[int32(w.GetRole())]; !known {
		return fail("unknown role %d", w.GetRole())
	}
	if err := checkName("model", w.GetModel(), false); err != nil {
		return fail("%v", err)
	}
	if err := checkName("engine", w.GetEngine(), false); err != nil {
		return fail("%v", err)
	}
	if w.GetBlockSize() > MaxBlockSize {
		return fail("block size %d above %d", w.GetBlockSize(), MaxBlockSize)
	}
	if w.GetSlot() >= MaxSlot {
		return fail("slot %d not below %d", w.GetSlot(), MaxSlot)
	}
	if w.GetLoadIndex() >= MaxLoadIndex {
		return fail("load index %d not below %d", w.GetLoadIndex(), MaxLoadIndex)
	}
	if n := len(w.GetLoraAdapters()); n > MaxLoRAAdapters {
		return fail("%d LoRA adapters, above %d", n, MaxLoRAAdapters)
	}
	for _, a := range w.GetLoraAdapters() {
		if err := checkName("LoRA adapter", a, true); err != nil {
			return fail("%v", err)
		}
		if a == w.GetModel() {
			return fail("LoRA adapter %q is the worker's model", a)
		}
	}
	if l := w.GetLoad(); l != nil {
		if u := l.GetKvUsage(); math.IsNaN(u) || u < 0 || u > 1 {
			return fail("kv usage %g outside [0, 1]", u)
		}
		if l.GetObservedUnixNano() < 0 {
			return fail("load observed at negative time %d", l.GetObservedUnixNano())
		}
	}
	return nil
}

// ValidatePolicy reports why a proxy must refuse p, or nil. Zero fields mean the proxy's
// defaults. It checks: a printable policy name, finite non-negative weights (overlap weight
// at most MaxWeight, temperature at most MaxTemperature), fractions within [0, 1] (cache
// threshold, busy KV fraction, tier weights), no more than NumTiers tier weights, and a
// session TTL within [0, MaxSessionTTLMillis]. Errors wrap ErrInvalid.
func ValidatePolicy(p *xdsv1.RoutingPolicy) error {
	if p == nil {
		return fmt.Errorf("%w: nil routing policy", ErrInvalid)
	}
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%w: routing policy %d: %s", ErrInvalid, p.GetVersion(), fmt.Sprintf(format, args...))
	}
	if err := checkName("policy", p.GetPolicy(), false); err != nil {
		return fail("%v", err)
	}
	if err := checkRange("overlap weight", p.GetOverlapWeight(), 0, MaxWeight); err != nil {
		return fail("%v", err)
	}
	if err := checkRange("queue weight", p.GetQueueWeight(), 0, MaxWeight); err != nil {
		return fail("%v", err)
	}
	if err := checkRange("temperature", p.GetTemperature(), 0, MaxTemperature); err != nil {
		return fail("%v", err)
	}
	if err := checkRange("cache threshold", p.GetCacheThreshold(), 0, 1); err != nil {
		return fail("%v", err)
	}
	if err := checkRange("busy kv fraction", p.GetBusyKvFraction(), 0, 1); err != nil {
		return fail("%v", err)
	}
	if n := len(p.GetTierWeights()); n > NumTiers {
		return fail("%d tier weights, at most %d", n, NumTiers)
	}
	for i, tw := range p.GetTierWeights() {
		if err := checkRange("tier weight "+strconv.Itoa(i), tw, 0, 1); err != nil {
			return fail("%v", err)
		}
	}
	if ttl := p.GetSessionTtlMs(); ttl < 0 || ttl > MaxSessionTTLMillis {
		return fail("session ttl %d ms outside [0, %d]", ttl, int64(MaxSessionTTLMillis))
	}
	if d := p.GetDisagg(); d != "" && d != "auto" && d != "off" {
		return fail("disagg %q is not auto or off", d)
	}
	if p.ComputeWeight != nil {
		if err := checkRange("compute weight", p.GetComputeWeight(), 0, MaxWeight); err != nil {
			return fail("%v", err)
		}
	}
	if p.BackgroundWeight != nil {
		if err := checkRange("background weight", p.GetBackgroundWeight(), 0, MaxWeight); err != nil {
			return fail("%v", err)
		}
	}
	if err := checkRange("candidate share", p.GetCandidateShare(), 0, 1); err != nil {
		return fail("%v", err)
	}
	switch prof := p.GetProfile(); {
	case prof == nil && p.GetPolicy() == policy.Custom:
		return fail("policy %s without a profile", policy.Custom)
	case prof != nil && p.GetPolicy() != policy.Custom:
		return fail("a profile under policy %q: a profile is policy %s", p.GetPolicy(), policy.Custom)
	case prof != nil:
		if err := ProfileOf(prof).Check(); err != nil {
			return fail("%v", err)
		}
	}
	if c := p.GetCandidate(); c != nil {
		if c.GetCandidate() != nil {
			return fail("its candidate has a candidate")
		}
		if c.GetVersion() == 0 || c.GetVersion() == p.GetVersion() {
			return fail("its candidate has version %d: it needs its own, not 0 and not the stable one's", c.GetVersion())
		}
		if err := ValidatePolicy(c); err != nil {
			return fail("candidate: %v", err)
		}
	} else if p.GetCandidateShare() > 0 || p.GetShadow() {
		return fail("a candidate share or shadow without a candidate")
	}
	return nil
}

func checkRange(what string, v, lo, hi float64) error {
	if math.IsNaN(v) || v < lo || v > hi {
		return fmt.Errorf("%s %g outside [%g, %g]", what, v, lo, hi)
	}
	return nil
}

// checkName accepts up to MaxNameLen printable, non-space characters (empty only when not
// required).
func checkName(what, s string, required bool) error {
	if s == "" {
		if required {
			return fmt.Errorf("empty %s", what)
		}
		return nil
	}
	if len(s) > MaxNameLen {
		return fmt.Errorf("%s of %d bytes, at most %d", what, len(s), MaxNameLen)
	}
	for _, r := range s {
		if r == unicode.ReplacementChar || !unicode.IsPrint(r) || unicode.IsSpace(r) {
			return fmt.Errorf("%s %q has a space, control or invalid character", what, s)
		}
	}
	return nil
}

func checkURL(raw string) error {
	if raw == "" {
		return errors.New("empty url")
	}
	if len(raw) > MaxURLLen {
		return fmt.Errorf("url of %d bytes, at most %d", len(raw), MaxURLLen)
	}
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("parsing url: %w", err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("url %q: scheme %q, want http or https", raw, u.Scheme)
	}
	if u.Host == "" || u.Hostname() == "" {
		return fmt.Errorf("url %q has no host", raw)
	}
	if u.Fragment != "" || u.RawQuery != "" || u.User != nil {
		return fmt.Errorf("url %q: a base URL has no user, query or fragment", raw)
	}
	if p := u.Port(); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("url %q: bad port %q", raw, p)
		}
	} else if strings.HasSuffix(u.Host, ":") {
		return fmt.Errorf("url %q: empty port", raw)
	}
	if strings.ContainsAny(u.Hostname(), " \t\r\n") {
		return fmt.Errorf("url %q: bad host", raw)
	}
	if ip := net.ParseIP(u.Hostname()); ip == nil && strings.Contains(u.Hostname(), ":") {
		return fmt.Errorf("url %q: bad host %q", raw, u.Hostname())
	}
	return nil
}

// ProfileOf is the profile a resource carries (nil for none).
func ProfileOf(m *xdsv1.Profile) *policy.Profile {
	if m == nil {
		return nil
	}
	plugin := func(pl *xdsv1.Plugin) policy.Plugin {
		return policy.Plugin{Name: pl.GetName(), Weight: pl.GetWeight(), Params: maps.Clone(pl.GetParams())}
	}
	p := &policy.Profile{Picker: plugin(m.GetPicker())}
	for _, f := range m.GetFilters() {
		p.Filters = append(p.Filters, plugin(f))
	}
	for _, s := range m.GetScorers() {
		p.Scorers = append(p.Scorers, plugin(s))
	}
	if sp := m.GetSpread(); sp != nil {
		v := plugin(sp)
		p.Spread = &v
	}
	return p
}

// ProfileResource is p as a resource's profile (nil for none).
func ProfileResource(p *policy.Profile) *xdsv1.Profile {
	if p == nil {
		return nil
	}
	plugin := func(pl policy.Plugin) *xdsv1.Plugin {
		return &xdsv1.Plugin{Name: pl.Name, Weight: pl.Weight, Params: maps.Clone(pl.Params)}
	}
	m := &xdsv1.Profile{Picker: plugin(p.Picker)}
	for _, f := range p.Filters {
		m.Filters = append(m.Filters, plugin(f))
	}
	for _, s := range p.Scorers {
		m.Scorers = append(m.Scorers, plugin(s))
	}
	if p.Spread != nil {
		m.Spread = plugin(*p.Spread)
	}
	return m
}
