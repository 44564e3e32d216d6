#!/usr/bin/env bash
# The eBPF probes' cost and fidelity, on loopback (root: the probes need it).
#
#   hack/bench-ebpf.sh overhead   proxy throughput and p99 with every probe attached vs none
#   hack/bench-ebpf.sh fidelity   kernel-side request-to-first-byte vs the proxy's own TTFT
#
# overhead: a fixed-response nginx (hack/bench-proxy/backend.conf.in) stands in for an engine
# and `kvrelay proxy --policy kv --ebpf off` sits in front of it; wrk POSTs
# hack/bench-proxy/post.lua through the proxy on CONNS keep-alive connections. Each run starts
# a fresh proxy (so its upstream connections open after the probes attach and sock_ops follows
# them); in an "on" run hack/bench-ebpf (a separate process) attaches all five probes watching
# the backend and the proxy's PID first. Runs alternate on/off, the order flipping each round.
# It prints every run, the median req/s and p99 of each side, and the median of the per-round
# throughput ratios on/off. Everything runs on CPU PIN (default 0; "" unpinned), as
# hack/bench-proxy.sh does on a 2-vCPU machine.
#
# fidelity: `kvrelay up --ebpf on` (simulated workers at --speedup-ratio SPEEDUP) answers N
# sequential chat completions (half streamed); after each one the proxy's /metrics is read, and
# the growth of kvrelay_ebpf_first_byte_seconds_sum and kvrelay_proxy_time_to_first_token_
# seconds_sum (each by exactly one observation) gives the two values for that request. It
# prints the medians and the median absolute difference, per streaming mode.
#
# BASE=REV also builds the probes as they are at git revision REV (from a temporary worktree)
# and adds a third side, "base", to each round (order rotating): it prints the median per-round
# ratios on/off, base/off and on/base, so that a change to the probes is measured against
# what it replaces in one run, on the same drift of the machine.
#
# BPFSTATS=1 also turns on kernel.bpf_stats_enabled during the runs and prints the probes' own
# CPU time (run_time_ns / run_cnt per program, from bpftool); the accounting itself costs two
# clock reads per program run, so leave it off for the throughput comparison.
#
# Environment: ROUNDS [4] DURATION [3] seconds per run  CONNS [16]  PIN [0]  N [40]  SPEEDUP [1]
#   BPFSTATS [0]  BASE [unset]
#   PROBES: comma-separated probes to attach in the "on" runs (default all): tcp_rtt,
#     tcp_state, first_byte, listen_queue, runq_latency
#   SCOPE [dial]: the cgroup the socket probes attach to. The proxy starts in a cgroup v2 of
#     its own (as a container or a systemd service would put it) and "dial" attaches them to
#     a dial scope under it, into which the proxy is moved once it listens, as `kvrelay proxy`
#     does by default (--ebpf-cgroup dial): they run on its connections to the backend only;
#     "proxy" attaches them to the proxy's cgroup (--ebpf-cgroup own: on its client
#     connections too); "root" to the whole hierarchy, where they also run on every packet of
#     wrk and the backend. A BASE attacher that predates the dial scope attaches as "proxy".
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODE=${1:-overhead}
ROUNDS=${ROUNDS:-4}
DURATION=${DURATION:-3}
CONNS=${CONNS:-16}
PIN=${PIN-0}
N=${N:-40}
SPEEDUP=${SPEEDUP:-1}
BPFSTATS=${BPFSTATS:-0}
SCOPE=${SCOPE:-dial}
PROBES=${PROBES:-}
BASE=${BASE:-}
[ "$(id -u)" = 0 ] || { echo "bench-ebpf: needs root (the probes do)"; exit 1; }
W=$(mktemp -d /tmp/bench-ebpf.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  drop_build "$W/attach-base"
  rm -rf "$W"
}
trap cleanup EXIT
log() { echo "bench-ebpf: $*" >&2; }
die() { log "$*"; exit 1; }
pinned() { if [ -n "$PIN" ]; then taskset -c "$PIN" "$@"; else "$@"; fi; }
# bg CMD...: CMD in the background (pinned); LASTPID is CMD's own pid (taskset and env exec it)
bg() {
  if [ -n "$PIN" ]; then taskset -c "$PIN" "$@" & else "$@" & fi
  LASTPID=$!
  PIDS+=("$LASTPID")
}
source "$ROOT/hack/lib.sh" # freeport, build_at
wait_up() { # URL PID
  for _ in $(seq 200); do
    kill -0 "$2" 2>/dev/null || return 1
    curl -fsS -o /dev/null --max-time 1 "$1" 2>/dev/null && return 0
    sleep 0.05
  done
  return 1
}
stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }
# await_attacher PID WORD: wait (up to 10 s) until the attacher PID has printed WORD
await_attacher() {
  for _ in $(seq 500); do
    grep -q "$2" "$W/attach.out" 2>/dev/null && return 0
    kill -0 "$1" || die "attach failed: $(cat "$W/attach.err")"
    sleep 0.02
  done
  die "the attacher did not say $2"
}

