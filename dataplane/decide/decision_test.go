package decide

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/dataplane/tenant"
	"github.com/kvrelay/kvrelay/engines/blockhash"
)

// chat8k is a chat body whose system prompt renders to about 8k tokens.
func chat8k(user string) []byte { return chat8kWith("", user) }

// chat8kWith starts the system prompt with prefix.
func chat8kWith(prefix, user string) []byte {
	var sys strings.Builder
	sys.WriteString(prefix)
	words := strings.Fields("the router sends each request to the worker that already holds most of its prompt in cache")
	for i := range 8000 {
		sys.WriteString(words[i%len(words)])
		sys.WriteByte(' ')
	}
	b, _ := json.Marshal(map[string]any{
		"model":      "gpt-oss-120b",
		"max_tokens": 64,
		"messages":   []map[string]string{{"role": "system", "content": sys.String()}, {"role": "user", "content": user}},
	})
	return b
}

// decideBody runs the request path up to the routing decision: parse, tokenize, hash,
// match, score, pick.
func decideBody(tb testing.TB, r *Request, body []byte) {
	if err := r.Parse(body); err != nil {
		tb.Fatal(err)
	}
	if err := r.Prepare(); err != nil {
		tb.Fatal(err)
	}
	if err := r.c.kv.Route(&r.rreq, &r.dec); err != nil {
		tb.Fatal(err)
	}
}

// benchTenants is a keys file of three tenants whose budgets are limited (so that admitting
// a request does the buckets' arithmetic) but never spent by a benchmark.
const benchTenants = `sk-a tenant=a,weight=2,rps=1e9,prompt_tps=1e15,output_tpm=1e15
sk-b tenant=b,rps=1e9,prompt_tps=1e15,output_tpm=1e15
sk-c tenant=c
`

// tenantCore is decisionCore with tenants' headroom kept (tenant_headroom 1 of busy_requests
// 8), the most a tenant adds to a decision; the busy filter itself, which costs the same with
// a tenant or without, stays off.
func tenantCore(tb testing.TB, n int, policy string) *Core {
	cfg := testConfig()
	cfg.BusyRequests, cfg.TenantHeadroom = 8, 1
	return newTestCore(tb, cfg, testRouteConfig(policy), testWorkers(n))
}

// decideTenant is decideBody for a request of tenant ten (of table tab) at now, with what the
// proxy does per request with API keys besides: the tenant and its flow set as its setFlow
// sets them, the request admitted to the tenant's budgets before its decision, its headroom
// read (and the request counted among its tenant's running ones) as Decide does, and, once
// decided, counted out again and its reservation settled, as its answer's end does.
func decideTenant(tb testing.TB, r *Request, body []byte, tab *tenant.Table, ten *tenant.Tenant, now time.Time) {
	setTenant(r, tab, ten)
	if err := r.Parse(body); err != nil {
		tb.Fatal(err)
	}
	if err := r.Prepare(); err != nil {
		tb.Fatal(err)
	}
	resv := admitTenant(tb, r, ten, now)
	if err := r.c.kv.Route(&r.rreq, &r.dec); err != nil {
		tb.Fatal(err)
	}
	settleTenant(r, resv)
}

// setTenant, admitTenant and settleTenant are what decideTenant adds to decideBody: before
// the parse, after the prompt is prepared, and once decided.
func setTenant(r *Request, tab *tenant.Table, ten *tenant.Tenant) {
	r.SetTenant(ten.Name, tab.Share(ten))
	r.SetFlow(ten.Name, ten.Limits.Weight)
}

func admitTenant(tb testing.TB, r *Request, ten *tenant.Tenant, now time.Time) tenant.Reservation {
	resv, ex := ten.Admit(now, r.PromptTokens(), r.oreq.MaxTokens)
	if ex != nil {
		tb.Fatal(ex)
	}
	r.rreq.Headroom = r.headroom(r.c.kv.Pool())
	return resv
}

func settleTenant(r *Request, resv tenant.Reservation) {
	r.countRunning(-1)
	resv.Settle(r.oreq.MaxTokens / 2)
}

// benchTenant is tenant a of benchTenants.
func benchTenant(tb testing.TB) (*tenant.Table, *tenant.Tenant) {
	tab, err := tenant.Parse([]byte(benchTenants))
	if err != nil {
		tb.Fatal(err)
	}
	ten := tab.Lookup([]byte("Bearer sk-a"))
	if ten == nil {
		tb.Fatal("no tenant a")
	}
	return tab, ten
}

