// Package leader elects one control-plane replica to make changes: the planner's scaling,
// the rollout controller's steps and the operator API's writes. Every replica ingests every
// engine's KV events and serves proxies; only the leader acts.
//
// Leadership is a coordination.k8s.io/v1 Lease held through client-go's leaderelection:
// Kubernetes is the consensus, nothing here is home-made. A nil *Elector is a control plane
// alone (kvrelay up, a single process): it always leads.
package leader

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// Defaults of Config, those of Kubernetes' own controllers: a leader that stops renewing
// loses the Lease within LeaseDuration; it gives up leading when it has not renewed for
// RenewDeadline, so two replicas never lead at once while clocks drift less than the
// difference.
const (
	DefaultLeaseDuration = 15 * time.Second
	DefaultRenewDeadline = 10 * time.Second
	DefaultRetryPeriod   = 2 * time.Second
)

// Config says which Lease the replicas contend for and who this one is.
type Config struct {
	Client    kubernetes.Interface
	Namespace string
	// Name is the Lease's name, the same for every replica of one control plane.
	Name string
	// Identity names this replica in the Lease (holderIdentity) and in followers' refusals;
	// default: the host name (the pod's name in Kubernetes).
	Identity string

	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	Logger                                    *slog.Logger
}

// Elector campaigns for the Lease and says whether this replica leads and who does.
type Elector struct {
	cfg     Config
	le      *leaderelection.LeaderElector
	leading atomic.Bool
	holder  atomic.Pointer[string]
	terms   atomic.Int64 // times this replica started leading
	// term is the Lease's leaderTransitions when this replica last won it: what fences its
	// writes (Fence). termCtx is that term's context, done when the term ends; mu orders
	// a term's start against its end.
	mu      sync.Mutex
	term    int64
	termCtx context.Context
}

// New builds an elector; Run campaigns.
func New(cfg Config) (*Elector, error) {
	if cfg.Client == nil {
		return nil, errors.New("leader election: no Kubernetes client")
	}
	if cfg.Namespace == "" || cfg.Name == "" {
		return nil, errors.New("leader election: the Lease's namespace and name are required")
	}
	if cfg.Identity == "" {
		h, err := os.Hostname()
		if err != nil || h == "" {
			return nil, fmt.Errorf("leader election: no identity given and no host name: %v", err)
		}
		cfg.Identity = h
	}
	if cfg.LeaseDuration <= 0 {
		cfg.LeaseDuration = DefaultLeaseDuration
	}
	if cfg.RenewDeadline <= 0 {
		cfg.RenewDeadline = min(DefaultRenewDeadline, cfg.LeaseDuration*2/3)
	}
	if cfg.RetryPeriod <= 0 {
		cfg.RetryPeriod = min(DefaultRetryPeriod, cfg.RenewDeadline/2)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	e := &Elector{cfg: cfg}
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: cfg.Namespace, Name: cfg.Name},
		Client:     cfg.Client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: cfg.Identity},
	}
	le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:          lock,
		LeaseDuration: cfg.LeaseDuration,
		RenewDeadline: cfg.RenewDeadline,
		RetryPeriod:   cfg.RetryPeriod,
		// Not client-go's release: Run releases the Lease itself (see release).
		ReleaseOnCancel: false,
		Name:            cfg.Name,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: e.started,
			OnStoppedLeading: func() { e.stopped(nil) },
			OnNewLeader: func(id string) {
				e.holder.Store(&id)
				if id != cfg.Identity {
					cfg.Logger.Info("control plane leader", "leader", id)
				}
			},
		},
	})
	if err != nil {
		return nil, fmt.Errorf("leader election: %w", err)
	}
	e.le = le
	return e, nil
}

