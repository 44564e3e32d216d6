package oai

import (
	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

type wantObs struct {
	mode    Mode
	chunks  int
	events  int
	finish  string
	done    bool
	usage   Usage
	errSeen bool
	errMsg  string // prefix of the (JSON-escaped) message
	errType string
	status  int
}

// transcripts are real response payloads (see testdata/README.md for where each comes from)
// and what the observer must report for them.
var transcripts = []struct {
	file string
	want wantObs
}{
	// kvrelay's simulated engine, captured (TestCaptureSim -update).
	{"sim_chat_stream.sse", wantObs{mode: ModeSSE, chunks: 8, events: 9, finish: "length", done: true}},
	{"sim_chat_stream_usage.sse", wantObs{mode: ModeSSE, chunks: 8, events: 10, finish: "length", done: true,
		usage: Usage{PromptTokens: 83, CompletionTokens: 8, CachedTokens: 80, Has: true, HasCached: true}}},
	{"sim_completions_stream_usage.sse", wantObs{mode: ModeSSE, chunks: 6, events: 7, finish: "length", done: true,
		usage: Usage{PromptTokens: 4, CompletionTokens: 6, Has: true, HasCached: true}}},
	{"sim_chat.json", wantObs{mode: ModeJSON, chunks: 1, events: 1, finish: "length",
		usage: Usage{PromptTokens: 83, CompletionTokens: 8, CachedTokens: 80, Has: true, HasCached: true}}},
	{"sim_completions.json", wantObs{mode: ModeJSON, chunks: 1, events: 1, finish: "length",
		usage: Usage{PromptTokens: 4, CompletionTokens: 6, Has: true, HasCached: true}}},
	{"sim_error.json", wantObs{mode: ModeJSON, events: 1, errSeen: true,
		errMsg: "messages must be a non-empty array", errType: "BadRequestError", status: 400}},

	// vLLM.
	{"vllm_chat_stream.sse", wantObs{mode: ModeSSE, chunks: 9, events: 11, finish: "stop", done: true}},
	{"vllm_chat_stream_usage.sse", wantObs{mode: ModeSSE, chunks: 9, events: 12, finish: "stop", done: true,
		usage: Usage{PromptTokens: 42, CompletionTokens: 10, CachedTokens: 32, Has: true, HasCached: true}}},
	{"vllm_chat_reasoning.sse", wantObs{mode: ModeSSE, chunks: 11, events: 14, finish: "stop", done: true,
		usage: Usage{PromptTokens: 9, CompletionTokens: 12, Has: true}}},
	{"vllm_chat_reasoning_field.sse", wantObs{mode: ModeSSE, chunks: 6, events: 8, finish: "stop", done: true}},
	{"vllm_chat_tool_calls.sse", wantObs{mode: ModeSSE, chunks: 6, events: 8, finish: "tool_calls", done: true}},
	{"vllm_chat_error.sse", wantObs{mode: ModeSSE, chunks: 2, events: 4, done: true, errSeen: true,
		errMsg: "The decoder prompt (length 9000)", errType: "BadRequestError", status: 400}},
	{"vllm_completions_stream.sse", wantObs{mode: ModeSSE, chunks: 6, events: 6, finish: "length", done: true}},
	{"vllm_completions_stream_usage.sse", wantObs{mode: ModeSSE, chunks: 6, events: 7, finish: "length", done: true,
		usage: Usage{PromptTokens: 7, CompletionTokens: 6, Has: true}}},
	{"vllm_chat.json", wantObs{mode: ModeJSON, chunks: 1, events: 1, finish: "stop",
		usage: Usage{PromptTokens: 42, CompletionTokens: 10, CachedTokens: 32, Has: true, HasCached: true}}},
	{"vllm_chat_tool_calls.json", wantObs{mode: ModeJSON, chunks: 1, events: 1, finish: "tool_calls",
		usage: Usage{PromptTokens: 180, CompletionTokens: 23, Has: true}}},
	{"vllm_error.json", wantObs{mode: ModeJSON, events: 1, errSeen: true,
		errMsg: "max_tokens must be at least 1", errType: "BadRequestError", status: 400}},
	{"vllm_error_flat.json", wantObs{mode: ModeJSON, events: 1, errSeen: true,
		errMsg: "The model `gpt-4` does not exist.", errType: "NotFoundError", status: 404}},
	{"vllm_embeddings.json", wantObs{mode: ModeJSON, events: 1, usage: Usage{PromptTokens: 8, Has: true}}},

	// The OpenAI API.
	{"openai_chat_stream_usage.sse", wantObs{mode: ModeSSE, chunks: 9, events: 12, finish: "stop", done: true,
		usage: Usage{PromptTokens: 19, CompletionTokens: 10, Has: true, HasCached: true}}},
	{"openai_responses_stream.sse", wantObs{mode: ModeSSE, chunks: 8, events: 16, finish: "completed",
		usage: Usage{PromptTokens: 37, CompletionTokens: 11, Has: true, HasCached: true}}},
	{"openai_chat.json", wantObs{mode: ModeJSON, chunks: 1, events: 1, finish: "stop",
		usage: Usage{PromptTokens: 1117, CompletionTokens: 46, CachedTokens: 1024, Has: true, HasCached: true}}},
	{"openai_responses.json", wantObs{mode: ModeJSON, chunks: 1, events: 1, finish: "completed",
		usage: Usage{PromptTokens: 36, CompletionTokens: 87, Has: true, HasCached: true}}},

	// SGLang.
	{"sglang_chat_stream_usage.sse", wantObs{mode: ModeSSE, chunks: 6, events: 9, finish: "stop", done: true,
		usage: Usage{PromptTokens: 30, CompletionTokens: 7, CachedTokens: 16, Has: true, HasCached: true}}},
	{"sglang_chat.json", wantObs{mode: ModeJSON, chunks: 1, events: 1, finish: "stop",
		usage: Usage{PromptTokens: 30, CompletionTokens: 7, Has: true}}},

	// SSE framing: CRLF, comments, id/retry, multi-line data, an empty data line, a named
	// error event.
	{"edge_framing.sse", wantObs{mode: ModeSSE, chunks: 2, events: 4, finish: "stop", done: true, errSeen: true,
		errMsg: "upstream overloaded", status: 503}},
}

func readTranscript(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// observe feeds pieces, all at time now, to a fresh observer.
func observe(now int64, pieces ...[]byte) Observation {
	var o Observer
	o.Reset(ModeAuto, 0)
	for _, p := range pieces {
		o.Feed(p, now)
	}
	return *o.Result()
}

func checkObs(t *testing.T, got *Observation, w wantObs) {
	t.Helper()
	if got.Mode != w.mode {
		t.Errorf("mode = %d, want %d", got.Mode, w.mode)
	}
	if got.Chunks != w.chunks {
		t.Errorf("chunks = %d, want %d", got.Chunks, w.chunks)
	}
	if got.Events != w.events {
		t.Errorf("events = %d, want %d", got.Events, w.events)
	}
	if string(got.FinishReason()) != w.finish {
		t.Errorf("finish = %q, want %q", got.FinishReason(), w.finish)
	}
	if got.Done != w.done {
		t.Errorf("done = %v, want %v", got.Done, w.done)
	}
	if got.Usage != w.usage {
		t.Errorf("usage = %+v, want %+v", got.Usage, w.usage)
	}
	if got.Err.Seen != w.errSeen {
		t.Errorf("error seen = %v, want %v", got.Err.Seen, w.errSeen)
	}
	if !bytes.HasPrefix(got.Err.Message(), []byte(w.errMsg)) {
		t.Errorf("error message = %q, want prefix %q", got.Err.Message(), w.errMsg)
	}
	if string(got.Err.Type()) != w.errType {
		t.Errorf("error type = %q, want %q", got.Err.Type(), w.errType)
	}
	if got.Err.Status() != w.status {
		t.Errorf("error status = %d, want %d", got.Err.Status(), w.status)
	}
	if got.Malformed != 0 || got.Truncated != 0 {
		t.Errorf("malformed = %d, truncated = %d, want 0", got.Malformed, got.Truncated)
	}
}

func TestObserverTranscripts(t *testing.T) {
	for _, tc := range transcripts {
		t.Run(tc.file, func(t *testing.T) {
			b := readTranscript(t, tc.file)
			whole := observe(1, b)
			checkObs(t, &whole, tc.want)
			if whole.Bytes != int64(len(b)) {
				t.Errorf("bytes = %d, want %d", whole.Bytes, len(b))
			}
			if got := observe(1, b[:0], b); got != whole {
				t.Errorf("an empty first piece changed the observation")
			}
		})
	}
}

// TestObserverSplitInvariance feeds every transcript split at every byte (and in three
// pieces at random points, and byte by byte): the observation must not change.
func TestObserverSplitInvariance(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range transcripts {
		t.Run(tc.file, func(t *testing.T) {
			b := readTranscript(t, tc.file)
			whole := observe(1, b)
			step := 1
			if testing.Short() || raceEnabled {
				step = 1 + len(b)/500
			}
			for k := 0; k <= len(b); k += step {
				if got := observe(1, b[:k], b[k:]); got != whole {
					t.Fatalf("split at %d of %d: %+v\nwant %+v", k, len(b), got, whole)
				}
			}
			for range 200 {
				i := rng.IntN(len(b) + 1)
				j := i + rng.IntN(len(b)-i+1)
				if got := observe(1, b[:i], b[i:j], b[j:]); got != whole {
					t.Fatalf("split at %d and %d: %+v\nwant %+v", i, j, got, whole)
				}
			}
			var o Observer
			o.Reset(ModeAuto, 0)
			for k := range b {
				o.Feed(b[k:k+1], 1)
			}
			if *o.Result() != whole {
				t.Fatalf("byte by byte: %+v\nwant %+v", *o.Result(), whole)
			}
		})
	}
}

// TestObserverLineEndings rewrites each SSE transcript's line endings to LF, CRLF and CR:
// every form gives the same observation (bytes aside).
func TestObserverLineEndings(t *testing.T) {
	for _, tc := range transcripts {
		if !strings.HasSuffix(tc.file, ".sse") {
			continue
		}
		t.Run(tc.file, func(t *testing.T) {
			lf := bytes.ReplaceAll(readTranscript(t, tc.file), []byte("\r\n"), []byte("\n"))
			want := observe(1, lf)
			for _, nl := range []string{"\r\n", "\r"} {
				b := bytes.ReplaceAll(lf, []byte("\n"), []byte(nl))
				got := observe(1, b)
				got.Bytes = want.Bytes
				if got != want {
					t.Errorf("line ending %q: %+v\nwant %+v", nl, got, want)
				}
				// A CR ending one piece and the LF starting the next are one line ending.
				if nl == "\r\n" {
					for k := 0; k+1 < len(b); k++ {
						if b[k] == '\r' {
							got := observe(1, b[:k+1], b[k+1:])
							got.Bytes = want.Bytes
							if got != want {
								t.Fatalf("split inside CRLF at %d: %+v", k, got)
							}
						}
					}
				}
			}
		})
	}
}

type recSink struct{ vals []float64 }

func (s *recSink) Observe(v float64) { s.vals = append(s.vals, v) }

// splitEvents cuts an SSE payload after each blank line.
func splitEvents(b []byte) [][]byte {
	var out [][]byte
	for len(b) > 0 {
		k := bytes.Index(b, []byte("\n\n"))
		if k < 0 {
			return append(out, b)
		}
		out = append(out, b[:k+2])
		b = b[k+2:]
	}
	return out
}

// TestObserverTiming feeds each event of a stream at its own time: TTFT is the time of the
// first content chunk, and the sink gets one gap per later content chunk.
func TestObserverTiming(t *testing.T) {
	for _, tc := range transcripts {
		if !strings.HasSuffix(tc.file, ".sse") || strings.Contains(tc.file, "edge") {
			continue
		}
		t.Run(tc.file, func(t *testing.T) {
			events := splitEvents(readTranscript(t, tc.file))
			sink := &recSink{}
			o := Observer{ITL: sink}
			const start = 5_000
			o.Reset(ModeSSE, start)
			// Event k arrives at start + 1000·(k+1)² ns, so gaps differ.
			firstContent, lastContent := int64(-1), int64(0)
			for k, ev := range events {
				now := int64(start + 1000*(k+1)*(k+1))
				before := o.Result().Chunks
				o.Feed(ev, now)
				if o.Result().Chunks > before {
					if firstContent < 0 {
						firstContent = now
					}
					lastContent = now
				}
			}
			r := o.Result()
			if r.Chunks != tc.want.chunks {
				t.Fatalf("chunks = %d, want %d", r.Chunks, tc.want.chunks)
			}
			ttft, ok := r.TTFT()
			if !ok || ttft != firstContent-start {
				t.Errorf("TTFT = %d, %v; want %d", ttft, ok, firstContent-start)
			}
			if len(sink.vals) != r.Chunks-1 {
				t.Errorf("sink got %d gaps, want %d", len(sink.vals), r.Chunks-1)
			}
			if r.ITLSum != lastContent-firstContent {
				t.Errorf("ITL sum = %d, want %d", r.ITLSum, lastContent-firstContent)
			}
			sum := 0.0
			for _, v := range sink.vals {
				sum += v
			}
			if d := sum*1e9 - float64(r.ITLSum); d > 1 || d < -1 {
				t.Errorf("sink sum = %gs, ITL sum = %dns", sum, r.ITLSum)
			}
			// Reset keeps the sink and clears the rest.
			o.Reset(ModeAuto, 0)
			if o.ITL != sink || *o.Result() != (Observation{}) {
				t.Errorf("Reset: sink kept = %v, result = %+v", o.ITL == sink, *o.Result())
			}
		})
	}
}

func TestObserverCases(t *testing.T) {
	long := strings.Repeat("x", 300)
	cases := []struct {
		name  string
		mode  Mode
		in    string
		check func(t *testing.T, r *Observation)
	}{
		{"huge event is observed in fixed memory", ModeAuto,
			`data: {"choices":[{"delta":{"content":"` + strings.Repeat("é", 1<<20) + `"},"finish_reason":"stop"}]}` + "\n\n",
			func(t *testing.T, r *Observation) {
				if r.Chunks != 1 || string(r.FinishReason()) != "stop" || r.Malformed != 0 {
					t.Errorf("%+v", r)
				}
			}},
		{"long error message is cut and counted", ModeAuto,
			`{"error":{"message":"` + long + `","type":"X","code":500}}`,
			func(t *testing.T, r *Observation) {
				if !r.Err.Seen || len(r.Err.Message()) != 256 || r.Truncated != 1 || r.Err.Status() != 500 {
					t.Errorf("seen=%v len=%d truncated=%d status=%d", r.Err.Seen, len(r.Err.Message()), r.Truncated, r.Err.Status())
				}
			}},
		{"data lines join with a newline, which ends a number", ModeSSE,
			"data: {\"usage\":{\"prompt_tokens\":12\ndata: 3}}\n\ndata: {\"usage\":{\"completion_tokens\":4\ndata: }}\n\n",
			func(t *testing.T, r *Observation) {
				// "12\n3" is two numbers, not 123: the first event is malformed. The second
				// splits a valid object between lines.
				if r.Usage.PromptTokens == 123 || r.Malformed != 1 || r.Events != 2 || r.Usage.CompletionTokens != 4 {
					t.Errorf("%+v", r)
				}
			}},
		{"string error", ModeJSON, `{"error":"Request failed","error_type":"overloaded"}`,
			func(t *testing.T, r *Observation) {
				if !r.Err.Seen || string(r.Err.Message()) != "Request failed" {
					t.Errorf("%+v", r.Err)
				}
			}},
		{"null error is no error", ModeJSON, `{"error":null,"choices":[{"message":{"content":"hi"}}]}`,
			func(t *testing.T, r *Observation) {
				if r.Err.Seen || r.Chunks != 1 {
					t.Errorf("%+v", r)
				}
			}},
		{"responses error event", ModeSSE,
			"event: error\ndata: {\"type\":\"error\",\"code\":\"rate_limit_exceeded\",\"message\":\"Slow down\",\"param\":null,\"sequence_number\":3}\n\n",
			func(t *testing.T, r *Observation) {
				if !r.Err.Seen || string(r.Err.Code()) != "rate_limit_exceeded" || string(r.Err.Message()) != "Slow down" || r.Err.Status() != 0 {
					t.Errorf("%+v", r.Err)
				}
			}},
		{"escaped quotes and backslashes in content", ModeSSE,
			"data: {\"choices\":[{\"delta\":{\"content\":\"\\\"\\\\\"},\"finish_reason\":\"st\\u006fp\"}]}\n\n",
			func(t *testing.T, r *Observation) {
				if r.Chunks != 1 || string(r.FinishReason()) != `st\u006fp` || r.Malformed != 0 {
					t.Errorf("%+v", r)
				}
			}},
		{"empty and null content are not tokens", ModeSSE,
			"data: {\"choices\":[{\"delta\":{\"content\":\"\",\"reasoning_content\":null,\"tool_calls\":[]}}]}\n\n" +
				"data: {\"choices\":[{\"delta\":{\"content\":null,\"tool_calls\":null}}]}\n\n",
			func(t *testing.T, r *Observation) {
				if r.Chunks != 0 || r.Events != 2 {
					t.Errorf("%+v", r)
				}
			}},
		{"keys elsewhere do not count", ModeSSE,
			"data: {\"content\":\"x\",\"x\":{\"choices\":[{\"delta\":{\"content\":\"y\"}}]},\"usage\":{\"x\":{\"prompt_tokens\":5}}}\n\n",
			func(t *testing.T, r *Observation) {
				if r.Chunks != 0 || r.Usage.Has {
					t.Errorf("%+v", r)
				}
			}},
		{"malformed events are counted", ModeSSE,
			"data: {\"choices\":[\n\ndata: not json\n\ndata: {} {}\n\ndata: {\"a\":1}\n\n",
			func(t *testing.T, r *Observation) {
				if r.Malformed != 3 || r.Events != 4 {
					t.Errorf("malformed=%d events=%d", r.Malformed, r.Events)
				}
			}},
		{"usage null and continuous usage", ModeSSE,
			"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"prompt_tokens_details\":null}}\n\n" +
				"data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}],\"usage\":null}\n\n" +
				"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":null}}}\n\n",
			func(t *testing.T, r *Observation) {
				if r.Usage != (Usage{PromptTokens: 3, CompletionTokens: 2, Has: true}) || r.Chunks != 2 {
					t.Errorf("%+v", r.Usage)
				}
			}},
		{"deep nesting past the tracked depth", ModeSSE,
			"data: {\"x\":" + strings.Repeat("[", 100) + strings.Repeat("]", 100) + ",\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
			func(t *testing.T, r *Observation) {
				if r.Chunks != 1 || r.Malformed != 0 {
					t.Errorf("%+v", r)
				}
			}},
		{"second choice carries the content", ModeSSE,
			"data: {\"choices\":[{\"index\":0,\"delta\":{}},{\"index\":1,\"delta\":{\"content\":\"z\"},\"finish_reason\":\"length\"}]}\n\n",
			func(t *testing.T, r *Observation) {
				if r.Chunks != 1 || string(r.FinishReason()) != "length" {
					t.Errorf("%+v", r)
				}
			}},
		{"whitespace before a JSON body", ModeAuto, "\n  \r\n{\"choices\":[{\"text\":\"a\"}]}\n",
			func(t *testing.T, r *Observation) {
				if r.Mode != ModeJSON || r.Chunks != 1 || r.Events != 1 {
					t.Errorf("%+v", r)
				}
			}},
		{"event without trailing blank line is not dispatched", ModeSSE,
			"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n",
			func(t *testing.T, r *Observation) {
				if r.Chunks != 0 || r.Events != 0 {
					t.Errorf("%+v", r)
				}
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var o Observer
			o.Reset(tc.mode, 0)
			o.Feed([]byte(tc.in), 7)
			tc.check(t, o.Result())
			// The same input split at every 97th byte observes the same.
			var o2 Observer
			o2.Reset(tc.mode, 0)
			in := []byte(tc.in)
			for k := 0; k < len(in); k += 97 {
				o2.Feed(in[k:min(k+97, len(in))], 7)
			}
			if *o2.Result() != *o.Result() {
				t.Errorf("split feeding differs: %+v\nwant %+v", *o2.Result(), *o.Result())
			}
		})
	}
}

