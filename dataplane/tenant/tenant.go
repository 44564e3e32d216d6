// Package tenant knows who sends a request and what it may still send: API keys (from a
// file, hashed at rest) mapping to tenants, and each tenant's budgets of requests per second,
// prompt tokens per second and generated tokens per minute, reserved when a request is
// admitted and settled from its answer's usage.
//
// A keys file has one key a line, `#` comments and blank lines aside:
//
//	<key> tenant=<name>[,weight=<w>][,rps=<n>][,prompt_tps=<n>][,output_tpm=<n>][,cache=<region>]
//
// where <key> is the key itself or `sha256:<hex>`, its SHA-256. A limit left out (or 0) is no
// limit; weight (default 1) is the tenant's share when tenants contend. Several keys may name
// one tenant; they share its budgets.
//
// Each tenant's requests carry a cache_salt of its own (Tenant.Salt), so that prefix caching
// is shared within a tenant and never across two. cache=<region> puts a tenant in a cache
// region instead: every tenant naming the region gets the region's salt, so a prompt (a
// system prompt many of them send) is cached once for all of them, and each can learn by
// timing what the others of the region sent. Only the salt is shared; budgets and fairness
// stay the tenant's. A region is a set of tenants, not a set of prefixes: engines hash the
// salt into a prompt's first block, which the whole chain of block hashes carries on, so no
// salt can share a prefix and keep the rest of a prompt apart. Every key of a tenant names
// the same region, or none; a region's name follows a tenant name's rules, and lives apart
// from tenant names (a region named like a tenant does not get that tenant's salt).
package tenant

import (
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"
)

// Limits are a tenant's budgets; 0 is no limit.
type Limits struct {
	// Weight is the tenant's share when tenants contend (default 1).
	Weight float64
	// RPS is requests per second; PromptTPS prompt tokens per second; OutputTPM generated
	// tokens per minute.
	RPS, PromptTPS, OutputTPM float64
}

// Tenant is one tenant: its name, limits and the buckets its keys share. Safe for concurrent
// use.
type Tenant struct {
	Name   string
	Limits Limits
	// Region is the cache region whose salt the tenant's requests carry (the keys file's
	// cache=); empty: none, the tenant's own.
	Region string

	mu                       sync.Mutex
	requests, prompt, output bucket
	// share is this proxy's fraction of each of the limits (requests, prompt, output), set
	// by SetShare where a control plane divides fleet-wide budgets among proxies; 1 alone.
	share [3]float64
	// asked sums the costs of the requests asked since the last Demand, admitted or not;
	// rate is their smoothed rate per second, at rateAt; admitted and refused count requests.
	asked             [3]float64
	rate              [3]float64
	rateAt            time.Time
	admitted, refused uint64
}

// bucket is a token bucket that may go into debt: a request is admitted once the level holds
// its cost, or for a cost larger than the bucket once the bucket is full (one prompt larger
// than a second's budget still goes, alone, and leaves the bucket in debt); the level refills
// at rate up to burst.
type bucket struct {
	rate, burst float64 // per second; 0 rate: no limit
	level       float64
	at          time.Time
}

func newBucket(rate, window float64) bucket {
	if rate <= 0 {
		return bucket{}
	}
	b := max(rate*window, 1)
	return bucket{rate: rate, burst: b, level: b}
}

func (b *bucket) refill(now time.Time) {
	if b.rate <= 0 {
		return
	}
	if !b.at.IsZero() {
		if d := now.Sub(b.at).Seconds(); d > 0 {
			b.level = min(b.burst, b.level+d*b.rate)
		}
	}
	b.at = now
}

// wait is how long until the level holds cost (at most the bucket's size); 0: it does.
func (b *bucket) wait(cost float64) time.Duration {
	need := min(cost, b.burst)
	if b.rate <= 0 || b.level >= need {
		return 0
	}
	return time.Duration(((need-b.level)/b.rate)*float64(time.Second)) + time.Millisecond
}

