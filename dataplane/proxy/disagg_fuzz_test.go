package proxy

import (
	"encoding/json"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/decide"
)

// FuzzPrefillParams feeds prefill answers and client bodies to the parsers of the
// disaggregated path: nothing panics, accepted parameters ask for a remote prefill, and the
// legs built from valid JSON are valid JSON.
func FuzzPrefillParams(f *testing.F) {
	f.Add([]byte(`{"choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_host":"127.0.0.1","remote_port":5600}}`),
		[]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"min_tokens":3}`))
	f.Add([]byte(`{"kv_transfer_params":null}`), []byte(`{}`))
	f.Add([]byte(`data: {"choices":[{"delta":{"content":"a"}}]}`+"\n\n"), []byte(`{"messages":[]}`))
	f.Fuzz(func(t *testing.T, answer, body []byte) {
		params, err := prefillParams(answer)
		if err == nil {
			var p struct {
				DoRemotePrefill bool `json:"do_remote_prefill"`
			}
			if json.Unmarshal(params, &p) != nil || !p.DoRemotePrefill {
				t.Fatalf("accepted %s", params)
			}
			if out, err := decodeLegBody(body, params); err == nil && !json.Valid(out) {
				t.Fatalf("decode leg %s", out)
			}
		}
		for _, id := range []string{"", decide.NewKVRequestID()} {
			for _, source := range []string{"", "10.0.0.7:5600", string(answer)} {
				if out, err := prefillBody(body, id, source); err == nil && !json.Valid(out) {
					t.Fatalf("prefill leg %s", out)
				}
			}
		}
		if out, err := decodeLegBody(body, decide.PeerSourceParams("remote_prefiller", decide.NewKVRequestID(), string(answer))); err == nil && !json.Valid(out) {
			t.Fatalf("decode leg in the p2p form %s", out)
		}
		if out, err := speculativeBody(body, answer); err == nil && !json.Valid(out) {
			t.Fatalf("speculative body %s", out)
		}
		_, _ = answerText(answer)
	})
}
