#!/usr/bin/env bash
# Quick start, command 2: set up and run the whole test suite, plus ruff and mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,docs
echo "== ruff"
.venv/bin/ruff check aiodatadist tests bench examples
echo "== mypy (strict on the package)"
.venv/bin/mypy
echo "== pytest"
# The last line of defence: a run that hangs past this ends (TERM, then KILL) and fails.
timeout --kill-after=30 "${AIODATADIST_TEST_TIMEOUT:-2400}" .venv/bin/pytest "$@"
