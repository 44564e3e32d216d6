// Package tokenizer turns OpenAI chat requests into the token ids an engine will see. The proxy
// (dataplane) and the simulated engine (engines/sim) both run it, so that they agree on every
// request's ids and therefore on its block hashes (engines/blockhash).
//
// It has two halves:
//
//   - Tokenizers (New): byte-level BPE over the built-in tiktoken vocabularies "o200k_harmony"
//     (gpt-oss: o200k_base plus the harmony special tokens such as <|start|> = 200006),
//     "o200k_base" and "cl100k_base", or over a HuggingFace tokenizer.json (gpt-oss, Qwen2/2.5/3,
//     Llama 3, DeepSeek: model type BPE with a ByteLevel pre-tokenizer). Special and added tokens
//     written in the text are encoded as their ids, as vLLM does for rendered chat prompts. The
//     pre-tokenizer regexes of o200k, cl100k/Llama 3 and Qwen2 are implemented by hand (other
//     patterns run on regexp2), and BPE runs over a rank map with a lock-free cache of short
//     pieces, so AppendEncode into a reused slice does not allocate.
//   - Chat templates (NewTemplate): Go ports of the gpt-oss harmony, Qwen3 ChatML and Llama 3
//     templates for the hot path, and a Jinja engine (github.com/ardanlabs/jinja) for any
//     HuggingFace chat_template from a tokenizer_config.json or .jinja file.
//
// ForModel picks defaults by model name, and Codec joins a tokenizer and a template into the
// EncodeChat / EncodePrompt pipeline.
//
// Correctness is pinned by golden files under testdata/, written once by
// hack/tokenizer-fixtures from independent implementations (js-tiktoken, transformers.js-based
// tokenizers, @huggingface/jinja) over the real model files; see README.md.
//
// Every Tokenizer, Template and Codec is immutable after construction and safe for concurrent
// use. Built-in tokenizers are built once per process on first use (about 0.3 s for o200k).
package tokenizer
