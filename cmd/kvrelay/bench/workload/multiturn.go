package workload

import (
	"fmt"
	"slices"
	"time"
)

var multiTurnOwnParams = []param{
	{"sessions", "32", "concurrent conversations"},
	{"turns", "8", "user turns per conversation"},
	{"system", "1024", "tokens of the system prompt"},
	{"systems", "1", "distinct system prompts, assigned to sessions round-robin"},
	{"user", "48", "tokens of each user message"},
	{"osl", "128", "max_tokens of every turn (ignore_eos)"},
	{"think", "2s", "mean think time before each turn (exponential), the first included"},
	{"hints", "false", "send osl as nvext.agent_hints.osl"},
	{"rate", "0", "sessions starting per second (Poisson, in session order), each sending its first turn as it starts; 0: every session starts at time 0 and sends its first turn after a think time"},
	{"session_ids", "true", "send each session's id (nvext.session_id, x-session-id); false: a client that names no session"},
}

var multiTurnParams = append(multiTurnOwnParams, burstParams...)

// buildMultiTurn: S sessions of T turns. Turn k sends the system prompt, the k-1 earlier user
// messages each followed by the answer it got, and a new user message. With a rate, sessions
// start as a Poisson stream (on/off with burst) and send their first turn as they start.
func buildMultiTurn(p *params, seed uint64, v *vocab, _ Tokenizer) (*Workload, error) {
	cfg := chatConfig{
		turns:     p.int("turns", 1, 1<<16),
		user:      p.int("user", 1, 1<<22),
		osl:       p.int("osl", 1, 1<<22),
		think:     p.duration("think"),
		hints:     p.bool("hints"),
		system:    p.int("system", 0, 1<<22),
		anonymous: !p.bool("session_ids"),
	}
	sessions := p.int("sessions", 0, 1<<20)
	systems := p.int("systems", 1, 1<<20)
	rate := p.float("rate", 0, 1e6)
	b := burstOf(p)
	if p.err != nil {
		return nil, p.err
	}
	if rate == 0 {
		if err := b.needRate("multi-turn"); err != nil {
			return nil, err
		}
	}
	starts := sessionStarts(newRNG(seed, streamChatArrivals), sessions, rate, b)
	prompts := make([]string, min(systems, max(sessions, 1)))
	for j := range prompts {
		prompts[j] = idText(v, newRNG(seed, streamSystemPrompt, uint64(j)), uint64(j), cfg.system)
	}
	w := &Workload{Sessions: make([]Session, sessions)}
	for i := range w.Sessions {
		var start time.Duration
		if starts != nil {
			start = starts[i]
		}
		w.Sessions[i] = &chatSession{
			cfg:    &cfg,
			v:      v,
			r:      newRNG(seed, streamMultiTurn, uint64(i)),
			id:     fmt.Sprintf("chat-%d", i),
			system: prompts[i%len(prompts)],
			start:  start,
			rated:  starts != nil,
		}
	}
	return w, nil
}

type chatConfig struct {
	turns, user, osl, system int
	think                    time.Duration
	hints                    bool
	anonymous                bool // session_ids=false
	tag                      string
}

// sessionStarts returns the start times of n sessions arriving at rate per second (Poisson,
// warped by b), or nil without a rate (every session starts at 0).
func sessionStarts(r *rng, n int, rate float64, b burst) []time.Duration {
	if rate <= 0 {
		return nil
	}
	starts := make([]time.Duration, n)
	mean := time.Duration(float64(time.Second) / rate)
	var at time.Duration
	for i := range starts {
		at += r.exp(mean)
		starts[i] = b.at(at)
	}
	return starts
}

// chatSession is one multi-turn conversation.
type chatSession struct {
	cfg    *chatConfig
	v      *vocab
	r      *rng
	id     string
	system string
	// start, when the workload has a rate, is when the session sends its first turn;
	// without one (nil starts) the first turn waits a think time like the others.
	start   time.Duration
	rated   bool
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
	if s.turn == 1 && s.rated {
		at = s.start
	}
	s.history = append(s.history, Message{Role: "user", Content: s.v.text(s.r, s.cfg.user)})
	req := Request{
		At:        at,
		Session:   s.id,
		Chat:      true,
		Messages:  slices.Clip(s.history),
		MaxTokens: s.cfg.osl,
		IgnoreEOS: true,
		Tag:       "chat",
		Anonymous: s.cfg.anonymous,
	}
	if s.cfg.tag != "" {
		req.Tag = s.cfg.tag
	}
	if s.cfg.hints {
		req.OSL = s.cfg.osl
	}
	return req, true
}

var _ Session = (*chatSession)(nil)
