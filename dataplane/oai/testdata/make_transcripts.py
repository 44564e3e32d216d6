"""Writes the engine transcripts under dataplane/oai/testdata that cannot be captured here.

vLLM and SGLang need a GPU, and the OpenAI API a key, so their responses are rebuilt with the
serializers those servers use: pydantic's model_dump_json (compact) for chunks, json.dumps
(", " and ": " separators) for vLLM's streaming error events, and the shapes of the OpenAI API
reference. kvrelay's simulated engine is captured for real by `go test -run TestCaptureSim
-update`. Run from this folder: python3 make_transcripts.py
"""
import json
def sse(name, events, crlf=False):
    nl = "\r\n" if crlf else "\n"
    with open(name, "w", newline="") as f:
        for e in events:
            if isinstance(e, tuple):  # (event name, data)
                f.write("event: " + e[0] + nl)
                e = e[1]
            f.write("data: " + (e if isinstance(e, str) else json.dumps(e, separators=(",", ":"), ensure_ascii=False)) + nl + nl)

# ---- vLLM (pydantic model_dump_json(exclude_unset=True): compact; errors via json.dumps) ----
vid = "chatcmpl-9c1f0b6a2e7d4e0f8a3b5c6d7e8f9a0b"
def vchunk(delta, fin=None, stop=False, model="meta-llama/Llama-3.1-8B-Instruct"):
    ch = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin}
    if stop: ch["stop_reason"] = None
    return {"id": vid, "object": "chat.completion.chunk", "created": 1764000000, "model": model, "choices": [ch]}
words = ["Hello", "!", " How", " can", " I", " help", " you", " today", "?"]
ev = [vchunk({"role": "assistant", "content": ""})] + [vchunk({"content": w}) for w in words] + [vchunk({"content": ""}, "stop", True), "[DONE]"]
sse("vllm_chat_stream.sse", ev)
usage = {"id": vid, "object": "chat.completion.chunk", "created": 1764000000, "model": "meta-llama/Llama-3.1-8B-Instruct", "choices": [],
         "usage": {"prompt_tokens": 42, "total_tokens": 52, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 32}}}
sse("vllm_chat_stream_usage.sse", ev[:-1] + [usage, "[DONE]"])

# reasoning parser (deepseek_r1): reasoning_content deltas, then content
rmodel = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
ev = [vchunk({"role": "assistant", "content": ""}, model=rmodel)]
ev += [vchunk({"reasoning_content": w}, model=rmodel) for w in ["Okay", ",", " the", " user", " greets", " me", ".\n"]]
ev += [vchunk({"content": w}, model=rmodel) for w in ["\n\n", "Hi", " there", "!"]]
ev += [vchunk({"content": ""}, "stop", True, model=rmodel)]
ev += [{"id": vid, "object": "chat.completion.chunk", "created": 1764000000, "model": rmodel, "choices": [],
        "usage": {"prompt_tokens": 9, "total_tokens": 21, "completion_tokens": 12}}, "[DONE]"]
sse("vllm_chat_reasoning.sse", ev)

# newer vLLM names the field "reasoning"
ev = [vchunk({"role": "assistant", "content": ""}, model="openai/gpt-oss-20b")]
ev += [vchunk({"reasoning": w}, model="openai/gpt-oss-20b") for w in ["User", " says", " hi", "."]]
ev += [vchunk({"content": w}, model="openai/gpt-oss-20b") for w in ["Hello", "!"]]
ev += [vchunk({}, "stop", True, model="openai/gpt-oss-20b"), "[DONE]"]
sse("vllm_chat_reasoning_field.sse", ev)

# tool calls (hermes parser)
tid = "chatcmpl-tool-4b2f8e1c9d0a4f6e8b7c5d3a1e2f0b9c"
ev = [vchunk({"role": "assistant", "content": ""}, model="Qwen/Qwen2.5-7B-Instruct"),
      vchunk({"tool_calls": [{"id": tid, "type": "function", "index": 0, "function": {"name": "get_weather"}}]}, model="Qwen/Qwen2.5-7B-Instruct")]
for a in ['{"city": "', 'Paris', '", "unit": "', 'celsius', '"}']:
    ev.append(vchunk({"tool_calls": [{"index": 0, "function": {"arguments": a}}]}, model="Qwen/Qwen2.5-7B-Instruct"))
ev += [vchunk({"content": ""}, "tool_calls", True, model="Qwen/Qwen2.5-7B-Instruct"), "[DONE]"]
sse("vllm_chat_tool_calls.sse", ev)

# mid-stream error: serving_chat yields create_streaming_error_response (json.dumps) then [DONE]
ev = [vchunk({"role": "assistant", "content": ""})] + [vchunk({"content": w}) for w in ["The", " answer"]]
ev.append(json.dumps({"error": {"object": "error", "message": "The decoder prompt (length 9000) is longer than the maximum model length of 8192. Make sure that `max_model_len` is no smaller than the number of text tokens.", "type": "BadRequestError", "param": None, "code": 400}}))
ev.append("[DONE]")
sse("vllm_chat_error.sse", ev)

