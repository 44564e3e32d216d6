package decide

import (
	"strings"
	"testing"
	"time"
)

// TestPinsOnlyWhereTheEnginePins: a prompt pinned by nvext.cache_control stays matched in the
// proxy's index past the index's TTL on a worker whose engine keeps pins, and not on one
// whose engine does not (vLLM, SGLang): there it lapses like any other prompt.
func TestPinsOnlyWhereTheEnginePins(t *testing.T) {
	ws := testWorkers(2)
	ws[0].Pins = true
	c := newTestCore(t, testConfig(), testRouteConfig("kv"), ws)
	body := []byte(`{"model":"gpt-oss-120b","messages":[{"role":"user","content":"` + strings.Repeat("a pinned preamble ", 200) +
		`"}],"max_tokens":4,"nvext":{"cache_control":{"type":"ephemeral","ttl":"1h"}}}`)
	now := nanotime()
	var hashes []uint64
	for _, w := range ws {
		r := prepared(t, c, body, "")
		if r.oreq.Hints.PinTTL != time.Hour {
			t.Fatalf("pin ttl %v", r.oreq.Hints.PinTTL)
		}
		hashes = r.rreq.Hashes
		r.recordPlacement(w, 0, now)
	}
	later := now + int64(10*testConfig().IndexTTL)
	overlap := make([]float64, 2)
	c.Index().MatchAt(hashes, overlap, later)
	if overlap[0] != float64(len(hashes)) || overlap[1] != 0 {
		t.Fatalf("overlap %v of %d blocks after 10 TTLs: want the pin kept on w0 (its engine pins) only", overlap, len(hashes))
	}
}
