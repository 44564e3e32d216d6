package auth

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// ServerConfig is what a control plane's xDS listener asks of the proxies that connect.
// The zero value serves plaintext to anyone, which NewServer allows on a loopback address
// only (or with Insecure).
type ServerConfig struct {
	// CertFile and KeyFile are the listener's certificate and key (PEM): with them the
	// listener speaks TLS. They are read again when they change.
	CertFile, KeyFile string
	// ClientCAFile, with a certificate, makes the TLS mutual: a client must present a
	// certificate this CA signed, and may then claim as its node id only a name the
	// certificate carries (subject common name, DNS or URI SANs) unless it also sends a
	// token.
	ClientCAFile string
	// TokensFile lists the bearer tokens proxies send, one "<node-id> <token>" a line; a
	// stream without a listed token is refused, and a token's holder may claim only its
	// node id. Read again when it changes.
	TokensFile string
	// Reviewer, when set, takes bearer tokens the tokens file does not list to the issuer of
	// proxies' identities (Kubernetes: a ServiceAccount token a pod was given, checked with
	// a TokenReview): a stream whose token it refuses is refused, and a token's holder may
	// claim only a node id its review names (the pod's name).
	Reviewer TokenReviewer
	// Insecure lets a listener on an address other than loopback serve without TLS or
	// without a way to authenticate proxies.
	Insecure bool
}

// TokenReviewer checks a bearer token with the authority that issued it.
type TokenReviewer interface {
	// Review returns the node ids the token's holder may claim, or an error: ErrTokenRefused
	// (wrapped) when the authority refuses the token, another when it could not be asked.
	Review(ctx context.Context, token string) (nodes []string, err error)
	// Name says what it checks, e.g. "Kubernetes ServiceAccount tokens".
	Name() string
}

// ErrTokenRefused: a TokenReviewer's authority does not accept the token for this listener.
var ErrTokenRefused = errors.New("token refused")

// Enabled reports whether any credential is configured.
func (c ServerConfig) Enabled() bool {
	return c.CertFile != "" || c.KeyFile != "" || c.ClientCAFile != "" || c.TokensFile != "" || c.Reviewer != nil
}

// Server checks the credentials of every xDS stream. Build one with NewServer and add its
// Options to the gRPC server.
type Server struct {
	cfg     ServerConfig
	cert    *watched[*tls.Certificate]
	clients *watched[*x509.CertPool]
	tokens  *watched[tokenTable]
	summary string

	noToken, badToken, wrongNode, badCert, revoked atomic.Uint64
}

// NewServer checks cfg for a listener on listen (host:port) and loads its files. It refuses
// a listener beyond loopback that would be plaintext or would let anyone in, unless
// cfg.Insecure. log gets one line saying what is checked (nil: slog.Default).
func NewServer(cfg ServerConfig, listen string, log *slog.Logger) (*Server, error) {
	if log == nil {
		log = slog.Default()
	}
	s := &Server{cfg: cfg}
	if (cfg.CertFile == "") != (cfg.KeyFile == "") {
		return nil, errors.New("xds auth: a certificate needs its key and a key its certificate (--xds-cert, --xds-key)")
	}
	if cfg.ClientCAFile != "" && cfg.CertFile == "" {
		return nil, errors.New("xds auth: a client CA (mutual TLS) needs the listener's own certificate and key")
	}
	onErr := func(err error) {
		log.Error("xds credentials: a changed file does not parse; keeping the previous one", "err", err)
	}
	var err error
	if cfg.CertFile != "" {
		if s.cert, err = newWatched(parseKeyPair, onErr, cfg.CertFile, cfg.KeyFile); err != nil {
			return nil, fmt.Errorf("xds auth: loading the listener's certificate: %w", err)
		}
	}
	if cfg.ClientCAFile != "" {
		if s.clients, err = newWatched(parsePool, onErr, cfg.ClientCAFile); err != nil {
			return nil, fmt.Errorf("xds auth: loading the client CA: %w", err)
		}
	}
	if cfg.TokensFile != "" {
		if s.tokens, err = newWatched(parseTokens, onErr, cfg.TokensFile); err != nil {
			return nil, fmt.Errorf("xds auth: loading the tokens file: %w", err)
		}
	}
	authenticates := s.clients != nil || s.tokens != nil || cfg.Reviewer != nil
	var parts []string
	switch {
	case s.cert != nil && s.clients != nil:
		parts = append(parts, "mutual TLS")
	case s.cert != nil:
		parts = append(parts, "TLS")
	default:
		parts = append(parts, "plaintext")
	}
	if s.tokens != nil {
		parts = append(parts, "bearer tokens")
	}
	if cfg.Reviewer != nil {
		parts = append(parts, cfg.Reviewer.Name())
	}
	if !authenticates {
		parts = append(parts, "no client credentials")
	}
	s.summary = strings.Join(parts, ", ")
	loop := IsLoopback(listen)
	switch {
	case loop && !authenticates:
		log.Info("xDS listener on loopback without client credentials: any local process may follow the fleet and report load", "listen", listen, "checks", s.summary)
	case !loop && (s.cert == nil || !authenticates) && !cfg.Insecure:
		return nil, fmt.Errorf("xds auth: %s is not a loopback address and the listener would serve %s: give a certificate and key (--xds-cert, --xds-key) with a client CA (--xds-client-ca), a tokens file (--xds-tokens-file) or Kubernetes ServiceAccount tokens (--xds-kube-auth), or --xds-insecure", listen, s.summary)
	case !loop && (s.cert == nil || !authenticates):
		log.Warn("xDS listener beyond loopback without full credentials (--xds-insecure)", "listen", listen, "checks", s.summary)
	default:
		log.Info("xDS listener credentials", "listen", listen, "checks", s.summary)
	}
	return s, nil
}

