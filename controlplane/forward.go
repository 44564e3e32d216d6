package controlplane

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/controlplane/registry"
)

// A follower does not make changes; an operator calling the Service that fronts every
// replica reaches one at random. So each replica shares the address its operator API is
// reached at (Options.APIAdvertise) beside its proxies' arms, and a follower forwards a
// change (an HTTP PUT, POST or DELETE) to the leader's address, the caller's token with it;
// the leader checks and answers it. A forwarded request carries forwardedHeader and is never
// forwarded again: a replica that is not the leader either (the lead moved meanwhile) answers
// 503 naming the leader, as without forwarding. A leader that cannot be reached, or whose
// certificate the follower does not trust, gets the change answered 502 naming it and its
// address; one that does not answer within the API's read timeout, 504. gRPC calls are not
// forwarded (they get Unavailable, the status gRPC clients retry).
const (
	shareAPI        = "api"
	forwardedHeader = "X-Kvrelay-Forwarded-By"
	// apiShareEvery is how often a replica writes its address again (a deleted share
	// comes back); leaderAddrTTL how long a follower keeps the leader's address it read.
	apiShareEvery = time.Minute
	leaderAddrTTL = 5 * time.Second
)

// apiShare is one replica's share of its operator API's address.
type apiShare struct {
	Addr string `json:"addr"`
	TLS  bool   `json:"tls"`
}

// forwarder sends a follower's changes to the leader.
type forwarder struct {
	s     *Server
	ks    *registry.KubeStore
	proxy *httputil.ReverseProxy
	count prometheus.Counter // changes forwarded
	// timeout bounds a forwarded change, the leader's answer included: the API's read
	// timeout, so that the follower answers within its own write timeout (twice that).
	timeout time.Duration

	mu     sync.Mutex
	leader string // the replica whose address addr is
	addr   *url.URL
	at     time.Time
}

// newForwarder returns the follower side of forwarding, or nil when this control plane has no
// replicas to forward to (no elector or no shared store).
func (s *Server) newForwarder() (*forwarder, error) {
	ks, ok := s.store.(*registry.KubeStore)
	if !ok || s.opts.Leader == nil {
		return nil, nil
	}
	f := &forwarder{s: s, ks: ks, timeout: s.opts.APIReadTimeout}
	if f.timeout <= 0 {
		f.timeout = DefaultAPIReadTimeout
	}
	tr, err := s.peerTransport()
	if err != nil {
		return nil, err
	}
	f.proxy = &httputil.ReverseProxy{
		Transport: tr,
		Rewrite: func(r *httputil.ProxyRequest) {
			target := r.In.Context().Value(forwardTarget{}).(*leaderAPI).url
			r.SetURL(target)
			r.Out.Host = target.Host
			r.Out.Header.Set(forwardedHeader, s.opts.Leader.Identity())
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			f.forget()
			target := r.Context().Value(forwardTarget{}).(*leaderAPI)
			status, code := http.StatusBadGateway, "unavailable"
			msg := fmt.Sprintf("control plane replica %s could not forward the change to the leader %s at %s: %v", s.opts.Leader.Identity(), target.leader, target.url, err)
			if errors.Is(r.Context().Err(), context.DeadlineExceeded) {
				status, code = http.StatusGatewayTimeout, "deadline_exceeded"
				msg = fmt.Sprintf("control plane replica %s forwarded the change to the leader %s at %s, which did not answer within %s", s.opts.Leader.Identity(), target.leader, target.url, f.timeout)
			}
			b, _ := json.Marshal(map[string]any{"error": map[string]string{"code": code, "message": msg}})
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			_, _ = w.Write(append(b, '\n'))
		},
	}
	return f, nil
}

// peerTransport is how a replica reaches the others' operator APIs: their certificates
// checked with --api-peer-ca (and --api-peer-server-name) when one is given.
func (s *Server) peerTransport() (*http.Transport, error) {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if s.opts.APIPeerCAFile != "" {
		pem, err := os.ReadFile(s.opts.APIPeerCAFile)
		if err != nil {
			return nil, fmt.Errorf("control plane: reading --api-peer-ca: %w", err)
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("control plane: --api-peer-ca %s holds no PEM certificate", s.opts.APIPeerCAFile)
		}
		tr.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots, ServerName: s.opts.APIPeerServerName}
	}
	return tr, nil
}

// forwardTarget is the context key of a forwarded change's *leaderAPI.
type forwardTarget struct{}

// leaderAPI is the leader's operator API, as it shared it.
type leaderAPI struct {
	leader string
	url    *url.URL
}

