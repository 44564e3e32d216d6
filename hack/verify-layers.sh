#!/usr/bin/env bash
# Fails when a package imports (directly or not) across kvrelay's layers: the data plane and
# the control plane never import each other, xds sits below both, engines know nothing of
# routing or of either plane, and nixl imports no other kvrelay package. Test files are
# exempt (integration tests run both planes).
set -euo pipefail
cd "$(dirname "$0")/.."
mod=github.com/kvrelay/kvrelay
fail=0
# check <packages> <forbidden import prefix, under the module or (starting with ^) a full path pattern> <why>
check() {
  local bad pat="^$mod/$2(/|$)"
  case "$2" in ^*) pat="$2";; esac
  bad=$(go list -deps -f '{{.ImportPath}}' $1 | grep -E "$pat" || true)
  if [ -n "$bad" ]; then
    echo "layering: $1 imports $2 ($3):"
    echo "$bad" | sed 's/^/  /'
    # Name the direct importers, to say where to look.
    for p in $(go list $1); do
      for imp in $(go list -f '{{join .Imports " "}}' "$p"); do
        if echo "$imp" | grep -qE "$pat"; then echo "  $p -> $imp"; fi
      done
    done
    fail=1
  fi
}
check "./controlplane/..." dataplane "the planes never import each other"
check "./dataplane/..." controlplane "the planes never import each other"
check "./xds/..." dataplane "xds sits below both planes"
check "./xds/..." controlplane "xds sits below both planes"
check "./engines/..." dataplane "engines know nothing of routing"
check "./engines/..." controlplane "engines know nothing of the control plane"
check "./dataplane/decide/..." "dataplane/(proxy|epp|http1)" "a request is decided in one place and carried in another"
check "./dataplane/decide/..." "^github.com/(panjf2000/gnet|envoyproxy/go-control-plane/envoy/(service|extensions/filters/http)/ext_proc)" "a decision knows no transport"
check "./nixl/..." "(dataplane|controlplane|xds|engines|ebpf)" "nixl is a leaf"
exit $fail