go build -o "$W/kvrelay" ./cmd/kvrelay
go build -o "$W/attach" ./hack/bench-ebpf
if [ -n "$BASE" ]; then
  build_at "$BASE" ./hack/bench-ebpf "$W/attach-base"
fi

overhead() {
  local NGINX HERE=$ROOT/hack/bench-proxy
  NGINX=$(command -v nginx || echo /usr/sbin/nginx)
  [ -x "$NGINX" ] && command -v wrk >/dev/null || die "needs nginx and wrk (hack/bench-proxy.sh installs them)"
  local bport pport
  bport=$(freeport)
  mkdir -p "$W/backend/tmp"
  local resp
  resp=$(<"$HERE/response.json")
  sed -e "s|@DIR@|$W/backend|g" -e "s|@PORT@|$bport|g" -e "s|@RESPONSE@|$resp|g" "$HERE/backend.conf.in" >"$W/backend/nginx.conf"
  bg "$NGINX" -p "$W/backend" -e "$W/backend/error.log" -c "$W/backend/nginx.conf" >"$W/backend.log" 2>&1
  local npid=$LASTPID
  wait_up "http://127.0.0.1:$bport/health" "$npid" || die "backend did not start"
  local stats_was
  stats_was=$(sysctl -n kernel.bpf_stats_enabled 2>/dev/null || echo 0)
  if [ "$BPFSTATS" = 1 ]; then
    sysctl -qw kernel.bpf_stats_enabled=1 2>/dev/null || log "could not enable kernel.bpf_stats_enabled: no per-program CPU time"
  fi
  local cg="" cgroot
  cgroot=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/self/mounts)
  if [ "$SCOPE" = proxy ] || [ "$SCOPE" = dial ]; then
    [ -n "$cgroot" ] || die "no cgroup v2 mounted"
    cg=$cgroot/kvrelay-bench-$$
    mkdir -p "$cg"
  fi
  log "socket probes attach to cgroup ${cg:-$cgroot} (SCOPE=$SCOPE); probes: ${PROBES:-all}"
  printf '%-6s %-4s %10s %10s %9s\n' round ebpf req/s p99_ms requests
  for r in $(seq 1 "$ROUNDS"); do
    local order="off on"
    ((r % 2 == 0)) && order="on off"
    if [ -n "$BASE" ]; then
      case $((r % 3)) in 1) order="off on base" ;; 2) order="on base off" ;; 0) order="base off on" ;; esac
    fi
    for m in $order; do
      local apid="" bin=$W/attach dial=""
      [ "$m" != base ] || bin=$W/attach-base
      if [ "$SCOPE" = dial ] && "$bin" --help 2>&1 | grep -q -- -dial; then dial=--dial; fi
      rm -f "$W/pid"
      if [ "$m" != off ]; then
        "$bin" --target "127.0.0.1:$bport" --pid-file "$W/pid" ${cg:+--cgroup "$cg"} $dial ${PROBES:+--probes "$PROBES"} >"$W/attach.out" 2>"$W/attach.err" &
        apid=$!
        PIDS+=("$apid")
        await_attacher "$apid" attached
      fi
      pport=$(freeport)
      bg env GOMAXPROCS=1 CG="$cg" sh -c '[ -z "$CG" ] || echo $$ >"$CG/cgroup.procs"; exec "$@"' sh "$W/kvrelay" proxy --listen "127.0.0.1:$pport" --policy kv --event-loops 1 --ebpf off \
        --upstream "id=w1,url=http://127.0.0.1:$bport,model=bench-model" >"$W/proxy.log" 2>&1
      local ppid=$LASTPID
      wait_up "http://127.0.0.1:$pport/health" "$ppid" || die "proxy did not start: $(tail -n 3 "$W/proxy.log")"
      # The proxy listens: the attacher may move it into the dial scope now (and watch its run
      # queue); wrk starts once it has.
      echo "$ppid" >"$W/pid.tmp" && mv "$W/pid.tmp" "$W/pid"
      if [ -n "$apid" ] && [ -n "$dial" ]; then
        await_attacher "$apid" entered # (moved the proxy into the dial scope)
      fi
      pinned wrk -t1 -c"$CONNS" -d1s -s "$HERE/post.lua" "http://127.0.0.1:$pport" >/dev/null
      pinned wrk -t1 -c"$CONNS" -d"${DURATION}s" --timeout 5s --latency -s "$HERE/post.lua" "http://127.0.0.1:$pport" >"$W/wrk.txt"
      if [ -n "$apid" ] && [ "$BPFSTATS" = 1 ] && command -v bpftool >/dev/null; then
        # the probes' own CPU time (kernel.bpf_stats_enabled: run_time_ns and run_cnt per program)
        bpftool -j prog show | python3 -c '
