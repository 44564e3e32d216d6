package route

import (
	"strings"
	"sync"
	"sync/atomic"
)

// maxSessions bounds a router's session table.
const maxSessions = 1 << 20

// sessions binds session ids to worker ids for a TTL after each use. Ids may alias a buffer
// the caller reuses (the proxy's read buffer): the table keeps its own copy of each key.
//
// The table holds at most limit sessions, in a slab of entries linked in order of last use
// (head the most recent). A new session first drops up to two expired sessions from the
// least recently used end, then, if the table is still full, the least recently used
// session, live or not: every call does a constant amount of work under the mutex, however
// full the table, and expired sessions drain as fast as new ones come. Under one TTL the
// order of use is the order of expiry, so the expired go first; after a TTL change a session
// that expired early may wait until it reaches the end (or is looked up) to go.
//
// Every event loop routing a request with a session id calls get and put, from any
// goroutine; mu serialises them.
type sessions struct {
	mu    sync.Mutex
	ttl   atomic.Int64 // nanoseconds
	limit int
	m     map[string]int32 // id → its entry in e
	e     []session
	// head and tail are the most and least recently used entries, free the first entry
	// not in use (a list through next); -1 for none.
	head, tail, free int32
}

type session struct {
	id, worker string // id is the table's copy, the key in m
	expires    int64
	prev, next int32
}

// init empties the table and bounds it to limit sessions.
func (s *sessions) init(limit int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.limit = max(limit, 1)
	s.m = make(map[string]int32)
	s.e = nil
	s.head, s.tail, s.free = -1, -1, -1
}

// len is the number of sessions in the table, expired ones not yet dropped included.
func (s *sessions) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.m)
}

// get returns the worker session id is bound to at now (a time of day from Now).
func (s *sessions) get(id string, now int64) (string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.m[id]
	if !ok {
		return "", false
	}
	if s.e[i].expires < now {
		s.remove(i)
		return "", false
	}
	return s.e[i].worker, true
}

// put binds session id to worker from now for the TTL, as the most recently used session.
// worker must not alias a reused buffer (it is a Worker's ID).
func (s *sessions) put(id, worker string, now int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	expires := now + s.ttl.Load()
	if i, ok := s.m[id]; ok {
		s.e[i].worker, s.e[i].expires = worker, expires
		s.unlink(i)
		s.pushFront(i)
		return
	}
	for range 2 {
		if s.tail < 0 || s.e[s.tail].expires >= now {
			break
		}
		s.remove(s.tail)
	}
	if len(s.m) >= s.limit {
		s.remove(s.tail)
	}
	var i int32
	if s.free >= 0 {
		i, s.free = s.free, s.e[s.free].next
	} else {
		i = int32(len(s.e))
		s.e = append(s.e, session{})
	}
	s.e[i] = session{id: strings.Clone(id), worker: worker, expires: expires}
	s.m[s.e[i].id] = i
	s.pushFront(i)
}

// remove drops entry i from the table and frees it.
func (s *sessions) remove(i int32) {
	delete(s.m, s.e[i].id)
	s.unlink(i)
	s.e[i] = session{next: s.free}
	s.free = i
}

func (s *sessions) unlink(i int32) {
	e := &s.e[i]
	if e.prev >= 0 {
		s.e[e.prev].next = e.next
	} else {
		s.head = e.next
	}
	if e.next >= 0 {
		s.e[e.next].prev = e.prev
	} else {
		s.tail = e.prev
	}
	e.prev, e.next = -1, -1
}

func (s *sessions) pushFront(i int32) {
	e := &s.e[i]
	e.prev, e.next = -1, s.head
	if s.head >= 0 {
		s.e[s.head].prev = i
	} else {
		s.tail = i
	}
	s.head = i
}