// take takes cost from the level (into debt, if it comes to that).
func (b *bucket) take(cost float64) {
	if b.rate > 0 {
		b.level -= cost
	}
}

// reset is how long until the bucket is full again.
func (b *bucket) reset() time.Duration {
	if b.rate <= 0 {
		return 0
	}
	return time.Duration(math.Max(b.burst-b.level, 0) / b.rate * float64(time.Second))
}

// Windows of the buckets: a second's worth of requests and prompt tokens, a minute's of
// generated tokens.
const (
	secondWindow = 1
	minuteWindow = 60
)

func newTenant(name, region string, l Limits) *Tenant {
	if l.Weight <= 0 {
		l.Weight = 1
	}
	return &Tenant{Name: name, Limits: l, Region: region,
		requests: newBucket(l.RPS, secondWindow),
		prompt:   newBucket(l.PromptTPS, secondWindow),
		output:   newBucket(l.OutputTPM/minuteWindow, minuteWindow),
		share:    [3]float64{1, 1, 1}}
}

// rescale makes the bucket fill at rate (with the burst of its window), keeping its level
// the same fraction of its size: a share that moves neither refills nor empties it.
func (b *bucket) rescale(rate, window float64) {
	if b.rate <= 0 || rate <= 0 {
		return
	}
	burst := max(rate*window, 1)
	b.level *= burst / b.burst
	b.rate, b.burst = rate, burst
}

// Limited reports whether t has any budget: only such tenants are divided among proxies.
func (t *Tenant) Limited() bool {
	return t.Limits.RPS > 0 || t.Limits.PromptTPS > 0 || t.Limits.OutputTPM > 0
}

// Share bounds: a share below minShare is taken as minShare, so that a proxy never refuses
// a tenant forever on a share of 0.
const minShare = 1e-4

// SetShare makes t's budgets on this proxy the given fractions of its limits (requests/s,
// prompt tokens/s, generated tokens/min), as a control plane divides a tenant's fleet-wide
// budgets among the proxies that serve it. Fractions out of (0, 1] are clamped; NaN changes
// nothing. Each bucket keeps its level as the same fraction of its new size.
func (t *Tenant) SetShare(requests, prompt, output float64, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	limits := [3]float64{t.Limits.RPS, t.Limits.PromptTPS, t.Limits.OutputTPM / minuteWindow}
	windows := [3]float64{secondWindow, secondWindow, minuteWindow}
	for i, b := range [3]*bucket{&t.requests, &t.prompt, &t.output} {
		f := [3]float64{requests, prompt, output}[i]
		if math.IsNaN(f) {
			continue
		}
		f = min(max(f, minShare), 1)
		b.refill(now)
		b.rescale(limits[i]*f, windows[i])
		t.share[i] = f
	}
}

// Shares are t's fractions of its limits on this proxy (SetShare): requests, prompt tokens,
// output tokens.
func (t *Tenant) Shares() [3]float64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.share
}

// Demand is what a tenant asked of this proxy: the costs of its requests, admitted or
// refused, per second (smoothed over the last few calls of Demand), and its requests
// admitted and refused so far.
type Demand struct {
	Requests, PromptTokens, OutputTokens float64
	Admitted, Refused                    uint64
}

// demandSmoothing is the weight of the latest interval in a Demand's rates.
const demandSmoothing = 0.5

// Demand is what t was asked since the last call, as rates smoothed with the earlier calls'.
// The first call starts the clock and gives no rates.
func (t *Tenant) Demand(now time.Time) Demand {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.rateAt.IsZero() {
		if d := now.Sub(t.rateAt).Seconds(); d > 0 {
			for i := range t.rate {
				t.rate[i] = (1-demandSmoothing)*t.rate[i] + demandSmoothing*t.asked[i]/d
				t.asked[i] = 0
			}
			t.rateAt = now
		}
	} else {
		t.asked, t.rateAt = [3]float64{}, now
	}
	return Demand{Requests: t.rate[0], PromptTokens: t.rate[1], OutputTokens: t.rate[2], Admitted: t.admitted, Refused: t.refused}
}