// fillIndex records about n blocks spread over the workers.
func fillIndex(s *Core, n int) {
	toks := make([]uint32, 16*256)
	var h blockhash.Hasher
	var hashes []uint64
	for g := 0; s.index.Len() < n-len(toks)/16; g++ {
		for i := range toks {
			toks[i] = uint32(g*7919 + i)
		}
		hashes = h.AppendSeq(hashes[:0], toks, 16, nil)
		s.index.Record(g%len(s.WorkerStates()), hashes, 0)
	}
}

func TestDecisionFollowsThePrefix(t *testing.T) {
	s := decisionCore(t, 8)
	cc := newChat(s)
	decideBody(t, cc, chat8k("first question"))
	if cc.rreq.PromptTokens < 8000 || len(cc.rreq.Hashes) != cc.rreq.PromptTokens/16 {
		t.Fatalf("prompt %d tokens, %d blocks", cc.rreq.PromptTokens, len(cc.rreq.Hashes))
	}
	first := cc.dec.Worker
	s.index.Record(first.Index, cc.rreq.Hashes, 0)
	decideBody(t, cc, chat8k("second question"))
	if cc.dec.Worker != first || cc.dec.Mode != "cost" || cc.dec.Overlap < float64(len(cc.rreq.Hashes)-2) {
		t.Fatalf("the shared 8k-token system prompt should follow %s: got %s (%s, overlap %v of %d)",
			first.ID, cc.dec.Worker.ID, cc.dec.Mode, cc.dec.Overlap, len(cc.rreq.Hashes))
	}
}

func TestDecisionAllocations(t *testing.T) {
	for _, policy := range []string{route.PolicyKV, route.PolicyLatency} {
		t.Run(policy, func(t *testing.T) { testDecisionAllocations(t, policy) })
	}
}

func testDecisionAllocations(t *testing.T, policy string) {
	s := decisionCore(t, 64, policy)
	cc := newChat(s)
	body := chat8k("warm")
	decideBody(t, cc, body)
	// Hash, match and score allocate nothing, and neither does the whole decision once the
	// connection's buffers have grown and the token cache holds the prompt.
	if a := leastAllocs(func() {
		cc.rreq.Hashes = cc.hasher.AppendSeq(cc.rreq.Hashes[:0], cc.toks, 16, nil)
		_ = s.kv.Route(&cc.rreq, &cc.dec)
	}); a != 0 {
		t.Fatalf("hash+match+score allocates %.1f times", a)
	}
	if a := leastAllocs(func() { decideBody(t, cc, body) }); a != 0 {
		t.Fatalf("the whole decision allocates %.1f times", a)
	}
	// Nor does a tenant's, headroom kept.
	ts := tenantCore(t, 64, policy)
	tab, ten := benchTenant(t)
	tc := newChat(ts)
	decideTenant(t, tc, body, tab, ten, time.Now())
	if a := leastAllocs(func() { decideTenant(t, tc, body, tab, ten, time.Now()) }); a != 0 {
		t.Fatalf("a tenant's decision allocates %.1f times", a)
	}
	if n := ts.tenantRunning["a"]; n != 0 {
		t.Fatalf("tenant a counts %d running requests after its decisions were counted out", n)
	}
}

// leastAllocs is the fewest allocations per run of f in three testing.AllocsPerRun
// measurements. AllocsPerRun counts the whole process's allocations, so goroutines that
// earlier tests left winding down can only add to it.
func leastAllocs(f func()) float64 {
	least := testing.AllocsPerRun(20, f)
	for range 2 {
		least = min(least, testing.AllocsPerRun(20, f))
	}
	return least
}

// BenchmarkDecision8k: an 8k-token chat request against 64 workers and 1M indexed blocks,
// under the kv policy ("warm", "cold", "warm-tenant") and the latency policy
// ("latency-warm", "latency-cold", "latency-warm-tenant"). "warm" repeats the system prompt
// (the token cache serves it); "cold" changes the whole prompt each time; "warm-tenant" is
// "warm" as a tenant's request with API keys (decideTenant: its flow, its admission to its
// budgets and their settling, its headroom, kept), on the same core and index. Reported: p50
// and p99 of the whole decision in µs.
func BenchmarkDecision8k(b *testing.B) {
	for _, policy := range []string{route.PolicyKV, route.PolicyLatency} {
		benchmarkDecision8k(b, policy)
	}
}

