#!/usr/bin/env bash
# The control plane at fleet scale: bench-xds -mode scale (see hack/bench-xds/README.md) with
# 1,000 synthetic engines, 100 proxies' xDS sides (counting sinks with load reporters) and 2
# control-plane replicas, each a process that ingests every engine's KV events and serves
# xDS, once per block event rate. Each run measures a steady load (freshness from an event's
# arrival at a replica to its send on every proxy stream, and from the engine's publish to
# the proxy's journal client; bytes per proxy per second; each replica's CPU and memory; a
# proxy's replica memory) and then kills replica 0 under load (how long its proxies take to
# be synced on the other). Holds /tmp/kvrelay-bench.lock (flock -o) for each run.
#
#   hack/bench-scale.sh
#
# Settings (environment): OUT [out/bench-scale]  RATES ["10000 100000"] block events/s
#   WORKERS [1000]  PROXIES [100]  REPLICAS [2]  DURATION [15s]  EXTRA [] more bench-xds flags
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/bench-scale}
RATES=${RATES:-"10000 100000"}
mkdir -p "$OUT"
go build -o "$OUT/bench-xds" ./hack/bench-xds
for rate in $RATES; do
	echo "== $rate block events/s" | tee "$OUT/scale-$rate.txt"
	# shellcheck disable=SC2086
	flock -o /tmp/kvrelay-bench.lock "$OUT/bench-xds" -mode scale -rate "$rate" -workers "${WORKERS:-1000}" \
		-proxies "${PROXIES:-100}" -replicas "${REPLICAS:-2}" -duration "${DURATION:-15s}" ${EXTRA:-} | tee -a "$OUT/scale-$rate.txt"
done
