#!/usr/bin/env bash
# Compares kvrelay's routing policies on fresh local clusters (8 simulated workers, a control
# plane following their KV events, a proxy fed over xDS), one cluster per policy, each given
# the identical request stream. The figures in the top-level README come from it. Results
# (results.json, results.md, PNG/SVG plots) go under $OUT (default bench-results/).
#
#   hack/bench-compare.sh [mooncake|agentic|all|capacity|agentic-capacity]
#
#   mooncake          the first 2000 requests of the Mooncake conversation trace
#                     (TRACE, default hack/traces/mooncake-conversation.jsonl.gz)
#   agentic           SESSIONS agentic sessions (default 900), RATE new sessions per second
#   all               both (the default)
#   capacity          round-robin alone on the trace at each LOAD of LOADS ("5 6 7 8 9"):
#                     one table row per load (offered and completed req/s, TTFT, goodput share)
#   agentic-capacity  round-robin alone at each session count of SESSION_COUNTS
#                     ("300 600 900 1200"; "saturate": 2000 sessions within 50 s)
#
# Settings (environment):
#   POLICIES          default latency,kv,round-robin,least-loaded,random
#   LOAD              how many times faster requests arrive than the engines run (default 6)
#   BLOCKS            each worker's KV cache in 16-token blocks (default 131072 for the trace,
#                     65536 for agentic; 65536 ≈ 1M tokens, an H200 serving gpt-oss-120b)
#   ENGINE_SPEEDUP    divides the engines' step times for the trace runs (default 0.5);
#   AGENTIC_SPEEDUP   the same for the agentic runs (0.5). The whole cluster runs in one
#                     process: above 0.5 a 2-core machine starves the engines, so check the
#                     "engine stall" row of each table.
#   SESSION_IDS       send nvext.session_id with agentic calls (default false: only routing on
#                     the prompt keeps a session on its cache)
#   AGENTIC_OPTS      extra agentic workload parameters (e.g. preamble=12000,tool=1500);
#   REQUESTS          caps the calls of agentic runs
#   OVERLAP_WEIGHT, QUEUE_WEIGHT, COMPUTE_WEIGHT, CACHE_THRESHOLD
#                     override the routing policy's defaults
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
TRACE=${TRACE:-hack/traces/mooncake-conversation.jsonl.gz}
ENGINE_SPEEDUP=${ENGINE_SPEEDUP:-0.5}
LOAD=${LOAD:-6}
BLOCKS=${BLOCKS:-}
OVERLAP_WEIGHT=${OVERLAP_WEIGHT:-}
SESSIONS=${SESSIONS:-900}
RATE=${RATE:-8}
SESSION_IDS=${SESSION_IDS:-false}
AGENTIC_SPEEDUP=${AGENTIC_SPEEDUP:-0.5}
POLICIES=${POLICIES:-latency,kv,round-robin,least-loaded,random}
what=${1:-all}
go build -o bin/kvrelay ./cmd/kvrelay
arrival=$(python3 -c "print($ENGINE_SPEEDUP * $LOAD)")

if [ "$what" = capacity ]; then
  # Round-robin alone at each LOAD of LOADS, one line each: its capacity is where its TTFT turns
  # from a queue's wait into a backlog that grows for the whole run.
  for load in ${LOADS:-5 6 7 8 9}; do
    bin/kvrelay bench compare --workers 8 --policies round-robin \
      --workload "mooncake:path=$TRACE,requests=2000" --num-gpu-blocks "${BLOCKS:-131072}" \
      --replay-speedup "$(python3 -c "print($ENGINE_SPEEDUP * $load)")" --speedup-ratio "$ENGINE_SPEEDUP" \
      --out "$OUT/capacity/load-$load"
  done
  python3 - "$OUT/capacity" "$TRACE" ${LOADS:-5 6 7 8 9} <<'EOF'
import gzip, json, sys
with (gzip.open if sys.argv[2].endswith(".gz") else open)(sys.argv[2], "rt") as f:
    ts = [json.loads(line)["timestamp"] / 1000 for _, line in zip(range(2000), f)]
print("| LOAD | offered req/s | completed req/s | TTFT p50 | TTFT p90 | goodput share |")
print("|---:|---:|---:|---:|---:|---:|")
for load in sys.argv[3:]:
    s = json.load(open(f"{sys.argv[1]}/load-{load}/results.json"))[0]["summary"]
    offered = len(ts) * float(load) / (ts[-1] - ts[0])
    print(f"| {load} | {offered:.1f} | {s['requests_per_s']:.1f} | {s['ttft']['p50_ns'] / 1e6:.0f} ms "
          f"| {s['ttft']['p90_ns'] / 1e6:.0f} ms | {100 * s['goodput_share']:.1f}% |")
