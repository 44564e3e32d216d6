#!/usr/bin/env bash
# Installs the binaries internal/kubetest runs, a real etcd and kube-apiserver on loopback,
# into a cache keyed by the Kubernetes release:
#   ${KVRELAY_KUBE_CACHE:-$HOME/.cache/kvrelay/kube}/<release>/bin/{etcd,kube-apiserver}
# etcd is Debian's etcd-server package (copied, so the cache outlives the package); the
# kube-apiserver is built from the Go module proxy by the wrapper module in hack/kube-testenv/,
# whose go.mod names the release (once: 4 to 9 minutes on 2 cores, 2.4 GB of memory). What is
# cached already is kept, so a second run only prints the directory. Prints the bin directory
# on its last line; KVRELAY_KUBE_BIN=<that> points the tests at another one.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive # apt-get in CI has no terminal to ask on
die() { echo "kube-testenv: $*" >&2; exit 1; }

wrapper=hack/kube-testenv
release=$(cd "$wrapper" && go list -m -f '{{.Version}}' k8s.io/kubernetes)
[[ $release =~ ^v1\.([0-9]+)\.[0-9]+$ ]] || die "unexpected k8s.io/kubernetes version $release"
minor=${BASH_REMATCH[1]}
bin=${KVRELAY_KUBE_CACHE:-$HOME/.cache/kvrelay/kube}/$release/bin
mkdir -p "$bin"

if [ ! -x "$bin/etcd" ]; then
  if ! [ -x /usr/bin/etcd ]; then
    [ "$(id -u)" = 0 ] || die "etcd is missing: run as root, or apt-get install etcd-server"
    # A fresh machine has no package lists: update only when the install cannot find it.
    apt-get install -y -qq etcd-server >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq etcd-server >/dev/null; } \
      || die "apt-get install etcd-server failed"
  fi
  cp /usr/bin/etcd "$bin/etcd.tmp"
  mv "$bin/etcd.tmp" "$bin/etcd"
  echo "kube-testenv: etcd $("$bin/etcd" --version | sed -n 's/^etcd Version: //p')"
fi

if [ ! -x "$bin/kube-apiserver" ]; then
  echo "kube-testenv: building kube-apiserver $release (a few minutes, once)"
  start=$SECONDS
  # The version variables are what upstream's build stamps; /version reports them. Built to
  # a temporary name and renamed, so an interrupted build leaves nothing the tests would run.
  pkg=k8s.io/component-base/version
  (cd "$wrapper" && go build -trimpath -buildvcs=false \
    -ldflags "-s -w -X $pkg.gitVersion=$release -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean" \
    -o "$bin/kube-apiserver.tmp" .) || die "building kube-apiserver failed"
  mv "$bin/kube-apiserver.tmp" "$bin/kube-apiserver"
  echo "kube-testenv: built kube-apiserver in $((SECONDS - start))s"
fi

echo "$bin"
