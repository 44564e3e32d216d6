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
	"sync/atomic"
	"time"

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
		// A replica that stops (a rolling update, a drained node) hands the Lease over at
		// once instead of leaving the fleet leaderless for a LeaseDuration.
		ReleaseOnCancel: true,
		Name:            cfg.Name,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(context.Context) {
				e.terms.Add(1)
				e.leading.Store(true)
				cfg.Logger.Info("leading the control plane", "lease", cfg.Namespace+"/"+cfg.Name, "identity", cfg.Identity)
			},
			OnStoppedLeading: func() {
				if e.leading.Swap(false) {
					cfg.Logger.Warn("stopped leading the control plane", "lease", cfg.Namespace+"/"+cfg.Name, "identity", cfg.Identity)
				}
			},
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

// Run campaigns until ctx ends, standing again after each term it loses (a renewal that
// failed for RenewDeadline). On return this replica no longer leads and, if it led, the
// Lease is released.
func (e *Elector) Run(ctx context.Context) {
	if e == nil {
		return
	}
	for ctx.Err() == nil {
		e.le.Run(ctx)
		e.leading.Store(false)
		select {
		case <-ctx.Done():
		case <-time.After(e.cfg.RetryPeriod):
		}
	}
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

// ErrNotLeader is what a follower answers to a change it must not make.
var ErrNotLeader = errors.New("not the leader")

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
