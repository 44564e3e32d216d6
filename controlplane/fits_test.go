package controlplane_test

import (
	"bytes"
	"cmp"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/latency"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// streamChat sends a streamed chat completion (what teaches a proxy's latency model) and
// reads it to its end.
func streamChat(t *testing.T, base, system, user string) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{
		"model": model, "max_tokens": 8, "stream": true,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}},
	})
	resp, err := http.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("streamed chat: %d", resp.StatusCode)
	}
}

// TestProxiesShareWhatTheyLearn: what one proxy's latency model learns from the requests it
// routes reaches the control plane in its load reports, is pooled, and is pushed back with
// the workers: a proxy that starts later, and has routed nothing, predicts with the first
// one's coefficients and knows each worker's speed, instead of starting from the prior.
func TestProxiesShareWhatTheyLearn(t *testing.T) {
	c := newCluster(t, 2)
	p0 := c.addProxy(c.xds)
	waitWorkers(t, p0, 2)
	// Until the first proxy's model of the workers (as they are now: a worker whose model
	// name arrives after it joined gets a model of that name afresh) has learned 20 first
	// tokens, and each worker at least two: a proxy takes a worker's pooled figures only
	// when the pool saw twice the first tokens it did (latency.Worker.Share), so a worker
	// the first proxy sent one request would keep the second proxy's prior. Every prompt
	// is new, so neither worker caches more of it than the other and the router's ties
	// spread the requests over both (with a few repeated prompts, the worker that first got
	// each could take them all).
	// Ties do not always spread them: once one worker's model has learned, the other's prior
	// can predict it slower than exploration tries. Then the worker that took the requests
	// is drained until the other has learned from two.
	var learned latency.Fit
	drained := ""
	setDraining := func(id string, on bool) {
		t.Helper()
		verb := map[bool]string{true: "drain", false: "undrain"}[on]
		if code, out := c.api("POST", "/v1/workers/"+id+"/"+verb, "", true); code != 200 {
			t.Fatalf("%s %s: %d %v", verb, id, code, out)
		}
		deadline := time.Now().Add(time.Minute)
		for !slices.ContainsFunc(p0.Workers(), func(w *route.Worker) bool { return w.ID == id && w.Draining() == on }) {
			if time.Now().After(deadline) {
				t.Fatalf("the proxy never saw %s %sed", id, verb)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	for i := 0; learned.TTFTObs < 20 || leastObs(p0) < 2; i++ {
		if i == 400 {
			t.Fatalf("the first proxy's model learned %d first tokens from %d requests, a worker %d", learned.TTFTObs, i, leastObs(p0))
		}
		if drained == "" && i > 0 && i%20 == 0 && leastObs(p0) < 2 {
			busy := slices.MaxFunc(p0.Workers(), func(a, b *route.Worker) int { return cmp.Compare(a.Latency().Fit().Obs, b.Latency().Fit().Obs) })
			drained = busy.ID
			setDraining(drained, true)
		}
		streamChat(t, "http://"+p0.Addr(), family(100+i), "question "+strconv.Itoa(i))
		learned = p0.Workers()[0].Latency().Model().Fit()
		if drained != "" && leastObs(p0) >= 2 {
			setDraining(drained, false)
			drained = ""
		}
	}
	p1 := c.addProxy(c.xds)
	waitWorkers(t, p1, 2)
	// The fits go out every few seconds, and the pool is pushed with the workers' next
	// update: within seconds, given a minute under load (-race on a busy machine).
	deadline := time.Now().Add(time.Minute)
	for {
		got := p1.Workers()[0].Latency().Model().Fit()
		if got.TTFTObs == 0 && near(got.Theta[:], learned.Theta[:]) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second proxy's coefficients %v, want the first one's %v (its own first tokens: %d)", got.Theta, learned.Theta, got.TTFTObs)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// And each worker's own figures, which the second proxy has seen nothing of. They come
	// with the first proxy's reports too, but a report sent while the first proxy was still
	// learning may have carried a worker's earlier figures, and the pool moves when the
	// next one arrives.
	deadline = time.Now().Add(time.Minute)
	for _, w := range p1.Workers() {
		var first float64
		for _, w0 := range p0.Workers() {
			if w0.ID == w.ID {
				first = w0.Latency().Fit().Occupancy
			}
		}
		for {
			got := w.Latency().Fit()
			if got.Obs == 0 && near([]float64{got.Occupancy}, []float64{first}) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("worker %s: the second proxy's occupancy %v (own first tokens %d), want the first one's %v", w.ID, got.Occupancy, got.Obs, first)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// leastObs is the fewest first tokens the proxy's model of one of its workers learned from.
func leastObs(p *proxy.Server) int64 {
	least := int64(math.MaxInt64)
	for _, w := range p.Workers() {
		least = min(least, w.Latency().Fit().Obs)
	}
	return least
}

// near reports whether a and b agree within the pool's rounding (two significant digits)
// and the first proxy's learning since it reported.
func near(a, b []float64) bool {
	for i := range a {
		if math.Abs(a[i]-b[i]) > 0.1*math.Max(math.Abs(b[i]), 0.01) {
			return false
		}
	}
	return true
}
