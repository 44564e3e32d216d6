package sim

import (
	"strconv"
	"strings"
	"testing"
)

// TestMaxLoadTokens: a prompt whose prefix the worker keeps only in host memory is loaded
// back whole by default, loaded up to max_load_tokens beyond the GPU's hit when the request
// caps it, and computed when the cap is 0 (vLLM's kv_transfer_params.max_load_tokens); a
// malformed cap is refused.
func TestMaxLoadTokens(t *testing.T) {
	w := startWorker(t, func(c *WorkerConfig) {
		c.Engine.NumGPUBlocks, c.Engine.CPUOffloadBlocks = 64, 512
		c.Engine.OffloadOn = OffloadOnStore
	})
	prompt := "host " + longText(480) // ~30 blocks of 16 tokens
	body := func(params string) string {
		b := `{"messages":[{"role":"user","content":` + strconv.Quote(prompt) + `}],"max_tokens":2`
		if params != "" {
			b += `,"kv_transfer_params":` + params
		}
		return b + "}"
	}
	// push fills the GPU with another prompt, so that the first lives only in host memory.
	push := func(i int) {
		chatUsage(t, w, `{"messages":[{"role":"user","content":`+strconv.Quote("other"+strconv.Itoa(i)+" "+longText(900))+`}],"max_tokens":2}`)
	}
	first := chatUsage(t, w, body(""))
	push(0)
	whole := chatUsage(t, w, body(""))
	if whole.PromptTokensDetails.CachedTokens < first.PromptTokens-32 {
		t.Fatalf("without a cap %d of %d tokens came back from host memory", whole.PromptTokensDetails.CachedTokens, whole.PromptTokens)
	}
	// What is left on the GPU after a push is loaded anyway: max_load_tokens caps what
	// comes from below it.
	push(1)
	none := chatUsage(t, w, body(`{"max_load_tokens":0}`))
	gpu := none.PromptTokensDetails.CachedTokens
	if gpu > whole.PromptTokensDetails.CachedTokens-160 {
		t.Fatalf("max_load_tokens 0: %d tokens cached, of %d loaded without a cap", gpu, whole.PromptTokensDetails.CachedTokens)
	}
	push(2)
	capped := chatUsage(t, w, body(`{"max_load_tokens":160}`))
	if got := capped.PromptTokensDetails.CachedTokens; got != gpu+160 {
		t.Fatalf("max_load_tokens 160: %d tokens cached, want the GPU's %d and 160 (10 blocks) from host memory", got, gpu)
	}
	if st := w.Engine().TierStats(); st.LoadCapped < 10 {
		t.Fatalf("LoadCapped %d, want the blocks the caps left to compute", st.LoadCapped)
	}
	for _, bad := range []string{`{"max_load_tokens":-1}`, `{"max_load_tokens":"all"}`, `{"max_load_tokens":1.5}`} {
		if code, b := post(t, w.URL()+"/v1/chat/completions", body(bad)); code != 400 || !strings.Contains(string(b), "max_load_tokens") {
			t.Errorf("%s: %d %s", bad, code, b)
		}
	}
}
