package workload

import "time"

var fixedParams = []param{
	{"isl", "3000", "prompt tokens of every request: a unique random prompt"},
	{"osl", "150", "max_tokens of every request (ignore_eos)"},
	{"requests", "200", "number of requests"},
	{"rate", "2", "mean arrival rate in requests/s (Poisson)"},
	{"chat", "true", "chat completions (isl counts the user message; the chat template adds its own tokens) or text completions (false: the prompt is exactly isl tokens)"},
	{"hints", "false", "send osl as nvext.agent_hints.osl"},
}

// buildFixed: N requests of the same shape, each a fresh prompt of exactly isl tokens (no two
// share a prefix block: each starts with the words spelling its index) asking for exactly osl
// tokens, sent at Poisson arrival times. A prefill-heavy synthetic load (isl=3000,osl=150) for
// measuring prefill/decode disaggregation, where prefix caching must not help.
func buildFixed(p *params, seed uint64, v *vocab, _ Tokenizer) (*Workload, error) {
	isl := p.int("isl", 1, 1<<22)
	osl := p.int("osl", 1, 1<<22)
	n := p.int("requests", 0, 1<<24)
	rate := p.float("rate", 1e-6, 1e9)
	chat := p.bool("chat")
	hints := p.bool("hints")
	if p.err != nil {
		return nil, p.err
	}
	r := newRNG(seed, streamFixed)
	mean := time.Duration(float64(time.Second) / rate)
	w := &Workload{Open: make([]Request, n)}
	var at time.Duration
	for i := range w.Open {
		at += r.exp(mean)
		text := idText(v, newRNG(seed, streamFixedPrompt, uint64(i)), uint64(i), isl)
		req := &w.Open[i]
		req.At = at
		req.Chat = chat
		if chat {
			req.Messages = []Message{{Role: "user", Content: text}}
		} else {
			req.Prompt = text
		}
		req.MaxTokens, req.IgnoreEOS = osl, true
		req.Tag = "fixed"
		if hints {
			req.OSL = osl
		}
	}
	return w, nil
}