// started begins a term: client-go calls it on a goroutine of its own once the Lease is
// won, with a context that ends with the term. The term is the Lease's leaderTransitions as
// the API server has it now; a callback that comes after its term already ended (the
// renewal failed meanwhile) leads nothing.
func (e *Elector) started(ctx context.Context) {
	term, err := e.readTerm(ctx)
	if err != nil {
		// The Lease is ours (client-go just wrote it) but unreadable now: lead without a
		// term. Fence reads the Lease again before every write and refuses while it stays
		// unreadable or names another holder.
		e.cfg.Logger.Warn("leading without the Lease's term", "lease", e.cfg.Namespace+"/"+e.cfg.Name, "err", err)
		term = -1
	}
	e.mu.Lock()
	if ctx.Err() != nil {
		e.mu.Unlock()
		return
	}
	e.term, e.termCtx = term, ctx
	e.terms.Add(1)
	e.leading.Store(true)
	e.mu.Unlock()
	e.cfg.Logger.Info("leading the control plane", "lease", e.cfg.Namespace+"/"+e.cfg.Name, "identity", e.cfg.Identity, "term", term)
	<-ctx.Done()
	e.stopped(ctx)
}

// stopped ends the term whose context is ctx (nil: whichever runs).
func (e *Elector) stopped(ctx context.Context) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if ctx != nil && ctx != e.termCtx {
		return // a later term has begun
	}
	e.termCtx = nil
	if e.leading.Swap(false) {
		e.cfg.Logger.Warn("stopped leading the control plane", "lease", e.cfg.Namespace+"/"+e.cfg.Name, "identity", e.cfg.Identity)
	}
}

// readTerm reads the Lease's leaderTransitions, when this replica holds it.
func (e *Elector) readTerm(ctx context.Context) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.RenewDeadline)
	defer cancel()
	// The API server's Lease, not the lock's: client-go's LeaseLock keeps the Lease it read
	// last for its own renewals and is not safe to read beside them.
	l, err := e.cfg.Client.CoordinationV1().Leases(e.cfg.Namespace).Get(ctx, e.cfg.Name, metav1.GetOptions{})
	if err != nil {
		return 0, fmt.Errorf("reading the Lease %s/%s: %w", e.cfg.Namespace, e.cfg.Name, err)
	}
	if h := l.Spec.HolderIdentity; h == nil || *h != e.cfg.Identity {
		holder := "nobody"
		if h != nil && *h != "" {
			holder = *h
		}
		return 0, fmt.Errorf("%w: the Lease %s/%s is held by %s", ErrFenced, e.cfg.Namespace, e.cfg.Name, holder)
	}
	if t := l.Spec.LeaseTransitions; t != nil {
		return int64(*t), nil
	}
	return 0, nil
}

// ErrFenced is what a write gets from Fence when this replica thought it led and the
// Lease says otherwise: another replica took the lead meanwhile (this one was paused, or
// cut off, for longer than the Lease lasts). It wraps ErrNotLeader.
var ErrFenced = fmt.Errorf("%w: the Lease has another holder or a later term", ErrNotLeader)

// Fence is called before every write to the shared state: it reads the Lease from the API
// server and returns this replica's term when it still holds the Lease in the term it won,
// else an error wrapping ErrNotLeader (ErrFenced when the Lease moved on). A writer stamps
// the term into what it writes and refuses to overwrite a record of a later term, so that a
// leader deposed between this check and its write cannot undo its successor's changes. The
// nil Elector, alone, always may write (term 0).
func (e *Elector) Fence(ctx context.Context) (int64, error) {
	if e == nil {
		return 0, nil
	}
	if err := e.Check(); err != nil {
		return 0, err
	}
	e.mu.Lock()
	want := e.term
	e.mu.Unlock()
	term, err := e.readTerm(ctx)
	if err != nil {
		return 0, err
	}
	if want < 0 || term != want || !e.Leading() {
		return 0, fmt.Errorf("%w: this replica won term %d, the Lease is at term %d", ErrFenced, want, term)
	}
	return term, nil
}

