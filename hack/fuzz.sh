#!/usr/bin/env bash
# Runs every FuzzXxx target in the module for $FUZZTIME each (default 10s).
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZTIME=${FUZZTIME:-10s}
status=0
while IFS= read -r file; do
  dir=$(dirname "$file")
  for fn in $(grep -oE '^func (Fuzz[A-Za-z0-9_]+)\(' "$file" | sed -E 's/^func (Fuzz[A-Za-z0-9_]+)\(/\1/'); do
    echo "== ./$dir $fn ($FUZZTIME)"
    go test "./$dir" -run '^$' -fuzz "^${fn}\$" -fuzztime "$FUZZTIME" || status=1
  done
done < <(git ls-files '*_test.go' | xargs grep -l '^func Fuzz' | sort)
exit $status
