#!/usr/bin/env bash
# Regenerates everything `go generate` produces and fails if the committed copies differ.
set -euo pipefail
cd "$(dirname "$0")/.."
go generate ./...
if ! git diff --quiet -- .; then
  echo "generated files differ from what is committed; run 'make generate' and commit:"
  git diff --stat -- .
  exit 1
fi
