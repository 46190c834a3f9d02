#!/usr/bin/env bash
# The test command: installs what the tests need (CPU torch, the package, an etcd
# server) on a fresh machine, runs ruff and mypy, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "the tests need an etcd server (3.4 or 3.5): sudo apt-get install -y etcd-server" >&2
    exit 2
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq etcd-server >/dev/null
fi

# torch first, pinned, so pip takes the CPU wheel instead of a multi-GB CUDA build.
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
python3 -m pip install -q --disable-pip-version-check -e ".[test]"

# Static checks first: they take seconds and name the line.
python3 -m ruff check .
python3 -m mypy

exec python3 -m pytest -q -p no:cacheprovider --durations=25 -m "not chaos_full" "$@" tests
