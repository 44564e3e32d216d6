package api_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvrelay/kvrelay/controlplane/api"
	"github.com/kvrelay/kvrelay/controlplane/api/apitest"
)

// FuzzRequestBody feeds arbitrary bodies to the two routes that decode one (a worker spec,
// a policy): the handler never panics, answers 200, 400, 409 or 413, and always with JSON.
func FuzzRequestBody(f *testing.F) {
	for _, seed := range []string{
		`{"url": "http://127.0.0.1:8005", "kv_events": "tcp://127.0.0.1:5565", "engine": "sim", "block_size": 16}`,
		`{"id": "w9", "url": "http://127.0.0.1:8009", "kvEventsBind": "tcp://*:5566", "role": "prefill"}`,
		`{"policy": "kv", "overlap_weight": 1, "temperature": 0, "cache_threshold": 0.3, "tier_weights": [1, 0.75, 0.25]}`,
		`{"busy_prefill_tokens": "8192", "busy_decode_blocks": 100, "busy_kv_fraction": 0.9, "session_ttl_ms": "-1"}`,
		`{"version": "18446744073709551615", "policy": "session"}`,
		`{"overlap_weight": "NaN", "temperature": "Infinity"}`,
		`{`, `null`, `[]`, `{"id": 1}`, "{\"url\": \"\xff\"}", `{"block_size": 4294967296}`,
	} {
		f.Add(false, []byte(seed))
		f.Add(true, []byte(seed))
	}
	h := api.Handler(apitest.New(), api.Options{AllowUnauthenticated: true})
	f.Fuzz(func(t *testing.T, policy bool, body []byte) {
		path := "/v1/workers/w9"
		if policy {
			path = "/v1/policy"
		}
		req := httptest.NewRequest(http.MethodPut, path, bytes.NewReader(body))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		switch rec.Code {
		case 200, 400, 409, 413:
		default:
			t.Fatalf("PUT %s %q: status %d: %s", path, body, rec.Code, rec.Body)
		}
		if !json.Valid(rec.Body.Bytes()) {
			t.Fatalf("PUT %s %q: invalid JSON response: %s", path, body, rec.Body)
		}
	})
}
