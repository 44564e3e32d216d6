package auth

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// ClientConfig is how a proxy proves itself to the control plane. The zero value dials
// plaintext without credentials, which DialOptions allows to a loopback address only (or
// with Insecure).
type ClientConfig struct {
	// CAFile verifies the control plane's certificate (PEM); with it, or with a client
	// certificate, the connection is TLS (the system roots verify when CAFile is empty).
	CAFile string `yaml:"ca_file"`
	// CertFile and KeyFile are the proxy's own certificate for mutual TLS.
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
	// ServerName is the name the control plane's certificate must carry (default: the
	// dialled host).
	ServerName string `yaml:"server_name"`
	// TokenFile holds the proxy's bearer token, sent on every stream; read again when it
	// changes.
	TokenFile string `yaml:"token_file"`
	// Insecure lets the proxy dial an address other than loopback without TLS.
	Insecure bool `yaml:"insecure"`
}

// TLS reports whether the connection is TLS.
func (c ClientConfig) TLS() bool { return c.CAFile != "" || c.CertFile != "" }

// DialOptions returns the gRPC dial options that apply c to a connection to target
// (host:port). It refuses plaintext to an address beyond loopback unless c.Insecure, and a
// token without TLS there (it would cross the network in the clear). log gets one line when
// the connection goes without credentials (nil: slog.Default).
func (c ClientConfig) DialOptions(target string, log *slog.Logger) ([]grpc.DialOption, error) {
	if log == nil {
		log = slog.Default()
	}
	if (c.CertFile == "") != (c.KeyFile == "") {
		return nil, errors.New("xds auth: a client certificate needs its key and a key its certificate (--xds-cert, --xds-key)")
	}
	loop := IsLoopback(target)
	if !loop && !c.TLS() && !c.Insecure {
		return nil, fmt.Errorf("xds auth: %s is not a loopback address: give the control plane's CA (--xds-ca) and a client certificate (--xds-cert, --xds-key) or a token (--xds-token-file), or --xds-insecure", target)
	}
	onErr := func(err error) {
		log.Error("xds credentials: a changed file does not parse; keeping the previous one", "err", err)
	}
	var opts []grpc.DialOption
	if c.TLS() {
		cfg, err := c.tlsConfig(target, onErr)
		if err != nil {
			return nil, err
		}
		opts = append(opts, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	}
	if c.TokenFile != "" {
		tok, err := newWatched(parseToken, onErr, c.TokenFile)
		if err != nil {
			return nil, fmt.Errorf("xds auth: loading the token: %w", err)
		}
		opts = append(opts, grpc.WithPerRPCCredentials(tokenCreds{tok: tok, secure: !loop && !c.Insecure}))
	}
	switch {
	case !c.TLS() && !loop:
		log.Warn("dialling the control plane beyond loopback in plaintext (--xds-insecure)", "xds", target)
	case !c.TLS() && c.TokenFile == "":
		log.Info("dialling the control plane on loopback without credentials", "xds", target)
	}
	return opts, nil
}

func (c ClientConfig) tlsConfig(target string, onErr func(error)) (*tls.Config, error) {
	name := c.ServerName
	if name == "" {
		name = target
		if h, _, err := net.SplitHostPort(target); err == nil {
			name = h
		}
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: name}
	if c.CertFile != "" {
		cert, err := newWatched(parseKeyPair, onErr, c.CertFile, c.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("xds auth: loading the client certificate: %w", err)
		}
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert.get() }
	}
	if c.CAFile != "" {
		roots, err := newWatched(parsePool, onErr, c.CAFile)
		if err != nil {
			return nil, fmt.Errorf("xds auth: loading the control plane's CA: %w", err)
		}
		// The CA file is read again when it changes, so the chain is verified here against
		// its current contents rather than by a RootCAs fixed at dial time.
		cfg.InsecureSkipVerify = true
		cfg.VerifyConnection = func(cs tls.ConnectionState) error {
			pool, err := roots.get()
			if err != nil {
				return err
			}
			if len(cs.PeerCertificates) == 0 {
				return errors.New("the control plane sent no certificate")
			}
			inter := x509.NewCertPool()
			for _, ic := range cs.PeerCertificates[1:] {
				inter.AddCert(ic)
			}
			_, err = cs.PeerCertificates[0].Verify(x509.VerifyOptions{DNSName: name, Roots: pool, Intermediates: inter})
			return err
		}
	}
	return cfg, nil
}

// tokenCreds sends the current token as a bearer token on every call.
type tokenCreds struct {
	tok    *watched[string]
	secure bool
}

func (t tokenCreds) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	tok, err := t.tok.get()
	if err != nil {
		return nil, err
	}
	return map[string]string{"authorization": "Bearer " + tok}, nil
}

func (t tokenCreds) RequireTransportSecurity() bool { return t.secure }
