package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/panjf2000/gnet/v2"

	"github.com/kvrelay/kvrelay/dataplane/decide"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// Disaggregated serving. When the pool has prefill-role and decode-role workers for the
// model, a chat or text completion goes in two legs, as vLLM's NixlConnector expects (and
// as its own disaggregation proxy sends them):
//
//  1. the prefill leg, to a prefill worker chosen KV-aware: the request with max_tokens 1,
//     stream false, no stream_options, no min_tokens, and kv_transfer_params asking for a
//     remote decode; the engine computes the prompt's KV blocks, answers with
//     kv_transfer_params saying where they are, and holds them;
//  2. the decode leg, to a decode worker chosen by load: the original request with those
//     kv_transfer_params; the engine pulls the blocks (NIXL) and decodes, streaming to the
//     client through the ordinary exchange.
//
// The routing core (decide.Request.Decide) chooses both workers and whether to split at all
// (conditional disaggregation: when the part of the prompt the decode worker does not cache
// is short (Config.DisaggThreshold), every prefill worker is busy, or the chosen one already
// has more than Config.DisaggMaxQueue tokens to prefill, the decode worker prefills itself);
// the proxy sends the legs. A prefill worker with a P2P side channel (route.Worker.P2PPort:
// vLLM's OffloadingConnector with its p2p tier) takes the legs in that tier's form instead,
// as its tests' p2p_connector_proxy.py sends them: the prefill leg names a kv_request_id of
// the proxy's (kv_transfer_params {"remote_decoder": {"kv_request_id"}}) and its answer
// carries nothing to forward; the decode leg names that id and the prefill worker's side
// channel ({"remote_prefiller": {"kv_request_id", "remote_host", "remote_port"}}), and pulls
// from there. When the core chose the prefill worker for pulling the prompt's prefix from a
// peer that caches it (decide.Request.PrefillSource: the holder was busy), the prefill leg
// also names that peer ({"remote_kv_source": {…}} beside remote_decoder) and the prefill
// worker computes only the rest. A prefill leg that fails or times out falls back to prefilling on
// the decode worker too; a decode leg that fails before its first byte is retried on another
// decode worker, prefilling there (the prefill worker frees the blocks nobody pulls after its
// own timeout).

// maxPrefillResponse bounds a prefill leg's answer (one token and kv_transfer_params).
const maxPrefillResponse = 4 << 20

// pdState is what the proxy keeps of a request's prefill leg, reset per request (the
// routing core keeps its disaggregation decision, decide.Request).
type pdState struct {
	decodeBody []byte // the decode leg's body (with kv_transfer_params); nil: local prefill
	cancel     context.CancelFunc
	startedAt  int64
}

// prefill starts the prefill leg on worker p, which the core chose, off the event loop; the
// decode leg is decided when it ends (prefillDone).
func (cc *clientConn) prefill(p *route.Worker) {
	s := cc.srv
	pd := &cc.pd
	var p2pID, source string
	if p.P2PPort > 0 {
		p2pID = decide.NewKVRequestID()
		if h := cc.in.PrefillSource(); h != nil && h.P2PPort > 0 {
			source = h.P2PAddr()
		}
	}
	body, err := prefillBody(cc.body, p2pID, source)
	if err != nil {
		// The body parsed as an OpenAI request, so this cannot happen; prefill locally.
		s.log.Warn("cannot build the prefill leg; prefilling on the decode worker", "err", err)
		cc.in.PrefillDone(false)
		cc.route(false)
		return
	}
	if source != "" {
		s.core.PeerFetch()
	}
	cc.in.HoldPrefill(cc.lp.now) // the prefill worker caches the prompt now
	pd.startedAt = cc.lp.now
	s.core.Enter() // a graceful stop waits for the leg
	s.metrics.prefillInflight.Inc()
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.PrefillTimeout)
	pd.cancel = cancel
	cc.state = stPrefill
	url := p.URL + string(cc.path)
	hdr := forwardedHeaders(cc.fwd)
	orig := append([]byte(nil), cc.body...)
	lp := cc.lp
	p2pAddr := p.P2PAddr()
	go func() {
		params, err := s.pdClient.prefill(ctx, url, hdr, body, p2pID == "")
		if err == nil && p2pID != "" {
			params = decide.PeerSourceParams("remote_prefiller", p2pID, p2pAddr)
		}
		if err != nil && ctx.Err() == nil {
			err = fmt.Errorf("prefill on %s: %w", p.ID, err)
		} else if err != nil {
			err = fmt.Errorf("prefill on %s: %w", p.ID, ctx.Err())
		}
		var decodeBody []byte
		if err == nil {
			decodeBody, err = decodeLegBody(orig, params)
		}
		_ = lp.el.Execute(context.Background(), gnet.RunnableFunc(func(context.Context) error {
			if cc.state != stPrefill || cc.pd.cancel == nil {
				return nil // the client left; closed() ended the leg
			}
			cc.lp.now = nanotime()
			cc.state = stIdle
			cc.prefillDone(decodeBody, err)
			return nil
		}))
	}()
}

// prefillDone continues a request whose prefill leg ended: the decode leg with the KV
// transfer parameters, or, when the leg failed, prefill on a decode worker.
func (cc *clientConn) prefillDone(decodeBody []byte, err error) {
	s := cc.srv
	pd := &cc.pd
	pd.cancel()
	pd.cancel = nil
	s.core.Leave()
	s.metrics.prefillInflight.Dec()
	s.metrics.prefillSeconds.Observe(seconds(cc.lp.now - pd.startedAt))
	if err != nil {
		s.metrics.prefillFailures.Inc()
		s.log.Warn("prefill leg failed; prefilling on the decode worker", "err", err)
		pd.decodeBody = nil
	} else {
		pd.decodeBody = decodeBody
	}
	cc.in.PrefillDone(err == nil)
	// The decode worker by load now, not when the prefill leg began.
	cc.route(false)
}

