package workload

import (
	"fmt"
	"time"
)

var mixedOwnParams = []param{
	{"users", "200", "chat users: sessions of short turns, all under one short system prompt"},
	{"user_rate", "4", "chat users arriving per second (Poisson), each sending its first turn as it arrives"},
	{"turns", "3", "turns per chat user"},
	{"system", "300", "tokens of the chat system prompt, the same for every user"},
	{"user", "60", "tokens of each chat message"},
	{"osl", "64", "max_tokens of a chat turn (ignore_eos)"},
	{"think", "3s", "mean think time before a user's next turn (exponential)"},
	{"rag", "60", "RAG requests: one long prompt each, open loop"},
	{"rag_rate", "1", "RAG requests per second (Poisson)"},
	{"rag_system", "200", "tokens of the RAG instructions, the same for every RAG request"},
	{"docs", "0", "distinct retrieved documents RAG requests draw from, document k with probability ∝ 1/(k+1)^zipf; 0: every RAG request retrieves a document of its own"},
	{"doc", "6000", "tokens of a retrieved document"},
	{"zipf", "1", "popularity skew of the documents (with docs > 0)"},
	{"question", "50", "tokens of the question after the document"},
	{"rag_osl", "128", "max_tokens of a RAG answer (ignore_eos)"},
	{"session_ids", "false", "send each chat user's id (nvext.session_id, x-session-id); false: a client that names no session"},
	{"hints", "false", "send osl and rag_osl as nvext.agent_hints.osl"},
}

var mixedParams = append(mixedOwnParams, burstParams...)

// buildMixed: short chat from many users beside long retrieval-augmented prompts. Chat users
// arrive as a Poisson stream and each runs a multi-turn conversation (as multi-turn does)
// under one shared short system prompt; RAG requests arrive as an open-loop Poisson stream,
// each [system: the RAG instructions, user: a retrieved document, then a question], the
// document shared by requests that retrieve the same one (docs > 0) or unique. Both streams
// go on/off together with burst.
func buildMixed(p *params, seed uint64, v *vocab, _ Tokenizer) (*Workload, error) {
	chat := chatConfig{
		turns:     p.int("turns", 1, 1<<16),
		user:      p.int("user", 1, 1<<22),
		osl:       p.int("osl", 1, 1<<22),
		think:     p.duration("think"),
		hints:     p.bool("hints"),
		system:    p.int("system", 0, 1<<22),
		anonymous: !p.bool("session_ids"),
		tag:       "chat",
	}
	users := p.int("users", 0, 1<<20)
	userRate := p.float("user_rate", 1e-6, 1e6)
	nRAG := p.int("rag", 0, 1<<24)
	ragRate := p.float("rag_rate", 1e-6, 1e6)
	ragSystem := p.int("rag_system", 0, 1<<22)
	docs := p.int("docs", 0, 1<<20)
	doc := p.int("doc", 1, 1<<22)
	skew := p.float("zipf", 0, 100)
	question := p.int("question", 1, 1<<22)
	ragOSL := p.int("rag_osl", 1, 1<<22)
	b := burstOf(p)
	if p.err != nil {
		return nil, p.err
	}
	system := idText(v, newRNG(seed, streamSystemPrompt, 0), 0, chat.system)
	starts := sessionStarts(newRNG(seed, streamChatArrivals), users, userRate, b)
	w := &Workload{Sessions: make([]Session, users), Open: make([]Request, nRAG)}
	for i := range w.Sessions {
		w.Sessions[i] = &chatSession{
			cfg:    &chat,
			v:      v,
			r:      newRNG(seed, streamMixedChat, uint64(i)),
			id:     fmt.Sprintf("user-%d", i),
			system: system,
			start:  starts[i],
			rated:  true,
		}
	}

	// RAG: the instructions start with the words spelling 1<<32 so that they share no block
	// with the chat system prompt; document k starts with the words spelling k (a unique
	// document with those spelling its request's index plus docs).
	instr := idText(v, newRNG(seed, streamSystemPrompt, 1), 1<<32, ragSystem)
	var cdf []float64
	cache := map[int]string{}
	if docs > 0 {
		cdf = zipfCDF(docs, skew)
	}
	r := newRNG(seed, streamMixedRAG)
	mean := time.Duration(float64(time.Second) / ragRate)
	var at time.Duration
	for i := range w.Open {
		at += r.exp(mean)
		k := docs + i
		if docs > 0 {
			k = r.pick(cdf)
		}
		text, ok := cache[k]
		if !ok {
			text = idText(v, newRNG(seed, streamMixedDoc, uint64(k)), uint64(k), doc)
			if docs > 0 {
				cache[k] = text
			}
		}
		q := v.text(newRNG(seed, streamMixedPrompt, uint64(i)), question)
		req := &w.Open[i]
		req.At = b.at(at)
		req.Chat = true
		var msgs []Message
		if ragSystem > 0 {
			msgs = append(msgs, Message{Role: "system", Content: instr})
		}
		req.Messages = append(msgs, Message{Role: "user", Content: text + "\n\nQuestion:" + q})
		req.MaxTokens, req.IgnoreEOS = ragOSL, true
		req.Tag = "rag"
		if chat.hints {
			req.OSL = ragOSL
		}
	}
	return w, nil
}