import json, sys
ns = cnt = 0
per = {}
for p in json.load(sys.stdin):
    if p.get("name", "").startswith("kvrelay_"):
        ns += p.get("run_time_ns", 0); cnt += p.get("run_cnt", 0)
        a = per.setdefault(p["name"], [0, 0])
        a[0] += p.get("run_time_ns", 0); a[1] += p.get("run_cnt", 0)
print(ns, cnt)
for name, (pns, pc) in sorted(per.items()):
    print(f"  {name:<20} {pc:>9} runs {pns / max(pc, 1):>6.0f} ns each {pns / 1e6:>8.1f} ms", file=sys.stderr)' >"$W/bpfstats.txt" 2>"$W/bpfprogs.txt"
      fi
      stop "$ppid"
      if [ -n "$apid" ]; then
        stop "$apid"
        grep -E '_count' "$W/attach.err" | sed "s/^/  round $r probes: /" >"$W/probes.txt" || true
      fi
      python3 - "$W/wrk.txt" "$r" "$m" >>"$W/results" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
def ms(v, u): return float(v) * {"us": 1e-3, "ms": 1, "s": 1e3}[u]
p99 = ms(*re.search(r"99%\s+([\d.]+)(us|ms|s)", t).groups())
n = int(re.search(r"(\d+) requests in", t).group(1))
bad = re.search(r"Non-2xx or 3xx responses: (\d+)", t)
if bad: sys.exit("non-2xx responses: " + bad.group(1))
print(sys.argv[2], sys.argv[3], rps, p99, n)
PY
      tail -n 1 "$W/results" | awk '{ printf "%-6s %-4s %10.0f %10.3f %9d\n", $1, $2, $3, $4, $5 }'
      if [ -n "$apid" ]; then
        cat "$W/probes.txt"
        if [ -s "$W/bpfstats.txt" ]; then
          read -r bns bcnt <"$W/bpfstats.txt"
          echo "$bns $bcnt $((DURATION + 1))" >>"$W/bpfstats.all"
          awk -v ns="$bns" -v c="$bcnt" -v d="$((DURATION + 1))" 'BEGIN { printf "  round %s bpf: %d program runs, %.0f ns each, %.2f%% of one CPU over the run\n", "'"$r"'", c, c ? ns / c : 0, 100 * ns / (d * 1e9) }'
          cat "$W/bpfprogs.txt"
        fi
      fi
    done
  done
  python3 - "$W/results" <<'PY'
import statistics as st, sys
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for r, m, rps, p99, n in rows:
    by.setdefault(m, []).append((int(r), float(rps), float(p99)))
