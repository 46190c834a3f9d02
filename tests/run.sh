#!/usr/bin/env bash
# The test command: installs what the tests need (CPU torch, the package, an etcd
# server) on a fresh machine, runs ruff and mypy, then the whole suite.
#
#   bash tests/run.sh            the whole suite (what CI runs): the fast lane's tests, then
#                                the tests that start real parts, each phase on two workers
#   bash tests/run.sh --fast     ruff, mypy and every test that starts no torchrun agent,
#                                etcd server or network namespace, on two workers
# The phases stay apart so that the fast lane's guard (tests/conftest.py) holds in the first
# and a fast test never waits behind a chaos run.
# Further arguments go to pytest (e.g. -k NAME, or a test file).
set -euo pipefail
cd "$(dirname "$0")/.."

fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi

if [ "$fast" = 0 ] && ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "the tests need an etcd server (3.4 or 3.5): sudo apt-get install -y etcd-server" >&2
    exit 2
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq etcd-server >/dev/null
fi

# torch first, pinned, so pip takes the CPU wheel instead of a multi-GB CUDA build. The
# fast lane installs only what is missing, so that it answers in seconds once set up.
if [ "$fast" = 0 ] || ! python3 -c "import torch, elastic_ext, pytest, xdist, ruff, mypy" \
    2>/dev/null; then
  python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
  python3 -m pip install -q --disable-pip-version-check -e ".[test]"
fi

# Static checks first: they take seconds and name the line.
python3 -m ruff check .
python3 -m mypy

FAST_LANE="not slow and not etcd and not slurm and not netns and not chaos_full"
REAL_PARTS="(slow or etcd or slurm or netns) and not chaos_full"

# pytest's "no tests ran" (5) fails only when no phase ran a test: -k NAME may select
# tests of one phase alone.
phases_with_tests=0
run_phase() {
  local rc=0
  python3 -m pytest -q -p no:cacheprovider "$@" || rc=$?
  [ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"
  [ "$rc" = 5 ] || phases_with_tests=$((phases_with_tests + 1))
}

# tests/conftest.py fails a fast-lane test that starts a real part (so the lane, and this
# two-worker phase, cannot slowly grow slow or load-sensitive)
ELASTIC_EXT_FAST_LANE=1 run_phase -n 2 --dist load -m "$FAST_LANE" "$@" tests
if [ "$fast" = 0 ]; then
  run_phase -n 2 --dist load --durations=25 -m "$REAL_PARTS" "$@" tests
fi
if [ "$phases_with_tests" = 0 ]; then
  echo "no test ran" >&2
  exit 5
fi