// Exceeded says which budget refused a request and when to try again.
type Exceeded struct {
	// Limit is "requests", "prompt_tokens" or "output_tokens".
	Limit      string
	RetryAfter time.Duration
}

func (e *Exceeded) Error() string {
	return fmt.Sprintf("rate limit reached for %s: retry in %s", e.Limit, e.RetryAfter.Round(time.Millisecond))
}

// Reservation is what an admitted request took from its tenant's budgets; Settle gives back
// what its answer did not use.
type Reservation struct {
	t      *Tenant
	output float64
}

// Admit takes a request of promptTokens and up to maxOutput generated tokens from t's budgets
// at now, or refuses it (nothing taken) with the budget that is spent.
func (t *Tenant) Admit(now time.Time, promptTokens, maxOutput int) (Reservation, *Exceeded) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.requests.refill(now)
	t.prompt.refill(now)
	t.output.refill(now)
	out := float64(max(maxOutput, 0))
	costs := [...]struct {
		b    *bucket
		cost float64
		name string
	}{{&t.requests, 1, "requests"}, {&t.prompt, float64(max(promptTokens, 0)), "prompt_tokens"}, {&t.output, out, "output_tokens"}}
	for i, c := range costs {
		t.asked[i] += c.cost
	}
	for _, c := range costs {
		if w := c.b.wait(c.cost); w > 0 {
			t.refused++
			return Reservation{}, &Exceeded{Limit: c.name, RetryAfter: w}
		}
	}
	for _, c := range costs {
		c.b.take(c.cost)
	}
	t.admitted++
	return Reservation{t: t, output: out}, nil
}

// Settle returns to the tenant's output budget what the answer did not generate of what was
// reserved. Safe to call on the zero Reservation.
func (r Reservation) Settle(outputTokens int) {
	if r.t == nil {
		return
	}
	t := r.t
	t.mu.Lock()
	if t.output.rate > 0 {
		t.output.level = min(t.output.burst, t.output.level+max(r.output-float64(max(outputTokens, 0)), 0))
	}
	t.mu.Unlock()
}

// Budget is one of a tenant's budgets as OpenAI's x-ratelimit-* headers give it: whether it
// is limited, its limit (the bucket's size), what remains and how long until it is whole
// again.
type Budget struct {
	Limited          bool
	Limit, Remaining int64
	Reset            time.Duration
}

// budget is the bucket as a Budget.
func (b *bucket) budget() Budget {
	return Budget{Limited: b.rate > 0, Limit: int64(b.burst), Remaining: int64(math.Max(b.level, 0)), Reset: b.reset()}
}

// Status is the budgets of a tenant OpenAI's headers report: requests, and prompt tokens.
type Status struct{ Requests, Tokens Budget }

// Status is t's budgets at now.
func (t *Tenant) Status(now time.Time) Status {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.requests.refill(now)
	t.prompt.refill(now)
	return Status{Requests: t.requests.budget(), Tokens: t.prompt.budget()}
}

// AppendHeaders appends st as OpenAI's x-ratelimit-* header lines (CRLF-terminated) to b.
func (st Status) AppendHeaders(b []byte) []byte {
	return st.Tokens.appendHeaders(st.Requests.appendHeaders(b, "requests"), "tokens")
}

// appendHeaders appends the x-ratelimit-{limit,remaining,reset}-<what> lines of a limited
// budget to b.
func (bu Budget) appendHeaders(b []byte, what string) []byte {
	if !bu.Limited {
		return b
	}
	b = append(append(append(b, "x-ratelimit-limit-"...), what...), ": "...)
	b = strconv.AppendInt(b, bu.Limit, 10)
	b = append(append(append(b, "\r\nx-ratelimit-remaining-"...), what...), ": "...)
	b = strconv.AppendInt(b, bu.Remaining, 10)
	b = append(append(append(b, "\r\nx-ratelimit-reset-"...), what...), ": "...)
	b = append(b, resetString(bu.Reset)...)
	return append(b, "\r\n"...)
}

