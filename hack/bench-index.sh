#!/usr/bin/env bash
# Compares the KV index's benchmarks (the block set both sides of xDS keep, the control
# plane's index and ingest pipeline, the proxy's replica) between a base revision and the
# working tree: test binaries built for each, run alternately ROUNDS times, and per
# benchmark and metric the median and range of each side and the ratio of the medians
# (working tree / base).
#
#   hack/bench-index.sh [BASE]        BASE defaults to HEAD
#
# Settings (environment): ROUNDS (default 3); BENCH_BLOCKSET, BENCH_SLOTS, BENCH_MEMORY, BENCH_KVINDEX,
# BENCH_INGEST, BENCH_PREFIX, the benchmarks run (regular expressions; defaults below); OUT, the file the raw lines and the summary go to (default
# bench-results/index-<base>.txt). Run it alone: under flock -o /tmp/kvrelay-bench.lock.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-HEAD}
rounds=${ROUNDS:-3}
rev=$(git rev-parse --short "$base")
OUT=${OUT:-bench-results/index-$rev.txt}
mkdir -p "$(dirname "$OUT")"
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add --detach "$tmp/base" "$base" >/dev/null 2>&1

# package;benchmark expression;benchtime
benches=(
	"xds/blockset;${BENCH_BLOCKSET:-Match};2000x"
	"xds/blockset;${BENCH_SLOTS:-ClearSlot|EachSlots};20x"
	"xds/blockset;${BENCH_MEMORY:-SetMemory};1x"
	"controlplane/kvindex;${BENCH_KVINDEX:-Ingest|Match512};1s"
	"controlplane/ingest;${BENCH_INGEST:-Pipeline/decoded};2s"
	"dataplane/prefix;${BENCH_PREFIX:-Replica};1x"
)
for side in base tree; do
	dir=$PWD
	[ "$side" = base ] && dir=$tmp/base
	for b in "${benches[@]}"; do
		pkg=${b%%;*}
		bin=$tmp/$side-$(echo "$pkg" | tr / -).test
		[ -x "$bin" ] && continue
		# The base gets the working tree's benchmarks of the block set, so both run the
		# same ones, unless they do not build against it (then it keeps its own, and the
		# benchmarks only one side has show no ratio).
		if [ "$side" = base ] && [ "$pkg" = xds/blockset ]; then
			cp "$dir/xds/blockset/bench_test.go" "$tmp/base-bench_test.go"
			cp xds/blockset/bench_test.go "$dir/xds/blockset/bench_test.go"
			if ! (cd "$dir" && go test -c -o "$bin" "./$pkg" 2>/dev/null); then
				echo "the working tree's block set benchmarks do not build against $rev: it runs its own" >&2
				cp "$tmp/base-bench_test.go" "$dir/xds/blockset/bench_test.go"
			fi
		fi
		[ -x "$bin" ] || (cd "$dir" && go test -c -o "$bin" "./$pkg")
	done
done

: >"$OUT.raw"
for r in $(seq "$rounds"); do
	for side in base tree; do
		for b in "${benches[@]}"; do
			IFS=';' read -r pkg expr time <<<"$b"
			bin=$tmp/$side-$(echo "$pkg" | tr / -).test
			dir=$PWD/$pkg
			[ "$side" = base ] && dir=$tmp/base/$pkg
			(cd "$dir" && "$bin" -test.run '^$' -test.bench "$expr" -test.benchtime "$time" -test.benchmem) |
				{ grep '^Benchmark' || true; } | sed "s/^/$side /" | tee -a "$OUT.raw"
		done
	done
done

python3 - "$OUT.raw" "$rev" >"$OUT" <<'EOF'
import re, statistics, sys
raw, rev = sys.argv[1], sys.argv[2]
vals = {}
order = []
for line in open(raw):
    side, name, _n, *rest = line.split()
    name = re.sub(r"-\d+$", "", name)
    for v, unit in zip(rest[0::2], rest[1::2]):
        key = (name, unit)
        if key not in vals:
            vals[key] = {"base": [], "tree": []}
            order.append(key)
        vals[key][side].append(float(v))
print(f"base {rev} against the working tree, {len(next(iter(vals.values()))['base'])} rounds; median [min-max]; ratio tree/base")
for key in order:
    b, t = vals[key]["base"], vals[key]["tree"]
    if not b or not t:
        continue
    mb, mt = statistics.median(b), statistics.median(t)
    ratio = f"{mt / mb:.3f}" if mb else "-"
    print(f"{key[0]:<55} {key[1]:<12} base {mb:>14.6g} [{min(b):.6g}-{max(b):.6g}]  tree {mt:>14.6g} [{min(t):.6g}-{max(t):.6g}]  ×{ratio}")
print()
print(open(raw).read(), end="")
EOF
cat "$OUT" | sed -n '1,/^$/p'
