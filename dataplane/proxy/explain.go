package proxy

import (
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/kvrelay/kvrelay/dataplane/decide"
)

// The routing core's views of its sampled decisions and workers' latency models, as the
// proxy's admin listener serves them.
type (
	DecisionJSON    = decide.DecisionJSON
	CandidateJSON   = decide.CandidateJSON
	WorkerModelJSON = decide.WorkerModelJSON
	DecodePointJSON = decide.DecodePointJSON
)

// Decisions returns the sampled decisions, newest first, at most n (0: all kept).
func (s *Server) Decisions(n int) []DecisionJSON { return s.core.Decisions(n) }

// WorkerModels returns every worker's latency model.
func (s *Server) WorkerModels() []WorkerModelJSON { return s.core.WorkerModels() }

// DecisionsHandler serves, for the proxy's admin listener, GET /debug/decisions (the
// sampled decisions of a predicting policy, newest first; ?n= bounds them) and
// GET /debug/latency (each worker's latency model).
//
// It also serves GET /metrics: the admin listener is where metrics live (the client port
// answers /metrics only while it listens on loopback).
func (s *Server) DecisionsHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/decisions", func(w http.ResponseWriter, r *http.Request) {
		n, _ := strconv.Atoi(r.URL.Query().Get("n"))
		writeJSON(w, s.Decisions(n))
	})
	mux.HandleFunc("GET /debug/latency", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, s.WorkerModels())
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_, _ = w.Write(s.gatherMetrics())
	})
	return mux
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
