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
# Bytecode for the package and the tests, written once here. Where PYTHONDONTWRITEBYTECODE
# is set (as on the dev VM), nothing else writes it, and every process that imports the
# editable package (each peer process a test starts, each demo process) compiled its ~80
# modules from source: ~0.08 s of a peer's ~0.2 s start. A stale file is never used (its
# source's mtime is checked), so this only saves time.
.venv/bin/python -m compileall -q -j 0 aiodatadist tests examples bench >/dev/null