side = {m: dict((r, (a, b)) for r, a, b in v) for m, v in by.items()}
on, off = side["on"], side["off"]
ratio = st.median(on[r][0] / off[r][0] for r in on)
p99r = st.median(on[r][1] / off[r][1] for r in on)
print("median req/s  " + "  ".join(f"{m} {st.median(x[1] for x in by[m]):.0f}" for m in by))
print("median p99 ms " + "  ".join(f"{m} {st.median(x[2] for x in by[m]):.3f}" for m in by))
print(f"throughput on/off (median of per-round ratios) {ratio:.4f}  → {100*(1-ratio):+.2f}% loss;  p99 on/off {p99r:.3f}")
if "base" in side:
    base = side["base"]
    b = st.median(base[r][0] / off[r][0] for r in base)
    ob = st.median(on[r][0] / base[r][0] for r in on)
    print(f"throughput base/off {b:.4f}  → {100*(1-b):+.2f}% loss;  on/base {ob:.4f}")
PY
  if [ -s "$W/bpfstats.all" ]; then
    awk '{ ns += $1; c += $2; d += $3 } END { printf "probes CPU: %d runs, %.0f ns per run, %.2f%% of one CPU while attached (the bound on their throughput cost when the proxy, wrk and backend share that CPU)\n", c, ns / c, 100 * ns / (d * 1e9) }' "$W/bpfstats.all"
  fi
  sysctl -qw kernel.bpf_stats_enabled="$stats_was" 2>/dev/null || true
  if [ -n "$cg" ]; then
    stop "$npid"
    rmdir "$cg" 2>/dev/null || true
  fi
}

fidelity() {
  local base pport
  base=$(freeport 1)
  pport=$(freeport)
  "$W/kvrelay" up --ebpf on --workers 2 --speedup-ratio "$SPEEDUP" --proxy-listen "127.0.0.1:$pport" \
    --base-port "$base" --kv-events-base-port "$((base + 100))" --kv-events-replay-base-port "$((base + 200))" \
    --xds-listen "127.0.0.1:$(freeport)" --api-listen "127.0.0.1:$(freeport)" >"$W/up.log" 2>&1 &
  local upid=$!
  PIDS+=("$upid")
  wait_up "http://127.0.0.1:$pport/health" "$upid" || die "kvrelay up did not start: $(tail -n 5 "$W/up.log")"
  sleep 1
  python3 - "$pport" "$N" <<'PY'
import json, statistics as st, sys, time, urllib.request
port, n = sys.argv[1], int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
def scrape():
    out = {}
    for line in urllib.request.urlopen(base + "/metrics").read().decode().splitlines():
        if line.startswith("#"): continue
        name, _, v = line.rpartition(" ")
        for k in ("kvrelay_ebpf_first_byte_seconds_sum", "kvrelay_ebpf_first_byte_seconds_count",
                  "kvrelay_proxy_time_to_first_token_seconds_sum", "kvrelay_proxy_time_to_first_token_seconds_count"):
            if name.startswith(k):
                out[k] = out.get(k, 0) + float(v)
    return out
model = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
pairs = {False: [], True: []}
skipped = 0
for i in range(n):
    stream = i % 2 == 1
    before = scrape()
    body = {"model": model, "max_tokens": 16, "stream": stream,
            "messages": [{"role": "user", "content": f"request {i}: tell me about rivers and stones " * (1 + i % 5)}]}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    urllib.request.urlopen(req).read()
    time.sleep(0.05)
    after = scrape()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    if d.get("kvrelay_ebpf_first_byte_seconds_count") != 1 or d.get("kvrelay_proxy_time_to_first_token_seconds_count") != 1:
        skipped += 1
        continue
    pairs[stream].append((d["kvrelay_ebpf_first_byte_seconds_sum"], d["kvrelay_proxy_time_to_first_token_seconds_sum"]))
for stream, ps in pairs.items():
    if not ps: continue
    k = [a * 1e3 for a, _ in ps]; p = [b * 1e3 for _, b in ps]
    diff = [abs(a - b) for a, b in zip(k, p)]
    print(f"{'stream' if stream else 'non-stream'}: {len(ps)} requests  kernel first byte median {st.median(k):.3f} ms  "
          f"proxy TTFT median {st.median(p):.3f} ms  median |diff| {st.median(diff):.3f} ms  "
          f"median (proxy - kernel) {st.median(b - a for a, b in zip(k, p)):.3f} ms")
print(f"skipped {skipped} requests whose scrape did not see exactly one observation of each")
PY
}

case "$MODE" in
  overhead) overhead ;;
  fidelity) fidelity ;;
  *) die "usage: hack/bench-ebpf.sh overhead|fidelity" ;;
esac
