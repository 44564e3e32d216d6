#!/usr/bin/env bash
# Measures canary rollouts of routing policies (kvrelay ctl policy rollout) on simulated
# fleets of 8 workers under the agentic workload (sessions carry x-session-id, which the
# proxies split the arms by), with shortened steps (STEP, default 20 s, at least MIN_REQ
# requests per arm). One run, five measurements:
#
#   1  a bad candidate rolls back by itself: overlap_weight: 0 (the latency policy routing on
#      load alone) over the default latency policy, shadow first; the step it rolled back at,
#      time to the decision, each arm's TTFT p90 and hit rate, the reason
#   2  a good candidate promotes: the stable policy set to round-robin first, the candidate
#      policy: latency, shadow first; time to promotion and each arm's figures per step. The
#      stable round-robin runs with a session TTL of 1 ms: kvrelay binds a session to the
#      worker that served it under every policy that predicts no latency, so with its
#      default TTL (30 min) round-robin only places each session's first call and the rest
#      stick to its cache (a good policy on this workload, not a poor one). 2b is that case:
#      round-robin with the default TTL against the same candidate, whatever it decides.
#   3  a neutral candidate is not rolled back: session_ttl_ms one more than the stable one's
#      (the latency policy binds no session, so it routes the same), NEUTRAL_RUNS (10)
#      rollouts one after another on one fleet: false rollbacks and inconclusive steps
#   4  the shadow step predicts the canary: for 1, 2 and 2b, the shadow's disagreement and mean
#      counterfactual overlap (candidate vs stable picks' cached blocks) beside the canary's
#      hit rate and TTFT per arm; they must point the same way
#   6  a tail-bad candidate: policy: kv (cache affinity alone, which piles a hot prefix's
#      sessions onto one worker) over the latency policy, shadow first; as 1
#   7  fast abort: a candidate that fails its requests (busy_kv_fraction 0.0001, a percentage
#      typed as a fraction: every worker decoding anything is "busy", so its requests wait
#      in the queue until they time out, 2 s on this fleet's proxy), no shadow; the time
#      from the start to the rollback, and the candidate's requests that failed before it
#   5  faults, on a fleet run as separate processes (kvrelay sim, controlplane, proxy) with a
#      persistent --data-dir: (a) the control plane killed (SIGKILL) mid-step and restarted:
#      the proxy's split goes on meanwhile (kvrelay_proxy_policy_requests_total of the
#      candidate version grows) and the rollout resumes at its persisted step and finishes;
#      (b) the proxy killed mid-step and restarted: it gets the current assignment
#
#   hack/bench-rollout.sh
#
# Prints one summary line per measurement (also in $OUT/summary.txt), writes the per-step
# table to $OUT/results.md, every rollout's final status (ctl policy rollout status -o json)
# to $OUT/*.json and the processes' logs to $OUT/logs/. Holds /tmp/kvrelay-bench.lock
# (flock -o) for the whole run, as kvrelay's other benchmarks do. About 17 minutes on 2 CPUs.
#
# Settings (environment):
#   OUT [out/bench-rollout]   MEASURE ["1 1m 2 2b 3 6 7 5"] which measurements (4 comes with 1, 2,
#     2b; 1m is 1 under the Mooncake trace of hack/traces, replayed SPEEDUP times faster)
#   STEP [20s] step duration   MIN_REQ [40] least requests per arm and step
#   SHADOW [20s]   STEPS [25,50,100]   STEP_TIMEOUT [2m]   NEUTRAL_RUNS [10]
#   RATE [0.4] agentic sessions started per second of workload time (× SPEEDUP per second of
#     wall time; 0.4 gives 30-45 requests/s)   SPEEDUP [5] replay speedup and engine
#     --speedup-ratio   BLOCKS [16384] KV blocks per worker   WARMUP [15] seconds of traffic
#     before a rollout starts   CLIENT_ERRORS [0.005] share of the workload's calls sent with
#     max_tokens -1 (a 400: the client's error, which no arm may be judged on)
#   FAULT_STEP [30s] step duration of measurement 5 (room for the kills within a step)
#   CP_DOWN [10] seconds the control plane stays down in 5a
#   REPORT_ONLY=1 runs nothing and reports again from what is in $OUT
# TTFTs come from the proxies' per-arm histograms (buckets 5, 10, 20, 40, 80 ms, …; the
# quantiles are interpolated within a bucket), in wall time of engines sped up SPEEDUP times.
set -euo pipefail
LOCK=/tmp/kvrelay-bench.lock
if [ "${KVRELAY_BENCH_ROLLOUT_LOCKED:-}" != 1 ]; then
  flock -n "$LOCK" true 2>/dev/null || echo "bench-rollout: waiting for $LOCK (another benchmark runs)" >&2
  exec env KVRELAY_BENCH_ROLLOUT_LOCKED=1 flock -o "$LOCK" bash "$0" "$@"
