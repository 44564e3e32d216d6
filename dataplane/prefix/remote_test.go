package prefix

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// TestRemoteAnswersFromQueries: a Remote asks about the pool's slots, weighs each run's
// lower blocks with its weights, maps slots to pool positions, answers nothing for a prompt
// it was not asked about (counted), and refuses malformed answers and failures (counted).
func TestRemoteAnswersFromQueries(t *testing.T) {
	var asked *xdsv1.IndexMatchRequest
	answer := &xdsv1.IndexMatchResponse{Slot: []uint32{3, 9}, Run: []uint32{10, 4}, Host: []uint32{2, 0}, Disk: []uint32{0, 1}, Shared: []uint32{0, 0}}
	var fail error
	r := NewRemote(func(_ context.Context, req *xdsv1.IndexMatchRequest) (*xdsv1.IndexMatchResponse, error) {
		asked = req
		return answer, fail
	}, "p1", time.Second, blockset.Weights{1, 0.5, 0.25, 0.2})
	r.SetSlots([]int{9, -1, 3}) // pool position 0 is slot 9, 2 is slot 3
	hashes := []uint64{11, 12, 13}
	if err := r.Query(context.Background(), hashes); err != nil {
		t.Fatal(err)
	}
	if asked.NodeId != "p1" || len(asked.Hashes) != 3 || len(asked.Slots) != 2 || asked.Slots[0] != 1<<3 || asked.Slots[1] != 1<<1 {
		t.Fatalf("asked %v", asked)
	}
	overlap := make([]float64, 3)
	lower := make([]blockset.Lower, 3)
	best := r.MatchTiers(hashes, overlap, lower)
	if overlap[2] != 9 || overlap[0] != 3.25 || overlap[1] != 0 || best != 9 {
		t.Fatalf("overlap %v best %v", overlap, best)
	}
	if lower[2] != (blockset.Lower{Host: 2, Deficit: 1}) || lower[0] != (blockset.Lower{Disk: 1, Deficit: 0.75}) {
		t.Fatalf("lower %v", lower)
	}
	if r.Match([]uint64{11, 12}, overlap) != 0 || r.Stats().Unasked.Load() != 1 {
		t.Fatalf("a prompt never asked about matched %v (%d unasked)", overlap, r.Stats().Unasked.Load())
	}
	for _, bad := range []*xdsv1.IndexMatchResponse{
		{Slot: []uint32{3}, Run: []uint32{1, 2}, Host: []uint32{0}, Disk: []uint32{0}, Shared: []uint32{0}},
		{Slot: []uint32{9, 3}, Run: []uint32{1, 1}, Host: []uint32{0, 0}, Disk: []uint32{0, 0}, Shared: []uint32{0, 0}},
		{Slot: []uint32{3}, Run: []uint32{1}, Host: []uint32{math.MaxUint32}, Disk: []uint32{1}, Shared: []uint32{0}},
	} {
		answer = bad
		if err := r.Query(context.Background(), []uint64{99}); !errors.Is(err, ErrBadAnswer) {
			t.Fatalf("answer %v taken: %v", bad, err)
		}
	}
	fail = errors.New("unreachable")
	if r.Query(context.Background(), []uint64{98}) == nil || r.Stats().Failed.Load() != 4 || r.Stats().Queries.Load() != 5 {
		t.Fatalf("failed %d of %d queries", r.Stats().Failed.Load(), r.Stats().Queries.Load())
	}
	if r.Match([]uint64{99}, overlap) != 0 {
		t.Fatal("a refused answer was kept")
	}
}

// FuzzRemoteAnswer: whatever a control plane answers (any encoding of IndexMatchResponse),
// the Remote keeps it only when it holds together, and a match then credits each pool
// position at most its run, never below zero.
func FuzzRemoteAnswer(f *testing.F) {
	good, _ := proto.Marshal(&xdsv1.IndexMatchResponse{Slot: []uint32{1, 5}, Run: []uint32{3, 7}, Host: []uint32{1, 0}, Disk: []uint32{0, 2}, Shared: []uint32{0, 1}})
	f.Add(good)
	f.Add([]byte{0x0a, 0x02, 0x01, 0x05})
	f.Fuzz(func(t *testing.T, b []byte) {
		var resp xdsv1.IndexMatchResponse
		if proto.Unmarshal(b, &resp) != nil {
			return
		}
		r := NewRemote(func(context.Context, *xdsv1.IndexMatchRequest) (*xdsv1.IndexMatchResponse, error) { return &resp, nil },
			"p", time.Second, blockset.DefaultWeights)
		r.SetSlots([]int{0, 1, 2, 3, 4, 5, 6, 7})
		hashes := []uint64{1, 2}
		if r.Query(context.Background(), hashes) != nil {
			return
		}
		overlap := make([]float64, 8)
		lower := make([]blockset.Lower, 8)
		r.MatchTiers(hashes, overlap, lower)
		for i, o := range overlap {
			if o < 0 || math.IsNaN(o) || o+lower[i].Deficit > float64(math.MaxUint32) {
				t.Fatalf("position %d credited %v (%+v)", i, o, lower[i])
			}
		}
	})
}
