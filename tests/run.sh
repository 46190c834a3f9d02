#!/usr/bin/env bash
# The test command: installs what the tests need (CPU torch, the package, an etcd
# server) on a fresh machine, runs ruff and mypy, then the whole suite.
#
#   bash tests/run.sh            the whole suite (what CI runs), on three workers
#   bash tests/run.sh --fast     ruff, mypy and every test that starts no torchrun agent,
#                                etcd server or network namespace, on two workers
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

# tests/conftest.py fails a test without a real-part marker that starts a real part anyway
# (so the fast lane cannot slowly grow slow or load-sensitive).
if [ "$fast" = 1 ]; then
  exec python3 -m pytest -q -p no:cacheprovider -n 2 --durations=10 \
    -m "not slow and not etcd and not slurm and not netns and not chaos_full" "$@" tests
fi
# One run on three workers, on two cores: on two, the cores were idle a good part of the
# time (tests wait on timeouts and on training steps); on three they are busy. The join
# tests leave room for a newcomer's start on a loaded machine. tests/conftest.py orders the
# tests (tests/support/machine_share.py): the few with a bound on time ("quiet") first,
# each alone on the machine, then the ones that start real parts, longest first, then the
# fast ones.
# --maxschedchunk=1 hands out one test at a time (xdist's default would give one worker
# the first quarter of the collection at once), so each goes to whichever worker is free.
exec python3 -m pytest -q -p no:cacheprovider -n 3 --dist load --maxschedchunk=1 \
  --durations=25 -m "not chaos_full" "$@" tests
