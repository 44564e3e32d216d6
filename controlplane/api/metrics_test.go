package api_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvrelay/kvrelay/controlplane/api"
)

// TestMetricsNeedsAToken: beyond loopback /metrics answers the metrics token and the
// operator token, and nothing else; on loopback (open reads) it is open.
func TestMetricsNeedsAToken(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("kvrelay_up 1\n")) })
	metricsToken := "metrics-token"
	var rejected []string
	opts := api.Options{Token: "operator-token", OnReject: func(reason string, _ *http.Request) { rejected = append(rejected, reason) }}
	h := opts.Metrics(ok, func() string { return metricsToken })
	get := func(h http.Handler, auth string) int {
		req := httptest.NewRequest("GET", "/metrics", nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Code
	}
	for auth, want := range map[string]int{
		"":                         401,
		"Bearer wrong":             401,
		"Basic bWV0cmljcy10b2tlbg": 401,
		"Bearer metrics-token":     200,
		"bearer operator-token":    200,
	} {
		if got := get(h, auth); got != want {
			t.Errorf("Authorization %q: %d, want %d", auth, got, want)
		}
	}
	if len(rejected) != 3 {
		t.Errorf("refusals heard: %v, want 3", rejected)
	}
	// A metrics token rotated in its file takes effect; the old one stops working.
	metricsToken = "rotated"
	if get(h, "Bearer metrics-token") != 401 || get(h, "Bearer rotated") != 200 {
		t.Error("the rotated metrics token is not the one in force")
	}
	// Without a metrics token, the operator's alone.
	if got := get(opts.Metrics(ok, nil), "Bearer operator-token"); got != 200 {
		t.Errorf("operator token without a metrics token: %d", got)
	}
	open := api.Options{OpenReads: true}
	if got := get(open.Metrics(ok, nil), ""); got != 200 {
		t.Errorf("loopback /metrics without a token: %d, want 200", got)
	}
}
