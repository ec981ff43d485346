"""omni-infer's LLMDataDistManager port (examples/clients/omni_infer_*.py) runs.

Two prefill ranks and one decode rank (2P1D): two-sided links per (prefill, decode) pair
made in one batch and polled until ready, one pull thread (task) per prefill cluster, three
sub-caches (model ids); the first pull from prefill rank 0 fails with
LLM_KV_CACHE_NOT_EXIST (its third sub-cache is registered late), which is outside the
retry set: re-raised without a retry and reported, then pulled again once registered.
Bytes and untouched blocks are checked inside the port.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clients._run import LOOPS, assert_client_ok, run_client

pytestmark = pytest.mark.slow  # three processes per run


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("script", ["omni_infer_sync.py", "omni_infer_async.py"])
def test_omni_infer_manager(script: str, loop: str, tmp_path: Path) -> None:
    result = run_client(script, loop, tmp_path)
    lines = assert_client_ok(result, script, loop)
    assert any(
        ln.startswith("2P1D: 4 requests x 3 sub-caches from 2 prefill ranks, ")
        and ln.endswith("LLM_KV_CACHE_NOT_EXIST re-raised without retry, then pulled")
        for ln in lines
    ), lines
    # The one expected failure, logged by the manager as it re-raised it.
    assert result.stderr.count("LLM_KV_CACHE_NOT_EXIST") == 1, result.stderr