// stream500 builds a vLLM-format chat stream of n content chunks with a usage chunk.
func stream500(n int) []byte {
	var b []byte
	for k := range n {
		b = append(b, `data: {"id":"chatcmpl-9c1f0b6a2e7d4e0f8a3b5c6d7e8f9a0b","object":"chat.completion.chunk","created":1764000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" word`...)
		b = strconv.AppendInt(b, int64(k), 10)
		b = append(b, `"},"logprobs":null,"finish_reason":null}]}`+"\n\n"...)
	}
	b = append(b, `data: {"id":"chatcmpl-9c1f0b6a2e7d4e0f8a3b5c6d7e8f9a0b","object":"chat.completion.chunk","created":1764000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[],"usage":{"prompt_tokens":8000,"total_tokens":8500,"completion_tokens":500,"prompt_tokens_details":{"cached_tokens":4096}}}`+"\n\ndata: [DONE]\n\n"...)
	return b
}

type nopSink struct{ n int }

func (s *nopSink) Observe(float64) { s.n++ }

func TestObserverAllocs(t *testing.T) {
	b := stream500(500)
	sink := &nopSink{}
	o := Observer{ITL: sink}
	allocs := testing.AllocsPerRun(20, func() {
		o.Reset(ModeAuto, 0)
		for k := 0; k < len(b); k += 1400 { // TCP-segment-sized pieces
			o.Feed(b[k:min(k+1400, len(b))], int64(k))
		}
	})
	if allocs != 0 {
		t.Errorf("Feed allocates %v times per stream, want 0", allocs)
	}
	if r := o.Result(); r.Chunks != 500 || r.Usage.CachedTokens != 4096 || !r.Done {
		t.Errorf("%+v", r)
	}
}

