#!/usr/bin/env bash
# Creates .venv (if missing) and installs aiodatadist into it, compiling the native core.
# Usage: scripts/setup.sh [extra]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
extra=${1:-}
if [[ -n "$extra" ]]; then
  .venv/bin/python -m pip install -q -e ".[$extra]"
else
  .venv/bin/python -m pip install -q -e .
fi
