#!/usr/bin/env bash
# The adversity suite's long mode: the scenarios of tests/adversity (soak with verified
# bytes over every path, cancel/timeout storm with canaries, API fuzz, wire and peer
# attacks, kill -9 of either side) for N minutes, then the figures: pulls, bytes,
# corrupt (must be 0), errors by status, faults that did not end in an exception within
# their deadline (must be 0), and the ledger of fds, threads, mappings and /dev/shm
# before and after each module (no growth).
#
#   scripts/adversity.sh [--minutes N]      (default 5; fractions allowed: --minutes 0.5)
#
# The N minutes are shared among the scenarios by weight; set-up, the siege's handshake
# timeouts and tear-down come on top. Exit status: 0 when every scenario passed with 0
# corrupt bytes, 0 late faults and 0 leaks; 1 otherwise; 2 for a usage error.
# Environment: PYTHON (default .venv/bin/python), PYTEST_ARGS (extra pytest arguments,
# e.g. "-k soak").
set -uo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

minutes=5
while [ $# -gt 0 ]; do
    case "$1" in
        --minutes) [ $# -ge 2 ] || { usage >&2; exit 2; }; minutes="$2"; shift 2 ;;
        --minutes=*) minutes="${1#*=}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "adversity.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-.venv/bin/python}"
seconds="$("$PY" -c "import sys; m = float(sys.argv[1]); assert m > 0; print(max(1, round(m * 60)))" "$minutes" 2>/dev/null)" \
    || { echo "adversity.sh: --minutes wants a positive number, got '$minutes'" >&2; exit 2; }

report="$(mktemp "${TMPDIR:-/tmp}/aiodd-adversity.XXXXXX.jsonl")"
trap 'rm -f "$report"' EXIT
echo "adversity: ${seconds} s of scenarios (report: $report)"
# A bound on the whole run: a hang is a failure, never a stuck job.
limit=$(( seconds * 3 + 900 ))
# shellcheck disable=SC2086
AIODATADIST_ADVERSITY_SECONDS="$seconds" AIODATADIST_ADVERSITY_REPORT="$report" \
    timeout --kill-after=30 "$limit" "$PY" -m pytest -q tests/adversity -p no:cacheprovider \
    ${PYTEST_ARGS:-}
rc=$?
"$PY" tests/adversity/report.py "$report" --pytest-rc "$rc"
