#!/usr/bin/env bash
# hack/build-llmd.sh: build llm-d's endpoint picker (`cmd/epp` of llm-d/llm-d-router) and
# `llm-d-inference-sim` (`cmd/llm-d-inference-sim` of llm-d/llm-d-inference-sim) from source
# into $OUT (default out/peers/bin, git-ignored), for hack/bench-llmd:
#
#   hack/build-llmd.sh
#   LLMD_EPP=out/peers/bin/epp LLMD_SIM=out/peers/bin/llm-d-inference-sim go run ./hack/bench-llmd
#
# Sources: LLMD_ROUTER_SRC / LLMD_SIM_SRC, each a git directory (bare or not) or a plain
# checkout; without them, a shallow clone from GitHub. LLMD_ROUTER_REF / LLMD_SIM_REF pick the commit (default HEAD; a checkout's
# committed HEAD, not its uncommitted edits). Each is exported into a temporary tree and built
# with CGO_ENABLED=0, as both projects' Dockerfiles do (no build tag needed: the simulator's
# default build is pure Go; the harness runs it with --force-dummy-tokenizer).
#
# The simulator's go.mod pins an llm-d-router release (v0.10.0 at the time of writing) that the
# Go module proxy may not serve (403). Then the pin is replaced by that release's tag exported
# from the router source (fetched into a clone), or, when the source lacks the tag, by the router
# tree built for the EPP, followed by `go mod tidy` (its newer dependencies are not in go.sum).
# Every run rebuilds both binaries (Go's build cache keeps that quick).
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

OUT=${OUT:-out/peers/bin}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/build-llmd.XXXXXX")
trap 'rm -rf "$work"' EXIT
export CGO_ENABLED=0

# export_tree SRC REPO REF DEST: write REF of SRC (or a fresh clone of llm-d/REPO) into DEST
# and print its commit ("plain-checkout" for a directory that is no git repository).
export_tree() {
  local src=$1 repo=$2 ref=$3 dest=$4 gitdir commit
  if [ -z "$src" ]; then
    gitdir="$work/$repo.git"
    [ -d "$gitdir" ] || git clone -q --bare --depth 1 "https://github.com/llm-d/$repo" "$gitdir" >&2
    git --git-dir="$gitdir" rev-parse -q --verify "$ref^{commit}" >/dev/null ||
      git --git-dir="$gitdir" fetch -q --depth 1 origin "refs/tags/$ref:refs/tags/$ref" >&2 || true
  elif [ -e "$src/.git" ]; then
    gitdir=$(git -C "$src" rev-parse --absolute-git-dir)
  elif git --git-dir="$src" rev-parse -q --verify HEAD >/dev/null 2>&1; then
    gitdir=$src
  elif [ -f "$src/go.mod" ] && [ "$ref" = HEAD ]; then
    mkdir -p "$dest"
    (cd "$src" && tar -c --exclude=./.git .) | tar -x -C "$dest"
    echo plain-checkout
    return
  else
    echo "build-llmd: $src is neither a git directory nor a Go checkout (at HEAD)" >&2
    return 1
  fi
  commit=$(git --git-dir="$gitdir" rev-parse -q --verify "$ref^{commit}") ||
    { echo "build-llmd: no commit $ref in $gitdir" >&2; return 1; }
  mkdir -p "$dest"
  git --git-dir="$gitdir" archive "$commit" | tar -x -C "$dest"
  echo "$commit"
}

router_src=${LLMD_ROUTER_SRC:-}
sim_src=${LLMD_SIM_SRC:-}

echo "== llm-d-router (${router_src:-clone}) =="
router_commit=$(export_tree "$router_src" llm-d-router "${LLMD_ROUTER_REF:-HEAD}" "$work/router")
router_mod=$(awk '$1 == "module" {print $2; exit}' "$work/router/go.mod")
(cd "$work/router" && go build -trimpath -buildvcs=false \
  -ldflags "-s -w -X $router_mod/version.CommitSHA=$router_commit" -o "$OUT/epp" ./cmd/epp)

echo "== llm-d-inference-sim (${sim_src:-clone}) =="
sim_commit=$(export_tree "$sim_src" llm-d-inference-sim "${LLMD_SIM_REF:-HEAD}" "$work/sim")
cd "$work/sim"
pin=$(go mod edit -json | awk -v m="\"$router_mod\"" '$1 == "\"Path\":" && $2 == m"," {getline; gsub(/[",]/, "", $2); print $2; exit}')
note="$router_mod ${pin:-(not required)} from the module proxy"
if [ -n "$pin" ] && ! go mod download "$router_mod@$pin" >/dev/null 2>&1; then
  if router_pin=$(export_tree "$router_src" llm-d-router "$pin" "$work/router-pin" 2>/dev/null); then
    go mod edit -replace "$router_mod=$work/router-pin"
    note="$router_mod $pin not on the module proxy: replaced by its tag in the router source ($router_pin)"
  else
    go mod edit -replace "$router_mod=$work/router"
    go mod tidy
    note="$router_mod $pin neither on the module proxy nor in the router source: replaced by the EPP's router tree ($router_commit) + go mod tidy"
  fi
fi
go build -trimpath -buildvcs=false -ldflags "-s -w" -o "$OUT/llm-d-inference-sim" ./cmd/llm-d-inference-sim

# The commits, for the harnesses' result headers (internal/benchharness.BinaryVersion).
printf 'epp llm-d-router %s\nllm-d-inference-sim llm-d-inference-sim %s\n' "$router_commit" "$sim_commit" > "$OUT/versions.txt"

cat <<EOF
built:
  $OUT/epp                  llm-d-router $router_commit
  $OUT/llm-d-inference-sim  llm-d-inference-sim $sim_commit
                            ($note)
run: LLMD_EPP=$OUT/epp LLMD_SIM=$OUT/llm-d-inference-sim go run ./hack/bench-llmd
EOF
