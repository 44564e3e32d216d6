-- wrk script for hack/bench-proxy.sh: every request is the same small, non-streaming OpenAI chat
-- completion, sent on keep-alive connections. kvrelay parses and tokenizes it and routes it by
-- model ("bench-model", the name its --upstream is given); nginx and the backend ignore the body.
-- The script also sends the body once through each target with curl, reading it from the
-- wrk.body line below: keep it on one line.
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"bench-model","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Give me one short sentence about rivers and stones."}],"max_tokens":16}'