func BenchmarkObserve(b *testing.B) {
	for _, size := range []struct {
		name  string
		piece int
	}{{"500chunks/1400B", 1400}, {"500chunks/16KiB", 16 << 10}, {"500chunks/event", 0}} {
		b.Run(size.name, func(b *testing.B) {
			s := stream500(500)
			var pieces [][]byte
			if size.piece == 0 {
				pieces = splitEvents(s)
			} else {
				for k := 0; k < len(s); k += size.piece {
					pieces = append(pieces, s[k:min(k+size.piece, len(s))])
				}
			}
			o := Observer{ITL: &nopSink{}}
			b.SetBytes(int64(len(s)))
			b.ReportAllocs()
			for b.Loop() {
				o.Reset(ModeSSE, 0)
				for k, p := range pieces {
					o.Feed(p, int64(k))
				}
			}
			if o.Result().Chunks != 500 {
				b.Fatal(o.Result().Chunks)
			}
		})
	}
}

// chatBody is a typical non-streamed chat completion, the size an engine sends for a short
// answer: the proxy observes one per request on its hottest path.
const chatBody = `{"id":"chatcmpl-bench0001","object":"chat.completion","created":1700000000,"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"Rivers carve stones slowly, one grain at a time."},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":31,"completion_tokens":12,"total_tokens":43,"prompt_tokens_details":{"cached_tokens":16}}}`

func BenchmarkObserveJSON(b *testing.B) {
	body := []byte(chatBody)
	o := Observer{ITL: &nopSink{}}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		o.Reset(ModeAuto, 0)
		o.Feed(body, 1)
	}
	if r := o.Result(); r.Chunks != 1 || r.Usage.CachedTokens != 16 || string(r.FinishReason()) != "stop" {
		b.Fatalf("%+v", r)
	}
}
