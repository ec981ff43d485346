#!/usr/bin/env bash
# Installs the transfer engines (NIXL, Mooncake) into .venv for their tests and data paths.
#
#   scripts/setup_engines.sh          (CI runs it before scripts/test.sh; root installs apt packages)
#
# NIXL: nixl-cu12 with --no-deps, its metadata requires a CUDA torch that nothing here uses
#   (numpy, its other dependency, comes with aiodatadist). On a GPU host `pip install
#   'aiodatadist[nixl]'` is the route (torch is there anyway).
# Mooncake: the non-CUDA wheel; its engine.so links the system's libibverbs.so.1 (and
#   libnuma.so.1, libcurl.so.4): apt packages libibverbs1 libnuma1 libcurl4, installed here
#   when running as root, else only checked.
# Ends by importing both engines (non-zero exit, with the reason, if one cannot be imported);
# `aiodatadist doctor` then says what each engine found here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
APT_PACKAGES=(libibverbs1 libnuma1 libcurl4)
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    echo "== apt-get install ${missing[*]}"
    apt-get update -qq && apt-get install -y -qq "${missing[@]}"
  fi
fi
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
echo "== engines into .venv: nixl-cu12 (--no-deps), mooncake-transfer-engine-non-cuda"
.venv/bin/python -m pip install -q --no-deps 'nixl-cu12>=1.5,<2'
.venv/bin/python -m pip install -q 'mooncake-transfer-engine-non-cuda>=0.3.13'
# The verdict without aiodatadist (its native core may not be built yet); nixl needs numpy.
.venv/bin/python -m pip install -q 'numpy>=1.24'
.venv/bin/python - <<'PY'
import importlib, sys
bad = 0
for module in ("nixl_cu12", "mooncake.engine"):
    try:
        importlib.import_module(module)
        print(f"{module}: imports")
    except Exception as exc:  # the reason is the report
        print(f"{module}: {type(exc).__name__}: {exc}", file=sys.stderr)
        bad = 1
sys.exit(bad)
PY
