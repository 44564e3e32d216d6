#!/usr/bin/env bash
# Regenerates everything `go generate` produces and fails if that changed any file: the
# committed generated code must be what the generators make from the committed sources.
set -euo pipefail
cd "$(dirname "$0")/.."
before=$(git status --porcelain=v1 --untracked-files=all; git diff | sha256sum)
./hack/gen-ebpf.sh # clang-14 for ebpf/probes (bpf2go)
go generate ./...
after=$(git status --porcelain=v1 --untracked-files=all; git diff | sha256sum)
if [ "$before" != "$after" ]; then
  echo "go generate changed the tree; run 'make generate' and commit the result:"
  git status --short
  exit 1
fi
