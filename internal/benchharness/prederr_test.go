package benchharness

import (
	"os"
	"path/filepath"
	"testing"
)

// FuzzPredictionErrorOf: whatever a run's results.json holds, reading its prediction error
// never panics, and a figure it gives is a finite error over at least one request.
func FuzzPredictionErrorOf(f *testing.F) {
	f.Add([]byte(`[{"records":[{"seq":0,"status":200,"ttft_ns":100000000,"predicted_ttft_ns":90000000}]}]`))
	f.Add([]byte(`[{"records":[{"seq":1,"status":200,"ttft_ns":0,"predicted_ttft_ns":5}]},{}]`))
	f.Add([]byte(`{"records":null}`))
	f.Add([]byte(`[`))
	f.Fuzz(func(t *testing.T, data []byte) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "results.json"), data, 0o644); err != nil {
			t.Fatal(err)
		}
		extra := map[string]float64{}
		PredictionErrorOf(dir, extra)
		if n, ok := extra["ttft_predictions"]; ok {
			if n < 1 || !(extra["ttft_rel_error_p50"] >= 0) || !(extra["ttft_rel_error_p90"] >= extra["ttft_rel_error_p50"]) {
				t.Fatalf("figures %v", extra)
			}
		}
	})
}
