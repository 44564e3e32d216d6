package latency

import (
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
)

// setFit publishes f as the model's fit, as the learners do after an observation.
func setFit(m *Model, f *fit) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.cur = *f
	m.pub.store(&m.cur)
}

func uniformFit(theta, step, kv float64) *fit {
	var f fit
	for i := range f.theta {
		f.theta[i] = theta
	}
	for i := range f.step {
		f.step[i] = step
	}
	for i := range f.kv {
		f.kv[i] = kv
	}
	return &f
}

// TestPredictionReadsOneFit: while a writer publishes two fits in turn, every prediction is
// the one of the first fit or the one of the second, never a mix of their coefficients (a
// TTFT of one beside the decode step of the other, or half of each one's θ).
func TestPredictionReadsOneFit(t *testing.T) {
	var m Model
	m.Init()
	var w Worker
	w.Init(&m)
	e := &Engine{MaxNumSeqs: 8}
	st := State{Requests: 9, Backlog: 4000, KVUsage: 0.3, OSL: 64}
	a, b := uniformFit(1, 0.01, 1), uniformFit(2, 0.03, 1.5)
	var pa, pb Prediction
	setFit(&m, a)
	w.Predict(e, st, 3000, &pa)
	setFit(&m, b)
	w.Predict(e, st, 3000, &pb)
	if pa.TTFT == pb.TTFT || pa.ITL == pb.ITL {
		t.Fatalf("the two fits predict alike: %+v, %+v", pa, pb)
	}

	var stop atomic.Bool
	var flips atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; !stop.Load(); i++ {
			f := a
			if i%2 == 1 {
				f = b
			}
			setFit(&m, f)
			flips.Add(1)
		}
	}()
	const readers, reads = 2, 100_000
	var torn atomic.Int64
	var first atomic.Value
	var wg sync.WaitGroup
	for range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for flips.Load() == 0 { // read while the writer writes
				runtime.Gosched()
			}
			var p Prediction
			for range reads {
				w.Predict(e, st, 3000, &p)
				if (p.TTFT == pa.TTFT && p.ITL == pa.ITL && p.Slowdown == pa.Slowdown) || (p.TTFT == pb.TTFT && p.ITL == pb.ITL && p.Slowdown == pb.Slowdown) {
					continue
				}
				if torn.Add(1) == 1 {
					first.Store(p)
				}
			}
		}()
	}
	wg.Wait()
	stop.Store(true)
	<-done
	if n := torn.Load(); n > 0 {
		t.Fatalf("%d of %d predictions mixed two fits (first: %+v; the fits give TTFT %v / %v, ITL %v / %v)", n, readers*reads, first.Load(), pa.TTFT, pb.TTFT, pa.ITL, pb.ITL)
	}
	t.Logf("%d publications during %d predictions", flips.Load(), readers*reads)
}

// TestReaderBehindAStalledWriter: a reader that finds a publication under way whenever it
// looks (a writer descheduled mid-store) waits for the model's mutex, which the writer
// holds, instead of spinning, and reads the fit that writer published, whole.
func TestReaderBehindAStalledWriter(t *testing.T) {
	var m Model
	m.Init()
	a, b := uniformFit(1, 0.01, 1), uniformFit(2, 0.03, 1.5)
	setFit(&m, a)
	m.mu.Lock()
	m.pub.seq.Add(1) // a writer between its first and last store
	m.pub.theta[0].Store(math.Float64bits(b.theta[0]))
	got := make(chan fit)
	go func() {
		var f fit
		m.fit(&f)
		got <- f
	}()
	m.cur = *b
	for i := range b.theta {
		m.pub.theta[i].Store(math.Float64bits(b.theta[i]))
	}
	for i := range b.step {
		m.pub.step[i].Store(math.Float64bits(b.step[i]))
	}
	for i := range b.kv {
		m.pub.kv[i].Store(math.Float64bits(b.kv[i]))
	}
	m.pub.seq.Add(1)
	m.mu.Unlock()
	if f := <-got; f != *b {
		t.Fatalf("read %+v, want the fit published %+v", f, *b)
	}
}
