package workload

import (
	"fmt"
	"slices"
	"time"
)

var multiTurnParams = []param{
	{"sessions", "32", "concurrent conversations"},
	{"turns", "8", "user turns per conversation"},
	{"system", "1024", "tokens of the system prompt"},
	{"systems", "1", "distinct system prompts, assigned to sessions round-robin"},
	{"user", "48", "tokens of each user message"},
	{"osl", "128", "max_tokens of every turn (ignore_eos)"},
	{"think", "2s", "mean think time before each turn (exponential), the first included"},
	{"hints", "false", "send osl as nvext.agent_hints.osl"},
}

// buildMultiTurn: S sessions of T turns. Turn k sends the system prompt, the k-1 earlier user
// messages each followed by the answer it got, and a new user message.
func buildMultiTurn(p *params, seed uint64, v *vocab, _ Tokenizer) (*Workload, error) {
	cfg := chatConfig{
		turns:  p.int("turns", 1, 1<<16),
		user:   p.int("user", 1, 1<<22),
		osl:    p.int("osl", 1, 1<<22),
		think:  p.duration("think"),
		hints:  p.bool("hints"),
		system: p.int("system", 0, 1<<22),
	}
	sessions := p.int("sessions", 0, 1<<20)
	systems := p.int("systems", 1, 1<<20)
	if p.err != nil {
		return nil, p.err
	}
	prompts := make([]string, min(systems, max(sessions, 1)))
	for j := range prompts {
		prompts[j] = idText(v, newRNG(seed, streamSystemPrompt, uint64(j)), uint64(j), cfg.system)
	}
	w := &Workload{Sessions: make([]Session, sessions)}
	for i := range w.Sessions {
		w.Sessions[i] = &chatSession{
			cfg:    &cfg,
			v:      v,
			r:      newRNG(seed, streamMultiTurn, uint64(i)),
			id:     fmt.Sprintf("chat-%d", i),
			system: prompts[i%len(prompts)],
		}
	}
	return w, nil
}

type chatConfig struct {
	turns, user, osl, system int
	think                    time.Duration
	hints                    bool
}

// chatSession is one multi-turn conversation.
type chatSession struct {
	cfg     *chatConfig
	v       *vocab
	r       *rng
	id      string
	system  string
	turn    int
	history []Message
}

func (s *chatSession) Next(prev string) (Request, bool) {
	if s.turn >= s.cfg.turns {
		return Request{}, false
	}
	if s.turn == 0 {
		if s.cfg.system > 0 {
			s.history = append(s.history, Message{Role: "system", Content: s.system})
		}
	} else {
		s.history = append(s.history, Message{Role: "assistant", Content: prev})
	}
	s.turn++
	at := s.r.exp(s.cfg.think)
	s.history = append(s.history, Message{Role: "user", Content: s.v.text(s.r, s.cfg.user)})
	req := Request{
		At:        at,
		Session:   s.id,
		Chat:      true,
		Messages:  slices.Clip(s.history),
		MaxTokens: s.cfg.osl,
		IgnoreEOS: true,
		Tag:       "chat",
	}
	if s.cfg.hints {
		req.OSL = s.cfg.osl
	}
	return req, true
}

var _ Session = (*chatSession)(nil)
