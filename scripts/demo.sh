#!/usr/bin/env bash
# Quick start, command 1: set up and run the demo (a prompt and a decoder exchanging KV blocks).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/aiodatadist demo "$@"
