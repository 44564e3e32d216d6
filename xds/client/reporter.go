package client

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// Bounds on the report interval a control plane may ask for.
const (
	DefaultReportInterval = time.Second
	// DefaultFitsEvery is how often a proxy sends what its latency models learned.
	DefaultFitsEvery = 5 * time.Second
	// DefaultTenantsEvery is how often a proxy sends what its tenants asked of it.
	DefaultTenantsEvery = time.Second
	minReportInterval   = 10 * time.Millisecond
	maxReportInterval   = time.Minute
)

// ReporterOptions configure a Reporter.
type ReporterOptions struct {
	// NodeID names this proxy (required); use the Client's.
	NodeID string
	// Snapshot returns the proxy's in-flight load per worker for the report numbered seq
	// (LoadReport.seq: from 1, increasing for the Reporter's life, across reconnects);
	// workers with none may be left out (the control plane counts them as zero). Called
	// from Run's goroutine once per interval; the result is only read, and not after the
	// next call.
	Snapshot func(seq uint64) []*xdsv1.WorkerLoad
	// Arms, when set, returns the figures of the routing policy versions the proxy routes
	// with (LoadReport.arms), called beside Snapshot.
	Arms func() []*xdsv1.ArmReport
	// Decisions, when set, returns the sampled decisions to send with the report
	// (LoadReport.decisions): each once, called beside Snapshot. A report that fails to go
	// out loses them (they are a sample).
	Decisions func() []*xdsv1.DecisionSample
	// Fits, when set, returns what the proxy's latency models learned (LoadReport.fits),
	// called beside Snapshot at most every FitsEvery; the reports between carry none.
	Fits func() []*xdsv1.LatencyFit
	// FitsEvery is how often fits go out (default DefaultFitsEvery).
	FitsEvery time.Duration
	// Tenants, when set, returns what the proxy's tenants asked of it (LoadReport.tenants),
	// called beside Snapshot at most every TenantsEvery; the reports between carry none.
	Tenants func() []*xdsv1.TenantDemand
	// TenantsEvery is how often tenants go out (default DefaultTenantsEvery).
	TenantsEvery time.Duration
	// Grants, when set, hears the proxy's shares of its tenants' budgets that the control
	// plane sends in answer to a report with tenants (LoadReportAck.tenants). Called from
	// the stream's receiving goroutine.
	Grants func([]*xdsv1.TenantGrant)
	// Included, when set, hears each merge of the proxies' reports that the control plane
	// tells this proxy of (LoadReportAck epoch and included_seq): pushed loads of that
	// Load.epoch include this proxy's report seq. It is called with (0, 0) when a stream
	// opens, for merges of another stream (another replica) are not this one's. Called from
	// the stream's receiving goroutine.
	Included func(epoch, seq uint64)
	// Acked, when set, hears every answer the control plane sends on the stream: it is
	// alive and merging this proxy's reports. Called from the stream's receiving goroutine.
	Acked func()
	// Interval is how often to report until the control plane names its interval (default
	// DefaultReportInterval).
	Interval time.Duration
	// BackoffBase and BackoffMax bound the wait before reopening a broken stream.
	BackoffBase, BackoffMax time.Duration
}

// Reporter streams a proxy's in-flight load to the control plane's LoadReporting service:
// a report as soon as the stream opens, then one per interval, at the interval the control
// plane's acknowledgements ask for. The control plane forgets the proxy's load when the
// stream ends.
//
// Lifecycle: NewReporter (no goroutines, no I/O) → Run, once, on a goroutine the caller
// owns; Run returns when its context is done. Interval and Sent are safe from any goroutine.
type Reporter struct {
	conn grpc.ClientConnInterface
	opts ReporterOptions
	// fitsAt and tenantsAt are when fits and tenants last went out (Run's goroutine only).
	fitsAt, tenantsAt time.Time

	running  atomic.Bool
	interval atomic.Int64 // nanoseconds
	sent     atomic.Uint64
	seq      uint64 // the last report's number; Run's goroutine only
}

// NewReporter builds a Reporter that will speak on conn (see Dial); it starts nothing.
func NewReporter(conn grpc.ClientConnInterface, opts ReporterOptions) (*Reporter, error) {
	switch {
	case conn == nil:
		return nil, errors.New("creating load reporter: nil connection")
	case opts.NodeID == "":
		return nil, errors.New("creating load reporter: empty node id")
	case opts.Snapshot == nil:
		return nil, errors.New("creating load reporter: no snapshot function")
	}
	if opts.Interval <= 0 {
		opts.Interval = DefaultReportInterval
	}
	if opts.BackoffBase <= 0 {
		opts.BackoffBase = DefaultBackoffBase
	}
	if opts.BackoffMax < opts.BackoffBase {
		opts.BackoffMax = max(DefaultBackoffMax, opts.BackoffBase)
	}
	r := &Reporter{conn: conn, opts: opts}
	r.interval.Store(int64(clampInterval(opts.Interval)))
	return r, nil
}

