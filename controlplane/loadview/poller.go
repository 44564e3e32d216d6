package loadview

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/engines"
)

// kvSignalDelta is how far KV usage must move (as a fraction) before it raises Changed.
const kvSignalDelta = 0.01

// maxModelBackoff bounds the wait between two failed model discoveries.
const maxModelBackoff = 30 * time.Second

// maxDrain bounds how much of a response body is read after use so that its connection can
// be reused.
const maxDrain = 64 << 10

// errNoAdapter: the target's engine kind has no adapter, so nothing reads its metrics.
var errNoAdapter = errors.New("no adapter to read metrics")

// acceptText asks for the Prometheus text format (promhttp would otherwise be free to pick
// OpenMetrics or protobuf).
const acceptText = "text/plain;version=0.0.4;q=1,*/*;q=0.1"

// poller watches one target on its own goroutine. Everything below done is owned by that
// goroutine.
type poller struct {
	v      *View
	target Target
	eng    engines.Engine // nil when the kind has no adapter
	engErr error
	stats  *counters

	metricsURL, healthURL string

	cancel context.CancelFunc
	done   chan struct{}
	// kick is raised (PutRemote) when another replica's reading of the target came.
	kick chan struct{}

	st           State // the working copy, published after each poll
	sig          State // the state as of the last Changed signal
	wantModel    bool  // discover (again) when next healthy
	modelBackoff time.Duration
	nextModelTry time.Time
}

func (v *View) newPoller(t Target) *poller {
	p := &poller{v: v, target: t, done: make(chan struct{}), kick: make(chan struct{}, 1), st: State{ID: t.ID}, wantModel: true}
	p.eng, p.engErr = v.opts.Adapters.Get(t.Engine)
	base := strings.TrimRight(t.URL, "/")
	health := "/health"
	if p.eng != nil {
		health = p.eng.HealthPath()
	}
	if base != "" {
		p.healthURL = base + health
	}
	p.metricsURL = t.MetricsURL
	if p.metricsURL == "" && base != "" && p.eng != nil {
		p.metricsURL = base + p.eng.MetricsPath()
	}
	p.sig = p.st
	return p
}

func (p *poller) start(parent context.Context) {
	ctx, cancel := context.WithCancel(parent)
	p.cancel = cancel
	go func() {
		defer close(p.done)
		p.run(ctx)
	}()
}

// stop cancels the poller and waits for it to exit.
func (p *poller) stop() {
	p.cancel()
	<-p.done
}

// run polls every Interval, starting after a random part of the first interval so that the
// pollers of targets synced together do not all scrape at once. Polls never overlap: a slow
// one delays the next (ticks it overran are dropped). Another replica's reading of a
// delegated target is taken as soon as it comes.
func (p *poller) run(ctx context.Context) {
	iv := p.v.opts.Interval
	first := time.NewTimer(rand.N(iv))
	select {
	case <-ctx.Done():
		first.Stop()
		return
	case <-first.C:
	case <-p.kick:
		first.Stop()
	}
	tick := time.NewTicker(iv)
	defer tick.Stop()
	due := true // a tick (or the start): poll unless a reading stands for it
	for {
		if !p.adopt() && due {
			p.poll(ctx)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			due = true
		case <-p.kick:
			due = false // a reading came: take it if it is this target's to take, poll nothing
		}
	}
}

