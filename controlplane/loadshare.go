package controlplane

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvrelay/kvrelay/controlplane/loadview"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/engines"
	xdsserver "github.com/kvrelay/kvrelay/xds/server"
)

// In-flight load across replicas. Each replica hears the load reports of the proxies
// connected to it, and publishes each worker's in-flight requests, prefill tokens and decode
// blocks summed over them; a proxy takes its own share out and sees the rest. With several
// replicas a proxy would see only its own replica's proxies. So each replica serves its
// proxies' sums at /v1/replica/load (to a caller with the operator API's token), and asks
// every other replica for theirs every replicaLoadEvery, at the operator API address each
// shares (the "api" KvrelayShare); what the others said within replicaLoadMaxAge is added to
// what it publishes.
//
// The same exchange shares the engines' polls. Each engine is polled by one replica: the one
// that ranks first for it by rendezvous hashing over this replica and the others that said
// within replicaLoadMaxAge that they share polls. Each replica's answer carries its own
// recent polls; the others take them in place of polling (loadview's Options.Delegated). A
// replica that stops answering, or stops polling an engine, leaves its readings to age past
// the load view's RemoteMaxAge, and the others poll that engine themselves again; while two
// replicas disagree on who polls an engine, both may.
const (
	replicaLoadPath   = "/v1/replica/load"
	replicaLoadEvery  = 100 * time.Millisecond
	replicaLoadMaxAge = time.Second
	// replicaPeersEvery is how often the other replicas' addresses are read again.
	replicaPeersEvery = 5 * time.Second
)

// replicaLoad is one replica's answer at replicaLoadPath: its proxies' in-flight load per
// worker id, as [requests, prefill tokens, decode blocks].
type replicaLoad struct {
	Replica string               `json:"replica"`
	Workers map[string][3]uint64 `json:"workers"`
	// PollShare says that the replica polls only the engines it ranks first for and takes
	// the others' polls of the rest; Polls are its own polls of the last RemoteMaxAge
	// published after the asker's ?after= (each once), and Seq the last it published, the
	// asker's next ?after=.
	PollShare bool         `json:"poll_share,omitempty"`
	Polls     []polledWire `json:"polls,omitempty"`
	Seq       uint64       `json:"seq,omitempty"`
}

// polledWire is one engine's state as the replica that polled it says it, its times as ages
// (microseconds before the answer) so that the replicas' clocks need not agree.
type polledWire struct {
	ID             string        `json:"id"`
	Healthy        bool          `json:"healthy,omitempty"`
	Load           engines.Load  `json:"load"`
	Model          engines.Model `json:"model"`
	BlockSize      int           `json:"block_size,omitempty"`
	CapacityBlocks int           `json:"capacity_blocks,omitempty"`
	Failures       int           `json:"failures,omitempty"`
	LastError      string        `json:"last_error,omitempty"`
	CheckedAgo     int64         `json:"checked_ago_us"`
	Seq            uint64        `json:"seq"`
	// ObservedAgo is -1 when the engine was never scraped.
	ObservedAgo int64 `json:"observed_ago_us"`
}

func toWire(st loadview.State, now time.Time) polledWire {
	w := polledWire{ID: st.ID, Healthy: st.Healthy, Load: st.Load, Model: st.Model, BlockSize: st.BlockSize,
		CapacityBlocks: st.CapacityBlocks, Failures: st.ConsecutiveFailures, LastError: st.LastError,
		CheckedAgo: now.Sub(st.CheckedAt).Microseconds(), ObservedAgo: -1, Seq: st.Seq}
	if !st.ObservedAt.IsZero() {
		w.ObservedAgo = now.Sub(st.ObservedAt).Microseconds()
	}
	return w
}