// resetString writes a reset time as OpenAI does: "1s", "6m0s", "20ms".
func resetString(d time.Duration) string {
	if d < time.Second {
		return strconv.FormatInt(d.Milliseconds(), 10) + "ms"
	}
	return d.Round(time.Second).String()
}

// Salt is the cache_salt a request of t carries to the engine, whatever salt its client sent
// (client, possibly empty): prefix caching is shared within a tenant and never across two, so
// that no tenant can learn by timing whether another sent a prompt. A tenant in a cache region
// gets the region's salt instead, the same for every tenant of the region and unlike any
// tenant's own (the region's name is hashed in a namespace of its own). A client's own salt is
// kept inside its tenant's or region's (two salts stay apart), never across.
func (t *Tenant) Salt(client []byte) []byte {
	h := sha256.New()
	if t.Region != "" {
		// The name's length first: no region's name and client salt read as another's.
		h.Write([]byte("kvrelay cache region\x00"))
		h.Write(binary.BigEndian.AppendUint32(nil, uint32(len(t.Region))))
		h.Write([]byte(t.Region))
	} else {
		h.Write([]byte("kvrelay tenant\x00"))
		h.Write([]byte(t.Name))
		h.Write([]byte{0})
	}
	h.Write(client)
	var sum [sha256.Size]byte
	return append([]byte("kvrelay-"), hex.EncodeToString(h.Sum(sum[:0])[:16])...)
}

// Table maps keys to tenants. Safe for concurrent reads.
type Table struct {
	keys    map[[sha256.Size]byte]*Tenant
	tenants map[string]*Tenant
	weight  float64 // the tenants' weights together
}

// Tenants are the table's tenants by name.
func (t *Table) Tenants() map[string]*Tenant { return t.tenants }

// Share is ten's weight over the weights of every tenant of the table: its share of the
// fleet when all of them want it.
func (t *Table) Share(ten *Tenant) float64 {
	if t.weight <= 0 {
		return 0
	}
	return ten.Limits.Weight / t.weight
}

// Lookup returns the tenant of the bearer token in authorization (an Authorization header's
// value), or nil.
func (t *Table) Lookup(authorization []byte) *Tenant {
	if t == nil {
		return nil
	}
	scheme, tok, ok := bytes.Cut(bytes.TrimSpace(authorization), []byte(" "))
	if !ok || !bytes.EqualFold(scheme, []byte("Bearer")) {
		return nil
	}
	h := sha256.Sum256(bytes.TrimSpace(tok))
	for k, ten := range t.keys {
		// Each key compared in constant time: how many keys match no prefix does not leak.
		if subtle.ConstantTimeCompare(k[:], h[:]) == 1 {
			return ten
		}
	}
	return nil
}

// MaxKeys bounds the keys of one file.
const MaxKeys = 65536

// ErrSyntax wraps what is wrong with a keys file.
var ErrSyntax = errors.New("api keys file")

