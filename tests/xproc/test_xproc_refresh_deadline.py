"""A pull of a key this side has not seen: the peer's table is fetched once (a round
trip) before ``LLM_KV_CACHE_NOT_EXIST`` is raised, and a deadline that passes during that
fetch is a timeout, not a verdict on the key (against a real prompt process)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from aiodatadist import BlocksCacheKey, LLMException, LLMStatusCode, LLMTimeoutError
from aiodatadist.testing import PromptSpec, remote_pair
from tests._procs import stop_now

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]  # a prompt process

BOUND_S = 5.0  # generous: the deadline was honoured, not a speed claim


async def test_a_deadline_passing_during_the_table_fetch_is_a_timeout() -> None:
    spec = PromptSpec(num_tensors=2, num_blocks=8, block_shape=(4096,), dtype="uint8", seed=41)
    async with remote_pair(spec, data_path="tcp") as rp:
        cm = rp.decoder.cache_manager
        dst = rp.decoder_cache()
        unknown = BlocksCacheKey(rp.prompt_id, 77)  # no such model_id on the prompt
        # The prompt answers the fetch: the key is not there.
        with pytest.raises(LLMException) as ei:
            await cm.pull_blocks(unknown, dst.cache, [0], [0], timeout=BOUND_S)
        assert ei.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, ei.value
        # The prompt stopped: the fetch cannot complete within 0.2 s.
        loop = asyncio.get_running_loop()
        stop_now(rp.prompt.pid)
        try:
            t0 = loop.time()
            with pytest.raises(LLMTimeoutError) as et:
                await cm.pull_blocks(unknown, dst.cache, [0], [0], timeout=0.2)
            assert et.value.status_code == LLMStatusCode.LLM_TIMEOUT
            assert loop.time() - t0 < BOUND_S
        finally:
            os.kill(rp.prompt.pid, signal.SIGCONT)
        # Running again: the link works, the key is still not there, a known one pulls.
        with pytest.raises(LLMException) as ei:
            await cm.pull_blocks(unknown, dst.cache, [0], [0], timeout=BOUND_S)
        assert ei.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        await cm.pull_blocks(rp.key(), dst.cache, [1], [2], timeout=BOUND_S)
        assert rp.mismatches(dst, [1], [2]) == []
