#!/usr/bin/env bash
# Measures the simulated engines' KV block manager under cache pressure: one fresh local
# cluster per tier setup (WORKERS simulated workers, a control plane following their KV
# events, a proxy on the latency policy), each given the identical agentic request stream,
# then one table. Results (results.json, results.md per setup; table.md) go under $OUT
# (default bench-results/kvbm).
#
#   hack/bench-kvbm.sh
#
# The workload: SESSIONS agentic sessions arriving at RATE per second, two 2000-token shared
# preambles, growing contexts (tool rounds), reasoning in every call (never sent back, so
# marked ephemeral), forked subagents; G1 sized so that the live working set is several times
# the fleet's GPU memory.
#
# Setups (SETUPS, space-separated names, default all of them, in this order):
#   g1-lru        G1 only, LRU (the engines' default)
#   g1-worm       G1 only, WORM eviction and pins (the workload pins its prompts for PIN)
#   g1-worm-nopin G1 only, WORM eviction, no pins (not in the default list)
#   g2-lru        G1 + G2 (host, G2_BLOCKS), LRU
#   g3-lru        G1 + G2 + G3 (disk, G3_BLOCKS), LRU
#   g3-worm       G1 + G2 + G3, WORM and pins
#   g3-fetch      the above with peer fetch (a worker pulls a prefix a peer caches when the
#                 latency policy predicts that beats computing it)
#   g3-worm-nohint, g3-worm-learn, g3-worm-reasoning  g3-worm without the client's
#                 ephemeral_output hint (ephemeral=false), the engines left to WORM's classes
#                 alone, or learning from what later requests resend that generated blocks
#                 are write-once (--learn-write-once), or reasoning models that answer the
#                 workload's reasoning tokens as reasoning_content and mark a reasoning
#                 request's output write-once (--reasoning-tokens) (not in the default list);
#                 g3-worm-reasoning-nopin the last without pins
#   g3-shared     G1 + G2 + a disk tier every worker mounts (shared storage, G3_BLOCKS
#                 written by each worker), LRU: a block one worker offloaded, all load
#   slow-weigh, slow-always, slow-never  G1 + G2 + G3 on a slow disk (SLOW_DISK, 0.5 GB/s):
#                 the latency policy weighing loads against recomputes (max_load_tokens 0
#                 when computing is sooner), always loading, never loading (not in the
#                 default list)
#   cold, cold-fetch  the subagent cold start: COLD_SESSIONS sessions whose forked
#                 subagents start from a COLD_CONTEXT-token context (G1 only, LRU), without
#                 and with peer fetch; their first calls are tagged "fork". Both rows move
#                 COLD_KV_SCALE (1/512) of the modelled KV bytes for real: at the simulators'
#                 default 1/64 a fork's 19 MB of loopback copies and checksums take about
#                 130 ms of this machine's CPU, five times the 24 ms the modelled 50 GB/s
#                 transfer takes, and the comparison would measure the copy, not the design
#
# Settings (environment): WORKERS (4), G1_BLOCKS (2048 blocks of 16 tokens per worker),
# COLD_CONTEXT (16000 tokens), COLD_SESSIONS (24, at most 64: one preamble each), COLD_KV_SCALE (1/512),
# G2_BLOCKS (2 × G1), G3_BLOCKS (8 × G1), SESSIONS (80), RATE (1.6 sessions/s), PIN (5m),
# KV_SCALE (the share of the modelled KV bytes the other rows move for real, to disk and
# between peers; the simulators' default 1/64),
# SPEEDUP (1: the engines' step times divided by it, arrivals at the same factor),
# AGENTIC_OPTS (extra workload parameters), SEED (1).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/kvbm}
WORKERS=${WORKERS:-4}
G1_BLOCKS=${G1_BLOCKS:-2048}
G2_BLOCKS=${G2_BLOCKS:-$((2 * G1_BLOCKS))}
G3_BLOCKS=${G3_BLOCKS:-$((8 * G1_BLOCKS))}
SESSIONS=${SESSIONS:-80}
RATE=${RATE:-1.6}
PIN=${PIN:-5m}
SPEEDUP=${SPEEDUP:-1}
SEED=${SEED:-1}
SETUPS=${SETUPS:-g1-lru g1-worm g2-lru g3-lru g3-worm g3-fetch g3-shared cold cold-fetch}
SLOW_DISK=${SLOW_DISK:-500MB/s}
COLD_CONTEXT=${COLD_CONTEXT:-16000}
COLD_SESSIONS=${COLD_SESSIONS:-24}
COLD_KV_SCALE=${COLD_KV_SCALE:-1/512}
KV_SCALE=${KV_SCALE:-1/64}
REASONING=128 # reasoning tokens of every call
base="agentic:sessions=$SESSIONS,rate=$RATE,preamble=2000,preambles=2,task=200,turns=3,rounds=3,tool=400,subagents=2,sub_task=100,sub_rounds=2,reasoning=$REASONING,osl=64,think=25s,tool_time=300ms,session_ids=false"
[ -n "${AGENTIC_OPTS:-}" ] && base="$base,$AGENTIC_OPTS"
go build -o bin/kvrelay ./cmd/kvrelay
mkdir -p "$OUT"

