#!/usr/bin/env bash
# Regenerates the Go code of the protobuf packages (xds/api/v1's kvrelay.proto, the operator
# API's controlplane/api/v1/operator.proto), or only of the package directories given as
# arguments, relative to the repository root. Needs protoc (Debian's
# protobuf-compiler, installed here when missing and running as root) and installs the Go
# plugins at pinned versions into hack/bin.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/hack/bin
mkdir -p "$bin"
if ! command -v protoc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq protobuf-compiler) >/dev/null
  else
    echo "gen-proto: protoc is missing (Debian: apt-get install protobuf-compiler)" >&2
    exit 1
  fi
fi
[ -x "$bin/protoc-gen-go" ] || GOBIN=$bin go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
[ -x "$bin/protoc-gen-go-grpc" ] || GOBIN=$bin go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2
dirs=("$@")
[ ${#dirs[@]} -gt 0 ] || dirs=(xds/api/v1 controlplane/api/v1)
for dir in "${dirs[@]}"; do
  (
    cd "$root/$dir"
    PATH=$bin:$PATH protoc --proto_path=. \
      --go_out=. --go_opt=paths=source_relative \
      --go-grpc_out=. --go-grpc_opt=paths=source_relative \
      ./*.proto
  )
done
