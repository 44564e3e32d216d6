package leader_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientretry "k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"

	"github.com/kvrelay/kvrelay/controlplane/leader"
	"github.com/kvrelay/kvrelay/internal/kubetest"
)

// Short terms, so that a failover takes seconds: a leader that cannot renew stops leading
// after renew; a follower takes over lease after the last renewal.
const (
	lease = 3 * time.Second
	renew = 2 * time.Second
	retry = 250 * time.Millisecond
)

// partition is a dialer whose connections can all be cut at once, as when a replica's node
// loses the network or its process freezes.
type partition struct {
	mu    sync.Mutex
	cut   bool
	conns []net.Conn
}

func (p *partition) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut {
		return nil, errors.New("partitioned")
	}
	c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err == nil {
		p.conns = append(p.conns, c)
	}
	return c, err
}

func (p *partition) sever() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for _, c := range p.conns {
		c.Close()
	}
}

type replica struct {
	e      *leader.Elector
	cancel context.CancelFunc
	done   chan struct{}
	net    *partition
}

func start(t *testing.T, env *kubetest.Env, id string) *replica {
	t.Helper()
	cfg := env.Config()
	p := new(partition)
	cfg.Dial = p.dial
	cfg.Timeout = time.Second
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e, err := leader.New(leader.Config{Client: client, Namespace: "default", Name: "kvrelay-controlplane", Identity: id,
		LeaseDuration: lease, RenewDeadline: renew, RetryPeriod: retry, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &replica{e: e, cancel: cancel, done: make(chan struct{}), net: p}
	go func() { defer close(r.done); e.Run(ctx) }()
	t.Cleanup(r.stop)
	return r
}

func (r *replica) stop() {
	r.cancel()
	<-r.done
}

// waitLeader waits until exactly one of rs leads and every one of them names it.
func waitLeader(t *testing.T, within time.Duration, rs ...*replica) *replica {
	t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		var leaders []*replica
		for _, r := range rs {
			if r.e.Leading() {
				leaders = append(leaders, r)
			}
		}
		if len(leaders) > 1 {
			t.Fatalf("%d replicas lead at once", len(leaders))
		}
		if len(leaders) == 1 {
			agreed := true
			for _, r := range rs {
				agreed = agreed && r.e.Leader() == leaders[0].e.Identity()
			}
			if agreed {
				return leaders[0]
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no single leader within %s", within)
	return nil
}

func other(a, b, not *replica) *replica {
	if a == not {
		return b
	}
	return a
}

// Against a real API server: one of two replicas leads and the other names it; a leader
// that stops hands over at once; a leader that loses the network stops leading before
// anyone else starts, and the follower leads within the Lease's duration of its last
// renewal.
func TestLeaseFailover(t *testing.T) {
	env := kubetest.Start(t)
	// client-go's leaderelection logs every failed renewal through klog; the partition
	// below makes many.
	klog.SetOutput(io.Discard)
	klog.LogToStderr(false)
	a, b := start(t, env, "cp-0"), start(t, env, "cp-1")
	first := waitLeader(t, lease+2*time.Second, a, b)
	second := other(a, b, first)
	if err := second.e.Check(); !errors.Is(err, leader.ErrNotLeader) || !strings.Contains(err.Error(), first.e.Identity()) {
		t.Fatalf("follower's Check = %v, want ErrNotLeader naming %s", err, first.e.Identity())
	}
	if err := first.e.Check(); err != nil {
		t.Fatalf("leader's Check = %v", err)
	}

	// A graceful stop releases the Lease: the follower takes over within a few retries.
	stopped := time.Now()
	first.stop()
	if first.e.Leading() {
		t.Fatal("a stopped replica still leads")
	}
	if got := waitLeader(t, lease, second); got != second {
		t.Fatal("the follower did not take over")
	}
	handover := time.Since(stopped)
	t.Logf("handover after a graceful stop: %s", handover)
	if handover > lease {
		t.Errorf("handover took %s, want well under the lease duration %s (the Lease is released)", handover, lease)
	}

	// A third replica joins and follows; then the leader is cut off.
	c := start(t, env, "cp-2")
	waitLeader(t, 2*time.Second, second, c)
	cut := time.Now()
	second.net.sever()
	deadline := cut.Add(2 * lease)
	for !c.e.Leading() {
		if second.e.Leading() && time.Since(cut) > renew+retry+500*time.Millisecond {
			t.Fatalf("a leader cut off still leads %s later (renew deadline %s)", time.Since(cut), renew)
		}
		if time.Now().After(deadline) {
			t.Fatalf("no new leader %s after the leader was cut off", 2*lease)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if second.e.Leading() {
		t.Fatal("two replicas lead at once after a partition")
	}
	failover := time.Since(cut)
	t.Logf("failover after a partition: %s (lease %s)", failover, lease)
	if failover > lease+2*retry+time.Second {
		t.Errorf("failover took %s, want within the lease duration %s of the last renewal", failover, lease)
	}
	if c.e.Terms() != 1 {
		t.Errorf("new leader's terms = %d, want 1", c.e.Terms())
	}
}

// The nil Elector is a control plane alone: it always leads and refuses nothing.
func TestNilElectorLeads(t *testing.T) {
	var e *leader.Elector
	if !e.Leading() || e.Check() != nil || e.Leader() != "" {
		t.Fatal("nil Elector does not lead")
	}
	e.Run(context.Background()) // returns at once
}

func TestNewValidates(t *testing.T) {
	if _, err := leader.New(leader.Config{Namespace: "ns", Name: "n"}); err == nil {
		t.Fatal("New without a client succeeded")
	}
}

// TestFence: a leader's writes are fenced by the Lease as the API server has it. While it
// holds the Lease, Fence gives its term, the Lease's leaderTransitions; once another
// replica has taken the Lease (this one paused or cut off past the Lease's duration, and
// not yet aware: it still believes it leads), Fence refuses, as gRPC's Unavailable.
func TestFence(t *testing.T) {
	env := kubetest.Start(t)
	klog.SetOutput(io.Discard)
	klog.LogToStderr(false)
	client, err := kubernetes.NewForConfig(env.Config())
	if err != nil {
		t.Fatal(err)
	}
	// Renewals far apart: after the Lease is taken from it, this replica goes on believing
	// it leads until its next renewal, as a paused process would.
	e, err := leader.New(leader.Config{Client: client, Namespace: "default", Name: "fence", Identity: "cp-0",
		LeaseDuration: time.Minute, RenewDeadline: 40 * time.Second, RetryPeriod: 20 * time.Second, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); e.Run(ctx) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, leading := e.Term(); leading {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the only replica does not lead")
		}
		time.Sleep(20 * time.Millisecond)
	}
	leases := client.CoordinationV1().Leases("default")
	l, err := leases.Get(t.Context(), "fence", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	term, err := e.Fence(t.Context())
	if err != nil || l.Spec.LeaseTransitions == nil || term != int64(*l.Spec.LeaseTransitions) {
		t.Fatalf("the leader's Fence = %d, %v; want the Lease's leaderTransitions %v", term, err, l.Spec.LeaseTransitions)
	}

	// Another replica takes the Lease, as client-go does once it has expired (read again on
	// a conflict: the leader may have written it since it was read above).
	other, next := "cp-1", int32(0)
	if err := clientretry.RetryOnConflict(clientretry.DefaultRetry, func() error {
		l, err := leases.Get(t.Context(), "fence", metav1.GetOptions{})
		if err != nil {
			return err
		}
		next = *l.Spec.LeaseTransitions + 1
		now := metav1.NewMicroTime(time.Now())
		l.Spec.HolderIdentity, l.Spec.LeaseTransitions, l.Spec.AcquireTime, l.Spec.RenewTime = &other, &next, &now, &now
		_, err = leases.Update(t.Context(), l, metav1.UpdateOptions{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if !e.Leading() {
		t.Fatal("the deposed replica noticed at once; the test needs it unaware")
	}
	_, err = e.Fence(t.Context())
	if !errors.Is(err, leader.ErrFenced) || !errors.Is(err, leader.ErrNotLeader) || !strings.Contains(err.Error(), "cp-1") {
		t.Fatalf("Fence of a deposed leader = %v, want ErrFenced naming cp-1", err)
	}
	if s, ok := status.FromError(fmt.Errorf("writing: %w", err)); !ok || s.Code() != codes.Unavailable {
		t.Fatalf("a fenced write's status %v, want Unavailable", s)
	}

	// The same holder at a later term (it lost the Lease and won it back meanwhile) is
	// fenced too: what it wrote in between belongs to another term.
	l, err = leases.Get(t.Context(), "fence", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	me, later := "cp-0", next+1
	l.Spec.HolderIdentity, l.Spec.LeaseTransitions = &me, &later
	if _, err := leases.Update(t.Context(), l, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Fence(t.Context()); !errors.Is(err, leader.ErrFenced) {
		t.Fatalf("Fence at a later term of the same holder = %v, want ErrFenced", err)
	}
}

// The nil Elector is alone: its writes are never fenced.
func TestNilElectorFence(t *testing.T) {
	var e *leader.Elector
	if term, err := e.Fence(context.Background()); term != 0 || err != nil {
		t.Fatalf("nil Elector's Fence = %d, %v", term, err)
	}
}