run() { # name, workload, bench flags...
  local name=$1 wl=$2
  shift 2
  echo "== $name" >&2
  flock -o /tmp/kvrelay-bench.lock bin/kvrelay bench compare --workers "$WORKERS" --policies latency \
    --workload "$wl" --seed "$SEED" --replay-speedup "$SPEEDUP" --speedup-ratio "$SPEEDUP" \
    --out "$OUT/$name" --kv-bytes-scale "$KV_SCALE" "$@" >/dev/null
}
# The cold start: few sessions, each with a context of its own (a preamble per session) and
# forking 4 subagents from it at its first tool round, on workers running 2 sequences at
# once (the parent's worker is full when they fork), GPU memory ample (no eviction): only
# where the context is matters.
cold="agentic:sessions=$COLD_SESSIONS,rate=0.5,preamble=$COLD_CONTEXT,preambles=$COLD_SESSIONS,task=200,turns=1,rounds=2,tool=400,subagents=4,sub_task=100,sub_rounds=1,reasoning=64,osl=64,think=1s,tool_time=300ms,session_ids=false"

for s in $SETUPS; do
  case $s in
    g1-lru) run g1-lru "$base" --num-gpu-blocks "$G1_BLOCKS" --eviction lru ;;
    g1-worm) run g1-worm "$base,pin=$PIN" --num-gpu-blocks "$G1_BLOCKS" --eviction worm ;;
    g1-worm-nopin) run g1-worm-nopin "$base,pin=0s" --num-gpu-blocks "$G1_BLOCKS" --eviction worm ;;
    g2-lru) run g2-lru "$base" --num-gpu-blocks "$G1_BLOCKS" --eviction lru --cpu-offload-blocks "$G2_BLOCKS" ;;
    g3-lru) run g3-lru "$base" --num-gpu-blocks "$G1_BLOCKS" --eviction lru --cpu-offload-blocks "$G2_BLOCKS" --disk-offload-blocks "$G3_BLOCKS" ;;
    g3-worm) run g3-worm "$base,pin=$PIN" --num-gpu-blocks "$G1_BLOCKS" --eviction worm --cpu-offload-blocks "$G2_BLOCKS" --disk-offload-blocks "$G3_BLOCKS" ;;
    g3-fetch) run g3-fetch "$base,pin=$PIN" --num-gpu-blocks "$G1_BLOCKS" --eviction worm --cpu-offload-blocks "$G2_BLOCKS" --disk-offload-blocks "$G3_BLOCKS" --peer-fetch ;;
    g3-worm-nohint) run g3-worm-nohint "$base,pin=$PIN,ephemeral=false" --num-gpu-blocks "$G1_BLOCKS" --eviction worm --cpu-offload-blocks "$G2_BLOCKS" --disk-offload-blocks "$G3_BLOCKS" ;;
    g3-worm-learn) run g3-worm-learn "$base,pin=$PIN,ephemeral=false" --num-gpu-blocks "$G1_BLOCKS" --eviction worm --learn-write-once --cpu-offload-blocks "$G2_BLOCKS" --disk-offload-blocks "$G3_BLOCKS" ;;
    g3-worm-reasoning) run g3-worm-reasoning "$base,pin=$PIN,ephemeral=false" --num-gpu-blocks "$G1_BLOCKS" --eviction worm --reasoning-tokens "$REASONING" --cpu-offload-blocks "$G2_BLOCKS" --disk-offload-blocks "$G3_BLOCKS" ;;
    g3-worm-reasoning-nopin) run g3-worm-reasoning-nopin "$base,pin=0s,ephemeral=false" --num-gpu-blocks "$G1_BLOCKS" --eviction worm --reasoning-tokens "$REASONING" --cpu-offload-blocks "$G2_BLOCKS" --disk-offload-blocks "$G3_BLOCKS" ;;
    g3-shared) run g3-shared "$base" --num-gpu-blocks "$G1_BLOCKS" --eviction lru --cpu-offload-blocks "$G2_BLOCKS" --disk-offload-blocks "$G3_BLOCKS" --disk-offload-shared ;;
    slow-weigh|slow-always|slow-never) run "$s" "$base" --num-gpu-blocks "$G1_BLOCKS" --eviction lru --cpu-offload-blocks "$G2_BLOCKS" --disk-offload-blocks "$G3_BLOCKS" --disk-bandwidth "$SLOW_DISK" --onboard "${s#slow-}" ;;
    cold) run cold "$cold" --num-gpu-blocks 65536 --max-num-seqs 2 --eviction lru --kv-bytes-scale "$COLD_KV_SCALE" ;;
    cold-fetch) run cold-fetch "$cold" --num-gpu-blocks 65536 --max-num-seqs 2 --eviction lru --peer-fetch --kv-bytes-scale "$COLD_KV_SCALE" ;;
    *) echo "unknown setup $s" >&2; exit 2 ;;
  esac
