package sim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"testing"
)

// p2pPrefillBody and p2pDecodeBody are the legs of a disaggregated chat request as vLLM's
// OffloadingConnector takes them when its p2p tier carries it (tests/v1/kv_offload/tiering/
// p2p/p2p_connector_proxy.py): the prefill leg names the kv_request_id its decoder will ask
// for, the decode leg names that id and the prefiller's address.
func p2pPrefillBody(prompt, id, extra string) string {
	return `{"messages":[{"role":"user","content":` + strconv.Quote(prompt) + `}],"max_tokens":1,"stream":false,` +
		`"kv_transfer_params":{"remote_decoder":{"kv_request_id":` + strconv.Quote(id) + `}` + extra + `}}`
}

func p2pDecodeBody(prompt, id, prefiller string, maxTokens int) string {
	host, port, _ := net.SplitHostPort(prefiller)
	return `{"messages":[{"role":"user","content":` + strconv.Quote(prompt) + `}],"max_tokens":` + strconv.Itoa(maxTokens) +
		`,"kv_transfer_params":{"remote_prefiller":{"kv_request_id":` + strconv.Quote(id) + `,"remote_host":` + strconv.Quote(host) + `,"remote_port":` + port + `}}}`
}

// TestDisaggP2PForm: the prefill leg (remote_decoder) computes the prompt and holds its
// blocks; the decode leg (remote_prefiller) pulls every prompt block from the prefiller
// named, computing only the last token, and the prefiller frees the leg's hold once its
// decoder has taken the blocks, before the timeout.
func TestDisaggP2PForm(t *testing.T) {
	const bs = 16
	pd := startPD(t, nil)
	prompt := "p2p " + longText(310)
	code, b := post(t, pd.pre.URL()+"/v1/chat/completions", p2pPrefillBody(prompt, "req-1", ""))
	if code != 200 {
		t.Fatalf("prefill leg: %d %s", code, b)
	}
	var pre pdResponse
	if err := json.Unmarshal(b, &pre); err != nil {
		t.Fatal(err)
	}
	if string(pre.KVTransferParams) != "null" {
		t.Fatalf("prefill leg answered kv_transfer_params %s, want null as vLLM's OffloadingConnector", pre.KVTransferParams)
	}
	n := pre.Usage.PromptTokens
	nBlocks := (n + bs - 1) / bs
	if reqs, blocks := pd.pre.Engine().HeldKV(); reqs != 1 || blocks != nBlocks {
		t.Fatalf("prefill holds %d requests, %d blocks; want 1, %d", reqs, blocks, nBlocks)
	}
	code, b = post(t, pd.dec.URL()+"/v1/chat/completions", p2pDecodeBody(prompt, "req-1", pd.pre.URL()[len("http://"):], 8))
	if code != 200 {
		t.Fatalf("decode leg: %d %s", code, b)
	}
	var d pdResponse
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	// The whole prompt's full blocks came from the prefiller.
	if d.Usage.CompletionTokens != 8 || d.Usage.PromptTokensDetails.CachedTokens < (n-1)/bs*bs {
		t.Fatalf("decode leg usage %+v: want the prompt's %d tokens pulled", d.Usage, n)
	}
	if got := metric(t, pd.dec, "kvrelay_sim_kv_peer_fetches_total", `result="pulled"`); got != 1 {
		t.Fatalf("decode pulled from its prefiller %v times, want 1", got)
	}
	// The leg's own hold ended when the decoder's export took its blocks; the export's hold
	// when the decoder read them.
	pd.awaitFreedByRead(t)
}

