"""Fixtures of the contract suite: one linked decoder/prompt per data path, nothing left over.

``path`` runs a test on each of the six data paths (``contract_side.PATHS``); every path
but ``inproc`` starts a peer process, so those runs are ``slow``. ``nixl`` and
``mooncake`` skip, with the reason, where the engine cannot run here (they fail instead
under ``AIODATADIST_REQUIRE_ENGINES=1``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import zlib
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from tests.contract.contract_side import ENGINES, PATHS, Side, engine_gate
from tests.xproc.xproc_harness import LIVE_PIDS, Harness, leftover_segments


@pytest.fixture(
    params=[pytest.param(p, marks=() if p == "inproc" else pytest.mark.slow) for p in PATHS]
)
def path(request: pytest.FixtureRequest) -> str:
    """The data path of the test (forced on both ends)."""
    name = str(request.param)
    if name in ENGINES:
        engine_gate(name)
    return name


@pytest_asyncio.fixture
async def side(path: str, request: pytest.FixtureRequest) -> AsyncIterator[Side]:
    """A decoder here linked to a prompt on ``path``, the prompt's caches filled from a seed
    of this test's own (its node id), all ended afterwards."""
    seed = zlib.crc32(request.node.nodeid.encode()) & 0xFFFFFF
    async with Harness() as h:
        yield await Side.start(h, path, seed)


@pytest.fixture(autouse=True)
def _reap_peers() -> Iterator[None]:
    """Kills and reaps any peer process a test left behind (the harness normally does)."""
    yield
    for pid in list(LIVE_PIDS):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
        LIVE_PIDS.discard(pid)
        assert not leftover_segments(pid), leftover_segments(pid)
