#!/usr/bin/env bash
# kvrelay's proxy overhead against nginx, side by side in one run.
#
# A fixed-response backend (one nginx worker answering every POST with hack/bench-proxy/
# response.json) stands in for an engine, so that the proxies in front of it dominate the cost.
# wrk POSTs a small chat completion (hack/bench-proxy/post.lua) on keep-alive connections to
#   direct   the backend itself (the floor),
#   nginx    nginx proxy_pass with a keep-alive upstream pool (the reference),
#   kvrelay  `kvrelay proxy --policy kv` (parses, tokenizes, scores and routes every request),
# alternating targets within each round (the order rotates from round to round) at two loads:
# CONNS connections (throughput) and LIGHT_CONNS connections (latency). For each target it prints
# the median req/s, p50 and p99 across rounds and the CPU time its server process (the backend
# for direct, the proxy otherwise) spent per request; then kvrelay/nginx for throughput and CPU
# per request, and the p50 and p99 each proxy adds over direct, in microseconds. Ratios and
# differences are taken per round, between runs of the same round, and their median is shown.
#
# Fairness: nginx gets worker_processes WORKERS; kvrelay gets --event-loops WORKERS and
# GOMAXPROCS=WORKERS (nginx runs no helper threads, so kvrelay's runtime gets no extra CPUs
# either; with a single loop the proxy itself raises GOMAXPROCS to 2, which adds no CPU, only a
# P for the Go scheduler: see hack/bench-proxy/README.md). Whichever proxy is under test runs on the same CPU set (PROXY_CPUS); wrk and the
# backend run on LOAD_CPUS. Only one proxy carries load at a time; the idle one sleeps in epoll.
# Default layout: with 4+ CPUs, the proxy gets the upper half and wrk + backend the lower half.
# With fewer (a 2-vCPU VM), everything shares CPU 0 with one worker each: there, waking a
# process on the other vCPU costs more than the work itself, and other load on the machine
# gathers on whichever CPU nothing is pinned to, so a split layout mostly measures that. On one
# shared CPU req/s reflects wrk + backend + proxy together, which dilutes the proxies' difference:
# the CPU-per-request column is the proxies' own cost, and the steadier figure on a busy box.
#
# Usage: hack/bench-proxy.sh      (root for apt-get if nginx, wrk or curl is missing; needs go)
# Environment (defaults in brackets):
#   ROUNDS [5]  DURATION [4] seconds per wrk run  CONNS [32]  LIGHT_CONNS [8]  THREADS [1] (wrk)
#   PACED ["16p1"]: a third load, NpMS: N connections that each wait MS milliseconds after an
#     answer before sending the next request (wrk's delay hook), so the CPU is not saturated:
#     the added latency at moderate load, without the queueing of closed-loop runs ("" skips it;
#     CONNS and LIGHT_CONNS connections send back to back and keep the shared CPU busy)
#   PROXY_CPUS, LOAD_CPUS: taskset CPU lists (see above); "" leaves that side unpinned
#   WORKERS [CPUs in PROXY_CPUS; 1 if unpinned]
#   EBPF [off]: kvrelay's --ebpf. Off compares proxy with proxy; as root the default of
#     `kvrelay proxy` (auto) also attaches the eBPF probes, whose own cost hack/bench-ebpf.sh
#     measures: EBPF=auto includes it here
#   KEEP=1 keeps the work directory (configs, logs, every raw wrk output)
#   BASE=REV adds a fourth target, "base": kvrelay built at git revision REV (from a temporary
#     worktree), run like kvrelay on the same CPUs, so that a change to the proxy is measured
#     against what it replaces in the same rounds; the report adds kvrelay/base per load
# Exits non-zero if any target fails: a non-2xx response, a socket error or timeout, a run with
# no requests, a server that exits, or a reply that differs from the backend's.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
HERE=$ROOT/hack/bench-proxy

ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-4}
DURATION=${DURATION%s}
CONNS=${CONNS:-32}
LIGHT_CONNS=${LIGHT_CONNS:-8}
PACED=${PACED-16p1}
THREADS=${THREADS:-1}
NCPU=$(nproc)
if ((NCPU >= 4)); then
  PROXY_CPUS=${PROXY_CPUS-$((NCPU / 2))-$((NCPU - 1))}
  LOAD_CPUS=${LOAD_CPUS-0-$((NCPU / 2 - 1))}
else
  PROXY_CPUS=${PROXY_CPUS-0}
  LOAD_CPUS=${LOAD_CPUS-0}
fi

