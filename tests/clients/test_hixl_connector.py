"""vllm-ascend's HIXLConnector port (examples/clients/hixl_connector_*.py) runs.

A prefill and a decode process, each a listening HIXL-backend instance; the decoder links
once (``ensure_linked`` under a lock, called by every pull) and pulls six requests as 96
``pull_blocks`` calls (contiguous runs x four caches with unique model ids: two attention
groups, Mamba conv and ssm with one tensor per layer) from 32 threads (tasks) on that one
link; every byte and every untouched block are checked inside the port.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clients._run import LOOPS, assert_client_ok, run_client

pytestmark = pytest.mark.slow  # two processes per run


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("script", ["hixl_connector_sync.py", "hixl_connector_async.py"])
def test_hixl_connector(script: str, loop: str, tmp_path: Path) -> None:
    lines = assert_client_ok(run_client(script, loop, tmp_path), script, loop)
    assert any(ln.startswith("6 requests, 96 pull_blocks calls from 32 ") for ln in lines), lines
    assert any("on 1 link, 4 caches" in ln for ln in lines), lines
