#!/usr/bin/env bash
# Measures herding across control-plane replicas: how evenly two proxies spread a burst over
# four simulated workers when they follow one replica, two replicas that share their
# proxies' in-flight load, and two that do not (controlplane's TestHerding, on a real API
# server: hack/kube-testenv.sh installs it). ROUNDS rounds (default 3), one after another,
# under the benchmark lock; the log lines and a summary go to $OUT (default
# bench-results/herding/<date>-<commit>.txt).
#
#   hack/bench-herding.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
commit=$(git rev-parse --short HEAD)
OUT=${OUT:-bench-results/herding/$(date -u +%F)-$commit.txt}
mkdir -p "$(dirname "$OUT")"
{
	echo "# kvrelay $commit, $(nproc) cores, $(date -u +%FT%TZ): go test -run TestHerding ./controlplane/ -args -herding, $ROUNDS rounds"
	for r in $(seq "$ROUNDS"); do
		echo "# round $r"
		flock -o /tmp/kvrelay-bench.lock go test -count=1 -run TestHerding -v ./controlplane/ -args -herding 2>&1 |
			grep -E 'herding .*max/mean|^(--- FAIL|FAIL|ok)' | sed 's/^ *herding_test.go:[0-9]*: //'
	done
} | tee "$OUT"
echo "results: $OUT" >&2