cid = "cmpl-7a8b9c0d1e2f4a5b8c6d7e8f9a0b1c2d"
def cchunk(text, fin=None, stop=False):
    ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin}
    if stop: ch["stop_reason"] = None
    return {"id": cid, "object": "text_completion", "created": 1764000000, "model": "meta-llama/Llama-3.1-8B", "choices": [ch]}
ev = [cchunk(w) for w in [" Paris", ".", " It", " is", " the"]] + [cchunk(" capital", "length", True)]
sse("vllm_completions_stream.sse", ev + ["[DONE]"])
sse("vllm_completions_stream_usage.sse", ev + [{"id": cid, "object": "text_completion", "created": 1764000000, "model": "meta-llama/Llama-3.1-8B", "choices": [],
    "usage": {"prompt_tokens": 7, "total_tokens": 13, "completion_tokens": 6}}, "[DONE]"])

# ---- OpenAI API (as documented: usage:null on every chunk with include_usage) ----
oid = "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT"
def ochunk(delta, fin=None, choices=True, usage=None):
    d = {"id": oid, "object": "chat.completion.chunk", "created": 1741570283, "model": "gpt-4o-2024-08-06", "service_tier": "default", "system_fingerprint": "fp_fc9f1d7035"}
    d["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin}] if choices else []
    d["usage"] = usage
    d["obfuscation"] = "xQ3v"
    return d
ev = [ochunk({"role": "assistant", "content": "", "refusal": None})] + [ochunk({"content": w}) for w in ["Hello", "!", " How", " can", " I", " assist", " you", " today", "?"]]
ev += [ochunk({}, "stop"), ochunk(None, choices=False, usage={"prompt_tokens": 19, "completion_tokens": 10, "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}), "[DONE]"]
sse("openai_chat_stream_usage.sse", ev)

# Responses API stream: named events, no [DONE]
rid = "resp_67c9fdcecf488190bdd9a0409de3a1ec07b8b0ad4e5eb654"
mid = "msg_67c9fdcf37fc8190ba82116e33fb28c507b8b0ad4e5eb654"
def resp(status, output, usage):
    return {"id": rid, "object": "response", "created_at": 1741290958, "status": status, "error": None, "incomplete_details": None,
            "instructions": "You are a helpful assistant.", "max_output_tokens": None, "model": "gpt-4.1-2025-04-14", "output": output,
            "parallel_tool_calls": True, "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": True,
            "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_p": 1.0,
            "truncation": "disabled", "usage": usage, "user": None, "metadata": {}}
seq = iter(range(100))
ev = [("response.created", {"type": "response.created", "sequence_number": next(seq), "response": resp("in_progress", [], None)}),
      ("response.in_progress", {"type": "response.in_progress", "sequence_number": next(seq), "response": resp("in_progress", [], None)}),
      ("response.output_item.added", {"type": "response.output_item.added", "sequence_number": next(seq), "output_index": 0, "item": {"id": mid, "type": "message", "status": "in_progress", "role": "assistant", "content": []}}),
      ("response.content_part.added", {"type": "response.content_part.added", "sequence_number": next(seq), "item_id": mid, "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})]
words = ["Hi", " there", "!", " How", " can", " I", " help", "?"]
for w in words:
    ev.append(("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": next(seq), "item_id": mid, "output_index": 0, "content_index": 0, "delta": w, "logprobs": []}))
text = "".join(words)
item = {"id": mid, "type": "message", "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}
ev += [("response.output_text.done", {"type": "response.output_text.done", "sequence_number": next(seq), "item_id": mid, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
       ("response.content_part.done", {"type": "response.content_part.done", "sequence_number": next(seq), "item_id": mid, "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}}),
       ("response.output_item.done", {"type": "response.output_item.done", "sequence_number": next(seq), "output_index": 0, "item": item}),
       ("response.completed", {"type": "response.completed", "sequence_number": next(seq), "response": resp("completed", [item],
           {"input_tokens": 37, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 11, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 48})})]
sse("openai_responses_stream.sse", ev)

# ---- SGLang (model_dump_json without exclusions: nulls everywhere, usage on each chunk) ----
sid = "3f6a1c2b9e8d4f7a8b0c1d2e3f4a5b6c"
def schunk(delta, fin=None, matched=None, choices=True, usage=None):
    d = {"id": sid, "object": "chat.completion.chunk", "created": 1764000000, "model": "Qwen/Qwen2.5-7B-Instruct"}
    full = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}
    full.update(delta)
    d["choices"] = [{"index": 0, "delta": full, "logprobs": None, "finish_reason": fin, "matched_stop": matched}] if choices else []
    d["usage"] = usage
    return d
ev = [schunk({"role": "assistant", "content": ""})] + [schunk({"content": w}) for w in ["Hello", "!", " I", "'m", " Qwen", "."]]
ev += [schunk({}, "stop", 151645), schunk({}, choices=False, usage={"prompt_tokens": 30, "total_tokens": 37, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 16}, "reasoning_tokens": 0}), "[DONE]"]
sse("sglang_chat_stream_usage.sse", ev)

# ---- synthetic framing edge cases (CRLF, comments, multi-line data, id/retry, named error) ----
nl = "\r\n"
with open("edge_framing.sse", "w", newline="") as f:
    f.write(": keep-alive" + nl + nl)
    f.write("retry: 1000" + nl + "id: 1" + nl + 'data:{"choices":[{"index":0,"delta":{"content":"a"}}]}' + nl + nl)
    f.write("event: message" + nl + 'data: {"choices":[{"index":0,"delta":' + nl + 'data: {"content":"b\\n\\"c\\""}}]}' + nl + nl)
    f.write("data" + nl + nl)  # an empty data line: nothing to dispatch
    f.write('data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}' + nl + nl)
    f.write("event: error" + nl + 'data: {"message":"upstream overloaded","code":503}' + nl + nl)
    f.write("data: [DONE]" + nl + nl)

# ---- JSON bodies ----
def jdump(name, obj, pretty=False):
    with open(name, "w") as f:
        f.write(json.dumps(obj, separators=(",", ":")) if not pretty else json.dumps(obj, indent=2))
jdump("vllm_chat.json", {"id": "chatcmpl-5d2c1b0a9f8e4d7c6b5a4f3e2d1c0b9a", "object": "chat.completion", "created": 1764000000, "model": "meta-llama/Llama-3.1-8B-Instruct",
    "choices": [{"index": 0, "message": {"role": "assistant", "reasoning_content": None, "content": "Hello! How can I help you today?", "tool_calls": []}, "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
    "usage": {"prompt_tokens": 42, "total_tokens": 52, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 32}}, "prompt_logprobs": None, "kv_transfer_params": None})
jdump("vllm_chat_tool_calls.json", {"id": "chatcmpl-5d2c1b0a9f8e4d7c6b5a4f3e2d1c0b9b", "object": "chat.completion", "created": 1764000000, "model": "Qwen/Qwen2.5-7B-Instruct",
    "choices": [{"index": 0, "message": {"role": "assistant", "reasoning_content": None, "content": None, "tool_calls": [{"id": tid, "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]}, "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}],
    "usage": {"prompt_tokens": 180, "total_tokens": 203, "completion_tokens": 23, "prompt_tokens_details": None}, "prompt_logprobs": None})
# older vLLM: flat ErrorResponse; newer: {"error": {...}}
with open("vllm_error_flat.json", "w") as f:
    f.write(json.dumps({"object": "error", "message": "The model `gpt-4` does not exist.", "type": "NotFoundError", "param": None, "code": 404}))
with open("vllm_error.json", "w") as f:
    f.write(json.dumps({"error": {"message": "max_tokens must be at least 1, got 0.", "type": "BadRequestError", "param": None, "code": 400}}))
jdump("vllm_embeddings.json", {"id": "embd-0a1b2c3d4e5f", "object": "list", "created": 1764000000, "model": "intfloat/e5-mistral-7b-instruct",
    "data": [{"index": 0, "object": "embedding", "embedding": [0.0123, -0.0456, 0.0789, -1.2e-05, 0.5]}], "usage": {"prompt_tokens": 8, "total_tokens": 8, "completion_tokens": 0, "prompt_tokens_details": None}})
jdump("openai_chat.json", {"id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG", "object": "chat.completion", "created": 1741570283, "model": "gpt-4o-2024-08-06",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "The image shows a wooden boardwalk.", "refusal": None, "annotations": []}, "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1117, "completion_tokens": 46, "total_tokens": 1163, "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
              "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}},
    "service_tier": "default", "system_fingerprint": "fp_fc9f1d7035"}, pretty=True)
jdump("openai_responses.json", resp("completed", [item], {"input_tokens": 36, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 87, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 123}), pretty=True)
jdump("sglang_chat.json", {"id": "8b1f5a2c3d4e4f6a9b0c1d2e3f4a5b6c", "object": "chat.completion", "created": 1764000000, "model": "Qwen/Qwen2.5-7B-Instruct",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! I'm Qwen.", "reasoning_content": None, "tool_calls": None}, "logprobs": None, "finish_reason": "stop", "matched_stop": 151645}],
    "usage": {"prompt_tokens": 30, "total_tokens": 37, "completion_tokens": 7, "prompt_tokens_details": None, "reasoning_tokens": 0}, "metadata": {"weight_version": "default"}})
