#!/usr/bin/env bash
# Installs the promtool that hack/deploy/helm's tests check the chart's alerting rules with
# (promtool check rules, promtool test rules), built from the Go module proxy, into
#   ${KVRELAY_TOOLS:-$HOME/.cache/kvrelay/tools}/promtool-<version>/promtool
# (a few minutes on 2 cores, once). A second run only prints the path. Prints the binary's
# path on its last line.
set -euo pipefail
die() { echo "promtool.sh: $*" >&2; exit 1; }

# Keep in step with promtoolVersion in hack/deploy/helm/rules_test.go, which looks for this
# path. The module's v0.316.0 is Prometheus 3.16.
version=v0.316.0
dir=${KVRELAY_TOOLS:-$HOME/.cache/kvrelay/tools}/promtool-$version
bin=$dir/promtool

if [ ! -x "$bin" ]; then
  echo "promtool.sh: building promtool $version (a few minutes, once)"
  start=$SECONDS
  mkdir -p "$dir"
  # Built into a temporary directory and renamed, so an interrupted build leaves nothing the
  # tests would run; run from there, outside any module, so no go.mod plays a part.
  tmp=$(mktemp -d "$dir/.build.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  cd "$tmp"
  GOBIN=$tmp go install -trimpath -ldflags "-s -w" "github.com/prometheus/prometheus/cmd/promtool@$version" \
    || die "go install github.com/prometheus/prometheus/cmd/promtool@$version failed"
  mv "$tmp/promtool" "$bin"
  echo "promtool.sh: built $("$bin" --version 2>&1 | head -1) in $((SECONDS - start))s"
fi

echo "$bin"
