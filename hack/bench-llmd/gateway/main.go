// Command gateway is a minimal stand-in for Envoy in front of an endpoint picker (EPP: llm-d's
// or kvrelay epp), for benchmarking without Kubernetes or an Envoy binary: an HTTP server over
// internal/extprocgw, which speaks ext_proc as Envoy's filter does with request and response
// body mode FULL_DUPLEX_STREAMED (see its doc).
//
// With --admin-listen it serves GET /picks: every request's pick time so far as JSON, in
// nanoseconds from opening the ext_proc stream (the client's request body already read) to the
// routing decision (the EPP's answer to the last request-body chunk, or its ImmediateResponse):
// what the EPP took to parse, tokenize, score and pick, plus the ext_proc hop, as Envoy would see it.
//
// With --render-listen it also serves vLLM's /v1/chat/completions/render and
// /v1/completions/render (what the EPP's token-producer calls) by asking an engine's /tokenize,
// for engines that tokenize but do not render, such as kvrelay's simulated engine.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"io"
	"log"
	"net/http"
	"sync"
	"time"

	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrelay/kvrelay/internal/extprocgw"
)

// picks records every request's pick time.
type picks struct {
	mu sync.Mutex
	d  []time.Duration
}

func (p *picks) record(d time.Duration) {
	p.mu.Lock()
	p.d = append(p.d, d)
	p.mu.Unlock()
}

// serve answers GET /picks with {"pick_ns": [...]}, in the order the decisions came.
func (p *picks) serve(w http.ResponseWriter, _ *http.Request) {
	p.mu.Lock()
	ns := make([]int64, len(p.d))
	for i, d := range p.d {
		ns[i] = d.Nanoseconds()
	}
	p.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string][]int64{"pick_ns": ns})
}

func main() {
	listen := flag.String("listen", "127.0.0.1:21080", "HTTP listen address")
	epp := flag.String("epp", "127.0.0.1:21090", "EPP ext_proc gRPC address (plaintext)")
	nconns := flag.Int("epp-conns", 1, "gRPC connections to the EPP (streams are spread over them)")
	verbose := flag.Bool("v", false, "log every request's routing")
	renderListen := flag.String("render-listen", "", "also serve /v1/{chat/,}completions/render here (empty: off)")
	renderFrom := flag.String("render-tokenize-url", "http://127.0.0.1:21001", "engine whose POST /tokenize answers the render calls")
	adminListen := flag.String("admin-listen", "", "serve GET /picks (every request's EPP pick time) here (empty: off)")
	flag.Parse()

	if *renderListen != "" {
		go func() {
			log.Printf("render shim on %s, tokenizing with %s/tokenize", *renderListen, *renderFrom)
			log.Fatal(http.ListenAndServe(*renderListen, renderShim(*renderFrom)))
		}()
	}
	var pk picks
	if *adminListen != "" {
		go func() {
			mux := http.NewServeMux()
			mux.HandleFunc("GET /picks", pk.serve)
			log.Printf("admin on %s (GET /picks)", *adminListen)
			log.Fatal(http.ListenAndServe(*adminListen, mux))
		}()
	}
	var clients []extproc.ExternalProcessorClient
	for i := 0; i < max(*nconns, 1); i++ {
		cc, err := grpc.NewClient(*epp,
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
		if err != nil {
			log.Fatalf("epp %s: %v", *epp, err)
		}
		clients = append(clients, extproc.NewExternalProcessorClient(cc))
	}
	g := extprocgw.New(extprocgw.Options{Pickers: clients, OnPick: pk.record, Verbose: *verbose})
	srv := &http.Server{Addr: *listen, Handler: g, ReadHeaderTimeout: 30 * time.Second}
	log.Printf("gateway listening on %s, EPP ext_proc at %s", *listen, *epp)
	log.Fatal(srv.ListenAndServe())
}

// renderShim answers vLLM's render endpoints from an engine's /tokenize, which takes the same
// body (messages for chat, prompt for completions) and applies the same chat template.
func renderShim(base string) http.Handler {
	c := &http.Client{Timeout: 30 * time.Second}
	render := func(w http.ResponseWriter, r *http.Request, list bool) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		resp, err := c.Post(base+"/tokenize", "application/json", bytes.NewReader(body))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			w.WriteHeader(resp.StatusCode)
			_, _ = w.Write(out)
			return
		}
		var tok struct {
			Tokens []uint32 `json:"tokens"`
		}
		if err := json.Unmarshal(out, &tok); err != nil {
			http.Error(w, "tokenize: "+err.Error(), http.StatusBadGateway)
			return
		}
		type rendered struct {
			TokenIDs []uint32 `json:"token_ids"`
		}
		var v any = rendered{TokenIDs: tok.Tokens}
		if list {
			v = []rendered{{TokenIDs: tok.Tokens}}
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(v)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions/render", func(w http.ResponseWriter, r *http.Request) { render(w, r, false) })
	mux.HandleFunc("POST /v1/completions/render", func(w http.ResponseWriter, r *http.Request) { render(w, r, true) })
	return mux
}