// adopt takes another replica's reading of a delegated target in place of a poll, when one
// no older than RemoteMaxAge is at hand; it reports whether it did.
func (p *poller) adopt() bool {
	opts := &p.v.opts
	if opts.Delegated == nil || !opts.Delegated(p.target.ID) {
		return false
	}
	r, ok := p.v.remoteFor(p.target.ID)
	now := opts.Now()
	if !ok || now.Sub(r.CheckedAt) > opts.RemoteMaxAge {
		return false
	}
	st := &p.st
	if r.From == st.From && r.Seq == st.Seq {
		return true // taken already
	}
	wasHealthy := st.Healthy
	model, bs, capacity := st.Model, st.BlockSize, st.CapacityBlocks
	*st = r
	st.ID = p.target.ID
	if st.Model.ID == "" {
		st.Model = model // the other replica has not discovered it (yet)
	} else {
		p.wantModel, p.modelBackoff, p.nextModelTry = false, 0, time.Time{}
	}
	if st.BlockSize == 0 {
		st.BlockSize = bs
	}
	if st.CapacityBlocks == 0 {
		st.CapacityBlocks = capacity
	}
	p.stats.remoteTaken()
	switch {
	case st.Healthy && !wasHealthy:
		p.stats.flipped(true)
		opts.Logger.Info("load view: worker healthy, as another replica polls it", "worker", p.target.ID, "replica", r.From)
	case !st.Healthy && wasHealthy:
		p.stats.flipped(false)
		p.wantModel, p.modelBackoff, p.nextModelTry = true, 0, time.Time{}
		opts.Logger.Warn("load view: worker unhealthy, as another replica polls it", "worker", p.target.ID, "replica", r.From,
			"failures", st.ConsecutiveFailures, "err", st.LastError)
	}
	signal := p.matters()
	if signal {
		p.sig = p.st
	}
	p.v.publish(p.st.clone(), signal)
	return true
}

// poll scrapes the target (or probes its health when the scrape fails), discovers its model
// when due, and publishes the result. A poll cut short by the poller's stop publishes
// nothing.
func (p *poller) poll(ctx context.Context) {
	opts := &p.v.opts
	start := time.Now()
	load, err := p.scrape(ctx)
	p.stats.scrapeDone(time.Since(start), err == nil)
	ok := err == nil
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		perr := p.probe(ctx)
		p.stats.probeDone(perr == nil)
		if perr != nil {
			if ctx.Err() != nil {
				return
			}
			err = fmt.Errorf("%w; %w", err, perr)
		}
		ok = perr == nil
	}
	now := opts.Now()
	st := &p.st
	wasHealthy := st.Healthy
	st.CheckedAt, st.From = now, ""
	if ok {
		st.ConsecutiveFailures = 0
		st.Healthy = true
	} else {
		st.ConsecutiveFailures = min(st.ConsecutiveFailures+1, 1<<30)
		if st.ConsecutiveFailures >= opts.FailAfter {
			st.Healthy = false
		}
		if st.ConsecutiveFailures == opts.FailAfter && !wasHealthy {
			opts.Logger.Warn("load view: worker not reachable", "worker", p.target.ID,
				"failures", st.ConsecutiveFailures, "err", err)
		}
	}
	if err == nil {
		if opts.KernelLatencyWaiting != nil {
			if n, ok := opts.KernelLatencyWaiting(p.target.ID); ok && n > load.Waiting {
				load.Waiting = n
			}
		}
		if opts.KernelWaiting != nil {
			if n, ok := opts.KernelWaiting(p.target.ID); ok && n > 0 {
				load.Waiting += n
			}
		}
		st.Load, st.ObservedAt, st.LastError = load, now, ""
		if load.Found.Has(engines.FieldBlockSize) {
			st.BlockSize = load.BlockSize
		}
		if load.Found.Has(engines.FieldCapacityBlocks) {
			st.CapacityBlocks = load.CapacityBlocks
		}
	} else {
		if st.LastError != err.Error() && ok {
			opts.Logger.Warn("load view: scrape failed, worker answers its health probe",
				"worker", p.target.ID, "err", err)
		}
		st.LastError = err.Error()
	}
	switch {
	case st.Healthy && !wasHealthy:
		p.stats.flipped(true)
		opts.Logger.Info("load view: worker healthy", "worker", p.target.ID)
	case !st.Healthy && wasHealthy:
		p.stats.flipped(false)
		// It may come back as another engine, serving another model.
		p.wantModel, p.modelBackoff, p.nextModelTry = true, 0, time.Time{}
		opts.Logger.Warn("load view: worker unhealthy", "worker", p.target.ID,
			"failures", st.ConsecutiveFailures, "err", st.LastError)
	}
	if st.Healthy && p.wantModel && !now.Before(p.nextModelTry) {
		p.discover(ctx, now)
		if ctx.Err() != nil {
			return
		}
	}
	signal := p.matters()
	if signal {
		p.sig = p.st
	}
	p.v.publish(p.st.clone(), signal)
}

