package proxy

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/decide"
	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// rolloutServer is a proxy fed only by applyXDS, with two workers.
func rolloutServer(t *testing.T) (*Server, []*xdsv1.Worker) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.XDS = "127.0.0.1:1" // nothing answers: only applyXDS feeds the proxy
	cfg.XDSSyncTimeout = 0
	s, err := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.setupXDS(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.stopXDS)
	return s, []*xdsv1.Worker{
		{Id: "w0", Url: "http://127.0.0.1:20000", Model: "gpt-oss-120b", Healthy: true},
		{Id: "w1", Url: "http://127.0.0.1:20001", Model: "gpt-oss-120b", Healthy: true, Slot: 1},
	}
}

// chat8k is a chat body whose system prompt renders to about 8k tokens.
func chat8k(user string) []byte {
	var sys strings.Builder
	words := strings.Fields("the router sends each request to the worker that already holds most of its prompt in cache")
	for i := range 8000 {
		sys.WriteString(words[i%len(words)])
		sys.WriteByte(' ')
	}
	b, _ := json.Marshal(map[string]any{
		"model":      "gpt-oss-120b",
		"max_tokens": 64,
		"messages":   []map[string]string{{"role": "system", "content": sys.String()}, {"role": "user", "content": user}},
	})
	return b
}

// prepared is a chat request of body parsed and turned into routing input by s's routing
// core, as a connection does before it routes.
func prepared(t *testing.T, s *Server, body []byte) *decide.Request {
	t.Helper()
	r := &decide.Request{}
	r.Init(s.core, new(route.Request), true)
	r.Start(oai.ChatCompletions, nanotime(), false)
	if err := r.Parse(body); err != nil {
		t.Fatal(err)
	}
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}
	if err := r.Prepare(); err != nil {
		t.Fatal(err)
	}
	return r
}

// TestProxyRefusesProfilesItCannotBuild: a pushed profile, or a candidate's, naming a
// plugin this proxy's registry lacks is refused (the xDS client NACKs it); one it can build
// passes and routes.
func TestProxyRefusesProfilesItCannotBuild(t *testing.T) {
	s, ws := rolloutServer(t)
	good := &xdsv1.Profile{Scorers: []*xdsv1.Plugin{{Name: "load", Weight: 1}}, Picker: &xdsv1.Plugin{Name: "min-cost"}}
	bad := &xdsv1.Profile{Scorers: []*xdsv1.Plugin{{Name: "gpu-temperature", Weight: 1}}, Picker: &xdsv1.Plugin{Name: "min-cost"}}
	if err := s.checkPolicy(&xdsv1.RoutingPolicy{Version: 2, Policy: "custom", Profile: bad}); err == nil || !strings.Contains(err.Error(), "gpu-temperature") {
		t.Fatalf("an unknown scorer: %v", err)
	}
	if err := s.checkPolicy(&xdsv1.RoutingPolicy{Version: 2, Policy: "kv", Candidate: &xdsv1.RoutingPolicy{Version: 3, Policy: "custom", Profile: bad}}); err == nil {
		t.Fatal("a candidate with an unknown scorer passed")
	}
	p := &xdsv1.RoutingPolicy{Version: 2, Policy: "custom", Profile: good}
	if err := s.checkPolicy(p); err != nil {
		t.Fatal(err)
	}
	s.applyXDS(ws, p, xds.PushedLoads{})
	if pol := s.RoutingPolicy(); pol.Name != "custom" || pol.Scorers[0].Name() != "load" {
		t.Fatalf("routing with %+v", pol)
	}
}
