package proxy

import (
	"bytes"
	"sync"
	"time"
)

// respTable remembers which worker served each stored Responses API response, so that a
// request naming it (previous_response_id) and GET /v1/responses/{id} reach the engine that
// holds it. Bounded: the oldest entries go first past max, and entries expire after ttl.
type respTable struct {
	mu    sync.Mutex
	m     map[string]respEntry
	order []string // insertion order, for eviction
	head  int
	max   int
	ttl   time.Duration
}

type respEntry struct {
	worker string
	at     int64 // nanotime of the response
}

func newRespTable(max int, ttl time.Duration) *respTable {
	return &respTable{m: make(map[string]respEntry), max: max, ttl: ttl}
}

// put records that worker served response id at now.
func (t *respTable) put(id, worker string, now int64) {
	if t.max <= 0 || id == "" {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.m[id]; !ok {
		if len(t.order) < t.max {
			t.order = append(t.order, id)
		} else {
			delete(t.m, t.order[t.head])
			t.order[t.head] = id
			t.head = (t.head + 1) % t.max
		}
	}
	t.m[id] = respEntry{worker: worker, at: now}
}

// get returns the worker that served response id, if it is remembered and not expired.
func (t *respTable) get(id string, now int64) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.m[id]
	if !ok || now-e.at > int64(t.ttl) {
		return "", false
	}
	return e.worker, true
}

// maxRespIDScan bounds how much of a Responses answer is searched for its id.
const maxRespIDScan = 8 << 10

// responseID finds the response id in the start of a Responses API answer: the first "id"
// member, which is the response object's own in a JSON answer ({"id":"resp_…",…}) and in a
// stream's first event (response.created, {"type":…,"sequence_number":0,"response":{"id":…}}).
// ok is false when b holds no complete id yet.
func responseID(b []byte) (id string, ok bool) {
	for i := 0; ; {
		k := bytes.Index(b[i:], []byte(`"id"`))
		if k < 0 {
			return "", false
		}
		j := i + k + 4
		for j < len(b) && (b[j] == ' ' || b[j] == '\t' || b[j] == '\n' || b[j] == '\r') {
			j++
		}
		if j < len(b) && b[j] == ':' {
			j++
			for j < len(b) && (b[j] == ' ' || b[j] == '\t' || b[j] == '\n' || b[j] == '\r') {
				j++
			}
			if j < len(b) && b[j] == '"' {
				end := bytes.IndexByte(b[j+1:], '"')
				if end < 0 {
					return "", false
				}
				v := b[j+1 : j+1+end]
				if len(v) == 0 || len(v) > 256 || bytes.IndexByte(v, '\\') >= 0 {
					return "", false
				}
				return string(v), true
			}
		}
		i = i + k + 4
	}
}
