"""vllm-ascend's LLMDataDistCMgrConnector port (examples/clients/vllm_ascend_*.py) runs.

Two prefill/decode process pairs (an MHA model on an A2 rank table, an MLA model with 61
layers on an A3 one) link two-sided, and the decoder pulls five requests (two with a
cached prefix) on the connector's single-thread executor; every pulled byte and every
block no request named are checked inside the port.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clients._run import LOOPS, assert_client_ok, run_client

pytestmark = pytest.mark.slow  # four processes per run


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("script", ["vllm_ascend_sync.py", "vllm_ascend_async.py"])
def test_vllm_ascend_connector(script: str, loop: str, tmp_path: Path) -> None:
    lines = assert_client_ok(run_client(script, loop, tmp_path), script, loop)
    assert any(ln.startswith("mha: 5 requests, ") for ln in lines), lines
    assert any(ln.startswith("mla: 5 requests, ") for ln in lines), lines
