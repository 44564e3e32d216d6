#!/usr/bin/env bash
# Reproduces the policy comparisons quoted in kvrelay's notes: the first 2000 requests of the
# Mooncake conversation trace and the agentic workload, each replayed against a fresh local
# cluster of 8 simulated workers per policy. Results (results.json, results.md, PNG/SVG plots)
# go under $OUT (default bench-results/).
#
#   hack/bench-compare.sh [mooncake|agentic|all]
#
# LOAD sets how many times faster requests arrive than the engines run (arrival speedup /
# engine speedup); the default loads round-robin to roughly 80% of its prefill capacity on the
# Mooncake trace. ENGINE_SPEEDUP compresses the engines' step times (and the run's wall time).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
TRACE=${TRACE:-../shared/traces/mooncake-conversation.jsonl}
ENGINE_SPEEDUP=${ENGINE_SPEEDUP:-2}
LOAD=${LOAD:-2}
POLICIES=${POLICIES:-kv,round-robin,least-loaded,random}
what=${1:-all}
go build -o bin/kvrelay ./cmd/kvrelay
arrival=$(python3 -c "print($ENGINE_SPEEDUP * $LOAD)")

if [ "$what" = mooncake ] || [ "$what" = all ]; then
  bin/kvrelay bench compare --workers 8 --policies "$POLICIES" \
    --workload "mooncake:path=$TRACE,requests=2000" \
    --speedup "$arrival" --engine-speedup "$ENGINE_SPEEDUP" --out "$OUT/mooncake"
fi
if [ "$what" = agentic ] || [ "$what" = all ]; then
  bin/kvrelay bench compare --workers 8 --policies "$POLICIES" \
    --workload "agentic:sessions=32" \
    --speedup "$arrival" --engine-speedup "$ENGINE_SPEEDUP" --out "$OUT/agentic"
fi