// fromWire is w as replica's reading, its ages taken back from now (the answer's arrival).
func fromWire(w polledWire, replica string, now time.Time) (loadview.State, bool) {
	if w.ID == "" || w.CheckedAgo < 0 || w.Failures < 0 || w.Load.Running < 0 || w.Load.Waiting < 0 ||
		!(w.Load.KVUsage >= 0 && w.Load.KVUsage <= 1) || w.BlockSize < 0 || w.CapacityBlocks < 0 {
		return loadview.State{}, false
	}
	st := loadview.State{ID: w.ID, Healthy: w.Healthy, Load: w.Load, Model: w.Model, BlockSize: w.BlockSize,
		CapacityBlocks: w.CapacityBlocks, ConsecutiveFailures: w.Failures, LastError: w.LastError, From: replica, Seq: w.Seq,
		CheckedAt: now.Add(-time.Duration(w.CheckedAgo) * time.Microsecond)}
	if w.ObservedAgo >= 0 {
		st.ObservedAt = now.Add(-time.Duration(w.ObservedAgo) * time.Microsecond)
	}
	return st, true
}

// pollShare is who polls the engines: this replica and the others that share their polls,
// as last heard.
type pollShare struct {
	mu    sync.Mutex
	self  string
	heard map[string]time.Time
	// ranked is self, first, and the replicas heard within replicaLoadMaxAge, read by
	// delegated.
	ranked atomic.Pointer[[]string]
}

// heardFrom records what replica answered at: that it shares its polls, or that it does
// not (it is forgotten); answered false, that it did not answer, which changes nothing of
// it (it is forgotten once silent past replicaLoadMaxAge: a replica too busy to answer one
// ask in time keeps polling its engines, and its share of the fleet is not doubled onto
// the others, who are as busy). It ranks again either way, forgetting the replicas silent
// past replicaLoadMaxAge (replica "", not answered: only that).
func (p *pollShare) heardFrom(replica string, answered, shares bool, at time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.heard == nil {
		p.heard = map[string]time.Time{}
	}
	switch {
	case !answered:
	case shares:
		p.heard[replica] = at
	default:
		delete(p.heard, replica)
	}
	rs := []string{p.self}
	for r, t := range p.heard {
		if at.Sub(t) > replicaLoadMaxAge {
			delete(p.heard, r)
			continue
		}
		rs = append(rs, r)
	}
	p.ranked.Store(&rs)
}

// delegated reports whether another replica polls worker id: one of the replicas that share
// polls ranks before this one for it.
func (p *pollShare) delegated(id string) bool {
	rs := p.ranked.Load()
	if rs == nil || len(*rs) < 2 {
		return false
	}
	return pollerOf(*rs, id) != (*rs)[0]
}

// pollerOf is the replica of rs that polls worker id: the highest rendezvous hash.
func pollerOf(rs []string, id string) string {
	var best string
	var top uint64
	for i, r := range rs {
		if h := xxh3.HashString(r + "\x00" + id); i == 0 || h > top || h == top && r < best {
			best, top = r, h
		}
	}
	return best
}

// remoteLoads is what the other replicas said of their proxies' load, by replica.
type remoteLoads struct {
	mu  sync.Mutex
	by  map[string]remoteLoad
	sum map[string]xdsserver.WorkerLoad // over the replicas heard within replicaLoadMaxAge
}

type remoteLoad struct {
	at      time.Time
	workers map[string]xdsserver.WorkerLoad
}

// sums is the other replicas' load per worker (nil: none), for workerResources.
func (r *remoteLoads) sums() map[string]xdsserver.WorkerLoad {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sum
}

