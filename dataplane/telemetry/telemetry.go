// Package telemetry reads each engine's own account of its load for a proxy that runs
// without a control plane: it scrapes every worker's Prometheus metrics (vLLM's names, which
// kvrelay's simulated engine and llm-d-inference-sim speak too, or another kind's through
// its engines.Engine adapter) and hands the running and waiting requests and KV usage to the
// router's worker (route.Worker.SetReported), as a control plane's load view would. The
// router then sees the requests other clients sent the engine, not only this proxy's, and
// the latency model learns each engine's concurrency limit from what it runs while requests
// wait, without being told.
//
// # Lifecycle
//
// A Scraper is configured by its fields and started with Run, which polls until its context
// ends; each worker is polled on a goroutine of its own, started when the worker first
// appears in Workers() and stopped when it leaves or Run returns. A worker whose metrics
// fail FailAfter times in a row has its report cleared, so that routing falls back to the
// proxy's own count instead of a stale one.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines"
)

// Defaults of a Scraper.
const (
	DefaultInterval  = 100 * time.Millisecond
	DefaultFailAfter = 5
	// maxDrain bounds what is read of a response after use, so its connection is reused.
	maxDrain = 64 << 10
)

// Scraper polls the metrics of the workers Workers returns.
type Scraper struct {
	// Workers returns the workers to poll (the proxy's current pool); called every
	// Interval from Run's goroutine.
	Workers func() []*route.Worker
	// Adapter reads an engine's exposition (engines/vllm by default for the engines
	// kvrelay proxies without a control plane).
	Adapter engines.Engine
	// Client makes the requests; nil: a client with a timeout of Interval·4.
	Client *http.Client
	// Interval between two polls of a worker (DefaultInterval when 0).
	Interval time.Duration
	// FailAfter is how many failed polls in a row clear a worker's report (DefaultFailAfter
	// when 0).
	FailAfter int
	// Log receives warnings (a worker's metrics failing, recovering); nil discards them.
	Log *slog.Logger

	scrapes, failures atomic.Int64
	active            atomic.Int64 // pollers running
}

// Stats counts a Scraper's polls.
type Stats struct {
	Scrapes, Failures int64
}

// Stats returns the polls made and failed so far. Safe from any goroutine.
func (s *Scraper) Stats() Stats { return Stats{Scrapes: s.scrapes.Load(), Failures: s.failures.Load()} }

// Run polls until ctx ends and returns ctx's error.
func (s *Scraper) Run(ctx context.Context) error {
	if s.Workers == nil || s.Adapter == nil {
		return errors.New("telemetry: a scraper needs Workers and an Adapter")
	}
	interval := s.Interval
	if interval <= 0 {
		interval = DefaultInterval
	}
	client := s.Client
	if client == nil {
		client = &http.Client{Timeout: 4 * interval}
	}
	log := s.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	type poller struct {
		cancel context.CancelFunc
		done   chan struct{}
	}
	polling := map[*route.Worker]*poller{}
	var wg sync.WaitGroup
	defer func() {
		for _, p := range polling {
			p.cancel()
		}
		wg.Wait()
	}()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		seen := map[*route.Worker]bool{}
		for _, w := range s.Workers() {
			seen[w] = true
			if polling[w] != nil || w.URL == "" {
				continue
			}
			pctx, cancel := context.WithCancel(ctx)
			p := &poller{cancel: cancel, done: make(chan struct{})}
			polling[w] = p
			wg.Add(1)
			s.active.Add(1)
			go func() {
				defer wg.Done()
				defer close(p.done)
				defer s.active.Add(-1)
				s.poll(pctx, client, w, interval, log)
			}()
		}
		for w, p := range polling {
			if !seen[w] {
				p.cancel()
				delete(polling, w)
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// poll scrapes w every interval until ctx ends.
func (s *Scraper) poll(ctx context.Context, client *http.Client, w *route.Worker, interval time.Duration, log *slog.Logger) {
	failAfter := s.FailAfter
	if failAfter <= 0 {
		failAfter = DefaultFailAfter
	}
	url := strings.TrimRight(w.URL, "/") + s.Adapter.MetricsPath()
	t := time.NewTicker(interval)
	defer t.Stop()
	fails := 0
	for {
		err := s.scrape(ctx, client, url, w)
		s.scrapes.Add(1)
		switch {
		case err == nil:
			if fails >= failAfter {
				log.Info("engine metrics readable again", "worker", w.ID)
			}
			fails = 0
		case ctx.Err() != nil:
			return
		default:
			s.failures.Add(1)
			fails++
			if fails == failAfter {
				w.SetReported(nil)
				log.Warn("engine metrics failing: routing on this proxy's own requests there", "worker", w.ID, "url", url, "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// scrape reads url once and reports w's load.
func (s *Scraper) scrape(ctx context.Context, client *http.Client, url string, w *route.Worker) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("scraping %s: %w", url, err)
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4;q=1,*/*;q=0.1")
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("scraping %s: %w", url, err)
	}
	defer func() {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxDrain))
		resp.Body.Close()
	}()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("scraping %s: status %d", url, resp.StatusCode)
	}
	l, err := s.Adapter.ParseLoad(resp.Body)
	if err != nil {
		return fmt.Errorf("scraping %s: %w", url, err)
	}
	r := &route.Reported{Running: l.Running, Waiting: l.Waiting, KVUsage: l.KVUsage}
	if !l.Found.Has(engines.FieldKVUsage) {
		r.KVUsage = w.KVInUse() // unknown: keep the proxy's own view
	}
	w.SetReported(r)
	return nil
}