# cpucount LIST: how many CPUs a taskset list such as "0", "1-3" or "0,2" names
cpucount() {
  local n=0 part a b
  IFS=, read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    if [[ $part == *-* ]]; then a=${part%-*} b=${part#*-}; n=$((n + b - a + 1)); else n=$((n + 1)); fi
  done
  echo "$n"
}
if [ -n "$PROXY_CPUS" ]; then WORKERS=${WORKERS:-$(cpucount "$PROXY_CPUS")}; else WORKERS=${WORKERS:-1}; fi

log() { echo "bench-proxy [${SECONDS}s]: $*" >&2; }
die() { log "$*"; exit 1; }

# ---- tools -----------------------------------------------------------------------------------
need=()
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx)
command -v wrk >/dev/null || need+=(wrk)
command -v curl >/dev/null || need+=(curl)
command -v taskset >/dev/null || need+=(util-linux)
if ((${#need[@]})); then
  log "installing ${need[*]} from Debian"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
command -v go >/dev/null || die "go is not on PATH"

# ---- processes ---------------------------------------------------------------------------------
W=$(mktemp -d "${TMPDIR:-/tmp}/bench-proxy.XXXXXX")
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
  drop_build "$W/kvrelay-base"
  if [ "${KEEP:-0}" = 1 ]; then log "kept $W"; else rm -rf "$W"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# pinned CPUS CMD...: CMD under taskset when CPUS is set
pinned() {
  local cpus=$1
  shift
  if [ -n "$cpus" ]; then taskset -c "$cpus" "$@"; else "$@"; fi
}

# start NAME CPUS CMD...: CMD in the background, logging to $W/NAME.log; sets LASTPID to CMD's
# own pid (taskset execs CMD), so that the cleanup stops the server and not a wrapper
start() {
  local name=$1 cpus=$2
  shift 2
  if [ -n "$cpus" ]; then
    taskset -c "$cpus" "$@" >"$W/$name.log" 2>&1 &
  else
    "$@" >"$W/$name.log" 2>&1 &
  fi
  LASTPID=$!
  PIDS+=("$LASTPID")
}

source "$ROOT/hack/lib.sh" # freeport, build_at

# wait_up URL PID NAME: wait until URL answers 200 while PID lives
wait_up() {
  local url=$1 pid=$2 name=$3
  for _ in $(seq 150); do
    curl -fsS -o /dev/null "$url" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || die "$name exited at start: $(tail -n 5 "$W/$name.log")"
    sleep 0.1
  done
  die "$name did not answer $url within 15s: $(tail -n 5 "$W/$name.log")"
}

# render TEMPLATE OUT KEY=VALUE...: replace each @KEY@ in TEMPLATE with VALUE
render() {
  local text kv
  text=$(<"$1")
  shopt -u patsub_replacement 2>/dev/null || true
  for kv in "${@:3}"; do text=${text//@${kv%%=*}@/${kv#*=}}; done
  printf '%s\n' "$text" >"$2"
}

# ---- build -----------------------------------------------------------------------------------
log "building bin/kvrelay"
go build -o bin/kvrelay ./cmd/kvrelay || die "go build ./cmd/kvrelay failed"
KVRELAY=$ROOT/bin/kvrelay
if [ -n "${BASE:-}" ]; then
  log "building kvrelay at $BASE"
  build_at "$BASE" ./cmd/kvrelay "$W/kvrelay-base"
fi

RESPONSE=$(<"$HERE/response.json")
[[ $RESPONSE != *"'"* ]] || die "response.json must not contain a single quote"
BODY=$(sed -n "s/^wrk.body = '\(.*\)'$/\1/p" "$HERE/post.lua")
[ -n "$BODY" ] || die "could not read the request body from post.lua"

# ---- backend and proxies -----------------------------------------------------------------------
BACKEND_PORT=$(freeport)
mkdir -p "$W/backend/tmp" "$W/nginx/tmp"
render "$HERE/backend.conf.in" "$W/backend/nginx.conf" DIR="$W/backend" PORT="$BACKEND_PORT" RESPONSE="$RESPONSE"
start backend "$LOAD_CPUS" "$NGINX" -p "$W/backend" -e "$W/backend/error.log" -c "$W/backend/nginx.conf"
BACKEND_PID=$LASTPID
wait_up "http://127.0.0.1:$BACKEND_PORT/health" "$BACKEND_PID" backend

NGINX_PORT=$(freeport)
render "$HERE/nginx-proxy.conf.in" "$W/nginx/nginx.conf" DIR="$W/nginx" PORT="$NGINX_PORT" \
  BACKEND_PORT="$BACKEND_PORT" WORKERS="$WORKERS"
start nginx "$PROXY_CPUS" "$NGINX" -p "$W/nginx" -e "$W/nginx/error.log" -c "$W/nginx/nginx.conf"
NGINX_PID=$LASTPID
wait_up "http://127.0.0.1:$NGINX_PORT/health" "$NGINX_PID" nginx

KVRELAY_PORT=$(freeport)
KVRELAY_CMD=(env GOMAXPROCS="$WORKERS" "$KVRELAY" proxy --listen "127.0.0.1:$KVRELAY_PORT" --policy kv --event-loops "$WORKERS" --ebpf "${EBPF:-off}"
  --upstream "id=w1,url=http://127.0.0.1:$BACKEND_PORT,model=bench-model")
start kvrelay "$PROXY_CPUS" "${KVRELAY_CMD[@]}"
KVRELAY_PID=$LASTPID
wait_up "http://127.0.0.1:$KVRELAY_PORT/health" "$KVRELAY_PID" kvrelay

TARGETS=(direct nginx kvrelay)
declare -A PORT=([direct]=$BACKEND_PORT [nginx]=$NGINX_PORT [kvrelay]=$KVRELAY_PORT)
declare -A PID=([direct]=$BACKEND_PID [nginx]=$NGINX_PID [kvrelay]=$KVRELAY_PID)
if [ -n "${BASE:-}" ]; then
  BASE_PORT=$(freeport)
  BASE_CMD=("${KVRELAY_CMD[@]}")
  for i in "${!BASE_CMD[@]}"; do
    [ "${BASE_CMD[$i]}" != "$KVRELAY" ] || BASE_CMD[$i]=$W/kvrelay-base
    [ "${BASE_CMD[$i]}" != "127.0.0.1:$KVRELAY_PORT" ] || BASE_CMD[$i]=127.0.0.1:$BASE_PORT
  done
  start base "$PROXY_CPUS" "${BASE_CMD[@]}"
  wait_up "http://127.0.0.1:$BASE_PORT/health" "$LASTPID" base
  TARGETS+=(base)
  PORT[base]=$BASE_PORT
  PID[base]=$LASTPID
fi
declare -A FAILED=()

fail_target() { # TARGET MESSAGE
  FAILED[$1]=1
  log "FAIL $1: $2"
}

# check TARGET WHEN: one chat completion through TARGET must come back 200 with the backend's
# body, byte for byte
check() {
  local t=$1 when=$2 out code body
  out=$W/check-$t-$when
  code=$(curl -sS -o "$out.body" -D "$out.headers" -w '%{http_code}' -X POST \
    -H 'Content-Type: application/json' --data-binary "$BODY" --max-time 10 \
    "http://127.0.0.1:${PORT[$t]}/v1/chat/completions" 2>"$out.err") || code="curl: $(<"$out.err")"
  body=$(cat "$out.body" 2>/dev/null || true)
  if [ "$code" != 200 ] || [ "$body" != "$RESPONSE" ]; then
    fail_target "$t" "$when check: POST /v1/chat/completions $BODY -> $code
$(cat "$out.headers" "$out.body" 2>/dev/null)"
  fi
}
for t in "${TARGETS[@]}"; do check "$t" before; done

# ---- measurement -------------------------------------------------------------------------------
# wrkrun TARGET LOAD SECONDS OUT: one wrk run, raw output in OUT. LOAD is a number of
# connections sending back to back, or NpMS (N connections pausing MS ms between requests).
wrkrun() {
  local t=$1 c=$2 d=$3 out=$4 threads=$THREADS script=$HERE/post.lua
  if [[ $c =~ ^([0-9]+)p([0-9]+)$ ]]; then
    c=${BASH_REMATCH[1]}
    script=$W/paced-${BASH_REMATCH[2]}.lua
    [ -e "$script" ] || { cat "$HERE/post.lua"; echo "function delay() return ${BASH_REMATCH[2]} end"; } >"$script"
  fi
  ((threads > c)) && threads=$c
  pinned "$LOAD_CPUS" wrk -t"$threads" -c"$c" -d"${d}s" --timeout 5s --latency -s "$script" \
    "http://127.0.0.1:${PORT[$t]}/v1/chat/completions" >"$out" 2>&1 || true
}

# cputicks PID: CPU time (user + system, in clock ticks) used so far by PID and its children
# (nginx's workers are children of its master; kvrelay is one process)
CLK_TCK=$(getconf CLK_TCK)
cputicks() {
  local f line rest total=0
  local -a x
  for f in /proc/[0-9]*/stat; do
    { read -r line <"$f"; } 2>/dev/null || continue # a process that just exited
    rest=${line##*) }
    read -ra x <<<"$rest"
    # after the command name: state ppid pgrp ... utime (12th) stime (13th)
    if [ "${f:6:-5}" = "$1" ] || [ "${x[1]}" = "$1" ]; then total=$((total + x[11] + x[12])); fi
  done
  echo "$total"
}

# parse OUT: "reqs_per_s p50_us p99_us requests errors" from wrk's report, where errors counts
# non-2xx responses and socket errors (connect, read, write, timeout)
parse() {
  awk '
    function us(v) {
      if (v ~ /us$/) return v + 0
      if (v ~ /ms$/) return v * 1000
      if (v ~ /m$/) return v * 60e6
      if (v ~ /s$/) return v * 1e6
      return v + 0
    }
    /^ +50% / { p50 = us($2) }
    /^ +99% / { p99 = us($2) }
    /requests in / { n = $1 }
    /^Requests\/sec:/ { rps = $2 }
    /Non-2xx or 3xx responses:/ { e += $NF }
    /Socket errors:/ { for (i = 3; i <= NF; i += 2) e += $(i + 1) + 0 }
    END { printf "%.0f %.0f %.0f %d %d\n", rps, p50, p99, n, e }' "$1"
}

LOADS=("$CONNS" "$LIGHT_CONNS")
[ -z "$PACED" ] || LOADS+=("$PACED")
log "layout: proxy CPUs [${PROXY_CPUS:-unpinned}], wrk+backend CPUs [${LOAD_CPUS:-unpinned}], $WORKERS worker(s)/event loop(s) each, $NCPU CPUs online"
log "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
if awk -v n="$NCPU" '{ exit !($1 > n / 2) }' /proc/loadavg; then
  log "WARNING: the machine is busy with other work; expect noisy figures"
fi
log "warming up"
for t in "${TARGETS[@]}"; do wrkrun "$t" "$CONNS" 1 "$W/warmup-$t.txt"; done

RES=$W/results.txt # round load target req/s p50_us p99_us cpu_ns_per_request errors
: >"$RES"
for ((r = 1; r <= ROUNDS; r++)); do
  for c in "${LOADS[@]}"; do
    line="round $r/$ROUNDS c=$c:"
    for ((i = 0; i < ${#TARGETS[@]}; i++)); do
      t=${TARGETS[$(((i + r - 1) % ${#TARGETS[@]}))]}
      [ -n "${FAILED[$t]:-}" ] && continue
      out=$W/wrk-r$r-c$c-$t.txt
      cpu0=$(cputicks "${PID[$t]}")
      wrkrun "$t" "$c" "$DURATION" "$out"
      cpu1=$(cputicks "${PID[$t]}")
      read -r rps p50 p99 n errs < <(parse "$out")
      cpu=0 # nanoseconds per request
      ((n > 0)) && cpu=$(((cpu1 - cpu0) * 1000000000 / CLK_TCK / n))
      echo "$r $c $t $rps $p50 $p99 $cpu $errs" >>"$RES"
      line+=" $t ${rps}/s p50=${p50}us p99=${p99}us cpu=$((cpu / 1000))us/req"
      if ! kill -0 "${PID[$t]}" 2>/dev/null; then
        fail_target "$t" "exited during round $r c=$c; last log lines:
$(tail -n 20 "$W/$t.log")"
      elif ((errs > 0 || n == 0)); then
        fail_target "$t" "round $r c=$c: $n requests, $errs errors; wrk said:
$(cat "$out")"
      fi
    done
    log "$line"
  done
done
for t in "${TARGETS[@]}"; do [ -n "${FAILED[$t]:-}" ] || check "$t" after; done
log "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
for f in kvrelay.log nginx.log nginx/error.log backend.log backend/error.log; do
  if [ -s "$W/$f" ] && grep -qiE 'error|panic|warn|alert|crit|emerg' "$W/$f"; then
    log "$f says:"
    grep -iE 'error|panic|warn|alert|crit|emerg' "$W/$f" | tail -n 20 >&2
  fi
done

# ---- report ------------------------------------------------------------------------------------
echo
echo "kvrelay proxy --policy kv vs nginx proxy_pass, in front of a fixed-response backend"
echo "  $ROUNDS rounds x ${DURATION}s per target and load, targets alternating; medians across rounds"
echo "  each proxy: $WORKERS worker(s)/event loop(s), GOMAXPROCS=$WORKERS, pinned to CPUs [${PROXY_CPUS:-unpinned}];" \
  "wrk ($THREADS thread) + backend (1 worker) pinned to CPUs [${LOAD_CPUS:-unpinned}]; $NCPU CPUs online"
echo "  load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) (other work on the machine skews every figure)"
awk -v loads="${LOADS[*]}" -v targets="${TARGETS[*]}" -v failed="${!FAILED[*]}" '
  function median(arr, k,    i, j, tmp, m) {
    if (k == 0) return "nan"
    for (i = 2; i <= k; i++) { tmp = arr[i]; for (j = i - 1; j >= 1 && arr[j] > tmp; j--) arr[j + 1] = arr[j]; arr[j + 1] = tmp }
    m = int((k + 1) / 2)
    return (k % 2) ? arr[m] : (arr[m] + arr[m + 1]) / 2
  }
  # med: median over rounds of field f (1 req/s, 2 p50, 3 p99, 4 CPU us/req) of target t at load c
  function med(c, t, f,    r, k, a, x) {
    k = 0; for (r = 1; r <= R; r++) if ((r, c, t) in v) { split(v[r, c, t], x, " "); a[++k] = x[f] + 0 }
    return median(a, k)
  }
  function range(c, t, f,    r, lo, hi, s, x) {
    lo = ""; for (r = 1; r <= R; r++) if ((r, c, t) in v) { split(v[r, c, t], x, " "); s = x[f] + 0; if (lo == "" || s < lo) lo = s; if (s > hi) hi = s }
    return lo == "" ? "-" : sprintf("%d-%d", lo, hi)
  }
  # paired: median over the rounds where both ran of a/b or a-b on field f
  function paired(c, ta, tb, f, op,    r, k, a, xa, xb) {
    k = 0
    for (r = 1; r <= R; r++) if ((r, c, ta) in v && (r, c, tb) in v) {
      split(v[r, c, ta], xa, " "); split(v[r, c, tb], xb, " ")
      if (op == "/") { if (xb[f] > 0) a[++k] = xa[f] / xb[f] } else a[++k] = xa[f] - xb[f]
    }
    return median(a, k)
  }
  function fmt(f, x) { return x == "nan" ? "-" : sprintf(f, x) }
  { v[$1, $2, $3] = $4 " " $5 " " $6 " " $7 / 1000; if ($1 > R) R = $1; err[$2, $3] += $8 }
  END {
    nl = split(loads, L, " ")
    nt = split(targets, T, " ")
    printf "\n%-6s %-8s %9s %13s %8s %8s %11s %7s\n", "conns", "target", "req/s", "req/s range", "p50 us", "p99 us", "CPU us/req", "errors"
    for (i = 1; i <= nl; i++) for (j = 1; j <= nt; j++) {
      c = L[i]; t = T[j]
      printf "%-6s %-8s %9s %13s %8s %8s %11s %7d\n", c, t, fmt("%.0f", med(c, t, 1)), range(c, t, 1),
        fmt("%.0f", med(c, t, 2)), fmt("%.0f", med(c, t, 3)), fmt("%.1f", med(c, t, 4)), err[c, t]
    }
    printf "\n%-6s %-21s %-21s %-21s\n", "", "kvrelay/nginx", "p50 added over direct", "p99 added over direct"
    printf "%-6s %10s %10s %10s %10s %10s %10s\n", "conns", "req/s", "CPU/req", "kvrelay", "nginx", "kvrelay", "nginx"
    for (i = 1; i <= nl; i++) {
      c = L[i]
      printf "%-6s %10s %10s %10s %10s %10s %10s\n", c,
        fmt("%.2f", paired(c, "kvrelay", "nginx", 1, "/")), fmt("%.2f", paired(c, "kvrelay", "nginx", 4, "/")),
        fmt("%+.0f us", paired(c, "kvrelay", "direct", 2, "-")), fmt("%+.0f us", paired(c, "nginx", "direct", 2, "-")),
        fmt("%+.0f us", paired(c, "kvrelay", "direct", 3, "-")), fmt("%+.0f us", paired(c, "nginx", "direct", 3, "-"))
    }
    if (nt > 3) {
      printf "\n%-6s %-21s %-10s\n", "", "kvrelay/base", "p50 kvrelay - base"
      printf "%-6s %10s %10s\n", "conns", "req/s", "CPU/req"
      for (i = 1; i <= nl; i++) {
        c = L[i]
        printf "%-6s %10s %10s %10s\n", c, fmt("%.3f", paired(c, "kvrelay", "base", 1, "/")),
          fmt("%.3f", paired(c, "kvrelay", "base", 4, "/")), fmt("%+.0f us", paired(c, "kvrelay", "base", 2, "-"))
      }
    }
    if (failed != "") printf "\nFAILED: %s (details above)\n", failed
    else print "\nall targets answered every request with 200"
  }' "$RES"

((${#FAILED[@]} == 0))