// Parse reads a keys file. Tenants keep their budgets' state across a reload only through
// Reload (Keys.reload carries them over by name).
func Parse(data []byte) (*Table, error) {
	t := &Table{keys: map[[sha256.Size]byte]*Tenant{}, tenants: map[string]*Tenant{}}
	limits := map[string]Limits{}
	type region struct {
		name string
		line int // where the tenant's first key named it (or none)
	}
	regions := map[string]region{}
	type entry struct {
		hash   [sha256.Size]byte
		tenant string
	}
	var entries []entry
	for n, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fail := func(format string, args ...any) error {
			return fmt.Errorf("%w: line %d: %s", ErrSyntax, n+1, fmt.Sprintf(format, args...))
		}
		key, rest, ok := strings.Cut(line, " ")
		if !ok {
			return nil, fail("want <key> tenant=<name>[,...]")
		}
		var h [sha256.Size]byte
		if hexed, ok := strings.CutPrefix(key, "sha256:"); ok {
			b, err := hex.DecodeString(hexed)
			if err != nil || len(b) != sha256.Size {
				return nil, fail("sha256: wants 64 hex digits")
			}
			copy(h[:], b)
		} else {
			h = sha256.Sum256([]byte(key))
		}
		var name, cache string
		var l Limits
		for _, kv := range strings.Split(strings.TrimSpace(rest), ",") {
			k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
			if !ok || v == "" {
				return nil, fail("%q: want name=value", kv)
			}
			if k == "tenant" || k == "cache" {
				if len(v) > 128 || strings.ContainsAny(v, " \t\"") || strings.ContainsFunc(v, unicode.IsControl) {
					return nil, fail("%s %q: at most 128 characters, no spaces, quotes or control characters", k, v)
				}
				if k == "tenant" {
					name = v
				} else {
					cache = v
				}
				continue
			}
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || f < 0 || math.IsInf(f, 0) || math.IsNaN(f) {
				return nil, fail("%s=%s: want a number ≥ 0", k, v)
			}
			switch k {
			case "weight":
				l.Weight = f
			case "rps":
				l.RPS = f
			case "prompt_tps":
				l.PromptTPS = f
			case "output_tpm":
				l.OutputTPM = f
			default:
				return nil, fail("unknown field %q (want tenant, weight, rps, prompt_tps, output_tpm, cache)", k)
			}
		}
		if name == "" {
			return nil, fail("no tenant=")
		}
		if prev, ok := limits[name]; ok && prev != l && l != (Limits{}) {
			return nil, fail("tenant %s has other limits on an earlier line", name)
		} else if !ok || prev == (Limits{}) {
			limits[name] = l
		}
		if prev, ok := regions[name]; !ok {
			regions[name] = region{cache, n + 1}
		} else if prev.name != cache {
			return nil, fail("tenant %s has %s here but %s on line %d (all its keys share one salt)", name, regionString(cache), regionString(prev.name), prev.line)
		}
		entries = append(entries, entry{h, name})
		if len(entries) > MaxKeys {
			return nil, fail("more than %d keys", MaxKeys)
		}
	}
	for name, l := range limits {
		t.tenants[name] = newTenant(name, regions[name].name, l)
		t.weight += t.tenants[name].Limits.Weight
	}
	for _, e := range entries {
		if prev, ok := t.keys[e.hash]; ok && prev.Name != e.tenant {
			return nil, fmt.Errorf("%w: one key given to tenants %s and %s", ErrSyntax, prev.Name, e.tenant)
		}
		t.keys[e.hash] = t.tenants[e.tenant]
	}
	return t, nil
}

// regionString names a key line's cache region in an error.
func regionString(region string) string {
	if region == "" {
		return "no cache region"
	}
	return "cache region " + region
}

// carry keeps in next the budgets' state of the tenants of prev that next has with the same
// limits and cache region, so that reloading a file does not refill anyone's budget. (A
// tenant whose region changed is next's: its requests take the new region's salt at once.)
func carry(prev, next *Table) {
	if prev == nil {
		return
	}
	for name, nt := range next.tenants {
		pt, ok := prev.tenants[name]
		if !ok {
			continue
		}
		if pt.Limits != nt.Limits || pt.Region != nt.Region {
			// New budgets (or a new salt), but this proxy's share of the budgets stays
			// until the control plane says otherwise.
			sh := pt.Shares()
			nt.SetShare(sh[0], sh[1], sh[2], time.Now())
			continue
		}
		for k, v := range next.keys {
			if v == nt {
				next.keys[k] = pt
			}
		}
		next.tenants[name] = pt
	}
}
