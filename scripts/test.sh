#!/usr/bin/env bash
# Quick start, command 2: set up and run the whole test suite, plus ruff and mypy.
#
#   scripts/test.sh [pytest args...]           the full run (what CI runs)
#   scripts/test.sh --quick [pytest args...]   the quick loop: ruff, then
#                                              pytest -m "not slow" (under a minute; no mypy)
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [[ ${1:-} == --quick ]]; then
  quick=1
  shift
fi
scripts/setup.sh test,docs
echo "== ruff"
.venv/bin/ruff check aiodatadist tests bench examples
if ((quick)); then
  set -- -m "not slow" "$@"
else
  echo "== mypy (strict on the package)"
  .venv/bin/mypy
fi
echo "== pytest $*"
# The last line of defence: a run that hangs past this ends (TERM, then KILL) and fails.
timeout --kill-after=30 "${AIODATADIST_TEST_TIMEOUT:-2400}" .venv/bin/pytest "$@"