// put records replica's answer (or forgets it: nil) and sums again; it reports whether the
// sums changed.
func (r *remoteLoads) put(replica string, workers map[string]xdsserver.WorkerLoad, now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.by == nil {
		r.by = map[string]remoteLoad{}
	}
	if workers == nil {
		delete(r.by, replica)
	} else {
		r.by[replica] = remoteLoad{at: now, workers: workers}
	}
	sum := map[string]xdsserver.WorkerLoad{}
	for id, rl := range r.by {
		if now.Sub(rl.at) > replicaLoadMaxAge {
			delete(r.by, id)
			continue
		}
		for w, l := range rl.workers {
			s := sum[w]
			sum[w] = xdsserver.WorkerLoad{Inflight: s.Inflight + l.Inflight, PrefillTokens: s.PrefillTokens + l.PrefillTokens,
				DecodeBlocks: s.DecodeBlocks + l.DecodeBlocks}
		}
	}
	if len(sum) == 0 {
		sum = nil
	}
	changed := !maps.Equal(sum, r.sum)
	r.sum = sum
	return changed
}

// serveReplicaLoad answers another replica with this one's proxies' load.
func (s *Server) serveReplicaLoad(w http.ResponseWriter, r *http.Request) {
	if !s.changeAuthorized(r.Header.Get("Authorization")) {
		w.Header().Set("WWW-Authenticate", `Bearer realm="kvrelay"`)
		http.Error(w, `{"error":{"code":"unauthenticated","message":"a replica's load is for the other replicas: send the operator API's token"}}`, http.StatusUnauthorized)
		return
	}
	out := replicaLoad{Replica: s.replicaID(), Workers: map[string][3]uint64{}}
	for id, l := range s.xds.Merged() {
		out.Workers[id] = [3]uint64{uint64(l.Inflight), l.PrefillTokens, l.DecodeBlocks}
	}
	if !s.opts.NoPollShare {
		out.PollShare = true
		after, _ := strconv.ParseUint(r.URL.Query().Get("after"), 10, 64)
		polled, last := s.view.Polled(after)
		now := time.Now()
		for _, st := range polled {
			out.Polls = append(out.Polls, toWire(st, now))
		}
		out.Seq = last
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

// replicaID names this replica to the others: its Lease identity, else Options.ReplicaID,
// else its operator API's address.
func (s *Server) replicaID() string {
	switch {
	case s.opts.Leader != nil:
		return s.opts.Leader.Identity()
	case s.opts.ReplicaID != "":
		return s.opts.ReplicaID
	case s.apiLis != nil:
		return s.apiLis.Addr().String()
	}
	return s.opts.APIListen
}

// shareLoadLoop asks the other replicas for their proxies' load and polls until ctx ends:
// those that share their operator API's address through ks, or Options.ReplicaPeers when ks
// is nil.
func (s *Server) shareLoadLoop(ctx context.Context, ks *registry.KubeStore, client *http.Client) {
	self := s.replicaID()
	s.pollers.mu.Lock()
	s.pollers.self = self
	s.pollers.mu.Unlock()
	var peers map[string]*url.URL
	if ks == nil {
		scheme := "http"
		if s.opts.APIPeerCAFile != "" {
			scheme = "https"
		}
		peers = map[string]*url.URL{}
		for _, addr := range s.opts.ReplicaPeers {
			peers[addr] = &url.URL{Scheme: scheme, Host: addr, Path: replicaLoadPath}
		}
	}
	var peersAt time.Time
	names := map[string]string{} // a peer's name for itself, by its key in peers
	after := map[string]uint64{} // the last Seq of its polls a peer sent, by its key
	tick := time.NewTicker(replicaLoadEvery)
	defer tick.Stop()
	var warned time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		// Shared addresses are read again every replicaPeersEvery, and every second while
		// none is known (a replica starting beside this one shares its address a moment
		// later).
		if ks != nil && (time.Since(peersAt) >= replicaPeersEvery || len(peers) == 0 && time.Since(peersAt) >= time.Second) {
			if shares, err := ks.Shares(ctx, shareAPI); err == nil {
				peers = map[string]*url.URL{}
				for replica, b := range shares {
					var sh apiShare
					if replica == self || json.Unmarshal(b, &sh) != nil || sh.Addr == "" {
						continue
					}
					scheme := "http"
					if sh.TLS {
						scheme = "https"
					}
					peers[replica] = &url.URL{Scheme: scheme, Host: sh.Addr, Path: replicaLoadPath}
				}
				peersAt = time.Now()
			}
		}
		changed := false
		for replica, u := range peers {
			if ctx.Err() != nil {
				return
			}
			rl, err := s.askReplicaLoad(ctx, client, u, after[replica])
			switch {
			case err != nil:
			case rl.seq < after[replica]:
				after[replica] = 0 // it restarted: all of its polls, next time
			default:
				after[replica] = rl.seq
			}
			if rl.replica == self {
				continue // an address of this replica's own among the peers
			}
			if err != nil && time.Since(warned) >= time.Minute {
				warned = time.Now()
				s.log.Warn("another replica's proxies' load not heard: this replica's proxies see only its own, and it polls every engine", "replica", replica, "err", err)
			}
			now := time.Now()
			if !s.opts.NoReplicaLoadShare && s.remote.put(replica, rl.workers, now) {
				changed = true
			}
			if !s.opts.NoPollShare {
				// Ranked by the name it gives itself, as it ranks this replica by its own.
				if rl.replica != "" {
					names[replica] = rl.replica
				}
				if id := names[replica]; id != "" {
					s.pollers.heardFrom(id, err == nil, rl.pollShare, now)
				}
				if len(rl.polls) > 0 {
					s.view.PutRemote(rl.polls)
				}
			}
		}
		if !s.opts.NoPollShare {
			// Replicas that left the peers, or went silent, age out of the share even
			// when no other answer comes to rank again.
			s.pollers.heardFrom("", false, false, time.Now())
		}
		if changed {
			// Published by the loop, at once when it may, or at its next tick that may:
			// a push refused as too soon here would leave the change to the next one.
			select {
			case s.remoteChanged <- struct{}{}:
			default:
			}
		}
	}
}

// peerAnswer is what another replica said: its proxies' load per worker, whether it shares
// its polls, and those polls as readings of this host's clock.
type peerAnswer struct {
	replica   string
	seq       uint64
	workers   map[string]xdsserver.WorkerLoad
	pollShare bool
	polls     []loadview.State
}

// askReplicaLoad asks the replica at u for its proxies' load and its polls published after
// its Seq after. It waits half of replicaLoadMaxAge: the asks go one after another, and a
// replica that answers in time must be asked again before its last answer ages out, however
// long another takes.
func (s *Server) askReplicaLoad(ctx context.Context, client *http.Client, u *url.URL, after uint64) (peerAnswer, error) {
	ctx, cancel := context.WithTimeout(ctx, replicaLoadMaxAge/2)
	defer cancel()
	q := *u
	q.RawQuery = "after=" + strconv.FormatUint(after, 10)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, q.String(), nil)
	if err != nil {
		return peerAnswer{}, err
	}
	token := s.opts.APIToken
	if s.opts.APITokenFile != "" {
		token = s.apiToken()
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := client.Do(req)
	if err != nil {
		return peerAnswer{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return peerAnswer{}, fmt.Errorf("%s: %s", u, resp.Status)
	}
	var rl replicaLoad
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(&rl); err != nil {
		return peerAnswer{}, fmt.Errorf("%s: %w", u, err)
	}
	now := time.Now()
	out := peerAnswer{replica: rl.Replica, seq: rl.Seq, workers: make(map[string]xdsserver.WorkerLoad, len(rl.Workers)), pollShare: rl.PollShare}
	for id, l := range rl.Workers {
		out.workers[id] = xdsserver.WorkerLoad{Inflight: uint32(min(l[0], 1<<31)), PrefillTokens: l[1], DecodeBlocks: l[2]}
	}
	for _, w := range rl.Polls {
		if st, ok := fromWire(w, rl.Replica, now); ok && rl.Replica != "" {
			out.polls = append(out.polls, st)
		}
	}
	return out, nil
}
