#!/usr/bin/env bash
# kvrelay's proxy against nginx as an operator would run both on one machine, unpinned: nginx
# proxy_pass with worker_processes auto (one worker per CPU) and a keep-alive upstream pool,
# `kvrelay proxy` with its defaults (GOMAXPROCS-1 event loops), in front of the same fixed-
# response backend (one nginx worker), wrk POSTing a small chat completion on 32 connections,
# 3 s per target, targets alternating within each round. Beside kvrelay as built from this
# checkout it runs the same binary with --event-loops LOOPS and, with BASE=REV, kvrelay built
# at REV, in the same rounds. It prints each target's median req/s and its ratio to nginx's,
# paired round by round (median [min-max]), and kvrelay ÷ base paired.
#
# hack/bench-proxy.sh is the controlled comparison (equal workers, pinned CPUs, CPU per
# request); this script is the default-against-default one, where a busy machine decides how
# much CPU each proxy gets.
#
# Usage: flock -o /tmp/kvrelay-bench.lock hack/bench-proxy-check.sh
# Environment: ROUNDS [7]  LOOPS [2]  BASE [none]  OUT [none: a file the report is also written to]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-7} LOOPS=${LOOPS:-2} BASE=${BASE:-} OUT=${OUT:-}
command -v nginx >/dev/null && command -v wrk >/dev/null || { echo "needs nginx and wrk (apt-get install nginx-light wrk)"; exit 1; }
W=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$W"; }
trap cleanup EXIT
start() { local name=$1; shift; "$@" >"$W/$name.log" 2>&1 & PIDS+=($!); }
wait_http() { for _ in $(seq 300); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done; echo "not up: $1"; exit 1; }
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }

go build -o "$W/kvrelay" ./cmd/kvrelay
if [ -n "$BASE" ]; then
  git worktree add -q --detach "$W/base" "$BASE"
  (cd "$W/base" && go build -o "$W/kvrelay-base" ./cmd/kvrelay)
  git worktree remove --force "$W/base"
fi
B=$(freeport) N=$(freeport) K=$(freeport) KL=$(freeport) KB=$(freeport)
mkdir -p "$W/be" "$W/px"
cat >"$W/be/nginx.conf" <<NG
worker_processes 1; daemon off; pid $W/be/nginx.pid; error_log $W/be/error.log;
events { worker_connections 4096; }
http { access_log off;
  server { listen 127.0.0.1:$B;
    location = /v1/models { default_type application/json; return 200 '{"object":"list","data":[{"id":"m","object":"model","owned_by":"bench"}]}'; }
    location = /health { return 200 'ok'; }
    location / { default_type application/json; return 200 '{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}'; } }
}
NG
cat >"$W/px/nginx.conf" <<NG
worker_processes auto; daemon off; pid $W/px/nginx.pid; error_log $W/px/error.log;
events { worker_connections 4096; }
http { access_log off;
  upstream be { server 127.0.0.1:$B; keepalive 128; }
  server { listen 127.0.0.1:$N; location /health { proxy_pass http://be; } location / { proxy_pass http://be; proxy_http_version 1.1; proxy_set_header Connection ""; } }
}
NG
start backend nginx -c "$W/be/nginx.conf"
start nginx nginx -c "$W/px/nginx.conf"
start kvrelay "$W/kvrelay" proxy --listen 127.0.0.1:$K --upstream http://127.0.0.1:$B --policy round-robin
start kvrelay-loops "$W/kvrelay" proxy --listen 127.0.0.1:$KL --upstream http://127.0.0.1:$B --policy round-robin --event-loops "$LOOPS"
ports=("$N" "$K" "$KL")
names=(nginx kvrelay "kvrelay --event-loops $LOOPS")
if [ -n "$BASE" ]; then
  start kvrelay-base "$W/kvrelay-base" proxy --listen 127.0.0.1:$KB --upstream http://127.0.0.1:$B --policy round-robin
  ports+=("$KB"); names+=("kvrelay at $BASE")
fi
wait_http "http://127.0.0.1:$B/health"
for p in "${ports[@]}"; do wait_http "http://127.0.0.1:$p/health"; done
cat >"$W/post.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Say ok."}]}'
LUA
rate() { wrk -t1 -c32 -d3s -s "$W/post.lua" "http://127.0.0.1:$1/v1/chat/completions" 2>/dev/null | awk '/Requests\/sec/ {r=$2} /Non-2xx/ {e=1} END {print (e ? -1 : r+0)}'; }
: >"$W/rates"
for r in $(seq "$ROUNDS"); do
  line=()
  for p in "${ports[@]}"; do line+=("$(rate "$p")"); done
  echo "${line[*]}" >>"$W/rates"
done
report=$(python3 - "$W/rates" "$(uname -r)" "$(nproc)" "$(git rev-parse --short HEAD)" "${names[@]}" <<'PY'
import statistics, sys
rows = [[float(x) for x in l.split()] for l in open(sys.argv[1])]
kernel, cpus, commit, names = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
if any(x < 0 for r in rows for x in r):
    print("a target answered non-2xx"); sys.exit(1)
def rng(v): return f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"
print(f"commit {commit}, {cpus} CPUs, Linux {kernel}, {len(rows)} rounds of 3 s per target, 32 connections")
for i, n in enumerate(names):
    col = [r[i] for r in rows]
    ratio = "" if i == 0 else f", ÷ nginx {rng([r[i] / r[0] for r in rows])}"
    print(f"{n}: {statistics.median(col):.0f} req/s [{min(col):.0f}-{max(col):.0f}]{ratio}")
if len(names) > 3:
    print(f"kvrelay ÷ {names[3][len('kvrelay at '):]}, paired: {rng([r[1] / r[3] for r in rows])}")
PY
)
echo "$report"
[ -z "$OUT" ] || echo "$report" >"$OUT"
