#!/usr/bin/env bash
# Installs the helm that hack/deploy/helm's tests run, built from the Go module proxy, into
#   ${KVRELAY_TOOLS:-$HOME/.cache/kvrelay/tools}/helm-<version>/helm
# (about 2 minutes on 2 cores, once). A second run only prints the path. The build is stamped
# as helm's own Makefile stamps a release: `helm version` reports the version, and templates
# and lint default to the Kubernetes minor of the client-go helm is built with (unstamped,
# they would assume 1.20). Prints the binary's path on its last line.
set -euo pipefail
die() { echo "helm.sh: $*" >&2; exit 1; }

# Keep in step with helmVersion in hack/deploy/helm/chart_test.go, which looks for this path.
version=v3.22.0
dir=${KVRELAY_TOOLS:-$HOME/.cache/kvrelay/tools}/helm-$version
bin=$dir/helm

if [ ! -x "$bin" ]; then
  echo "helm.sh: building helm $version (a minute or two, once)"
  start=$SECONDS
  mod=helm.sh/helm/v3
  mkdir -p "$dir"
  # Built into a temporary directory and renamed, so an interrupted build leaves nothing the
  # tests would run; run from there, outside any module, so no go.mod plays a part.
  tmp=$(mktemp -d "$dir/.build.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  cd "$tmp"
  gomod=$(go mod download -json "$mod@$version" | sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p')
  [ -n "$gomod" ] || die "go mod download $mod@$version failed"
  k8s=$(sed -n 's/^\tk8s.io\/client-go v0\.\([0-9]*\)\..*/\1/p' "$gomod")
  [ -n "$k8s" ] || die "no k8s.io/client-go in $gomod"
  ldflags="-s -w -X $mod/internal/version.version=$version -X $mod/internal/version.gitTreeState=clean"
  for pkg in chartutil lint/rules; do
    ldflags+=" -X $mod/pkg/$pkg.k8sVersionMajor=1 -X $mod/pkg/$pkg.k8sVersionMinor=$k8s"
  done
  GOBIN=$tmp go install -trimpath -ldflags "$ldflags" "$mod/cmd/helm@$version" \
    || die "go install $mod/cmd/helm@$version failed"
  mv "$tmp/helm" "$bin"
  echo "helm.sh: built $("$bin" version --short) in $((SECONDS - start))s"
fi

echo "$bin"