// TestDisaggP2PPrefillPullsFromAPeer: a prefill leg may pull a prefix from a peer
// (remote_kv_source beside remote_decoder) before computing the rest and holding the whole
// prompt for its decoder.
func TestDisaggP2PPrefillPullsFromAPeer(t *testing.T) {
	const bs = 16
	pd := startPD(t, nil)
	peer := startWorker(t, func(c *WorkerConfig) { c.Engine.PeerFetch = true; c.Engine.NumGPUBlocks = 1024 })
	shared := "shared context " + longText(300)
	if code, b := post(t, peer.URL()+"/v1/chat/completions", `{"messages":[{"role":"user","content":`+strconv.Quote(shared)+`}],"max_tokens":1}`); code != 200 {
		t.Fatalf("warming the peer: %d %s", code, b)
	}
	host, port, _ := net.SplitHostPort(peer.URL()[len("http://"):])
	src := fmt.Sprintf(`,"remote_kv_source":{"kv_request_id":"x","remote_host":%q,"remote_port":%s}`, host, port)
	prompt := shared + " and a question"
	code, b := post(t, pd.pre.URL()+"/v1/chat/completions", p2pPrefillBody(prompt, "req-2", src))
	if code != 200 {
		t.Fatalf("prefill leg: %d %s", code, b)
	}
	var pre pdResponse
	if err := json.Unmarshal(b, &pre); err != nil {
		t.Fatal(err)
	}
	if pre.Usage.PromptTokensDetails.CachedTokens < 300/bs*bs/2 {
		t.Fatalf("prefill leg usage %+v: want the shared prefix pulled from the peer", pre.Usage)
	}
	if got := metric(t, pd.pre, "kvrelay_sim_kv_peer_fetches_total", `result="pulled"`); got != 1 {
		t.Fatalf("the prefill leg pulled from its peer %v times, want 1", got)
	}
	if reqs, _ := pd.pre.Engine().HeldKV(); reqs != 1 {
		t.Fatalf("prefill holds %d requests, want the leg's", reqs)
	}
	code, b = post(t, pd.dec.URL()+"/v1/chat/completions", p2pDecodeBody(prompt, "req-2", pd.pre.URL()[len("http://"):], 4))
	if code != 200 || !bytes.Contains(b, []byte(`"completion_tokens":4`)) {
		t.Fatalf("decode leg: %d %s", code, b)
	}
}

// TestP2PParamsRefused: what vLLM's p2p form cannot mean is refused with 400.
func TestP2PParamsRefused(t *testing.T) {
	for _, p := range []string{
		`{"remote_decoder":"x"}`,
		`{"remote_decoder":{"kv_request_id":7}}`,
		`{"remote_decoder":{"kv_request_id":"a"},"do_remote_decode":true}`,
		`{"remote_prefiller":{"remote_host":"127.0.0.1","remote_port":1}}`,
		`{"remote_prefiller":{"kv_request_id":"a","remote_host":"a/b","remote_port":1}}`,
		`{"remote_prefiller":{"kv_request_id":"a","remote_host":"127.0.0.1","remote_port":0}}`,
		`{"remote_prefiller":{"kv_request_id":"a","remote_host":"127.0.0.1","remote_port":1},"remote_decoder":{"kv_request_id":"a"}}`,
		`{"remote_prefiller":{"kv_request_id":"a","remote_host":"127.0.0.1","remote_port":1},"remote_kv_source":{"remote_host":"127.0.0.1","remote_port":2}}`,
		`{"remote_kv_source":{"remote_host":"127.0.0.1","remote_port":2},"do_remote_prefill":true}`,
	} {
		if _, err := parseKVTransferParams(json.RawMessage(p), 64); err == nil {
			t.Errorf("%s: taken", p)
		}
	}
	p, err := parseKVTransferParams(json.RawMessage(`{"remote_decoder":{"kv_request_id":"a"},"remote_kv_source":{"kv_request_id":"b","remote_host":"127.0.0.1","remote_port":2}}`), 64)
	if err != nil || !p.DoRemoteDecode || p.KVRequestID != "a" || p.PeerFetch != "http://127.0.0.1:2" || p.FromPrefiller {
		t.Errorf("remote_decoder with remote_kv_source: %+v, %v", p, err)
	}
	p, err = parseKVTransferParams(json.RawMessage(`{"remote_prefiller":{"kv_request_id":"a","remote_host":"::1","remote_port":5710}}`), 64)
	if err != nil || p.DoRemoteDecode || p.KVRequestID != "a" || p.PeerFetch != "http://[::1]:5710" || !p.FromPrefiller {
		t.Errorf("remote_prefiller: %+v, %v", p, err)
	}
}
