package journal

import (
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

// A proxy that routes a few of the fleet's models needs only their workers' blocks. It names
// them when it opens its stream (JournalAck.models), and the server sends it the changes,
// snapshot entries and marks of those workers' slots only: its bytes and its replica follow
// the workers it routes to, not the fleet. Offsets stay the log's own, so a scoped proxy
// resumes like any other.
//
// Which models each slot's worker serves comes from the control plane (ModelScopes). When it
// changes, each scoped stream clears the slots that left its scope and fills again from the
// index those that entered (a worker added, or one whose model became known), in batches at
// the stream's offset (changes of a slot before it entered were not sent), the last of which
// carries the entered slots' marks. The server does not know the scope a reconnecting proxy's
// replica was built with, so a scoped stream always starts as a resume from the proxy's marks
// (Log.Resume), within its current scope: slots that entered meanwhile have no mark there and
// are filled, slots that left are cleared.

// ModelScopes holds the models each slot's worker serves. The control plane sets it whenever
// its workers or their models change; safe for concurrent use.
type ModelScopes struct {
	mu  sync.Mutex
	cur atomic.Pointer[modelTable]
}

// modelTable is one version of the slots' models: nil for a free slot, empty for a worker
// whose models are not known (in every scope).
type modelTable struct {
	bySlot [][]string
}

// Set replaces the slots' models: bySlot[i] the models of the worker in slot i (an empty,
// non-nil slice when they are not known; nil for a free slot). Setting what is already set
// changes nothing.
func (m *ModelScopes) Set(bySlot [][]string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if cur := m.cur.Load(); cur != nil && sameModels(cur.bySlot, bySlot) {
		return
	}
	t := &modelTable{bySlot: make([][]string, len(bySlot))}
	for i, ms := range bySlot {
		if ms != nil {
			t.bySlot[i] = append([]string{}, ms...)
		}
	}
	m.cur.Store(t)
}

func (m *ModelScopes) load() *modelTable {
	if m == nil {
		return nil
	}
	return m.cur.Load()
}

func sameModels(a, b [][]string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if (a[i] == nil) != (b[i] == nil) || len(a[i]) != len(b[i]) {
			return false
		}
		for j := range a[i] {
			if a[i][j] != b[i][j] {
				return false
			}
		}
	}
	return true
}

// scope is one stream's: the models its proxy routes and which slots serve one of them.
type scope struct {
	models map[string]bool
	key    string      // the models, sorted: what streams of the same scope share
	table  *modelTable // the version mask was built from
	mask   []bool
}

// newScope returns the scope of a stream whose proxy named models; nil (every slot) when it
// named none.
func newScope(models []string) *scope {
	if len(models) == 0 {
		return nil
	}
	sc := &scope{models: map[string]bool{}}
	for _, m := range models {
		sc.models[m] = true
	}
	sc.key = strings.Join(slices.Sorted(maps.Keys(sc.models)), "\x00")
	return sc
}

// in reports whether slot is in the scope; a nil scope, or one the control plane has given
// no slot models yet, holds every slot.
func (sc *scope) in(slot uint32) bool {
	return sc == nil || sc.table == nil || int(slot) < len(sc.mask) && sc.mask[slot]
}

// refresh builds the mask from t, when it is not the table the mask was built from, and
// returns the slots that entered and left the scope.
func (sc *scope) refresh(t *modelTable) (entered, left []uint32) {
	if sc == nil || t == nil || t == sc.table {
		return nil, nil
	}
	mask := make([]bool, len(t.bySlot))
	for i, ms := range t.bySlot {
		if ms == nil {
			continue
		}
		mask[i] = len(ms) == 0 // models not known: in every scope
		for _, m := range ms {
			mask[i] = mask[i] || sc.models[m]
		}
	}
	for i := range max(len(mask), len(sc.mask)) {
		was := i < len(sc.mask) && sc.mask[i]
		is := i < len(mask) && mask[i]
		switch {
		case is && !was:
			entered = append(entered, uint32(i))
		case was && !is:
			left = append(left, uint32(i))
		}
	}
	sc.table, sc.mask = t, mask
	return entered, left
}

// filter keeps, in place, the changes of slots in the scope.
func (sc *scope) filter(cs []Change) []Change {
	return inScope(sc, cs, func(c Change) uint32 { return c.Slot })
}

// filterMarks keeps, in place, the marks of slots in the scope.
func (sc *scope) filterMarks(ms []Mark) []Mark {
	return inScope(sc, ms, func(m Mark) uint32 { return m.Slot })
}

// inScope keeps, in place, the xs whose slot is in sc.
func inScope[T any](sc *scope, xs []T, slot func(T) uint32) []T {
	if sc == nil {
		return xs
	}
	out := xs[:0]
	for _, x := range xs {
		if sc.in(slot(x)) {
			out = append(out, x)
		}
	}
	return out
}
