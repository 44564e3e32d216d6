// Package workload generates the requests that `kvrelay bench run` and `kvrelay bench compare`
// replay against an OpenAI endpoint: a Mooncake trace turned into text, shared-prefix groups,
// multi-turn chat and agent sessions with subagents. Everything is deterministic in a seed and
// needs no network.
//
// # Specs
//
// Parse takes a spec, a built-in name with optional key=value parameters or the path of a
// Mooncake JSONL trace, and returns a Workload: open-loop requests (Open, sorted by send time)
// and closed-loop sessions (Sessions). A Request carries everything the runner sends (chat
// messages or a text prompt, max_tokens, ignore_eos, nvext agent hints and session id) plus a
// Tag for per-class reporting; Request.Body is the reference encoding. Workload.Spec names the
// workload with every default filled in, for result files.
//
// # Sessions
//
// A Session is driven by the runner: Next("") gives the first request; after each answer,
// Next(answer) gives the next request, whose At is the think time to wait first, until ok is
// false. A session's requests depend only on its seed and the answers it is given, never on how
// sessions interleave, and distinct sessions may run on distinct goroutines. A request may
// Spawn further sessions (an agent's subagents): the runner starts each once the request is
// answered, hands it that answer, and resumes the spawning session when all have ended.
//
// # Text of exact token lengths
//
// All text is built from a vocabulary taken from the tokenizer: up to 8192 lowercase words w
// of 2 to 6 letters such that " "+w is a single token, checked to concatenate one token per
// word. With byte-level BPE and GPT-style pre-tokenization a space before a letter always
// starts a new pre-token, so a run of such words tokenizes to exactly one token per word and a
// block of them tokenizes the same whatever precedes it. Text that must tell blocks apart
// (Mooncake blocks, system prompts of different groups) begins with three words that spell
// its id, so distinct ids differ within three tokens.
//
// # Ideal hit rate
//
// Ideal (and IdealHitRate) compute the prefix-cache hit rate an unbounded cache shared by all
// engines would reach over the prompts and answers a run actually sent: the bound the measured
// hit rate is compared to.
//
// # Concurrency
//
// Parse and the generators are safe for concurrent use. A Workload's Open slice is read-only.
// A Session must be driven by one goroutine at a time. The Tokenizer given to Parse must be
// safe for concurrent use: agent sessions call it from the runner's goroutines to strip
// reasoning from answers.
package workload
