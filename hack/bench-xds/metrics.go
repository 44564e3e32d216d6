package main

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"sync"

	"github.com/prometheus/common/expfmt"

	"github.com/kvrelay/kvrelay/engines/sim"
)

// A synthetic engine's /metrics is the page kvrelay's simulated engine serves (vLLM's metric
// families, labels and histogram buckets, about 20 KB), so that a replica's scrape parses what
// it parses in production, and its load (requests running and waiting, KV usage) moves on
// every scrape, as a busy engine's does: every worker's load changes between two pushes.

// exposition is one model's page cut at its three load gauges' sample lines, which each
// scrape fills in: parts[i], then the sample line of loadGauges[gauge[i]], and after the
// last gauge the last part.
type exposition struct {
	parts [][]byte
	gauge []int
	names [3]string // each gauge's name and labels
}

var (
	expositionsMu sync.Mutex
	expositions   = map[string]*exposition{}
)

// loadGauges are the gauges the control plane reads a vLLM engine's load from; exposition.gauge
// and the values of a scrape index them.
var loadGauges = [3]string{"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}

// expositionFor renders (once per model and cache size) the simulated engine's page.
func expositionFor(model string, blocks int) (*exposition, error) {
	key := model + "\x00" + strconv.Itoa(blocks)
	expositionsMu.Lock()
	defer expositionsMu.Unlock()
	if e, ok := expositions[key]; ok {
		return e, nil
	}
	cfg := sim.DefaultConfig()
	cfg.Model, cfg.BlockSize, cfg.NumGPUBlocks = model, synthBlockSize, blocks
	mfs, err := sim.NewMetrics(cfg).Registry().Gather()
	if err != nil {
		return nil, err
	}
	var page bytes.Buffer
	enc := expfmt.NewEncoder(&page, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			return nil, err
		}
	}
	e := &exposition{}
	var part []byte
	for l := range bytes.Lines(page.Bytes()) {
		k := slices.IndexFunc(loadGauges[:], func(g string) bool {
			rest, ok := bytes.CutPrefix(l, []byte(g))
			return ok && len(rest) > 0 && (rest[0] == '{' || rest[0] == ' ')
		})
		if k < 0 {
			part = append(part, l...)
			continue
		}
		e.parts, e.gauge, part = append(e.parts, part), append(e.gauge, k), nil
		e.names[k] = string(l[:bytes.LastIndexByte(l, ' ')])
	}
	e.parts = append(e.parts, part)
	for k, name := range e.names {
		if name == "" {
			return nil, fmt.Errorf("the simulated engine's page has no %s", loadGauges[k])
		}
	}
	expositions[key] = e
	return e, nil
}

// engineLoad is a synthetic engine's load, a random walk that takes a step on each scrape.
type engineLoad struct {
	mu               sync.Mutex
	rng              *rand.Rand
	running, waiting int
	usage            float64
	maxRunning       int
}

func (l *engineLoad) step() (running, waiting int, usage float64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.running = min(max(l.running+l.rng.IntN(5)-2, 0), l.maxRunning)
	l.waiting = max(l.waiting+l.rng.IntN(5)-2, 0)
	if l.running < l.maxRunning {
		l.waiting = 0
	}
	l.usage = min(max(l.usage+(l.rng.Float64()-0.5)*0.04, 0), 1)
	return l.running, l.waiting, l.usage
}

// metricsHandler serves e with l's next step on /metrics, and an empty 200 on any other path
// (the control plane's health probe).
func metricsHandler(e *exposition, l *engineLoad) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			rw.WriteHeader(http.StatusOK)
			return
		}
		running, waiting, usage := l.step()
		vals := [3]string{strconv.Itoa(running), strconv.Itoa(waiting), strconv.FormatFloat(usage, 'g', -1, 64)}
		var b bytes.Buffer
		for i, part := range e.parts {
			b.Write(part)
			if i < len(e.gauge) {
				k := e.gauge[i]
				b.WriteString(e.names[k])
				b.WriteByte(' ')
				b.WriteString(vals[k])
				b.WriteByte('\n')
			}
		}
		rw.Header().Set("Content-Type", string(expfmt.NewFormat(expfmt.TypeTextPlain)))
		_, _ = rw.Write(b.Bytes())
	})
}