// Term is this replica's current term (the Lease's leaderTransitions when it won it), and
// false when it does not lead.
func (e *Elector) Term() (int64, bool) {
	if e == nil {
		return 0, true
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.term, e.leading.Load()
}

// Run campaigns until ctx ends, standing again after each term it loses (a renewal that
// failed for RenewDeadline). On return this replica no longer leads and, if it led, the
// Lease is released.
func (e *Elector) Run(ctx context.Context) {
	if e == nil {
		return
	}
	for ctx.Err() == nil {
		e.le.Run(ctx)
		e.stopped(nil)
		select {
		case <-ctx.Done():
		case <-time.After(e.cfg.RetryPeriod):
		}
	}
	e.release()
}

// release gives up the Lease when this replica holds it, so that a replica that stops (a
// rolling update, a drained node) hands over at once instead of leaving the fleet
// leaderless for a LeaseDuration. It reads the Lease afresh and clears it only while it
// names this replica, the write conditional on that read. (client-go's ReleaseOnCancel
// releases after a failed renewal too, and judges whether it holds the Lease by the Lease it
// saw before: a replica frozen in the middle of a renewal past its Lease would, continued,
// clear the Lease of the replica that took over meanwhile, which would then take it again
// in a later term than the one its writes are fenced with, and be refused them all.)
func (e *Elector) release() {
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.RenewDeadline)
	defer cancel()
	leases := e.cfg.Client.CoordinationV1().Leases(e.cfg.Namespace)
	l, err := leases.Get(ctx, e.cfg.Name, metav1.GetOptions{})
	if err != nil || l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != e.cfg.Identity {
		return
	}
	// As client-go releases: no holder, a lease of a second, the term kept.
	none, second, now := "", int32(1), metav1.NewMicroTime(time.Now())
	l.Spec.HolderIdentity, l.Spec.LeaseDurationSeconds, l.Spec.AcquireTime, l.Spec.RenewTime = &none, &second, &now, &now
	if _, err := leases.Update(ctx, l, metav1.UpdateOptions{}); err != nil {
		e.cfg.Logger.Warn("the Lease not released: the other replicas take over once it expires", "lease", e.cfg.Namespace+"/"+e.cfg.Name, "err", err)
		return
	}
	e.cfg.Logger.Info("released the Lease", "lease", e.cfg.Namespace+"/"+e.cfg.Name, "identity", e.cfg.Identity)
}

// Leading reports whether this replica leads now. The nil Elector always does.
func (e *Elector) Leading() bool { return e == nil || e.leading.Load() }

// Identity is this replica's name in the Lease ("" for the nil Elector).
func (e *Elector) Identity() string {
	if e == nil {
		return ""
	}
	return e.cfg.Identity
}

// Leader is the identity of the replica last seen holding the Lease ("" when none was
// seen yet); the nil Elector's is "".
func (e *Elector) Leader() string {
	if e == nil {
		return ""
	}
	if p := e.holder.Load(); p != nil {
		return *p
	}
	return ""
}

// Terms is how many times this replica started leading.
func (e *Elector) Terms() int64 {
	if e == nil {
		return 0
	}
	return e.terms.Load()
}

// ErrNotLeader is what a follower answers to a change it must not make. Errors that wrap it
// carry gRPC's Unavailable (status.FromError), which the operator API answers as 503: the
// change may be retried, at the leader.
var ErrNotLeader error = unavailable("not the leader")

// unavailable is an error that is gRPC's Unavailable.
type unavailable string

func (e unavailable) Error() string { return string(e) }

func (e unavailable) GRPCStatus() *status.Status { return status.New(codes.Unavailable, string(e)) }

// Check returns nil when this replica leads, else an error wrapping ErrNotLeader that names
// this replica and the leader (when one is known).
func (e *Elector) Check() error {
	if e.Leading() {
		return nil
	}
	if l := e.Leader(); l != "" {
		return fmt.Errorf("%w: control plane replica %s follows %s, which makes every change; send it there (any replica takes changes while it leads)", ErrNotLeader, e.Identity(), l)
	}
	return fmt.Errorf("%w: control plane replica %s follows and no leader holds the Lease yet; retry in a few seconds", ErrNotLeader, e.Identity())
}