// wrap forwards the changes a follower gets to the leader and serves the rest with h.
func (f *forwarder) wrap(h http.Handler) http.Handler {
	if f == nil {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet || r.Method == http.MethodHead || r.Method == http.MethodOptions ||
			strings.HasPrefix(r.Header.Get("Content-Type"), "application/grpc") || r.Header.Get(forwardedHeader) != "" ||
			f.s.Acting() {
			h.ServeHTTP(w, r)
			return
		}
		if !f.s.changeAuthorized(r.Header.Get("Authorization")) {
			h.ServeHTTP(w, r) // the API's own check answers 401: nothing of the leader is told
			return
		}
		target, err := f.leaderAddr(r.Context())
		if err != nil || target == nil {
			if err != nil {
				f.s.log.Debug("change not forwarded to the leader", "err", err)
			}
			h.ServeHTTP(w, r) // 503 naming the leader, from the API's own check
			return
		}
		f.count.Inc()
		ctx, cancel := context.WithTimeout(context.WithValue(r.Context(), forwardTarget{}, target), f.timeout)
		defer cancel()
		f.proxy.ServeHTTP(w, r.WithContext(ctx))
	})
}

// leaderAddr is the leader's operator API as it shared it; nil when no leader is known or
// it shared none.
func (f *forwarder) leaderAddr(ctx context.Context) (*leaderAPI, error) {
	leader := f.s.opts.Leader.Leader()
	if leader == "" || leader == f.s.opts.Leader.Identity() {
		return nil, nil
	}
	f.mu.Lock()
	if f.leader == leader && time.Since(f.at) < leaderAddrTTL {
		defer f.mu.Unlock()
		return &leaderAPI{leader, f.addr}, nil
	}
	f.mu.Unlock()
	shares, err := f.ks.Shares(ctx, shareAPI)
	if err != nil {
		return nil, err
	}
	var sh apiShare
	b, ok := shares[leader]
	if !ok {
		return nil, fmt.Errorf("the leader %s shared no operator API address", leader)
	}
	if err := json.Unmarshal(b, &sh); err != nil || sh.Addr == "" {
		return nil, fmt.Errorf("the leader %s's operator API address %q: %v", leader, b, err)
	}
	scheme := "http"
	if sh.TLS {
		scheme = "https"
	}
	u := &url.URL{Scheme: scheme, Host: sh.Addr}
	f.mu.Lock()
	f.leader, f.addr, f.at = leader, u, time.Now()
	f.mu.Unlock()
	return &leaderAPI{leader, u}, nil
}

// forget drops the leader's address read last (forwarding to it failed).
func (f *forwarder) forget() {
	f.mu.Lock()
	f.leader, f.addr = "", nil
	f.mu.Unlock()
}

// shareAPILoop writes this replica's operator API address until ctx ends.
func (s *Server) shareAPILoop(ctx context.Context, ks *registry.KubeStore, addr string) {
	b, _ := json.Marshal(apiShare{Addr: addr, TLS: s.apiCert != nil})
	var warned time.Time
	for {
		if err := ks.PutShare(shareAPI, s.opts.Leader.Identity(), b); err != nil && time.Since(warned) >= time.Minute {
			warned = time.Now()
			s.log.Warn("this replica's operator API address not shared: followers answer changes with 503 instead of forwarding them here", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(apiShareEvery):
		}
	}
}

// advertisedAPI is the address other replicas reach this one's operator API at:
// Options.APIAdvertise, else the listener's when it is bound to one address (not 0.0.0.0).
func (s *Server) advertisedAPI() (string, error) {
	if s.opts.APIAdvertise != "" {
		if _, _, err := net.SplitHostPort(s.opts.APIAdvertise); err != nil {
			return "", fmt.Errorf("control plane: --api-advertise %q: %w", s.opts.APIAdvertise, err)
		}
		return s.opts.APIAdvertise, nil
	}
	if s.apiLis == nil {
		return "", nil
	}
	a, ok := s.apiLis.Addr().(*net.TCPAddr)
	if !ok || a.IP.IsUnspecified() {
		return "", nil
	}
	return a.String(), nil
}

// changeAuthorized reports whether authorization carries the operator API's token: a
// follower forwards only such changes, so that a caller without it learns nothing of the
// leader (its name, its address) from the follower.
func (s *Server) changeAuthorized(authorization string) bool {
	token := s.opts.APIToken
	if s.opts.APITokenFile != "" {
		token = s.apiToken()
	}
	scheme, tok, ok := strings.Cut(strings.TrimSpace(authorization), " ")
	if token == "" || !ok || !strings.EqualFold(scheme, "Bearer") {
		return false
	}
	got, want := sha256.Sum256([]byte(strings.TrimSpace(tok))), sha256.Sum256([]byte(token))
	return subtle.ConstantTimeCompare(got[:], want[:]) == 1
}