// Summary says what the listener checks, e.g. "mutual TLS, bearer tokens".
func (s *Server) Summary() string { return s.summary }

// Refused counts the streams refused, by reason: no_token, bad_token, wrong_node (a node id
// the credential does not carry), bad_cert (a verified certificate naming no node), revoked
// (an open stream whose token was withdrawn).
func (s *Server) Refused() map[string]uint64 {
	return map[string]uint64{
		"no_token":   s.noToken.Load(),
		"bad_token":  s.badToken.Load(),
		"wrong_node": s.wrongNode.Load(),
		"bad_cert":   s.badCert.Load(),
		"revoked":    s.revoked.Load(),
	}
}

// Options are the gRPC server options that apply s: the transport credentials and
// interceptors that authenticate each call and bind the node ids it sends.
func (s *Server) Options() []grpc.ServerOption {
	var opts []grpc.ServerOption
	if s.cert != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(s.tlsConfig())))
	}
	return append(opts, grpc.ChainStreamInterceptor(s.stream), grpc.ChainUnaryInterceptor(s.unary))
}

func (s *Server) tlsConfig() *tls.Config {
	base := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"}}
	base.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		cert, err := s.cert.get()
		if err != nil {
			return nil, err
		}
		c := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"}, Certificates: []tls.Certificate{*cert}}
		if s.clients != nil {
			pool, err := s.clients.get()
			if err != nil {
				return nil, err
			}
			c.ClientCAs, c.ClientAuth = pool, tls.RequireAndVerifyClientCert
		}
		return c, nil
	}
	return base
}

// identity is who a call proved to be: the node ids it may claim. nil means unchecked.
type identity struct {
	via   string // "token" or "certificate"
	nodes []string
	token [sha256.Size]byte // the token's hash, when via a token
}

func (id *identity) may(node string) bool { return id == nil || slices.Contains(id.nodes, node) }

// authenticate finds the caller's identity from its token or certificate.
func (s *Server) authenticate(ctx context.Context) (*identity, error) {
	if s.tokens != nil || s.cfg.Reviewer != nil {
		tok := bearer(ctx)
		if tok == "" {
			s.noToken.Add(1)
			return nil, status.Error(codes.Unauthenticated, "xDS needs a bearer token (authorization: Bearer …; a proxy's --xds-token-file)")
		}
		h := sha256.Sum256([]byte(tok))
		if s.tokens != nil {
			table, err := s.tokens.get()
			if err != nil {
				return nil, status.Error(codes.Unavailable, "xDS tokens unreadable")
			}
			if node, ok := table[h]; ok {
				return &identity{via: "token", nodes: []string{node}, token: h}, nil
			}
		}
		if s.cfg.Reviewer == nil {
			s.badToken.Add(1)
			return nil, status.Error(codes.Unauthenticated, "xDS bearer token not recognised")
		}
		nodes, err := s.cfg.Reviewer.Review(ctx, tok)
		switch {
		case errors.Is(err, ErrTokenRefused):
			s.badToken.Add(1)
			return nil, status.Errorf(codes.Unauthenticated, "xDS bearer token refused: %v", err)
		case err != nil:
			return nil, status.Errorf(codes.Unavailable, "xDS bearer token not checked: %v", err)
		case len(nodes) == 0:
			s.badToken.Add(1)
			return nil, status.Error(codes.Unauthenticated, "xDS bearer token names no node")
		}
		return &identity{via: s.cfg.Reviewer.Name(), nodes: nodes}, nil
	}
	if s.clients != nil {
		names := certNames(ctx)
		if len(names) == 0 {
			s.badCert.Add(1)
			return nil, status.Error(codes.Unauthenticated, "xDS client certificate names no node (common name, DNS or URI SAN)")
		}
		return &identity{via: "certificate", nodes: names}, nil
	}
	return nil, nil
}

