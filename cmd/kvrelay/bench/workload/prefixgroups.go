package workload

import "time"

var prefixGroupOwnParams = []param{
	{"groups", "16", "number of shared system prompts"},
	{"prompt", "2048", "tokens of each system prompt"},
	{"user", "64", "tokens of each request's random user message"},
	{"requests", "400", "number of requests"},
	{"rate", "20", "mean arrival rate in requests/s (Poisson)"},
	{"osl", "64", "max_tokens of every request (ignore_eos)"},
	{"zipf", "0", "popularity skew of the groups: group k drawn ∝ 1/(k+1)^zipf (0: uniform)"},
	{"hints", "false", "send osl as nvext.agent_hints.osl"},
}

var prefixGroupParams = append(prefixGroupOwnParams, burstParams...)

// buildPrefixGroups: each request is [system: one of G prompts, user: U fresh words], sent at
// Poisson arrival times (on/off with burst). Group g's prompt starts with the words spelling g, so distinct groups
// differ within their first tokens.
func buildPrefixGroups(p *params, seed uint64, v *vocab, _ Tokenizer) (*Workload, error) {
	groups := p.int("groups", 1, 1<<20)
	prompt := p.int("prompt", 0, 1<<22)
	user := p.int("user", 1, 1<<22)
	n := p.int("requests", 0, 1<<24)
	rate := p.float("rate", 1e-6, 1e9)
	osl := p.int("osl", 1, 1<<22)
	skew := p.float("zipf", 0, 100)
	hints := p.bool("hints")
	b := burstOf(p)
	if p.err != nil {
		return nil, p.err
	}
	systems := make([]string, groups)
	for g := range systems {
		systems[g] = idText(v, newRNG(seed, streamGroupPrompt, uint64(g)), uint64(g), prompt)
	}
	cdf := zipfCDF(groups, skew)
	r := newRNG(seed, streamPrefixGroups)
	mean := time.Duration(float64(time.Second) / rate)
	w := &Workload{Open: make([]Request, n)}
	var at time.Duration
	for i := range w.Open {
		at += r.exp(mean)
		g := r.pick(cdf)
		req := &w.Open[i]
		req.At = b.at(at)
		req.Chat = true
		req.Messages = []Message{
			{Role: "system", Content: systems[g]},
			{Role: "user", Content: v.text(r, user)},
		}
		req.MaxTokens, req.IgnoreEOS = osl, true
		req.Tag = "group"
		if hints {
			req.OSL = osl
		}
	}
	return w, nil
}

// idText returns n words that start with the words spelling id (see vocab.appendID), the rest
// drawn from r: text of exactly n tokens, distinct for distinct ids within its first tokens.
func idText(v *vocab, r *rng, id uint64, n int) string {
	b := v.appendID(make([]byte, 0, 6*n), id, n)
	return string(v.appendWords(b, r, n-min(n, idWords)))
}
