#!/usr/bin/env bash
# What a proxy adds to every streamed chunk, side by side in one run: an SSE engine
# (hack/bench-stream, one chunk a millisecond, each stamped with its write time) streamed
#   direct   from the engine itself,
#   nginx    through nginx proxy_pass (keep-alive upstream, proxy_buffering off),
#   kvrelay  through `kvrelay proxy`,
# in alternating rounds; prints per target the p50, p90 and p99 time from the engine's write
# to the client's read, and what each proxy adds over direct within the same round (medians
# across rounds). Engine, proxies and client are separate processes, unpinned.
#
# Usage: hack/bench-stream.sh   (root for apt-get if nginx is missing; needs go)
# Environment: ROUNDS [5], REQUESTS [20] streams per target and round, STREAMS [4] at once,
#   CHUNKS [100] per stream, GAP [1ms], WORKERS [1] nginx workers = kvrelay event loops,
#   EBPF [off] kvrelay's --ebpf
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5} REQUESTS=${REQUESTS:-20} STREAMS=${STREAMS:-4} CHUNKS=${CHUNKS:-100} GAP=${GAP:-1ms} WORKERS=${WORKERS:-1}
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || {
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null
}
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
W=$(mktemp -d "${TMPDIR:-/tmp}/bench-stream.XXXXXX")
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$W"' EXIT
go build -o bin/kvrelay ./cmd/kvrelay
go build -o "$W/bench-stream" ./hack/bench-stream
die() { echo "bench-stream: $*" >&2; exit 1; }
source hack/lib.sh # freeport
wait_up() { for _ in $(seq 100); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done; die "$1 not up"; }
E=$(freeport) N=$(freeport) K=$(freeport)
"$W/bench-stream" -serve 127.0.0.1:$E -chunks "$CHUNKS" -gap "$GAP" >"$W/engine.log" 2>&1 &
PIDS+=($!)
mkdir -p "$W/nginx/tmp"
cat >"$W/nginx/nginx.conf" <<NG
worker_processes $WORKERS; daemon off; pid $W/nginx/nginx.pid; error_log $W/nginx/error.log warn;
events { worker_connections 4096; }
http { access_log off; client_body_temp_path $W/nginx/tmp; proxy_temp_path $W/nginx/tmp;
  upstream engine { server 127.0.0.1:$E; keepalive 64; }
  server { listen 127.0.0.1:$N;
    location / { proxy_pass http://engine; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; } } }
NG
"$NGINX" -p "$W/nginx" -e "$W/nginx/error.log" -c "$W/nginx/nginx.conf" &
PIDS+=($!)
bin/kvrelay proxy --listen 127.0.0.1:$K --upstream "id=w1,url=http://127.0.0.1:$E,model=bench-model" \
  --event-loops "$WORKERS" --ebpf "${EBPF:-off}" >"$W/kvrelay.log" 2>&1 &
PIDS+=($!)
wait_up http://127.0.0.1:$E/health
wait_up http://127.0.0.1:$N/v1/models
wait_up http://127.0.0.1:$K/health
echo "bench-stream: $CHUNKS chunks every $GAP, $REQUESTS streams x $ROUNDS rounds per target, $STREAMS at once; load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
"$W/bench-stream" -rounds "$ROUNDS" -requests "$REQUESTS" -streams "$STREAMS" \
  -target direct=http://127.0.0.1:$E -target nginx=http://127.0.0.1:$N -target kvrelay=http://127.0.0.1:$K
