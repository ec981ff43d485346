"""finalize with a Mooncake transfer that cannot be cancelled: it returns only once
nothing more can land in the user's memory (Mooncake's stall timeouts set to 1 s here, and
4 requests in flight per transfer instead of 32: Mooncake fails a stalled peer's requests
one timeout per lane after another, so the wait grows with the window, not the property).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, LLMDataDist, LLMException, LLMRole
from aiodatadist.transports import mooncake
from tests._engines import require_engine
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import Harness, link

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

PROMPT, DECODER = 87, 88
MIB = 256
STALL = {"MC_TCP_PROGRESS_TIMEOUT_SEC": "1", "MC_TCP_STATUS_TIMEOUT_SEC": "1"}


async def test_finalize_returns_only_when_nothing_more_can_land(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require_engine("mooncake")
    monkeypatch.setattr(mooncake, "WINDOW", 4)
    spec = xc.big_spec(MIB)
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, data_path="mooncake", big_mib=MIB, env=STALL)
        for k, v in STALL.items():
            monkeypatch.setenv(k, v)  # read when this process's engine starts
        dd = LLMDataDist(LLMRole.DECODER, DECODER)
        await dd.init({"aiodatadist.DataPath": "mooncake"})
        shape = (spec.shape[0], spec.shape[1] * 2)  # fp16 blocks of 1 MiB
        raw = [np.zeros(shape, np.uint8) for _ in range(2)]
        dst = dd.cache_manager.register_blocks_cache(spec.desc(), [r.view(np.float16) for r in raw])
        await link(dd, prompt, PROMPT)
        key = BlocksCacheKey(PROMPT, xc.MODEL_BIG)
        blocks = list(range(spec.shape[0]))
        await dd.cache_manager.pull_blocks(key, dst, [0], [0], timeout=10)
        task = asyncio.ensure_future(
            dd.cache_manager.pull_blocks(key, dst, blocks, blocks, timeout=2)
        )
        await asyncio.sleep(0.02)
        os.kill(prompt.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            await dd.finalize()
            took = time.monotonic() - t0
            assert task.done()  # the transfer had returned before finalize did
            with pytest.raises(LLMException):
                task.result()
            for r in raw:
                r[...] = 0xAB
        finally:
            os.kill(prompt.pid, signal.SIGCONT)
        await asyncio.sleep(1.0)
        assert all(bool((r == 0xAB).all()) for r in raw)  # nothing landed after finalize
        assert took < 60, took
