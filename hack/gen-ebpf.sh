#!/usr/bin/env bash
# Makes sure the eBPF code generators are installed: clang-14 and llvm-strip-14 (bpf2go
# compiles ebpf/probes/*.c with them; the committed objects are clang-14's) and bpftool
# (for --vmlinux). As root on Debian it installs what is missing with apt-get; elsewhere it
# says what to install and fails.
#
#   hack/gen-ebpf.sh            check/install the tools
#   hack/gen-ebpf.sh --generate  ... then go generate ./ebpf/...
#   hack/gen-ebpf.sh --vmlinux   ... then refresh ebpf/probes/vmlinux.h from this kernel's BTF
#                                (CO-RE: the committed one need not match the running kernel)
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v clang-14 >/dev/null 2>&1 || need+=(clang-14)
command -v llvm-strip-14 >/dev/null 2>&1 || need+=(llvm-14)
[ "${1:-}" != --vmlinux ] || command -v bpftool >/dev/null 2>&1 || need+=(bpftool)
[ -e /usr/include/bpf/bpf_helpers.h ] || need+=(libbpf-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "gen-ebpf: installing ${need[*]}" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") >/dev/null
  else
    echo "gen-ebpf: missing ${need[*]}; install them (Debian: apt-get install ${need[*]})" >&2
    exit 1
  fi
fi
case "${1:-}" in
  --generate) go generate ./ebpf/... ;;
  --vmlinux) bpftool btf dump file /sys/kernel/btf/vmlinux format c > ebpf/probes/vmlinux.h ;;
esac
