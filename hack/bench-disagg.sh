#!/usr/bin/env bash
# Measures prefill/decode disaggregation on the simulated engines (default timing model) with a
# prefill-heavy workload: every request a unique prompt of ISL tokens (3000) asking for OSL
# tokens (150), Poisson arrivals at each rate in RATES. Each rate is one `kvrelay bench
# compare` over the SETUPS (default: 4 aggregated workers, 2 prefill + 2 decode with every
# prompt prefilled remotely, and the same pools under the conditional policy, which prefills
# on the decode worker when at most THRESHOLD prompt tokens are uncached there), each on a
# fresh cluster with the identical request stream. Results go under $OUT/rate-R/
# (results.json, results.md, plots); the end prints, and writes to $OUT/summary.md, a table
# rate × setup → goodput (requests/s meeting TTFT ≤ SLO_TTFT and mean ITL ≤ SLO_ITL), TTFT and
# ITL p50/p99, and each setup's goodput ratio to the first setup's.
#
#   hack/bench-disagg.sh                 # RATES="8 16 24 32 40" REQUESTS=400
#   RATES="4 8" REQUESTS=100 hack/bench-disagg.sh
#
# Times are the engines' own (bench compare scales what it measures by the engine speedup).
# SPEEDUP divides both the arrival times and the engines' step times; what the simulation
# itself costs in real time (tokenizing, HTTP, the KV bytes really copied over loopback: the
# modelled size × KV_BYTES_SCALE) is multiplied by it in the results, so keep it low (1 or 2)
# and the machine otherwise idle: at SPEEDUP 10 on 2 cores the real copying alone adds
# seconds to the disaggregated TTFTs. KV_BYTES_SCALE (default the simulator's 1/64) does not
# change the modelled transfer time (KV_BANDWIDTH, default 50GB/s), only what the machine
# copies.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/disagg}
RATES=${RATES:-8 16 24 32 40}
SETUPS=${SETUPS:-agg:4,disagg:2+2,conditional:2+2}
ISL=${ISL:-3000}
OSL=${OSL:-150}
REQUESTS=${REQUESTS:-400}
SPEEDUP=${SPEEDUP:-1}
THRESHOLD=${THRESHOLD:-512}
KV_BYTES_SCALE=${KV_BYTES_SCALE:-1/64}
KV_BANDWIDTH=${KV_BANDWIDTH:-50GB/s}
BLOCKS=${BLOCKS:-16384}
SLO_TTFT=${SLO_TTFT:-2s}
SLO_ITL=${SLO_ITL:-50ms}
SEED=${SEED:-1}
go build -o bin/kvrelay ./cmd/kvrelay
mkdir -p "$OUT"
for rate in $RATES; do
  echo "== rate $rate requests/s: $SETUPS" >&2
  bin/kvrelay bench compare --setups "$SETUPS" --disagg-threshold "$THRESHOLD" \
    --workload "fixed:isl=$ISL,osl=$OSL,requests=$REQUESTS" --rate "$rate" --seed "$SEED" \
    --replay-speedup "$SPEEDUP" --num-gpu-blocks "$BLOCKS" \
    --kv-bytes-scale "$KV_BYTES_SCALE" --kv-transfer-bandwidth "$KV_BANDWIDTH" \
    --slo-ttft "$SLO_TTFT" --slo-itl "$SLO_ITL" --out "$OUT/rate-$rate" | tee "$OUT/rate-$rate.log"
done
python3 - "$OUT" $RATES <<'PY' | tee "$OUT/summary.md"
import json, sys
out, rates = sys.argv[1], sys.argv[2:]
def ms(ns):
    if ns >= 1e10:
        return f"{ns / 1e9:.1f} s"
    return f"{ns / 1e6:.1f} ms" if ns < 1e8 else f"{ns / 1e6:.0f} ms"
print("| rate (req/s) | setup | ok | goodput (req/s) | goodput share | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | goodput ×first |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for rate in rates:
    runs = json.load(open(f"{out}/rate-{rate}/results.json"))
    base = runs[0]["summary"]["goodput_per_s"]
    for r in runs:
        s = r["summary"]
        ratio = f"{s['goodput_per_s'] / base:.2f}" if base > 0 else "–"
        print(f"| {rate} | {r['label']} | {s['ok']}/{s['requests']} | {s['goodput_per_s']:.2f} | {100 * s['goodput_share']:.0f}% "
              f"| {ms(s['ttft']['p50_ns'])} | {ms(s['ttft']['p99_ns'])} | {ms(s['itl']['p50_ns'])} | {ms(s['itl']['p99_ns'])} | {ratio} |")
PY
echo "wrote $OUT/summary.md" >&2
