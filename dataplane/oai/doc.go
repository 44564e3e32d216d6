// Package oai is the edge proxy's view of the OpenAI API: a request parser that reads every
// body once to route it, and a response observer that measures every response as it streams
// back. Both run per request on the hot path and allocate nothing once warmed up.
//
// # Parsing requests
//
// Parser.Parse reads a body posted to /v1/chat/completions, /v1/completions, /v1/embeddings
// or /v1/responses (Kind) into a reused Request: the model, messages (or prompt, input and
// instructions), stream and stream_options.include_usage, output limits, sampling fields the
// router looks at, chat template switches, cache_salt, kv_transfer_params, vLLM's top-level
// priority and Dynamo's nvext (agent_hints, session_id and cache_control). Unknown fields are
// skipped.
//
// The proxy tokenizes the text it reads and must see exactly what the engine sees, so the
// scanner reproduces what vLLM and SGLang get from FastAPI: Python's json.loads (strict mode)
// followed by pydantic validation in lax mode.
//
//   - Strings are fully unescaped: \" \\ \/ \b \f \n \r \t and \uXXXX with surrogate pairs.
//     Other escapes, raw control characters and malformed \u escapes are syntax errors.
//   - The body must be UTF-8 (a leading byte order mark is skipped, as Python's utf-8-sig
//     does). Python decodes the whole body before parsing and answers 400 on invalid UTF-8;
//     so does Parse. Python's decoder also lets UTF-8-encoded surrogates through; Parse
//     refuses them too, since no tokenizer can encode them.
//   - An unpaired surrogate escape (\ud800) is valid JSON to Python, which keeps it in the
//     string; the engine then fails to tokenize it. Parse refuses it with a 400 naming the
//     field when it is in text Parse reads, and accepts it anywhere else (unknown fields), as
//     the engine would.
//   - NaN, Infinity and -Infinity are accepted as numbers; numbers otherwise follow JSON's
//     grammar (no leading zeros, no bare '.', no bare exponent).
//   - Duplicate keys: the last one wins, including over an earlier value's error.
//   - Nesting deeper than MaxDepth (1024) is refused; Python gives up earlier (about 990).
//   - Integer and boolean fields take pydantic's lax forms: 5, 5.0, 1e3, "5", " 1_000 ",
//     true for integers; true, 1, "yes", "on", "t", … for booleans. null means absent.
//
// Byte slices in a Request point into the body (text without escapes, raw JSON such as tools
// or kv_transfer_params) or into the Request's own buffer (unescaped or joined text): they
// are read-only and valid until the next Parse into the same Request, and only while the
// body is unchanged. Neither Parser nor Request is safe for concurrent use; the proxy keeps
// one of each per connection.
//
// Errors are *Error values wrapping ErrInvalidJSON (the body is not JSON to Python) or
// ErrInvalidRequest (a field is missing, mistyped or out of range). Each carries the OpenAI
// param, a client-facing message and code; AppendJSON writes the
// {"error":{"message","type","param","code"}} body to answer with Status() (400). When a
// body has both a syntax error and a field error, the syntax error is reported, as Python
// would fail before validation.
//
// AppendWithField and AppendWithRawField copy a body with one top-level member added before
// its closing brace, so the proxy can forward, say, a translated "priority" without
// re-encoding anything else; Python keeps the last of duplicate keys, so the added member
// overrides one already present.
//
// # Agent hints and priority
//
// Hints follow Dynamo: nvext.agent_hints.priority is an integer where higher is more urgent;
// latency_sensitivity is Dynamo's older float hint (how many seconds earlier the request
// counts as having arrived in the router queue), an alias on the same scale; osl is the
// expected output length in tokens; speculative_prefill asks for the next turn's prefix to be
// warmed. Request.Priority resolves them: agent_hints.priority if present, else
// latency_sensitivity rounded half away from zero, else the negated top-level vLLM priority
// (vLLM runs lower values first), else 0. The proxy forwards priority to vLLM negated.
//
// # Observing responses
//
// An Observer is fed the response payload in whatever pieces the socket delivers, with the
// time each arrived. It reads server-sent event streams (data: lines, [DONE], comments, named
// events, multi-line data, LF, CRLF or CR line endings) or a plain JSON body, from vLLM,
// SGLang, the OpenAI API (Chat Completions, Completions and the Responses API's named
// events) and kvrelay's simulated engine. It reports the time of the first content-bearing
// chunk (one whose choices carry non-empty delta content, reasoning_content or reasoning,
// completion text, or tool call deltas; a Responses API *.delta event), gaps between
// content chunks (to a Sink such as a Prometheus histogram), chunk counts, the finish
// reason, usage (prompt, completion and cached tokens), an error object, and whether [DONE]
// arrived.
//
// The observer never buffers a payload: a resumable tokenizer follows the SSE framing and
// the JSON structure byte by byte, keeping only the few short values it reports in fixed
// arrays, so an Observer occupies about 1.3 KiB whatever the size of an event or body, and
// the result does not depend on where the payload was split.
package oai