EOF
fi
if [ "$what" = agentic-capacity ]; then
  # Round-robin alone at each session count of SESSION_COUNTS, one line each. The calls run
  # closed-loop, so more sessions do not queue more calls: each call slows down instead. Its
  # capacity is where the completed calls per second stop growing with the sessions.
  # SESSION_COUNTS=saturate is one run instead: 2000 sessions starting within 50 s, the first
  # 16000 calls, read off "requests/s mid-run" (an upper bound: saturated, decodes held back
  # by prefills finish in a burst once arrivals stop).
  counts=${SESSION_COUNTS:-300 600 900 1200}
  if [ "$counts" = saturate ]; then
    bin/kvrelay bench compare --workers 8 --policies round-robin \
      --workload "agentic:sessions=2000,rate=40,session_ids=$SESSION_IDS${AGENTIC_OPTS:+,$AGENTIC_OPTS}" --requests 16000 \
      --num-gpu-blocks "${BLOCKS:-65536}" --replay-speedup "$AGENTIC_SPEEDUP" --speedup-ratio "$AGENTIC_SPEEDUP" \
      --out "$OUT/agentic-capacity"
  else
    for n in $counts; do
      bin/kvrelay bench compare --workers 8 --policies round-robin \
        --workload "agentic:sessions=$n,rate=$RATE,session_ids=$SESSION_IDS${AGENTIC_OPTS:+,$AGENTIC_OPTS}" ${REQUESTS:+--requests $REQUESTS} \
        --num-gpu-blocks "${BLOCKS:-65536}" --replay-speedup "$AGENTIC_SPEEDUP" --speedup-ratio "$AGENTIC_SPEEDUP" \
        --out "$OUT/agentic-capacity/sessions-$n"
    done
    python3 - "$OUT/agentic-capacity" $counts <<'EOF'
import json, sys
print("| sessions | completed req/s | req/s mid-run | TTFT p50 | TTFT p90 | E2E p50 | goodput share | engine stall |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
for n in sys.argv[2:]:
    s = json.load(open(f"{sys.argv[1]}/sessions-{n}/results.json"))[0]["summary"]
    print(f"| {n} | {s['requests_per_s']:.1f} | {s['mid_run_requests_per_s']:.1f} | {s['ttft']['p50_ns'] / 1e6:.0f} ms "
          f"| {s['ttft']['p90_ns'] / 1e6:.0f} ms | {s['e2e']['p50_ns'] / 1e6:.0f} ms | {100 * s['goodput_share']:.1f}% "
          f"| {100 * s.get('engine_stall', 0):.1f}% |")
EOF
  fi
fi
if [ "$what" = mooncake ] || [ "$what" = all ]; then
  bin/kvrelay bench compare --workers 8 --policies "$POLICIES" \
    --workload "mooncake:path=$TRACE,requests=2000" --num-gpu-blocks "${BLOCKS:-131072}" \
    ${OVERLAP_WEIGHT:+--overlap-weight $OVERLAP_WEIGHT} ${QUEUE_WEIGHT:+--queue-weight $QUEUE_WEIGHT} ${COMPUTE_WEIGHT:+--compute-weight $COMPUTE_WEIGHT} ${CACHE_THRESHOLD:+--cache-threshold $CACHE_THRESHOLD} \
    --replay-speedup "$arrival" --speedup-ratio "$ENGINE_SPEEDUP" --out "$OUT/mooncake"
fi
if [ "$what" = agentic ] || [ "$what" = all ]; then
  bin/kvrelay bench compare --workers 8 --policies "$POLICIES" \
    --workload "agentic:sessions=$SESSIONS,rate=$RATE,session_ids=$SESSION_IDS${AGENTIC_OPTS:+,$AGENTIC_OPTS}" ${REQUESTS:+--requests $REQUESTS} --num-gpu-blocks "${BLOCKS:-65536}" \
    ${OVERLAP_WEIGHT:+--overlap-weight $OVERLAP_WEIGHT} ${QUEUE_WEIGHT:+--queue-weight $QUEUE_WEIGHT} ${COMPUTE_WEIGHT:+--compute-weight $COMPUTE_WEIGHT} ${CACHE_THRESHOLD:+--cache-threshold $CACHE_THRESHOLD} \
    --replay-speedup "$AGENTIC_SPEEDUP" --speedup-ratio "$AGENTIC_SPEEDUP" --out "$OUT/agentic"
fi
