package registry

import "time"

// NotReadyGrace is how long a discovered worker whose endpoint or pod turned not ready (and
// is not going away) stays, draining, before it goes.
const NotReadyGrace = 2 * time.Minute

// notReadyGrace is NotReadyGrace, shortened by tests.
var notReadyGrace = NotReadyGrace

// readiness keeps a discovery source's workers through a readiness blip: a worker seen ready
// that turns not ready stays, draining (no new requests, its index kept), for
// notReadyGrace; one never seen ready is no worker. A source makes passes over what it
// lists (begin, admit each worker, end); end sets a timer to make the next pass when a
// grace ends. Its owner serialises the calls.
type readiness struct {
	ready    map[string]bool      // ids seen ready while they stayed listed
	notReady map[string]time.Time // id → when it turned not ready
	seen     map[string]bool      // ids admitted in the current pass
	now      time.Time            // the current pass's time
	timer    *time.Timer          // the next grace to end
}

func newReadiness() *readiness {
	return &readiness{ready: map[string]bool{}, notReady: map[string]time.Time{}, seen: map[string]bool{}}
}

// begin starts a pass at now.
func (g *readiness) begin(now time.Time) {
	g.now = now
	clear(g.seen)
}

// admit reports whether id, ready or not now, is a worker in this pass, and whether it
// drains (not ready, within its grace).
func (g *readiness) admit(id string, ready bool) (keep, draining bool) {
	g.seen[id] = true
	if ready {
		g.ready[id] = true
		delete(g.notReady, id)
		return true, false
	}
	if !g.ready[id] {
		return false, false // never ready (still starting): not a worker yet
	}
	since, ok := g.notReady[id]
	if !ok {
		since = g.now
		g.notReady[id] = since
	}
	return g.now.Sub(since) < notReadyGrace, true
}

// end forgets the ids the pass did not list, and has again called (on the timer's
// goroutine) when the next grace ends.
func (g *readiness) end(again func()) {
	var next time.Time
	for id := range g.ready {
		if !g.seen[id] {
			delete(g.ready, id)
		}
	}
	for id, since := range g.notReady {
		if !g.seen[id] {
			delete(g.notReady, id)
			continue
		}
		if e := since.Add(notReadyGrace); e.After(g.now) && (next.IsZero() || e.Before(next)) {
			next = e
		}
	}
	g.stop()
	if !next.IsZero() {
		g.timer = time.AfterFunc(next.Sub(g.now)+time.Millisecond, again)
	}
}

// stop stops the timer.
func (g *readiness) stop() {
	if g.timer != nil {
		g.timer.Stop()
		g.timer = nil
	}
}