// abortPrefill ends a prefill leg whose client left.
func (cc *clientConn) abortPrefill() {
	pd := &cc.pd
	if pd.cancel == nil {
		return
	}
	pd.cancel()
	pd.cancel = nil
	cc.in.ReleasePrefill()
	cc.srv.core.Leave()
	cc.srv.metrics.prefillInflight.Dec()
	cc.srv.metrics.aborted.WithLabelValues("client_gone").Inc()
}

// pdClient sends prefill legs: plain HTTP/1.1 with pooled connections per prefill worker.
type pdClient struct{ c *http.Client }

func newPDClient(connectTimeout time.Duration) *pdClient {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = 64
	t.ResponseHeaderTimeout = 0 // the leg's context bounds it
	t.Proxy = nil
	t.DialContext = (&net.Dialer{Timeout: connectTimeout}).DialContext
	return &pdClient{c: &http.Client{Transport: t}}
}

// prefill posts a prefill leg and returns the kv_transfer_params of its answer (when
// params: NixlConnector's; the p2p form's answer carries none).
func (p *pdClient) prefill(ctx context.Context, url string, hdr http.Header, body []byte, params bool) (json.RawMessage, error) {
	data, err := postJSON(ctx, p.c, url, hdr, body, maxPrefillResponse)
	if err != nil || !params {
		return nil, err
	}
	return prefillParams(data)
}

// postJSON posts a JSON body (hdr may be nil) and returns the answer of a 200, of at most
// limit bytes; any other status is an error quoting the start of the answer.
func postJSON(ctx context.Context, c *http.Client, url string, hdr http.Header, body []byte, limit int64) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	if hdr != nil {
		req.Header = hdr
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("answer over %d bytes", limit)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("status %d: %s", resp.StatusCode, truncate(data, 200))
	}
	return data, nil
}

// prefillParams returns the kv_transfer_params of a prefill leg's answer: an object that
// asks for a remote prefill on the decode side.
func prefillParams(answer []byte) (json.RawMessage, error) {
	var out struct {
		Params json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(answer, &out); err != nil {
		return nil, fmt.Errorf("answer is not JSON: %w", err)
	}
	if len(out.Params) == 0 || bytes.Equal(out.Params, []byte("null")) {
		return nil, errors.New("answer has no kv_transfer_params (is the engine's KV connector a producer?)")
	}
	var p struct {
		DoRemotePrefill *bool `json:"do_remote_prefill"`
	}
	if err := json.Unmarshal(out.Params, &p); err != nil {
		return nil, fmt.Errorf("kv_transfer_params is not an object: %w", err)
	}
	if p.DoRemotePrefill == nil || !*p.DoRemotePrefill {
		return nil, errors.New("kv_transfer_params does not ask for a remote prefill")
	}
	return out.Params, nil
}

// prefillBody turns a client's request body into the prefill leg's, as vLLM's
// disaggregation proxy does: kv_transfer_params asking for a remote decode (in the p2p form
// when p2pID names the legs; in that form, when source names a peer's side channel, the
// prefill worker is also told to pull the prompt's prefix from it first: remote_kv_source,
// a transfer of its own), stream off
// (and stream_options gone), one output token (max_tokens, and max_completion_tokens when
// the request uses it), and no min_tokens / min_completion_tokens (the decode leg, which
// sends the original, keeps them).
func prefillBody(body []byte, p2pID, source string) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, err
	}
	m["kv_transfer_params"] = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)
	if p2pID != "" {
		params := `{"remote_decoder":{"kv_request_id":"` + p2pID + `"}`
		if source != "" {
			// PeerFetchParams is one object: its member goes beside remote_decoder.
			src := decide.PeerFetchParams(source)
			params += "," + string(src[1:len(src)-1])
		}
		m["kv_transfer_params"] = json.RawMessage(params + "}")
	}
	oneToken(m)
	return json.Marshal(m)
}

// oneToken makes a parsed request body ask for one output token, not streamed: max_tokens
// 1 (and max_completion_tokens 1 when the request uses it), stream false, no stream_options,
// no min_tokens / min_completion_tokens.
func oneToken(m map[string]json.RawMessage) {
	m["stream"] = json.RawMessage("false")
	delete(m, "stream_options")
	m["max_tokens"] = json.RawMessage("1")
	if _, ok := m["max_completion_tokens"]; ok {
		m["max_completion_tokens"] = json.RawMessage("1")
	}
	delete(m, "min_tokens")
	delete(m, "min_completion_tokens")
}

// decodeLegBody is the client's request body with the prefill leg's kv_transfer_params.
func decodeLegBody(body []byte, params json.RawMessage) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, err
	}
	m["kv_transfer_params"] = params
	return json.Marshal(m)
}

// forwardedHeaders parses the header lines the proxy forwards ("Name: value\r\n" each).
func forwardedHeaders(lines []byte) http.Header {
	h := http.Header{}
	for len(lines) > 0 {
		line := lines
		if i := bytes.Index(lines, []byte("\r\n")); i >= 0 {
			line, lines = lines[:i], lines[i+2:]
		} else {
			lines = nil
		}
		name, value, ok := strings.Cut(string(line), ":")
		if !ok {
			continue
		}
		h.Add(strings.TrimSpace(name), strings.TrimSpace(value))
	}
	return h
}

func truncate(b []byte, n int) string {
	if len(b) > n {
		return string(b[:n]) + "…"
	}
	return string(b)
}
