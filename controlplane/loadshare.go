package controlplane

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/registry"
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
	out := replicaLoad{Replica: s.opts.Leader.Identity(), Workers: map[string][3]uint64{}}
	for id, l := range s.xds.Merged() {
		out.Workers[id] = [3]uint64{uint64(l.Inflight), l.PrefillTokens, l.DecodeBlocks}
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

// shareLoadLoop asks the other replicas for their proxies' load until ctx ends.
func (s *Server) shareLoadLoop(ctx context.Context, ks *registry.KubeStore, client *http.Client) {
	self := s.opts.Leader.Identity()
	var peers map[string]*url.URL
	var peersAt time.Time
	tick := time.NewTicker(replicaLoadEvery)
	defer tick.Stop()
	var warned time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		// Read again every replicaPeersEvery, and every second while none is known (a
		// replica starting beside this one shares its address a moment later).
		if time.Since(peersAt) >= replicaPeersEvery || len(peers) == 0 && time.Since(peersAt) >= time.Second {
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
			workers, err := s.askReplicaLoad(ctx, client, u)
			if err != nil && time.Since(warned) >= time.Minute {
				warned = time.Now()
				s.log.Warn("another replica's proxies' load not heard: this replica's proxies see only its own", "replica", replica, "err", err)
			}
			if s.remote.put(replica, workers, time.Now()) {
				changed = true
			}
		}
		if changed {
			s.publish(false)
		}
	}
}

// askReplicaLoad asks the replica at u for its proxies' load.
func (s *Server) askReplicaLoad(ctx context.Context, client *http.Client, u *url.URL) (map[string]xdsserver.WorkerLoad, error) {
	ctx, cancel := context.WithTimeout(ctx, replicaLoadEvery*5)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, err
	}
	token := s.opts.APIToken
	if s.opts.APITokenFile != "" {
		token = s.apiToken()
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", u, resp.Status)
	}
	var rl replicaLoad
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(&rl); err != nil {
		return nil, fmt.Errorf("%s: %w", u, err)
	}
	out := make(map[string]xdsserver.WorkerLoad, len(rl.Workers))
	for id, l := range rl.Workers {
		out[id] = xdsserver.WorkerLoad{Inflight: uint32(min(l[0], 1<<31)), PrefillTokens: l[1], DecodeBlocks: l[2]}
	}
	return out, nil
}
