package prefix

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/zeebo/xxh3"
	"google.golang.org/protobuf/proto"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// Remote is the index of a proxy that keeps no replica: before a request is routed, Query
// asks the control plane's index about the request's prompt (one round trip, off the event
// loop), and Match answers from what it said. A prompt Query was not asked about, or whose
// answer did not come, matches nothing (counted in RemoteStats.Unasked), as with no index.
//
// Answers are kept by the prompt's hashes for RemoteTTL, and at most remoteMaxAnswers of
// them, so that every routing of the request (retries, a rollout's shadow pick) reads the
// same one. A request routed after its answer went (it waited in the admission queue past
// RemoteTTL, or behind that many newer queries) is routed as uncached, counted in Unasked.
// Safe for concurrent use.
type Remote struct {
	ask     func(ctx context.Context, req *xdsv1.IndexMatchRequest) (*xdsv1.IndexMatchResponse, error)
	nodeID  string
	timeout time.Duration

	mu      sync.Mutex
	answers map[xxh3.Uint128]remoteAnswer
	order   []kept  // answers as kept, oldest first
	mask    []byte  // the slots of the pool, as a bitmap (IndexMatchRequest.slots)
	pos     []int32 // slot → pool position, -1 for none
	weights blockset.Weights

	stats RemoteStats
}

// RemoteStats count a Remote's queries.
type RemoteStats struct {
	// Queries counts round trips asked; Failed those that ended in an error or timeout.
	Queries, Failed atomic.Uint64
	// Unasked counts matches for a prompt with no answer (never asked, failed or expired).
	Unasked atomic.Uint64
	// RequestBytes and ResponseBytes count the messages' encoded sizes.
	RequestBytes, ResponseBytes atomic.Uint64
}

// RemoteTTL is how long an answer is kept for the request's routings; remoteMaxAnswers
// bounds how many are kept (an answer is a few bytes per worker holding the prompt).
const (
	RemoteTTL        = 5 * time.Second
	remoteMaxAnswers = 8192
)

type remoteAnswer struct {
	resp *xdsv1.IndexMatchResponse
	at   time.Time
}

// kept is one answer kept, in the order they were: the key, and when (an answer kept again
// under the same key later is the later entry's).
type kept struct {
	k  xxh3.Uint128
	at time.Time
}

// ErrBadAnswer is a control plane's answer that does not hold together: not kept.
var ErrBadAnswer = errors.New("prefix: the control plane's index answer is malformed")

// checkAnswer checks that an answer's columns are as long as each other, its slots
// increasing and each run at least the blocks it counts below GPU memory.
func checkAnswer(resp *xdsv1.IndexMatchResponse) error {
	n := len(resp.Slot)
	if len(resp.Run) != n || len(resp.Host) != n || len(resp.Disk) != n || len(resp.Shared) != n {
		return fmt.Errorf("%w: columns of %d, %d, %d, %d and %d entries", ErrBadAnswer, n, len(resp.Run), len(resp.Host), len(resp.Disk), len(resp.Shared))
	}
	for j := range n {
		if j > 0 && resp.Slot[j] <= resp.Slot[j-1] {
			return fmt.Errorf("%w: slot %d after %d", ErrBadAnswer, resp.Slot[j], resp.Slot[j-1])
		}
		if uint64(resp.Host[j])+uint64(resp.Disk[j])+uint64(resp.Shared[j]) > uint64(resp.Run[j]) {
			return fmt.Errorf("%w: slot %d's run of %d counts more blocks below GPU memory", ErrBadAnswer, resp.Slot[j], resp.Run[j])
		}
	}
	return nil
}

var (
	_ TierIndex = (*Remote)(nil)
)

// NewRemote returns a Remote asking ask (the control plane's IndexQuery.Match) as node
// nodeID, each round trip given timeout.
func NewRemote(ask func(context.Context, *xdsv1.IndexMatchRequest) (*xdsv1.IndexMatchResponse, error), nodeID string, timeout time.Duration, w blockset.Weights) *Remote {
	return &Remote{ask: ask, nodeID: nodeID, timeout: timeout, weights: w, answers: map[xxh3.Uint128]remoteAnswer{}}
}

// Stats returns the Remote's counters.
func (r *Remote) Stats() *RemoteStats { return &r.stats }