// matters reports whether the state moved since the last signal in a way routing cares
// about.
func (p *poller) matters() bool {
	a, b := &p.sig, &p.st
	d := a.Load.KVUsage - b.Load.KVUsage
	return a.Healthy != b.Healthy ||
		a.Load.Running != b.Load.Running || a.Load.Waiting != b.Load.Waiting ||
		d > kvSignalDelta || d < -kvSignalDelta ||
		a.Model.ID != b.Model.ID || a.Model.MaxModelLen != b.Model.MaxModelLen ||
		!slices.Equal(a.Model.IDs, b.Model.IDs) ||
		a.BlockSize != b.BlockSize || a.CapacityBlocks != b.CapacityBlocks
}

// scrape reads the target's load with its adapter.
func (p *poller) scrape(ctx context.Context) (engines.Load, error) {
	if p.eng == nil {
		return engines.Load{}, fmt.Errorf("scraping metrics: %w: %w", errNoAdapter, p.engErr)
	}
	if p.metricsURL == "" {
		return engines.Load{}, errors.New("scraping metrics: target has neither a url nor a metrics url")
	}
	ctx, cancel := context.WithTimeout(ctx, p.v.opts.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.metricsURL, nil)
	if err != nil {
		return engines.Load{}, fmt.Errorf("scraping metrics: %w", err)
	}
	req.Header.Set("Accept", acceptText)
	resp, err := p.v.client.Do(req)
	if err != nil {
		return engines.Load{}, fmt.Errorf("scraping metrics: %w", err)
	}
	defer closeBody(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return engines.Load{}, fmt.Errorf("scraping metrics: GET %s: status %d", p.metricsURL, resp.StatusCode)
	}
	load, err := p.eng.ParseLoad(resp.Body)
	if err != nil {
		return engines.Load{}, fmt.Errorf("scraping metrics from %s: %w", p.metricsURL, err)
	}
	return load, nil
}

// probe asks the target's liveness endpoint; any 2xx answer is alive.
func (p *poller) probe(ctx context.Context) error {
	if p.healthURL == "" {
		return errors.New("probing health: target has no url")
	}
	ctx, cancel := context.WithTimeout(ctx, p.v.opts.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.healthURL, nil)
	if err != nil {
		return fmt.Errorf("probing health: %w", err)
	}
	resp, err := p.v.client.Do(req)
	if err != nil {
		return fmt.Errorf("probing health: %w", err)
	}
	closeBody(resp.Body)
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("probing health: GET %s: status %d", p.healthURL, resp.StatusCode)
	}
	return nil
}

// discover asks the target which model it serves. A failure is retried at later polls,
// backing off from Interval to maxModelBackoff.
func (p *poller) discover(ctx context.Context, now time.Time) {
	if p.eng == nil || p.target.URL == "" {
		p.wantModel = false
		return
	}
	dctx, cancel := context.WithTimeout(ctx, p.v.opts.Timeout)
	defer cancel()
	m, err := p.eng.DiscoverModel(dctx, p.v.client, p.target.URL)
	if ctx.Err() != nil {
		return
	}
	p.stats.discoveryDone(err == nil)
	if err != nil {
		p.modelBackoff = min(max(2*p.modelBackoff, p.v.opts.Interval), maxModelBackoff)
		p.nextModelTry = now.Add(p.modelBackoff)
		p.v.opts.Logger.Debug("load view: model discovery failed", "worker", p.target.ID,
			"retry_in", p.modelBackoff, "err", err)
		return
	}
	p.st.Model = m
	p.wantModel, p.modelBackoff, p.nextModelTry = false, 0, time.Time{}
}

func closeBody(b io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(b, maxDrain))
	_ = b.Close()
}