// Interval is the current report interval: the control plane's latest, or the default.
func (r *Reporter) Interval() time.Duration { return time.Duration(r.interval.Load()) }

// Sent counts the reports sent.
func (r *Reporter) Sent() uint64 { return r.sent.Load() }

// Run reports until ctx is done, reopening the stream after a jittered exponential backoff
// when it breaks. It returns nil when ctx is done, and an error only if already running.
func (r *Reporter) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("running load reporter: already running")
	}
	defer r.running.Store(false)
	bo := newBackoff(r.opts.BackoffBase, r.opts.BackoffMax)
	for {
		healthy, _ := r.stream(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if healthy {
			bo.reset()
		}
		if !sleep(ctx, bo.next()) {
			return nil
		}
	}
}

// stream runs one LoadReporting stream until it breaks; healthy reports whether the
// control plane acknowledged a report on it.
func (r *Reporter) stream(ctx context.Context) (healthy bool, err error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := xdsv1.NewLoadReportingClient(r.conn).Report(sctx, grpc.WaitForReady(true))
	if err != nil {
		return false, fmt.Errorf("opening load report stream: %w", err)
	}

	r.tenantsAt = time.Time{} // a new stream (perhaps another replica) hears the tenants at once
	intervals := make(chan time.Duration, 1)
	recvDone := make(chan error, 1)
	if r.opts.Included != nil {
		r.opts.Included(0, 0)
	}
	go func() { // ends when Recv fails, at the latest when stream returns and cancels sctx
		for {
			ack, err := st.Recv()
			if err != nil {
				recvDone <- err
				return
			}
			if r.opts.Acked != nil {
				r.opts.Acked()
			}
			if ack.GetEpoch() != 0 && r.opts.Included != nil {
				r.opts.Included(ack.GetEpoch(), ack.GetIncludedSeq())
			}
			if len(ack.GetTenants()) > 0 && r.opts.Grants != nil {
				r.opts.Grants(ack.GetTenants())
			}
			d := clampInterval(time.Duration(ack.GetIntervalMs()) * time.Millisecond)
			select { // keep only the latest interval
			case <-intervals:
			default:
			}
			intervals <- d
		}
	}()
	defer func() {
		cancel()
		<-recvDone
	}()

	send := func() error {
		r.seq++
		rep := &xdsv1.LoadReport{NodeId: r.opts.NodeID, Seq: r.seq, Workers: r.opts.Snapshot(r.seq)}
		if r.opts.Decisions != nil {
			rep.Decisions = r.opts.Decisions()
		}
		if r.opts.Arms != nil {
			rep.Arms = r.opts.Arms()
		}
		if r.opts.Fits != nil {
			every := r.opts.FitsEvery
			if every <= 0 {
				every = DefaultFitsEvery
			}
			if now := time.Now(); now.Sub(r.fitsAt) >= every {
				rep.Fits, r.fitsAt = r.opts.Fits(), now
			}
		}
		if r.opts.Tenants != nil {
			every := r.opts.TenantsEvery
			if every <= 0 {
				every = DefaultTenantsEvery
			}
			if now := time.Now(); now.Sub(r.tenantsAt) >= every {
				rep.Tenants, r.tenantsAt = r.opts.Tenants(), now
			}
		}
		if err := st.Send(rep); err != nil {
			return fmt.Errorf("sending load report: %w", err)
		}
		r.sent.Add(1)
		return nil
	}
	if err := send(); err != nil {
		return false, err
	}
	t := time.NewTicker(r.Interval())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return healthy, ctx.Err()
		case err := <-recvDone:
			recvDone <- err // for the deferred wait
			return healthy, fmt.Errorf("receiving load report ack: %w", err)
		case d := <-intervals:
			healthy = true
			if d != r.Interval() {
				r.interval.Store(int64(d))
				t.Reset(d)
			}
		case <-t.C:
			if err := send(); err != nil {
				return healthy, err
			}
		}
	}
}

func clampInterval(d time.Duration) time.Duration {
	return min(max(d, minReportInterval), maxReportInterval)
}