done

python3 - "$OUT" "$WORKERS" "$G1_BLOCKS" "$G2_BLOCKS" "$G3_BLOCKS" $SETUPS <<'EOF' | tee "$OUT/table.md"
import json, os, sys
out, workers, g1, g2, g3, setups = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:]
rows = {}
records = {}
later = {}  # TTFT p90 of the calls after each session's first (whose context no cache holds yet)
for s in setups:
    p = os.path.join(out, s, "results.json")
    if os.path.exists(p):
        res = json.load(open(p))[0]
        rows[s], records[s] = res["summary"], res["records"]
        first = {}
        for r in sorted(res["records"], key=lambda r: r["start_ns"]):
            first.setdefault(r.get("session"), r["seq"])
        v = sorted(r["ttft_ns"] for r in res["records"] if r.get("status") == 200 and first[r.get("session")] != r["seq"])
        later[s] = v[int(0.9 * (len(v) - 1))] if v else 0
print(f"{workers} workers, G1 {g1} blocks each, G2 {g2}, G3 {g3} (16-token blocks); latency policy; times in the engines' own time")
print()
print("| setup | hit rate | GPU | host | disk | peers | uncached prefill tokens | TTFT p50 | TTFT p90 | TTFT p90 after first calls | ITL p50 | goodput/s | fork TTFT p50 | fetches pulled / partly / fell back / no room | told to recompute | disk written | disk read |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for s, r in rows.items():
    t = r.get("kv_tiers") or {}
    pct = lambda v: f"{100 * v:.1f}%"
    fork = (r.get("tags") or {}).get("fork", {}).get("p50_ns", 0) / 1e6
    # Requests the proxy told to compute what their worker holds below GPU memory
    # (max_load_tokens 0), from each one's x-kvrelay-route.
    recomputed = sum("load=0" in (x.get("route") or "") for x in records[s]) / max(len(records[s]), 1)
    print(f"| {s}: {t.get('setup', '')} | {pct(r['hit_rate'])} | {pct(t.get('hit_gpu', 0))} | {pct(t.get('hit_cpu', 0))} | {pct(t.get('hit_disk', 0))} | {pct(t.get('hit_peer', 0))} "
          f"| {t.get('uncached_tokens', 0):,} | {r['ttft']['p50_ns'] / 1e6:.0f} ms | {r['ttft']['p90_ns'] / 1e6:.0f} ms | {later[s] / 1e6:.0f} ms | {r['itl']['p50_ns'] / 1e6:.1f} ms "
          f"| {r['goodput_per_s']:.2f} | {fork:.0f} ms | {t.get('peer_fetch_pulled', 0)} / {t.get('peer_fetch_partial', 0)} / {t.get('peer_fetch_fallback', 0)} / {t.get('peer_fetch_no_room', 0)} "
          f"| {pct(recomputed)} | {t.get('disk_written_bytes', 0) / 1e6:.1f} MB | {t.get('disk_read_bytes', 0) / 1e6:.1f} MB |")
print()
def ratio(name, a, b, f):
    if a in rows and b in rows and f(rows[b]) > 0:
        print(f"- {name}: ×{f(rows[a]) / f(rows[b]):.2f}")
gpu = lambda r: (r.get("kv_tiers") or {}).get("hit_gpu", 0)
p90 = lambda r: r["ttft"]["p90_ns"]
ratio("G1 hit rate, WORM + pins ÷ LRU (G1 only)", "g1-worm", "g1-lru", gpu)
ratio("G1 hit rate, WORM without pins ÷ LRU (G1 only)", "g1-worm-nopin", "g1-lru", gpu)
ratio("TTFT p90, G1 only ÷ G1 + G2 (LRU)", "g1-lru", "g2-lru", p90)
if "g1-lru" in later and later.get("g2-lru"):
    print(f"- TTFT p90 after each session's first call, G1 only ÷ G1 + G2 (LRU): ×{later['g1-lru'] / later['g2-lru']:.2f}")
ratio("TTFT p90, G1 + G2 ÷ G1 + G2 + G3 (LRU)", "g2-lru", "g3-lru", p90)
ratio("TTFT p90, LRU ÷ WORM + pins (G1 + G2 + G3)", "g3-lru", "g3-worm", p90)
hit = lambda r: r["hit_rate"]
ratio("G1 hit rate, WORM learning write-once ÷ WORM without the hint (G1 + G2 + G3)", "g3-worm-learn", "g3-worm-nohint", gpu)
ratio("G1 hit rate, WORM learning write-once ÷ WORM with the client's hint", "g3-worm-learn", "g3-worm", gpu)
ratio("TTFT p90, LRU ÷ WORM learning write-once (G1 + G2 + G3)", "g3-lru", "g3-worm-learn", p90)
ratio("G1 hit rate, WORM from the engines' reasoning spans ÷ WORM with the client's hint", "g3-worm-reasoning", "g3-worm", gpu)
ratio("G1 hit rate, WORM from the engines' reasoning spans ÷ LRU (G1 + G2 + G3)", "g3-worm-reasoning", "g3-lru", gpu)
ratio("TTFT p90, LRU ÷ WORM from the engines' reasoning spans (G1 + G2 + G3)", "g3-lru", "g3-worm-reasoning", p90)
ratio("TTFT p90, LRU ÷ WORM from the engines' reasoning spans, no pins (G1 + G2 + G3)", "g3-lru", "g3-worm-reasoning-nopin", p90)
p50 = lambda r: r["ttft"]["p50_ns"]
ratio("hit rate, shared G3 ÷ each worker's own G3 (LRU)", "g3-shared", "g3-lru", hit)
ratio("TTFT p90, own G3 ÷ shared G3 (LRU)", "g3-lru", "g3-shared", p90)
for other in ("always", "never"):
    ratio(f"TTFT p50, slow disk, {other} load ÷ weighed", f"slow-{other}", "slow-weigh", p50)
    ratio(f"TTFT p90, slow disk, {other} load ÷ weighed", f"slow-{other}", "slow-weigh", p90)
fork = lambda r: (r.get("tags") or {}).get("fork", {}).get("p50_ns", 0)
ratio("fork TTFT p50, recompute ÷ peer fetch (cold start)", "cold", "cold-fetch", fork)
# The target's comparison: a fork computing its context on a worker that caches (almost)
# none of it, against a fork told to fetch it.
def forks(setup, keep):
    return sorted(r["ttft_ns"] for r in records.get(setup, [])
                  if r.get("tag") == "fork" and r.get("status") == 200 and keep(r))
recompute = forks("cold", lambda r: r["cached_tokens"] < r["prompt_tokens"] / 10)
fetched = forks("cold-fetch", lambda r: "fetch=" in (r.get("route") or ""))
if recompute and fetched:
    med = lambda v: v[len(v) // 2]
    print(f"- fork TTFT p50, computed on a worker caching under a tenth of it ({len(recompute)} forks, {med(recompute) / 1e6:.0f} ms) ÷ fetched ({len(fetched)}, {med(fetched) / 1e6:.0f} ms): ×{med(recompute) / med(fetched):.2f}")
EOF
