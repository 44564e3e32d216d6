package api

import (
	"crypto/sha256"
	"crypto/subtle"
	"net/http"
	"strings"
)

// Metrics guards h, the Prometheus exposition, by the API's read rule: open when reads are
// (Options.OpenReads, an API on loopback), else only to a bearer token that is the operator
// token or, read-only, the metrics token (metricsToken, read at each request; nil or "" for
// none), so that Prometheus need not hold the token that changes the fleet. A refusal is
// 401 and OnReject hears "unauthenticated".
func (opts Options) Metrics(h http.Handler, metricsToken func() string) http.Handler {
	if opts.OpenReads {
		return h
	}
	a := newAuthorizer(opts)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		scheme, tok, ok := strings.Cut(strings.TrimSpace(r.Header.Get("Authorization")), " ")
		if ok && strings.EqualFold(scheme, "Bearer") {
			sum := sha256.Sum256([]byte(strings.TrimSpace(tok)))
			if t, want := a.token(); t != "" && subtle.ConstantTimeCompare(sum[:], want[:]) == 1 {
				h.ServeHTTP(w, r)
				return
			}
			if metricsToken != nil {
				if t := metricsToken(); t != "" {
					want := sha256.Sum256([]byte(t))
					if subtle.ConstantTimeCompare(sum[:], want[:]) == 1 {
						h.ServeHTTP(w, r)
						return
					}
				}
			}
		}
		if opts.OnReject != nil {
			opts.OnReject("unauthenticated", r)
		}
		w.Header().Set("WWW-Authenticate", `Bearer realm="kvrelay"`)
		http.Error(w, "/metrics needs a bearer token: the metrics token (--metrics-token-file) or the operator API's", http.StatusUnauthorized)
	})
}
