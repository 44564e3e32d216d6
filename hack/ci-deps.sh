#!/usr/bin/env bash
# Installs what the tests use beyond Go, when this machine can: a C compiler (gcc: the race
# detector needs cgo), helm (hack/helm.sh), promtool (hack/promtool.sh), Debian's chromium (the console's browser tests)
# and Debian's python3-zmq and python3-msgpack (real
# libzmq and an independent msgpack for the interoperability tests). Without them `make test` runs without
# -race and the interop tests skip, so a failed install is reported and not fatal.
set -u
if ! command -v "${CC:-gcc}" >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq gcc libc6-dev) >/dev/null 2>&1 \
      && echo "ci-deps: installed gcc" \
      || echo "ci-deps: could not install gcc; make test will run without the race detector"
  else
    echo "ci-deps: no C compiler and no way to install one; make test will run without the race detector"
  fi
fi
# helm for the chart's tests (built once with go install into a cache).
"$(dirname "$0")/helm.sh" >/dev/null || echo "ci-deps: could not build helm; the chart tests will skip"
# promtool for the chart's alerting rules (built once with go install into a cache).
"$(dirname "$0")/promtool.sh" >/dev/null || echo "ci-deps: could not build promtool; the rules tests will skip"
# Chromium for the operator console's browser tests (Debian's package).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
      && echo "ci-deps: installed chromium" \
      || echo "ci-deps: could not install chromium; the console's browser tests will skip"
  else
    echo "ci-deps: no chromium and no way to install it; the console's browser tests will skip"
  fi
fi
py=/usr/bin/python3
if [ -x "$py" ] && "$py" -c 'import zmq, msgpack' 2>/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq python3 python3-zmq python3-msgpack) >/dev/null 2>&1 \
    && echo "ci-deps: installed python3-zmq and python3-msgpack" \
    || echo "ci-deps: could not install python3-zmq/python3-msgpack; interop tests will skip"
else
  echo "ci-deps: not root or no apt-get; interop tests against libzmq will skip"
fi
exit 0