func benchmarkDecision8k(b *testing.B, policy string) {
	s := tenantCore(b, 64, policy) // the headroom it keeps is a tenant's alone
	fillIndex(s, 1<<20)
	prefix := ""
	if policy != route.PolicyKV {
		prefix = policy + "-"
	}
	tab, ten := benchTenant(b)
	for _, mode := range []string{"warm", "cold", "warm-tenant"} {
		b.Run(prefix+mode, func(b *testing.B) {
			cc := newChat(s)
			body := chat8k("warm-up")
			decideBody(b, cc, body)
			s.index.Record(cc.dec.Worker.Index, cc.rreq.Hashes, 0)
			var lat []time.Duration
			i := 0
			b.ReportAllocs()
			for b.Loop() {
				i++
				if mode == "cold" {
					body = chat8kWith(strconv.Itoa(i)+" ", "cold")
				}
				t0 := time.Now()
				if mode == "warm-tenant" {
					decideTenant(b, cc, body, tab, ten, t0) // the proxy admits at its loop's time
				} else {
					decideBody(b, cc, body)
				}
				lat = append(lat, time.Since(t0))
			}
			reportPercentiles(b, lat)
		})
	}
}

// BenchmarkTenantWork is what warm-tenant adds to warm, alone: a tenant's flow set, its
// request admitted to its budgets and its headroom read, then counted out and settled.
func BenchmarkTenantWork(b *testing.B) {
	s := tenantCore(b, 64, route.PolicyLatency)
	tab, ten := benchTenant(b)
	cc := newChat(s)
	decideBody(b, cc, chat8k("warm-up"))
	now := time.Now()
	b.ReportAllocs()
	for b.Loop() {
		now = now.Add(time.Microsecond) // the proxy admits at its loop's time: no clock read
		setTenant(cc, tab, ten)
		settleTenant(cc, admitTenant(b, cc, ten, now))
	}
}

func reportPercentiles(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	sortDurations(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
}

func sortDurations(d []time.Duration) {
	for i := 1; i < len(d); i++ {
		for j := i; j > 0 && d[j] < d[j-1]; j-- {
			d[j], d[j-1] = d[j-1], d[j]
		}
	}
}

// TestMultimodalPartsKeyTheirBlocks: an image in the prompt keys every block, so a
// conversation with an image follows the worker that holds that conversation with that
// image, and neither the same text without it nor with another image matches its blocks.
func TestMultimodalPartsKeyTheirBlocks(t *testing.T) {
	s := decisionCore(t, 4)
	cc := newChat(s)
	withImage := func(url string) []byte {
		var m map[string]any
		_ = json.Unmarshal(chat8k("what is in the picture?"), &m)
		msgs := m["messages"].([]any)
		user := msgs[1].(map[string]any)
		user["content"] = []any{
			map[string]any{"type": "text", "text": "what is in the picture?"},
			map[string]any{"type": "image_url", "image_url": map[string]any{"url": url}},
		}
		b, _ := json.Marshal(m)
		return b
	}
	hashes := func(body []byte) []uint64 {
		decideBody(t, cc, body)
		return append([]uint64(nil), cc.rreq.Hashes...)
	}
	cat, plain, dog := hashes(withImage("https://example.com/cat.png")), hashes(chat8k("what is in the picture?")), hashes(withImage("https://example.com/dog.png"))
	if len(cat) < 400 {
		t.Fatalf("%d blocks", len(cat))
	}
	for i := range min(len(cat), len(plain), len(dog)) {
		if cat[i] == plain[i] || cat[i] == dog[i] {
			t.Fatalf("block %d of the prompt with an image aliases the plain one or another image's", i)
		}
	}
	// The image's conversation, recorded on one worker, follows it there.
	decideBody(t, cc, withImage("https://example.com/cat.png"))
	first := cc.dec.Worker
	s.index.Record(first.Index, cc.rreq.Hashes, 0)
	decideBody(t, cc, withImage("https://example.com/cat.png"))
	if cc.dec.Worker != first || cc.dec.Overlap < float64(len(cc.rreq.Hashes)-2) {
		t.Fatalf("the same image and prompt went to %s (overlap %v of %d), want %s", cc.dec.Worker.ID, cc.dec.Overlap, len(cc.rreq.Hashes), first.ID)
	}
	decideBody(t, cc, chat8k("what is in the picture?"))
	if cc.dec.Overlap != 0 {
		t.Fatalf("the plain prompt matched %v blocks of the image's", cc.dec.Overlap)
	}
}