// SetWeights changes the tier weights (the routing policy's).
func (r *Remote) SetWeights(w blockset.Weights) {
	r.mu.Lock()
	r.weights = w
	r.mu.Unlock()
}

// SetSlots maps pool positions to index slots, as Replica.SetSlots: slots[i] is the slot of
// the pool's worker i, or -1. Answers already kept are read with the new mapping.
func (r *Remote) SetSlots(slots []int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.mask = r.mask[:0]
	r.pos = r.pos[:0]
	for i, s := range slots {
		if s < 0 {
			continue
		}
		for len(r.pos) <= s {
			r.pos = append(r.pos, -1)
		}
		r.pos[s] = int32(i)
		for len(r.mask) <= s/8 {
			r.mask = append(r.mask, 0)
		}
		r.mask[s/8] |= 1 << (s % 8)
	}
}

// key names a prompt by its hashes.
func key(hashes []uint64) xxh3.Uint128 {
	var buf [8]byte
	h := xxh3.New()
	for _, x := range hashes {
		binary.LittleEndian.PutUint64(buf[:], x)
		_, _ = h.Write(buf[:])
	}
	return h.Sum128()
}

// Query asks the control plane about a prompt and keeps the answer for Match. It blocks for
// a round trip (at most the Remote's timeout): call it off the event loop.
func (r *Remote) Query(ctx context.Context, hashes []uint64) error {
	if len(hashes) == 0 {
		return nil
	}
	r.mu.Lock()
	if len(r.mask) == 0 {
		r.mu.Unlock()
		return nil // no pool yet: nothing to ask about
	}
	req := &xdsv1.IndexMatchRequest{NodeId: r.nodeID, Hashes: hashes, Slots: append([]byte(nil), r.mask...)}
	r.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	r.stats.Queries.Add(1)
	r.stats.RequestBytes.Add(uint64(proto.Size(req)))
	resp, err := r.ask(ctx, req)
	if err == nil {
		r.stats.ResponseBytes.Add(uint64(proto.Size(resp)))
		err = checkAnswer(resp)
	}
	if err != nil {
		r.stats.Failed.Add(1)
		return err
	}
	k := key(hashes)
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now() // under the lock: order stays in time order
	// Forget the expired and, past the bound, the oldest.
	for len(r.order) > 0 && (now.Sub(r.order[0].at) >= RemoteTTL || len(r.order) >= remoteMaxAnswers) {
		if a := r.answers[r.order[0].k]; a.at.Equal(r.order[0].at) {
			delete(r.answers, r.order[0].k)
		}
		r.order = r.order[1:]
	}
	r.order = append(r.order, kept{k, now})
	r.answers[k] = remoteAnswer{resp: resp, at: now}
	return nil
}

// Match implements Index.
func (r *Remote) Match(hashes []uint64, overlap []float64) float64 {
	return r.MatchTiers(hashes, overlap, nil)
}

// MatchTiers implements TierIndex from the answer Query kept for hashes.
func (r *Remote) MatchTiers(hashes []uint64, overlap []float64, lower []blockset.Lower) float64 {
	clear(overlap)
	clear(lower)
	if len(hashes) == 0 {
		return 0
	}
	k := key(hashes)
	r.mu.Lock()
	defer r.mu.Unlock()
	a, ok := r.answers[k]
	if !ok || time.Since(a.at) >= RemoteTTL {
		r.stats.Unasked.Add(1)
		return 0
	}
	resp, wt := a.resp, r.weights // checked by checkAnswer
	best := 0.0
	for j, s := range resp.Slot {
		if int(s) >= len(r.pos) || r.pos[s] < 0 || int(r.pos[s]) >= len(overlap) {
			continue
		}
		i := r.pos[s]
		host, disk, shared := float64(resp.Host[j]), float64(resp.Disk[j]), float64(resp.Shared[j])
		deficit := host*(1-wt[blockset.Host]) + disk*(1-wt[blockset.Disk]) + shared*(1-wt[blockset.Shared])
		o := float64(resp.Run[j]) - deficit
		overlap[i] = o
		if lower != nil {
			lower[i] = blockset.Lower{Host: host, Disk: disk, Shared: shared, Deficit: deficit}
		}
		if o > best {
			best = o
		}
	}
	return best
}
