#!/usr/bin/env bash
# Installs what the interoperability tests use beyond Go, when this machine can: Debian's
# python3-zmq and python3-msgpack (real libzmq and an independent msgpack). The tests that
# need them skip without them, so a failed install is reported and not fatal.
set -u
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
