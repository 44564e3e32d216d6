package workload

import "encoding/json"

// wireRequest is the OpenAI body of a Request, in the field order Body writes.
type wireRequest struct {
	Model         string         `json:"model"`
	Messages      []Message      `json:"messages,omitempty"`
	Prompt        *string        `json:"prompt,omitempty"`
	MaxTokens     int            `json:"max_tokens,omitempty"`
	IgnoreEOS     bool           `json:"ignore_eos,omitempty"`
	Stream        bool           `json:"stream,omitempty"`
	StreamOptions *streamOptions `json:"stream_options,omitempty"`
	NVExt         *nvext         `json:"nvext,omitempty"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type nvext struct {
	SessionID    string        `json:"session_id,omitempty"`
	AgentHints   *agentHints   `json:"agent_hints,omitempty"`
	CacheControl *cacheControl `json:"cache_control,omitempty"`
}

type agentHints struct {
	Priority        *int `json:"priority,omitempty"`
	OSL             int  `json:"osl,omitempty"`
	EphemeralOutput bool `json:"ephemeral_output,omitempty"`
}

type cacheControl struct {
	Type string `json:"type"`
	TTL  string `json:"ttl"`
}

// WireSession is the session id a client sends for r: Session, or "" when there is none or
// r is Anonymous.
func (r *Request) WireSession() string {
	if r.Anonymous {
		return ""
	}
	return r.Session
}

// Body returns r as the JSON body of a chat completions (r.Chat) or completions request for
// model: messages (tool calls included) or prompt, max_tokens, ignore_eos, stream with
// stream_options.include_usage (so the final chunk carries usage and cached tokens), and
// nvext with session_id, agent_hints (priority, osl, ephemeral_output) and cache_control when
// set. The runner may build bodies
// itself; this is the reference encoding.
func (r *Request) Body(model string, stream bool) []byte {
	w := wireRequest{Model: model, MaxTokens: r.MaxTokens, IgnoreEOS: r.IgnoreEOS, Stream: stream}
	if r.Invalid {
		w.MaxTokens = -1
	}
	if r.Chat {
		w.Messages = r.Messages
		if w.Messages == nil {
			w.Messages = []Message{}
		}
	} else {
		w.Prompt = &r.Prompt
	}
	if stream {
		w.StreamOptions = &streamOptions{IncludeUsage: true}
	}
	var hints *agentHints
	if r.HasPriority || r.OSL > 0 || r.EphemeralOutput {
		hints = &agentHints{OSL: r.OSL, EphemeralOutput: r.EphemeralOutput}
		if r.HasPriority {
			hints.Priority = &r.Priority
		}
	}
	var cc *cacheControl
	if r.PinTTL > 0 {
		cc = &cacheControl{Type: "ephemeral", TTL: r.PinTTL.String()}
	}
	session := r.WireSession()
	if session != "" || hints != nil || cc != nil {
		w.NVExt = &nvext{SessionID: session, AgentHints: hints, CacheControl: cc}
	}
	b, err := json.Marshal(w)
	if err != nil {
		// Only strings, numbers and bools: Marshal cannot fail.
		panic("workload: encoding request body: " + err.Error())
	}
	return b
}
