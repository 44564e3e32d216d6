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

// FuzzRequestBody feeds arbitrary bodies to the routes that decode one (a worker spec, a
// policy, a rollout): the handler never panics, answers 200, 400, 409 or 413, and always with JSON.
func FuzzRequestBody(f *testing.F) {
	for _, seed := range []string{
		`{"url": "http://127.0.0.1:8005", "kv_events": "tcp://127.0.0.1:5565", "engine": "sim", "block_size": 16}`,
		`{"id": "w9", "url": "http://127.0.0.1:8009", "kvEventsBind": "tcp://*:5566", "role": "prefill"}`,
		`{"policy": "kv", "overlap_weight": 1, "temperature": 0, "cache_threshold": 0.3, "tier_weights": [1, 0.75, 0.25]}`,
		`{"busy_prefill_tokens": "8192", "busy_decode_blocks": 100, "busy_kv_fraction": 0.9, "session_ttl_ms": "-1"}`,
		`{"version": "18446744073709551615", "policy": "session"}`,
		`{"overlap_weight": "NaN", "temperature": "Infinity"}`,
		`{`, `null`, `[]`, `{"id": 1}`, "{\"url\": \"\xff\"}", `{"block_size": 4294967296}`,
		`{"candidate": {"policy": "kv", "overlap_weight": 0}, "spec": {"steps": [0.25, 1], "step_duration_ms": "20000", "min_requests": 40}}`,
		`{"candidate": {"candidate": {}}, "spec": {"shadow_ms": -1, "alpha": "NaN"}}`,
	} {
		for route := range uint8(3) {
			f.Add(route, []byte(seed))
		}
	}
	h := api.Handler(apitest.New(), api.Options{AllowUnauthenticated: true})
	f.Fuzz(func(t *testing.T, route uint8, body []byte) {
		method, path := http.MethodPut, "/v1/workers/w9"
		switch route % 3 {
		case 1:
			path = "/v1/policy"
		case 2:
			method, path = http.MethodPost, "/v1/rollout"
		}
		req := httptest.NewRequest(method, path, bytes.NewReader(body))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		switch rec.Code {
		case 200, 400, 409, 413:
		default:
			t.Fatalf("%s %s %q: status %d: %s", method, path, body, rec.Code, rec.Body)
		}
		if !json.Valid(rec.Body.Bytes()) {
			t.Fatalf("%s %s %q: invalid JSON response: %s", method, path, body, rec.Body)
		}
	})
}
