#!/usr/bin/env bash
# Builds aiodatadist._native with ASan + UBSan and runs the native-core tests against it.
#
#   scripts/sanitize.sh [pytest args...]      e.g. scripts/sanitize.sh -x -k sock
#
# The build goes to build/sanitize and is installed (not editable) into its own venv,
# build/sanitize-venv, so the developer venv (.venv, editable) is never touched or used.
# pytest runs from build/, where the source tree's aiodatadist/ cannot shadow the
# installed, sanitized one. Exits non-zero on a test failure or on any sanitizer report
# (reports are collected under build/sanitize-logs/ and printed), including reports
# from the worker processes the two-process tests start.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=$ROOT/build/sanitize-venv
BUILD=$ROOT/build/sanitize
LOGS=$ROOT/build/sanitize-logs
start=$SECONDS

if [[ ! -x $VENV/bin/python ]]; then
  "$PY" -m venv "$VENV"
fi
# Test deps (the repo's pytest config needs pytest-asyncio, tests/conftest.py needs uvloop)
# and build deps, so the build itself runs without isolation and stays incremental.
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q numpy pytest pytest-asyncio pytest-timeout uvloop \
  "scikit-build-core>=1.0" "pybind11>=2.12"

echo "== build (ASan + UBSan) into $BUILD"
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation --force-reinstall \
  --config-settings=cmake.define.AIODATADIST_SANITIZE=ON \
  --config-settings=cmake.build-type=RelWithDebInfo \
  --config-settings=build-dir="$BUILD" \
  "$ROOT"

ASAN_LIB=$(gcc -print-file-name=libasan.so)
UBSAN_LIB=$(gcc -print-file-name=libubsan.so)
for lib in "$ASAN_LIB" "$UBSAN_LIB"; do
  [[ -e $lib ]] || { echo "sanitize: $lib not found (install gcc's libasan/libubsan)" >&2; exit 2; }
done

rm -rf "$LOGS"
mkdir -p "$LOGS"
cd "$ROOT/build"
export LD_PRELOAD="$ASAN_LIB $UBSAN_LIB"
# CPython leaks by design; reports go to files so that none is lost in captured output.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:log_path=$LOGS/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$LOGS/ubsan"
export PYTHONDONTWRITEBYTECODE=1

# Refuse to run against anything but the sanitized build in the sanitize venv.
so=$("$VENV/bin/python" -c 'import aiodatadist._native as m; print(m.__file__)')
case $so in
  "$VENV"/*) ;;
  *) echo "sanitize: imported $so, not the sanitize venv's build" >&2; exit 2 ;;
esac
if ! LD_PRELOAD= readelf -d "$so" | grep -q 'libasan'; then
  echo "sanitize: $so is not linked against libasan" >&2
  exit 2
fi
echo "== pytest tests/native against $so"

rc=0
"$VENV/bin/python" -m pytest "$ROOT/tests/native" --rootdir="$ROOT" -p no:cacheprovider "$@" || rc=$?

unset LD_PRELOAD
reports=$(find "$LOGS" -type f | sort)
if [[ -n $reports ]]; then
  echo "== sanitizer reports" >&2
  for f in $reports; do
    echo "---- $f" >&2
    cat "$f" >&2
  done
  [[ $rc -ne 0 ]] || rc=1
fi
echo "== sanitize: pytest exit $rc, $(echo "$reports" | grep -c . || true) sanitizer report(s), $((SECONDS - start)) s"
exit $rc