fi
cd "$(dirname "$0")/.."
OUT=${OUT:-out/bench-rollout}
MEASURE=${MEASURE:-1 1m 2 2b 3 6 7 5}
STEP=${STEP:-20s}
MIN_REQ=${MIN_REQ:-40}
SHADOW=${SHADOW:-20s}
STEPS=${STEPS:-25,50,100}
STEP_TIMEOUT=${STEP_TIMEOUT:-2m}
NEUTRAL_RUNS=${NEUTRAL_RUNS:-10}
RATE=${RATE:-0.4}
SPEEDUP=${SPEEDUP:-5}
BLOCKS=${BLOCKS:-16384}
WARMUP=${WARMUP:-15}
FAULT_STEP=${FAULT_STEP:-30s}
CP_DOWN=${CP_DOWN:-10}
CLIENT_ERRORS=${CLIENT_ERRORS:-0.005}
WORKERS=8

die() { echo "bench-rollout: $*" >&2; exit 1; }
log() { echo "bench-rollout $(date +%T): $*" >&2; }
now_ms() { date +%s%3N; }

mkdir -p "$OUT/logs"
[ "${REPORT_ONLY:-}" = 1 ] && MEASURE="" || rm -f "$OUT"/*.json "$OUT"/m*.env "$OUT"/summary.txt "$OUT"/results.md "$OUT"/build-commit "$OUT"/logs/*
BIN=$OUT/kvrelay
if [ -n "$MEASURE" ]; then
  log "building $BIN"
  go build -o "$BIN" ./cmd/kvrelay
  # The commit the binary is built from, for the report (the tree may move on meanwhile).
  echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (tree modified)')" >"$OUT/build-commit"
fi
TOKEN=$OUT/api-token
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TOKEN"
chmod 600 "$TOKEN"

PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

# stop PID: SIGTERM, then SIGKILL after 15 s
stop() {
  local p=$1
  kill "$p" 2>/dev/null || return 0
  for _ in $(seq 150); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$p" 2>/dev/null || true
  wait "$p" 2>/dev/null || true
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# pick_ports: B (workers B.., KV events B+20.., replay B+40..), PROXY B+60, XDS B+61, API B+62
pick_ports() {
  local b ok p
  for _ in $(seq 100); do
    b=$((20000 + (RANDOM % 120) * 100))
    ok=1
    for p in $(seq $b $((b + WORKERS - 1))) $(seq $((b + 20)) $((b + 19 + WORKERS))) \
      $(seq $((b + 40)) $((b + 39 + WORKERS))) $((b + 60)) $((b + 61)) $((b + 62)); do
      port_free "$p" || { ok=0; break; }
    done
    if [ $ok = 1 ]; then
      B=$b PROXY=$((b + 60)) XDS=$((b + 61)) API=$((b + 62))
      return
    fi
  done
  die "no free port range"
}

wait_http() { # URL SECONDS
  for _ in $(seq $(($2 * 10))); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}

ctl() { "$BIN" ctl --api "127.0.0.1:$API" --token-file "$TOKEN" "$@"; }

# up NAME: a fresh `kvrelay up` (control plane, proxy and 8 workers in one process)
up() {
  local name=$1
  pick_ports
  rm -rf "$OUT/data-$name"
  "$BIN" up --ebpf off --workers $WORKERS --base-port $B --kv-events-base-port $((B + 20)) \
    --kv-events-replay-base-port $((B + 40)) --proxy-listen 127.0.0.1:$PROXY --xds-listen 127.0.0.1:$XDS \
    --api-listen 127.0.0.1:$API --api-token-file "$TOKEN" --speedup-ratio "$SPEEDUP" \
    --num-gpu-blocks "$BLOCKS" --data-dir "$OUT/data-$name" >"$OUT/logs/$name-up.log" 2>&1 &
  UP_PID=$!
  PIDS+=($UP_PID)
  wait_http "http://127.0.0.1:$PROXY/health" 60 || die "$name: kvrelay up not healthy (see $OUT/logs/$name-up.log)"
  log "$name: kvrelay up pid $UP_PID, proxy :$PROXY, api :$API"
}

# traffic NAME SECONDS: the agentic workload against the proxy, in the background (TRAFFIC_PID)
traffic() {
  local name=$1 secs=$2
  local sessions
  sessions=$(python3 -c "import math; print(math.ceil($RATE * $SPEEDUP * $secs) + 50)")
  "$BIN" bench run --target "http://127.0.0.1:$PROXY/v1" --workload "${TRAFFIC_WORKLOAD:-agentic:sessions=$sessions,rate=$RATE,client_errors=$CLIENT_ERRORS}" \
    --duration "${secs}s" --replay-speedup "$SPEEDUP" --out "$OUT/traffic-$name" >"$OUT/logs/$name-bench.log" 2>&1 &
  TRAFFIC_PID=$!
  PIDS+=($TRAFFIC_PID)
}

# status FILE: the rollout's status as JSON into FILE (fails while the API is down)
status() { ctl --timeout 5s policy rollout status -o json >"$1.tmp" 2>/dev/null && mv "$1.tmp" "$1"; }
jget() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$@"; }

# trace FILE: one line of the rollout's status to $OUT/logs/rollout-trace.log (each poll)
trace() {
  jget "$1" '"%s rollout %d %s step %d: current %s/%s requests (stable/cand)" % (__import__("time").strftime("%T"), d["id"], d["state"], d["step"] + 1, (d.get("current") or {}).get("stable_requests", "-"), (d.get("current") or {}).get("candidate_requests", "-"))' >>"$OUT/logs/rollout-trace.log" || true
}

# wait_done FILE SECONDS: polls the rollout until it ends; its final status goes to FILE
wait_done() {
  local file=$1 secs=$2 seen="" cur
  local deadline=$(($(date +%s) + secs))
  while [ "$(date +%s)" -lt $deadline ]; do
    if status "$file"; then
      trace "$file"
      cur=$(jget "$file" 'd["state"] + " step " + str(d["step"] + 1)')
      [ "$cur" = "$seen" ] || { log "  rollout: $cur"; seen=$cur; }
      case $cur in promoted* | rolled_back* | aborted*) return 0 ;; esac
    fi
    sleep 1
  done
  die "rollout did not end within ${secs}s (last: $seen; see $file)"
}

# wait_step STEP SECONDS_INTO_IT FILE: polls until the canary runs step STEP (0-based) and
# has run that long (returns 1 if the rollout left it first)
wait_step() {
  local want=$1 into=$2 file=$3
  for _ in $(seq 600); do
    if status "$file"; then
      trace "$file"
      local st
      st=$(jget "$file" 'd["state"] + " " + str(d["step"]) + " " + str(int(d.get("step_started_unix_ms") or 0))')
      set -- $st
      case $1 in promoted | rolled_back | aborted) return 1 ;; esac
      if [ "$1" = canary ] && [ "$2" = "$want" ] && [ $(($(now_ms) - $3)) -ge $((into * 1000)) ]; then return 0; fi
      if [ "$1" = canary ] && [ "$2" -gt "$want" ]; then return 1; fi
    fi
    sleep 0.5
  done
  return 1
}

# arm_requests VERSION: the proxy's answered requests routed by policy VERSION
arm_requests() {
  curl -fsS "http://127.0.0.1:$PROXY/metrics" 2>/dev/null |
    awk -v v="policy_version=\"$1\"" '/^kvrelay_proxy_policy_requests_total\{/ && index($0, v) {s += $2} END {print s + 0}'
}

rollout_start() { # CANDIDATE_FILE [extra flags]
  local f=$1
  shift
  ctl policy rollout start --candidate-file "$f" --steps "$STEPS" --step-duration "$STEP" \
    --min-requests "$MIN_REQ" --step-timeout "$STEP_TIMEOUT" "$@" >>"$OUT/logs/ctl.log" 2>&1 ||
    die "rollout start failed: $(tail -3 "$OUT/logs/ctl.log")"
}

secs() { python3 -c "import re,sys; s=sys.argv[1]; m=re.fullmatch(r'(\d+)(s|m)', s) or sys.exit('duration %s: use Ns or Nm' % s); print(int(m[1]) * (60 if m[2] == 'm' else 1))" "$1"; }
STEP_S=$(secs "$STEP") SHADOW_S=$(secs "$SHADOW") TIMEOUT_S=$(secs "$STEP_TIMEOUT") FAULT_STEP_S=$(secs "$FAULT_STEP")
NSTEPS=$(tr ',' '\n' <<<"$STEPS" | wc -l)
ROLLOUT_MAX=$((SHADOW_S + NSTEPS * TIMEOUT_S + 30)) # the longest a rollout can take, and some

want() { [[ " $MEASURE " == *" $1 "* ]]; }

# --- 1: a bad candidate, overlap_weight 0 ---------------------------------------------------
if want 1; then
  log "1: bad candidate (overlap_weight: 0) over the latency policy, shadow $SHADOW"
  up m1
  echo "overlap_weight: 0" >"$OUT/m1-candidate.yaml"
  traffic m1 $((WARMUP + SHADOW_S + NSTEPS * STEP_S + 60))
  sleep "$WARMUP"
  rollout_start "$OUT/m1-candidate.yaml" --shadow "$SHADOW"
  # a change of the policy is refused while the rollout runs
  if ctl policy set --policy latency >>"$OUT/logs/ctl.log" 2>&1; then echo refused=no >"$OUT/m1-set.env"; else echo refused=yes >"$OUT/m1-set.env"; fi
  wait_done "$OUT/m1-bad.json" $ROLLOUT_MAX
  stop $TRAFFIC_PID
  stop $UP_PID
fi

# --- 1m: the same bad candidate under the Mooncake trace (no session ids: the split goes by
# the prompt's first blocks) ------------------------------------------------------------------
if want 1m; then
  log "1m: bad candidate (overlap_weight: 0) under the Mooncake trace, shadow $SHADOW"
  up m1m
  echo "overlap_weight: 0" >"$OUT/m1m-candidate.yaml"
  TRAFFIC_WORKLOAD=mooncake traffic m1m $((WARMUP + SHADOW_S + NSTEPS * STEP_S + 60))
  sleep "$WARMUP"
  rollout_start "$OUT/m1m-candidate.yaml" --shadow "$SHADOW"
  wait_done "$OUT/m1m-bad.json" $ROLLOUT_MAX
  stop $TRAFFIC_PID
  stop $UP_PID
fi

# --- 2: a good candidate, latency over round-robin ------------------------------------------
good() { # NAME FILE [policy set flags]: policy: latency over the stable policy the flags set
  local name=$1 file=$2
  shift 2
  up "$name"
  ctl policy set "$@" >>"$OUT/logs/ctl.log" 2>&1 || die "$name: policy set $* failed"
  echo "policy: latency" >"$OUT/$name-candidate.yaml"
  traffic "$name" $((WARMUP + SHADOW_S + NSTEPS * STEP_S + 60))
  sleep "$WARMUP"
  rollout_start "$OUT/$name-candidate.yaml" --shadow "$SHADOW"
  wait_done "$OUT/$file" $ROLLOUT_MAX
  stop $TRAFFIC_PID
  stop $UP_PID
}
if want 2; then
  log "2: good candidate (policy: latency) over round-robin with a 1 ms session TTL, shadow $SHADOW"
  good m2 m2-good.json --policy round-robin --session-ttl 1ms
fi
if want 2b; then
  log "2b: the same candidate over round-robin with its default session TTL (sessions stick), shadow $SHADOW"
  good m2b m2b-sticky.json --policy round-robin
fi

# --- 3: neutral candidates, NEUTRAL_RUNS rollouts one after another on one fleet ------------
if want 3; then
  log "3: $NEUTRAL_RUNS neutral candidates (session_ttl_ms + 1) one after another"
  up m3
  traffic m3 $((WARMUP + NEUTRAL_RUNS * (NSTEPS * STEP_S + 15) + 120))
  sleep "$WARMUP"
  for i in $(seq "$NEUTRAL_RUNS"); do
    ttl=$(ctl policy -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["session_ttl_ms"])')
    echo "session_ttl_ms: $((ttl + 1))" >"$OUT/m3-candidate.yaml"
    log "3: run $i/$NEUTRAL_RUNS, session_ttl_ms $ttl -> $((ttl + 1))"
    rollout_start "$OUT/m3-candidate.yaml"
    wait_done "$OUT/m3-neutral-$(printf %02d "$i").json" $ROLLOUT_MAX
    kill -0 $TRAFFIC_PID 2>/dev/null || die "3: the traffic ended before run $i did (see $OUT/logs/m3-bench.log)"
  done
  stop $TRAFFIC_PID
  stop $UP_PID
fi

# --- 6: a tail-bad candidate, policy: kv over the latency policy ----------------------------
if want 6; then
  log "6: tail-bad candidate (policy: kv) over the latency policy, shadow $SHADOW"
  up m6
  echo "policy: kv" >"$OUT/m6-candidate.yaml"
  traffic m6 $((WARMUP + SHADOW_S + NSTEPS * TIMEOUT_S + 60))
  sleep "$WARMUP"
  rollout_start "$OUT/m6-candidate.yaml" --shadow "$SHADOW"
  wait_done "$OUT/m6-tail.json" $ROLLOUT_MAX
  stop $TRAFFIC_PID
  stop $UP_PID
fi

# separate NAME [proxy flags]: the fleet as separate processes (kvrelay sim, controlplane,
# proxy) with a persistent --data-dir; start_cp and start_proxy (re)start the latter two.
separate() {
  local name=$1
  shift
  PROXY_FLAGS=("$@")
  pick_ports
  DATA=$OUT/data-$name
  rm -rf "$DATA"
  "$BIN" sim --workers $WORKERS --listen 127.0.0.1:$B --kv-events-endpoint tcp://127.0.0.1:$((B + 20)) \
    --kv-events-replay-endpoint tcp://127.0.0.1:$((B + 40)) --speedup-ratio "$SPEEDUP" \
    --num-gpu-blocks "$BLOCKS" >"$OUT/logs/$name-sim.log" 2>&1 &
  SIM_PID=$!
  PIDS+=($SIM_PID)
  for i in $(seq 0 $((WORKERS - 1))); do
    wait_http "http://127.0.0.1:$((B + i))/health" 30 || die "$name: sim worker $i not up"
  done
  CP_ARGS=(controlplane --ebpf off --data-dir "$DATA" --xds-listen 127.0.0.1:$XDS --api-listen 127.0.0.1:$API --api-token-file "$TOKEN")
  for i in $(seq 0 $((WORKERS - 1))); do
    CP_ARGS+=(--worker "id=w$i,url=http://127.0.0.1:$((B + i)),kv-events=tcp://127.0.0.1:$((B + 20 + i)),kv-events-replay=tcp://127.0.0.1:$((B + 40 + i)),engine=sim,max-num-seqs=256,max-num-batched-tokens=8192")
  done
  start_cp "$OUT/logs/$name-controlplane-1.log"
  start_proxy "$OUT/logs/$name-proxy-1.log"
}
start_cp() { # LOG
  "$BIN" "${CP_ARGS[@]}" >"$1" 2>&1 &
  CP_PID=$!
  PIDS+=($CP_PID)
  for _ in $(seq 300); do ctl --timeout 2s policy >/dev/null 2>&1 && return 0; sleep 0.1; done
  die "control plane not up (see $1)"
}
start_proxy() { # LOG
  "$BIN" proxy --ebpf off --xds 127.0.0.1:$XDS --listen 127.0.0.1:$PROXY --node-id bench-proxy \
    --event-loops 1 "${PROXY_FLAGS[@]}" >"$1" 2>&1 &
  PROXY_PID=$!
  PIDS+=($PROXY_PID)
  wait_http "http://127.0.0.1:$PROXY/health" 30 || die "proxy not up (see $1)"
  # healthy once synced with the control plane: wait for the workers to be routable
  for _ in $(seq 100); do grep -q "control plane synced" "$1" && return 0; sleep 0.1; done
  die "proxy not synced (see $1)"
}

# --- 7: fast abort: a candidate that fails its requests --------------------------------------
if want 7; then
  log "7: fast abort: busy_kv_fraction 0.0001 (its requests queue until they time out, 2 s)"
  separate m7 --queue-timeout 2s
  echo "busy_kv_fraction: 0.0001" >"$OUT/m7-candidate.yaml"
  traffic m7 $((WARMUP + NSTEPS * TIMEOUT_S + 60))
  sleep "$WARMUP"
  rollout_start "$OUT/m7-candidate.yaml"
  wait_done "$OUT/m7-abort.json" $ROLLOUT_MAX
  stop $TRAFFIC_PID
  stop $PROXY_PID
  stop $CP_PID
  stop $SIM_PID
fi

# --- 5: faults, on separate processes -------------------------------------------------------
if want 5; then
  log "5: faults: control plane and proxy killed mid-rollout (separate processes)"
  separate m5
  log "5: sim pid $SIM_PID, control plane pid $CP_PID, proxy pid $PROXY_PID (proxy :$PROXY, api :$API)"
  ttl=$(ctl policy -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["session_ttl_ms"])')
  echo "session_ttl_ms: $((ttl + 1))" >"$OUT/m5-candidate.yaml"
  traffic m5 $((WARMUP + NSTEPS * FAULT_STEP_S + CP_DOWN + 90))
  sleep "$WARMUP"
  STEP=$FAULT_STEP rollout_start "$OUT/m5-candidate.yaml"
  F=$OUT/m5-facts.env
  : >"$F"
  fact() { echo "$1=$2" >>"$F"; }
  S=$OUT/m5-status.tmp.json
  # (a) the control plane killed 8 s into step 1 and kept down CP_DOWN seconds
  wait_step 0 8 "$S" || die "5a: the rollout left step 1 before the kill (see $S)"
  fact cand_version "$(jget "$S" 'd["candidate_version"]')"
  fact stable_version "$(jget "$S" 'd["stable_version"]')"
  CV=$(jget "$S" 'd["candidate_version"]') SV=$(jget "$S" 'd["stable_version"]')
  fact before_state "$(jget "$S" 'd["state"]')"
  fact before_step "$(jget "$S" 'd["step"] + 1')"
  fact before_share "$(jget "$S" 'd["share"]')"
  fact before_step_started "$(jget "$S" 'd["step_started_unix_ms"]')"
  kill -9 "$CP_PID"
  wait "$CP_PID" 2>/dev/null || true
  fact killed_ms "$(now_ms)"
  sleep 1
  if ctl --timeout 2s policy rollout status >/dev/null 2>&1; then fact api_down no; else fact api_down yes; fi
  c0=$(arm_requests "$CV") s0=$(arm_requests "$SV")
  sleep "$CP_DOWN"
  c1=$(arm_requests "$CV") s1=$(arm_requests "$SV")
  fact down_cand "$((c1 - c0))"
  fact down_stable "$((s1 - s0))"
  fact down_secs "$CP_DOWN"
  start_cp "$OUT/logs/m5-controlplane-2.log"
  fact restarted_ms "$(now_ms)"
  status "$S" || die "5a: no status after the restart"
  fact after_state "$(jget "$S" 'd["state"]')"
  fact after_step "$(jget "$S" 'd["step"] + 1')"
  fact after_share "$(jget "$S" 'd["share"]')"
  fact after_step_started "$(jget "$S" 'd["step_started_unix_ms"]')"
  grep -q "rollout resumed" "$OUT/logs/m5-controlplane-2.log" && fact resumed_logged yes || fact resumed_logged no
  # (b) the proxy killed 8 s into step 2 and restarted at once
  if wait_step 1 8 "$S"; then
    fact proxy_step "$(jget "$S" 'd["step"] + 1')"
    fact proxy_share "$(jget "$S" 'd["share"]')"
    kill -9 "$PROXY_PID"
    wait "$PROXY_PID" 2>/dev/null || true
    start_proxy "$OUT/logs/m5-proxy-2.log"
    sleep 8
    fact proxy_after_cand "$(arm_requests "$CV")"
    fact proxy_after_stable "$(arm_requests "$SV")"
    fact proxy_applied "$(grep -o 'rollout candidate applied.*' "$OUT/logs/m5-proxy-2.log" | head -1 | tr -d '"' | tr ' ' '_' || true)"
  else
    fact proxy_step none
  fi
  wait_done "$OUT/m5-faults.json" $ROLLOUT_MAX
  rm -f "$S"
  stop $TRAFFIC_PID
  stop $PROXY_PID
  stop $CP_PID
  stop $SIM_PID
fi

# --- the report ------------------------------------------------------------------------------
SETTINGS="$(date -u +%FT%TZ), built from commit $(cat "$OUT/build-commit" 2>/dev/null || echo unknown), $(nproc) CPUs: $WORKERS simulated workers, agentic rate=$RATE sessions/s, speedup $SPEEDUP, $BLOCKS blocks/worker; steps $STEPS of $STEP (faults: $FAULT_STEP), shadow $SHADOW, min $MIN_REQ requests/arm, step timeout $STEP_TIMEOUT"
python3 - "$OUT" "$STEP_S" "$SETTINGS" <<'PY'
import glob, json, os, sys

out, step_s, settings = sys.argv[1], float(sys.argv[2]), sys.argv[3]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None
def ms(s): return f"{1e3 * s:.0f} ms" if s >= 0.0095 else f"{1e3 * s:.1f} ms"
def pct(x): return f"{100 * x:.1f}%"
def dur(d): return (d["ended_unix_ms"] - d["started_unix_ms"]) / 1e3
def canary(d): return [s for s in d["steps"] if s["step"] >= 0]
def shadow(d): return next((s for s in d["steps"] if s["step"] < 0), None)
def name(s): return "shadow" if s["step"] < 0 else f"step {s['step'] + 1} ({100 * s['share']:.0f}%)"
def arms(s):
    return (f"TTFT p90 cand {ms(s['candidate_ttft_p90'])} vs stable {ms(s['stable_ttft_p90'])}, "
            f"hit rate cand {pct(s['candidate_hit_rate'])} vs stable {pct(s['stable_hit_rate'])}, "
            f"requests {s['candidate_requests']}/{s['stable_requests']}")

lines, rows = [], []
def row(meas, run, d):
    for s in d["steps"]:
        sh = s["step"] < 0  # in shadow the candidate routes nothing: no figures of its own
        c = lambda f, k: "-" if sh else f(s["candidate_" + k])
        rows.append([meas, run, name(s), s["verdict"], s["stable_requests"], s["candidate_requests"],
                     f"{ms(s['stable_ttft_p50'])} / {c(ms, 'ttft_p50')}",
                     f"{ms(s['stable_ttft_p90'])} / {c(ms, 'ttft_p90')}",
                     f"{pct(s['stable_hit_rate'])} / {c(pct, 'hit_rate')}",
                     f"{ms(s.get('stable_itl_p90', 0))} / {c(ms, 'itl_p90') if 'candidate_itl_p90' in s else '-'}",
                     f"{pct(s.get('stable_router_error_rate', 0))} / {c(pct, 'router_error_rate') if 'candidate_router_error_rate' in s else '-'}",
                     f"{pct(s.get('stable_client_error_rate', 0))} / {c(pct, 'client_error_rate') if 'candidate_client_error_rate' in s else '-'}",
                     f"{s.get('stable_groups', 0)} / {s.get('candidate_groups', 0)}",
                     f"{pct(s['shadow_disagreement'])}; {s['shadow_stable_overlap']:.0f} / {s['shadow_candidate_overlap']:.0f}" if s["step"] < 0 else "",
                     f"{(s['end_unix_ms'] - s['start_unix_ms']) / 1e3:.1f}", s["reason"]])

m1, m2, m2b = load("m1-bad.json"), load("m2-good.json"), load("m2b-sticky.json")
if m1:
    row("1 bad", "", m1)
    last = canary(m1)[-1] if canary(m1) else None
    sh = shadow(m1)
    refused = open(os.path.join(out, "m1-set.env")).read().strip().split("=")[1] if os.path.exists(os.path.join(out, "m1-set.env")) else "?"
    canary_s = (m1["ended_unix_ms"] - (last["start_unix_ms"] if last else m1["started_unix_ms"])) / 1e3
    lines.append(f"1 bad candidate (overlap_weight: 0): {m1['state']}"
                 + (f" at {name(last)}" if last and m1["state"] == "rolled_back" else "")
                 + f", decided {dur(m1):.1f} s after the start (shadow {(sh['end_unix_ms'] - sh['start_unix_ms']) / 1e3 if sh else 0:.1f} s, then {canary_s:.1f} s in the failing step)"
                 + (f"; {arms(last)}" if last else "") + f"; reason: {m1['reason']}; policy set during the rollout refused: {refused}")
m1m = load("m1m-bad.json")
if m1m:
    row("1m bad (Mooncake)", "", m1m)
    last = canary(m1m)[-1] if canary(m1m) else None
    sh = shadow(m1m)
    lines.append(f"1m bad candidate under the Mooncake trace: {m1m['state']}"
                 + (f" at {name(last)}" if last and m1m["state"] == "rolled_back" else "")
                 + f", decided {dur(m1m):.1f} s after the start"
                 + (f"; shadow disagreement {pct(sh['shadow_disagreement'])} of {sh['shadow_picks']} picks, mean overlap cand {sh['shadow_candidate_overlap']:.0f} vs stable {sh['shadow_stable_overlap']:.0f} blocks" if sh else "")
                 + (f"; {arms(last)}" if last else "") + f"; reason: {m1m['reason']}")
if m2:
    row("2 good", "", m2)
    parts = "; ".join(f"{name(s)} {s['verdict']}: {arms(s)}" for s in canary(m2))
    lines.append(f"2 good candidate (policy: latency over round-robin, session TTL 1 ms): {m2['state']}" + (" (100%)" if m2["state"] == "promoted" else "")
                 + f" {dur(m2):.1f} s after the start; {parts}; reason: {m2['reason']}")
if m2b:
    row("2b sticky rr", "", m2b)
    parts = "; ".join(f"{name(s)} {s['verdict']}: {arms(s)}" for s in canary(m2b))
    lines.append(f"2b the same candidate over round-robin with its default session TTL (sessions stick to their first worker): {m2b['state']} {dur(m2b):.1f} s after the start; {parts}; reason: {m2b['reason']}")
neutral = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "m3-neutral-*.json")))]
if neutral:
    for i, d in enumerate(neutral):
        row("3 neutral", i + 1, d)
    rb = [i + 1 for i, d in enumerate(neutral) if d["state"] != "promoted"]
    steps = [s for d in neutral for s in canary(d)]
    inc = [s for s in steps if "inconclusive" in s["reason"]]
    waited = [s for s in steps if (s["end_unix_ms"] - s["start_unix_ms"]) / 1e3 > step_s + 2.5]
    ratio = [s["candidate_ttft_p90"] / s["stable_ttft_p90"] for s in steps if s["stable_ttft_p90"] > 0]
    hit = [s["candidate_hit_rate"] - s["stable_hit_rate"] for s in steps]
    t = [dur(d) for d in neutral]
    lines.append(f"3 neutral candidate (session_ttl_ms + 1) x{len(neutral)}: false rollbacks {len(rb)}/{len(neutral)}"
                 + (f" (runs {rb}: " + "; ".join(neutral[i - 1]["reason"] for i in rb) + ")" if rb else "")
                 + f", inconclusive steps {len(inc)}/{len(steps)}, steps that waited past {step_s:.0f} s for requests {len(waited)}/{len(steps)}"
                 + (f"; candidate/stable TTFT p90 x{min(ratio):.2f}-x{max(ratio):.2f}, hit rate difference {100 * min(hit):+.1f} to {100 * max(hit):+.1f} points" if ratio else "")
                 + f"; time to promotion {min(t):.1f}-{max(t):.1f} s"
                 + f"; client errors per step {100 * min(s.get('candidate_client_error_rate', 0) for s in steps):.1f}-{100 * max(s.get('candidate_client_error_rate', 0) for s in steps):.1f}% (candidate), judged on none")
m7 = load("m7-abort.json")
if m7:
    row("7 fast abort", "", m7)
    last = canary(m7)[-1] if canary(m7) else None
    lines.append(f"7 a candidate failing its requests (busy_kv_fraction 0.0001, queue timeout 2 s): {m7['state']}"
                 + (f" at {name(last)}" if last and m7["state"] != "promoted" else "")
                 + f", decided {dur(m7):.1f} s after the start"
                 + (f"; router errors cand {pct(last.get('candidate_router_error_rate', 0))} of {last['candidate_requests']} vs stable {pct(last.get('stable_router_error_rate', 0))} of {last['stable_requests']}" if last else "")
                 + f"; reason: {m7['reason']}")
m6 = load("m6-tail.json")
if m6:
    row("6 tail-bad", "", m6)
    last = canary(m6)[-1] if canary(m6) else None
    lines.append(f"6 tail-bad candidate (policy: kv): {m6['state']}"
                 + (f" at {name(last)}" if last and m6["state"] != "promoted" else "")
                 + f", decided {dur(m6):.1f} s after the start"
                 + (f"; {arms(last)}, TTFT p50 cand {ms(last['candidate_ttft_p50'])} vs stable {ms(last['stable_ttft_p50'])}" if last else "")
                 + f"; reason: {m6['reason']}")
def predicts(label, d, want_higher):
    sh, cs = shadow(d), canary(d)
    if not sh or not cs:
        return f"{label}: no shadow or canary step"
    so, co = sh["shadow_stable_overlap"], sh["shadow_candidate_overlap"]
    c = cs[0]
    shadow_says = co > so
    canary_says = c["candidate_hit_rate"] > c["stable_hit_rate"]
    ttft_says = c["candidate_ttft_p90"] < c["stable_ttft_p90"]
    agree = shadow_says == canary_says == want_higher
    if want_higher is None:  # no expectation: does the shadow agree with the canary?
        agree = shadow_says == canary_says
    note = (" [the stable arm's overlap is recorded as 0 although its canary hit rate is "
            f"{pct(c['stable_hit_rate'])}: a policy that does not match prompts against the index reports no overlap at its picks]"
            if so == 0 and c["stable_hit_rate"] > 0 else "")
    return (f"{label}: shadow disagreement {pct(sh['shadow_disagreement'])} of {sh['shadow_picks']} picks, mean overlap cand {co:.0f} vs stable {so:.0f} blocks "
            f"(cand {'>' if co > so else '<='} stable), load cand {sh['shadow_candidate_load']:.1f} vs stable {sh['shadow_stable_load']:.1f} -> "
            f"canary {name(c)}: hit rate cand {pct(c['candidate_hit_rate'])} vs stable {pct(c['stable_hit_rate'])}, TTFT p90 cand {ms(c['candidate_ttft_p90'])} vs stable {ms(c['stable_ttft_p90'])} "
            f"(TTFT {'agrees' if ttft_says == (canary_says if want_higher is None else want_higher) else 'disagrees'}); same direction: {'yes' if agree else 'NO'}{note}")
if m1 or m2 or m2b:
    lines.append("4 shadow predicts the canary: " + " | ".join(
        ([predicts("bad", m1, False)] if m1 else []) + ([predicts("good", m2, True)] if m2 else [])
        + ([predicts("2b sticky", m2b, None)] if m2b else [])))
m5 = load("m5-faults.json")
fp = os.path.join(out, "m5-facts.env")
if m5 and os.path.exists(fp):
    row("5 faults", "", m5)
    f = dict(l.rstrip("\n").split("=", 1) for l in open(fp) if "=" in l)
    dc, dst = int(f["down_cand"]), int(f["down_stable"])
    cs = canary(m5)
    lines.append(f"5a control plane SIGKILLed in step {f['before_step']} ({100 * float(f['before_share']):.0f}%, state {f['before_state']}), down {f['down_secs']} s (API unreachable: {f['api_down']}): "
                 f"the proxy answered {dc} candidate (v{f['cand_version']}) and {dst} stable (v{f['stable_version']}) requests meanwhile "
                 f"(candidate share {pct(dc / (dc + dst)) if dc + dst else '-'}); after the restart state {f['after_state']} step {f['after_step']} ({100 * float(f['after_share']):.0f}%), "
                 f"same step clock: {'yes' if f['after_step_started'] == f['before_step_started'] else 'no'}, 'rollout resumed' logged: {f['resumed_logged']}; "
                 + (f"step {cs[0]['step'] + 1} then {cs[0]['verdict']}ed on {cs[0]['candidate_requests']}/{cs[0]['stable_requests']} requests (cand/stable, the downtime's included) over {(cs[0]['end_unix_ms'] - cs[0]['start_unix_ms']) / 1e3:.1f} s; " if cs else "")
                 + f"the rollout then ended {m5['state']} ({m5['reason']})")
    if f.get("proxy_step", "none") != "none":
        pc, ps = int(f["proxy_after_cand"]), int(f["proxy_after_stable"])
        lines.append(f"5b proxy SIGKILLed in step {f['proxy_step']} ({100 * float(f['proxy_share']):.0f}%) and restarted: "
                     f"{f['proxy_applied'].replace('_', ' ') or 'no candidate applied'}; in its first 8 s it answered {pc} candidate (v{f['cand_version']}) and {ps} stable requests "
                     f"(candidate share {pct(pc / (pc + ps)) if pc + ps else '-'})"
                     + (f"; step {cs[1]['step'] + 1} {cs[1]['verdict']}ed on {cs[1]['candidate_requests']}/{cs[1]['stable_requests']} requests (cand/stable; a restarted proxy's figures count from nothing, the others' from the step's start)" if len(cs) > 1 else "")
                     + f"; the rollout ended {m5['state']}")
    else:
        lines.append("5b proxy restart: not done (the rollout left step 2 before it)")

hdr = ["measurement", "run", "step", "verdict", "stable req", "cand req", "TTFT p50 s / c", "TTFT p90 s / c",
       "hit rate s / c", "ITL p90 s / c", "router errors s / c", "client errors s / c", "conversation groups s / c", "shadow disagreement; overlap s / c", "duration (s)", "reason"]
with open(os.path.join(out, "results.md"), "w") as fh:
    fh.write(f"# hack/bench-rollout.sh\n\n{settings}\n\n")
    fh.write("\n".join(lines) + "\n\n")
    fh.write("Per step: s = stable arm, c = candidate arm; shadow overlap is the mean cached prompt blocks at each arm's picks.\n\n")
    fh.write("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr) + "\n")
    for r in rows:
        fh.write("| " + " | ".join(str(x).replace("|", "/") for x in r) + " |\n")
with open(os.path.join(out, "summary.txt"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
print("\n".join(lines))
print(f"(per-step table: {out}/results.md)")
PY
