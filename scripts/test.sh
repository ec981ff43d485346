#!/usr/bin/env bash
# Quick start, command 2: set up and run the whole test suite, plus ruff and mypy.
#
#   scripts/test.sh [pytest args...]           the full run (what CI runs)
#   scripts/test.sh --quick [pytest args...]   the quick loop: ruff, then
#                                              pytest -m "not slow" (under a minute; no mypy)
#
# pytest runs in AIODATADIST_TEST_WORKERS processes (pytest-xdist; default 2, 0: in this
# process). Most of the suite's time is spent waiting (peer processes starting, deadlines
# passing, engines finalizing), so two workers halve it even on two cores: ~6 min instead
# of ~11 here, ~10 min instead of ~17.5 beside two CPU burners, every test still passing.
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
echo "== pytest -n ${AIODATADIST_TEST_WORKERS:-2} $*"
# The last line of defence: a run that hangs past this ends (TERM, then KILL) and fails.
workers=${AIODATADIST_TEST_WORKERS:-2}
timeout --kill-after=30 "${AIODATADIST_TEST_TIMEOUT:-2400}" .venv/bin/pytest -n "$workers" "$@"
