"""MindIE-LLM's SeparateDeploymentEngine port (examples/clients/mindie_*.py) runs.

A prefill, a decoder and a flex (MIX) instance; K and V caches as two model ids; two-sided
links with v1.0 rank tables ranked by device IP (the decoder is rank 0 of its pair), the
prefill linking to both in one window, the decoder's and the flex's duplicated link command
answered LLM_ALREADY_LINK and tolerated; pulls per model id with the engine's own range
check and error mapping; unlink on every side. Bytes and untouched blocks are checked
inside the port.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clients._run import LOOPS, assert_client_ok, run_client

pytestmark = pytest.mark.slow  # three processes per run


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("script", ["mindie_sync.py", "mindie_async.py"])
def test_mindie_separate_deployment(script: str, loop: str, tmp_path: Path) -> None:
    lines = assert_client_ok(run_client(script, loop, tmp_path), script, loop)
    assert "prefill: linked [200, 300]" in lines, lines
    for role in ("decoder", "flex"):
        assert any(
            ln.startswith(f"{role}: linked [100], 2 requests x 2 caches, ")
            and ln.endswith("ALREADY_LINK tolerated 1x")
            for ln in lines
        ), lines