func bearer(ctx context.Context) string {
	md, _ := metadata.FromIncomingContext(ctx)
	for _, v := range md.Get("authorization") {
		if tok, ok := strings.CutPrefix(v, "Bearer "); ok {
			return strings.TrimSpace(tok)
		}
	}
	return ""
}

// certNames are the names of the verified client certificate.
func certNames(ctx context.Context) []string {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.VerifiedChains) == 0 || len(info.State.VerifiedChains[0]) == 0 {
		return nil
	}
	leaf := info.State.VerifiedChains[0][0]
	var names []string
	if leaf.Subject.CommonName != "" {
		names = append(names, leaf.Subject.CommonName)
	}
	names = append(names, leaf.DNSNames...)
	for _, u := range leaf.URIs {
		names = append(names, u.String())
	}
	return names
}

func (s *Server) unary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	id, err := s.authenticate(ctx)
	if err != nil {
		return nil, err
	}
	if err := s.check(id, req); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

func (s *Server) stream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	id, err := s.authenticate(ss.Context())
	if err != nil {
		return err
	}
	if id == nil {
		return handler(srv, ss)
	}
	b := &boundStream{ServerStream: ss, s: s, id: id}
	err = handler(srv, b)
	// A handler may end quietly on a failed receive (go-control-plane's ADS does): the
	// refusal is the call's status either way.
	if r := b.refusal(); r != nil {
		return r
	}
	return err
}

// check refuses a message that claims a node id id does not carry, or that comes on a
// stream whose token has since been withdrawn from the tokens file (so that revoking a
// proxy's token ends its open streams at their next message, not only its new ones).
func (s *Server) check(id *identity, m any) error {
	if id != nil && id.via == "token" && s.tokens != nil {
		if table, err := s.tokens.get(); err == nil {
			if node, ok := table[id.token]; !ok || node != id.nodes[0] {
				s.revoked.Add(1)
				return status.Error(codes.Unauthenticated, "xDS bearer token withdrawn")
			}
		}
	}
	node := claimedNode(m)
	if node == "" || id.may(node) {
		return nil
	}
	s.wrongNode.Add(1)
	return status.Errorf(codes.PermissionDenied, "xDS node id %q is not one this %s was issued for", node, id.via)
}

// claimedNode is the node id a message of the xDS services names.
func claimedNode(m any) string {
	switch v := m.(type) {
	case *discovery.DeltaDiscoveryRequest:
		return v.GetNode().GetId()
	case *discovery.DiscoveryRequest:
		return v.GetNode().GetId()
	case *xdsv1.LoadReport:
		return v.GetNodeId()
	case *xdsv1.JournalAck:
		return v.GetNodeId()
	case *xdsv1.IndexMatchRequest:
		return v.GetNodeId()
	}
	return ""
}

// boundStream refuses every received message that claims another node.
type boundStream struct {
	grpc.ServerStream
	s  *Server
	id *identity

	mu      sync.Mutex // RecvMsg may run on a goroutine of its own
	refused error
}

func (b *boundStream) refusal() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.refused
}

func (b *boundStream) RecvMsg(m any) error {
	if r := b.refusal(); r != nil {
		return r
	}
	if err := b.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	if err := b.s.check(b.id, m); err != nil {
		b.mu.Lock()
		b.refused = err
		b.mu.Unlock()
		return err
	}
	return nil
}

// IsLoopback reports whether addr (host:port, or a host) names only this machine: a
// loopback IP or "localhost". An empty host (all interfaces) is not loopback.
func IsLoopback(addr string) bool {
	host := addr
	if h, _, err := net.SplitHostPort(addr); err == nil {
		host = h
	}
	host = strings.TrimPrefix(strings.TrimSuffix(host, "]"), "[")
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
