package controlplane_test

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
)

// The console's endpoints: decisions sampled by a proxy reach the control plane with their
// candidates and answers within a report interval or two, a decision can be fetched by id,
// a prefix shared by many requests is the hottest, the fleet carries each worker's figures
// from them, and /v1/events streams the fleet.
func TestConsoleEndpoints(t *testing.T) {
	c := newCluster(t, 3)
	p := c.addProxy(c.xds)
	waitWorkers(t, p, 3)
	// Until the control plane has scraped the workers' model, the proxy labels a sampled
	// decision's model "other", and one prompt would count as two prefixes.
	waitKnown(t, p, 3)
	base := "http://" + c.cp.APIAddr()
	// 48 requests sharing one system prompt: about six sampled (one in eight).
	for i := range 48 {
		if r := chat(t, "http://"+p.Addr(), family(0), "question "+strconv.Itoa(i)); r.status != 200 {
			t.Fatalf("request %d: %d %s", i, r.status, r.body)
		}
	}
	getJSON := func(path string, out any) {
		t.Helper()
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			b, _ := io.ReadAll(resp.Body)
			t.Fatalf("GET %s: %d %s", path, resp.StatusCode, b)
		}
		if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
	}
	var l struct {
		Decisions []controlplane.DecisionView `json:"decisions"`
		Last      uint64                      `json:"last"`
	}
	deadline := time.Now().Add(5 * time.Second)
	for getJSON("/v1/decisions", &l); len(l.Decisions) < 4; getJSON("/v1/decisions", &l) {
		if time.Now().After(deadline) {
			t.Fatalf("%d decisions at the control plane", len(l.Decisions))
		}
		time.Sleep(50 * time.Millisecond)
	}
	d := l.Decisions[0]
	if d.Proxy == "" || d.Worker == "" || d.Status != 200 || d.TTFTMs <= 0 || d.PromptTokens == 0 || len(d.Candidates) != 3 || d.Prefix == "" {
		t.Fatalf("decision %+v", d)
	}
	var one controlplane.DecisionView
	getJSON("/v1/decisions/"+strconv.FormatUint(d.ID, 10), &one)
	if one.ID != d.ID || one.Worker != d.Worker {
		t.Fatalf("decision %d by id: %+v", d.ID, one)
	}
	if resp, err := http.Get(base + "/v1/decisions/999999"); err != nil || resp.StatusCode != 404 {
		t.Fatalf("an unknown decision: %v %v", resp, err)
	}
	var since struct {
		Decisions []controlplane.DecisionView `json:"decisions"`
	}
	// Decisions keep arriving with the proxy's next reports, so what comes after the last
	// one seen may not be empty; it must hold only newer ones.
	getJSON("/v1/decisions?since="+strconv.FormatUint(l.Last, 10), &since)
	for _, n := range since.Decisions {
		if n.ID <= l.Last {
			t.Fatalf("decision %d returned after the last one, %d", n.ID, l.Last)
		}
	}
	// After the oldest one listed: the others listed, and not it.
	oldest := l.Decisions[len(l.Decisions)-1].ID
	getJSON("/v1/decisions?since="+strconv.FormatUint(oldest, 10), &since)
	got := map[uint64]bool{}
	for _, n := range since.Decisions {
		got[n.ID] = true
	}
	for _, n := range l.Decisions[:len(l.Decisions)-1] {
		if !got[n.ID] || got[oldest] {
			t.Fatalf("after decision %d: %d decisions, %d among them missing or the oldest returned", oldest, len(since.Decisions), n.ID)
		}
	}
	var pf struct {
		Prefixes []controlplane.PrefixView `json:"prefixes"`
	}
	getJSON("/v1/prefixes", &pf)
	if len(pf.Prefixes) == 0 || pf.Prefixes[0].Blocks == 0 || pf.Prefixes[0].Hits < 3 {
		t.Fatalf("hottest prefixes %+v", pf.Prefixes)
	}
	var fleet struct {
		Workers []struct {
			Spec    struct{ ID string } `json:"spec"`
			Figures controlplane.WorkerFigures
		} `json:"workers"`
		Decisions uint64 `json:"decisions"`
	}
	getJSON("/v1/fleet", &fleet)
	sampled := 0
	for _, w := range fleet.Workers {
		sampled += w.Figures.Samples
		if w.Figures.Samples > 0 && (w.Figures.TTFTP50 <= 0 || w.Figures.HitRate < 0 || w.Figures.HitRate > 1) {
			t.Fatalf("worker %s figures %+v", w.Spec.ID, w.Figures)
		}
	}
	if len(fleet.Workers) != 3 || sampled < 4 || fleet.Decisions < l.Last {
		t.Fatalf("fleet: %d workers, %d sampled decisions, newest %d", len(fleet.Workers), sampled, fleet.Decisions)
	}
	resp, err := http.Get(base + "/v1/events")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Fatalf("events content type %q", ct)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, "data: ") {
			if !strings.Contains(line, `"workers"`) {
				t.Fatalf("event %s", line)
			}
			break
		}
	}
	// The console's page is served, and its reads follow the API's rule (open here, on
	// loopback).
	page, err := http.Get(base + "/ui/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(page.Body)
	page.Body.Close()
	if page.StatusCode != 200 || !strings.Contains(string(body), "kvrelay console") || page.Header.Get("Content-Security-Policy") == "" {
		t.Fatalf("GET /ui/: %d %q", page.StatusCode, body[:min(len(body), 200)])
	}
}
