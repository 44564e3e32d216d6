package route

import (
	"math/rand/v2"
	"strconv"
	"testing"
	"time"
	"unsafe"
)

func newSessions(limit int, ttl time.Duration) *sessions {
	s := &sessions{}
	s.init(limit)
	s.ttl.Store(int64(ttl))
	return s
}

// bound reports which of ids the table binds at now.
func bound(s *sessions, now int64, ids ...string) map[string]bool {
	out := map[string]bool{}
	for _, id := range ids {
		_, out[id] = s.get(id, now)
	}
	return out
}

// TestSessionTableEvictsLeastRecentlyUsed: a table full of live sessions takes a new one
// and lets the least recently used go, not the new one.
func TestSessionTableEvictsLeastRecentlyUsed(t *testing.T) {
	s := newSessions(4, time.Hour)
	t0 := int64(1e18)
	for i, id := range []string{"s0", "s1", "s2", "s3"} {
		s.put(id, "w"+id, t0+int64(i))
	}
	s.put("s0", "w0", t0+10) // s0 used again: s1 is now the least recently used
	s.put("s4", "w4", t0+11)
	got := bound(s, t0+12, "s0", "s1", "s2", "s3", "s4")
	want := map[string]bool{"s0": true, "s1": false, "s2": true, "s3": true, "s4": true}
	if len(got) != len(want) || s.len() != 4 {
		t.Fatalf("%d sessions", s.len())
	}
	for id, w := range want {
		if got[id] != w {
			t.Fatalf("bound %v, want %v", got, want)
		}
	}
	if w, _ := s.get("s0", t0+12); w != "w0" {
		t.Fatalf("s0 on %q, want its last worker w0", w)
	}
}

// TestSessionTableDropsExpiredFirst: a new session takes the place of expired ones before
// any live one's.
func TestSessionTableDropsExpiredFirst(t *testing.T) {
	const sec = int64(time.Second)
	s := newSessions(4, 10*time.Second)
	t0 := int64(1e18)
	s.put("a", "w", t0)
	s.put("b", "w", t0+1*sec)
	s.put("c", "w", t0+2*sec)
	s.put("d", "w", t0+3*sec)
	s.put("a", "w", t0+5*sec) // a lives until 15 s, d until 13 s; b and c expire at 11 and 12 s
	now := t0 + 12*sec + sec/2
	s.put("e", "w", now)
	if n := s.len(); n != 3 {
		t.Fatalf("%d sessions after the expired b and c made room for e, want 3", n)
	}
	s.put("f", "w", now)
	s.put("g", "w", now) // full of live sessions: d, the least recently used, goes
	got := bound(s, now, "a", "b", "c", "d", "e", "f", "g")
	for id, want := range map[string]bool{"a": true, "b": false, "c": false, "d": false, "e": true, "f": true, "g": true} {
		if got[id] != want {
			t.Fatalf("bound %v", got)
		}
	}
}

// TestSessionTableStaysBounded: under random use (new sessions, old ones again, time passing
// and lookups) the table never holds more than its bound, its order of use stays a
// consistent list, and the session used last is always bound to the worker it was given.
func TestSessionTableStaysBounded(t *testing.T) {
	const limit = 64
	s := newSessions(limit, 10*time.Second)
	rng := rand.New(rand.NewPCG(7, 8))
	now := int64(1e18)
	for i := range 20000 {
		now += rng.Int64N(int64(50 * time.Millisecond))
		id := "s" + strconv.Itoa(rng.IntN(300))
		w := "w" + strconv.Itoa(i%8)
		if rng.IntN(4) == 0 {
			s.get(id, now)
		} else {
			s.put(id, w, now)
			if got, ok := s.get(id, now); !ok || got != w {
				t.Fatalf("step %d: %s on %q (%v), want %s", i, id, got, ok, w)
			}
		}
		if n := s.len(); n > limit {
			t.Fatalf("step %d: %d sessions, bound %d", i, n, limit)
		}
		s.check(t)
	}
}

// check verifies the table's list of use against its map.
func (s *sessions) check(t *testing.T) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	n, prev := 0, int32(-1)
	for i := s.head; i >= 0; i = s.e[i].next {
		e := &s.e[i]
		if e.prev != prev || s.m[e.id] != i {
			t.Fatalf("slot %d: prev %d (want %d), map %d", i, e.prev, prev, s.m[e.id])
		}
		if prev >= 0 && s.e[prev].expires < e.expires { // one TTL: expiry is the order of use
			t.Fatalf("slot %d expires at %d after slot %d at %d: not in order of use", i, e.expires, prev, s.e[prev].expires)
		}
		prev, n = i, n+1
		if n > len(s.m) {
			t.Fatal("the list loops")
		}
	}
	if prev != s.tail || n != len(s.m) {
		t.Fatalf("list of %d ending at %d, map of %d, tail %d", n, prev, len(s.m), s.tail)
	}
}

// BenchmarkSessionInsertFull: a new session into a table full of live ones, at several
// bounds. Each insert evicts the least recently used session: its cost does not grow with
// the table.
func BenchmarkSessionInsertFull(b *testing.B) {
	for _, size := range []int{1 << 10, 1 << 16, 1 << 20} {
		b.Run(strconv.Itoa(size), func(b *testing.B) {
			s := newSessions(size, time.Hour)
			now := int64(1e18)
			buf := make([]byte, 0, 32)
			id := func(i int) string { // aliases buf, as the proxy's read buffer does
				buf = strconv.AppendInt(append(buf[:0], "session-"...), int64(i), 10)
				return unsafe.String(&buf[0], len(buf))
			}
			for i := range size {
				s.put(id(i), "w1", now)
			}
			i := size
			b.ReportAllocs()
			for b.Loop() {
				s.put(id(i), "w2", now)
				i++
			}
			if n := s.len(); n != size {
				b.Fatalf("%d sessions, want %d", n, size)
			}
		})
	}
}
