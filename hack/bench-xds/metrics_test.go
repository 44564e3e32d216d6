package main

import (
	"bytes"
	"io"
	"math/rand/v2"
	"net/http/httptest"
	"testing"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/vllm"
)

// A synthetic engine's page reads as a vLLM engine's load, and the load moves between two
// scrapes.
func TestSynthMetricsMove(t *testing.T) {
	e, err := expositionFor("m-1", 1024)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(metricsHandler(e, &engineLoad{rng: rand.New(rand.NewPCG(1, 2)), maxRunning: 16}))
	defer srv.Close()
	a := vllm.NewSim()
	var prev engines.Load
	for i := range 5 {
		resp, err := srv.Client().Get(srv.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		l, err := a.ParseLoad(bytes.NewReader(body))
		if err != nil {
			t.Fatalf("scrape %d (%d bytes): %v", i, len(body), err)
		}
		if i == 0 {
			t.Logf("page of %d bytes", len(body))
		} else if l.KVUsage == prev.KVUsage {
			t.Fatalf("scrape %d: KV usage stayed %v", i, l.KVUsage)
		}
		prev = l
	}
}
