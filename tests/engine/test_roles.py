"""Which role may call what: pulls on DECODER or MIX, transfer_cache_async on PROMPT or MIX.

A refused call raises ``LLMException(LLM_FAILED)`` before anything moves.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LayerSynchronizer,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import inproc_pair, make_blocks_cache
from tests.engine._util import Tracker, blocks_of, instrument, snapshot

pytestmark = pytest.mark.asyncio

BLOCK = (64, 8, 16)


class Always(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def _exact_llm_failed(err: BaseException) -> None:
    assert type(err) is LLMException
    assert err.status_code == LLMStatusCode.LLM_FAILED


async def test_pulls_refused_on_prompt() -> None:
    # Two PROMPT instances linked: neither may pull.
    async with inproc_pair(prompt_id=401, decoder_id=402, decoder_role=LLMRole.PROMPT) as pair:
        pair.prompt_cache(num_tensors=2, num_blocks=4, block_shape=BLOCK)
        dst = pair.decoder_cache(seed=3, num_tensors=2, num_blocks=4, block_shape=BLOCK)
        tracker = Tracker()
        instrument(pair.decoder, 401, tracker)
        before = snapshot(dst)
        with pytest.raises(LLMException) as info:
            await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0], [0])
        _exact_llm_failed(info.value)
        assert "DECODER or MIX" in str(info.value)
        desc = CacheDesc(2, [2, 1024], DataType.DT_FLOAT16, Placement.HOST)
        rows = pair.decoder.cache_manager.register_cache(
            desc, [np.zeros((2, 1024), np.float16) for _ in range(2)]
        )
        with pytest.raises(LLMException) as info:
            await pair.decoder.cache_manager.pull_cache(CacheKey(401, 1), rows)
        _exact_llm_failed(info.value)
        assert tracker.events == []
        for t in range(2):
            assert np.array_equal(blocks_of(dst.tensors[t]), before[t])


async def test_transfer_cache_async_refused_on_decoder() -> None:
    async with inproc_pair(prompt_id=403, decoder_id=404) as pair:
        # The decoder tries to push its cache to the prompt.
        make_blocks_cache(pair.prompt, model_id=0, num_tensors=2, num_blocks=4,
                          block_shape=BLOCK)
        src = pair.decoder_cache(seed=1, num_tensors=2, num_blocks=4, block_shape=BLOCK)
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(403, 0), range(0, 1), range(0, 1))
        with pytest.raises(LLMException) as info:
            await pair.decoder.cache_manager.transfer_cache_async(
                src.cache, Always(), [cfg], [0], [0]
            )
        _exact_llm_failed(info.value)
        assert "PROMPT or MIX" in str(info.value)
        assert not pair.decoder.cache_manager._pipelines.tasks


async def test_decoder_pulls_and_prompt_pushes() -> None:
    async with inproc_pair(prompt_id=405, decoder_id=406) as pair:
        src = pair.prompt_cache(seed=1, num_tensors=2, num_blocks=4, block_shape=BLOCK)
        dst = make_blocks_cache(pair.decoder, model_id=9, num_tensors=2, num_blocks=4,
                                block_shape=BLOCK)
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1], [0])
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(406, 9), range(0, 1), range(0, 1))
        task = await pair.prompt.cache_manager.transfer_cache_async(
            src.cache, Always(), [cfg], [2], [3]
        )
        assert await task.synchronize() == LLMStatusCode.LLM_SUCCESS
        for t in range(2):
            assert np.array_equal(blocks_of(dst.tensors[t])[0], blocks_of(src.tensors[t])[1])
            assert np.array_equal(blocks_of(dst.tensors[t])[3], blocks_of(src.tensors[t])[2])


async def test_mix_does_both_in_both_directions() -> None:
    async with inproc_pair(prompt_id=407, decoder_id=408, prompt_role=LLMRole.MIX,
                           decoder_role=LLMRole.MIX) as pair:
        a = make_blocks_cache(pair.prompt, model_id=0, seed=1, num_tensors=2, num_blocks=4,
                              block_shape=BLOCK)
        b = make_blocks_cache(pair.decoder, model_id=0, seed=2, num_tensors=2, num_blocks=4,
                              block_shape=BLOCK)
        wa, wb = snapshot(a), snapshot(b)
        # MIX pulls both ways over the one link.
        await pair.decoder.cache_manager.pull_blocks(BlocksCacheKey(407, 0), b.cache, [0], [1])
        await pair.prompt.cache_manager.pull_blocks(BlocksCacheKey(408, 0), a.cache, [2], [3])
        # And pushes both ways.
        cfg_ab = TransferWithCacheKeyConfig(BlocksCacheKey(408, 0), range(0, 1), range(0, 1))
        cfg_ba = TransferWithCacheKeyConfig(BlocksCacheKey(407, 0), range(0, 1), range(0, 1))
        t1 = await pair.prompt.cache_manager.transfer_cache_async(a.cache, Always(), [cfg_ab],
                                                                  [0], [2])
        t2 = await pair.decoder.cache_manager.transfer_cache_async(b.cache, Always(), [cfg_ba],
                                                                   [3], [1])
        assert await t1.synchronize() == LLMStatusCode.LLM_SUCCESS
        assert await t2.synchronize() == LLMStatusCode.LLM_SUCCESS
        for t in range(2):
            got_a, got_b = blocks_of(a.tensors[t]), blocks_of(b.tensors[t])
            assert np.array_equal(got_b[1], wa[t][0])
            assert np.array_equal(got_a[3], wb[t][2])
            assert np.array_equal(got_b[2], wa[t][0])
            assert np.array_equal(got_a[1], wb[t][3])


@pytest.mark.parametrize("role", [LLMRole.PROMPT, LLMRole.DECODER, LLMRole.MIX])
async def test_registration_and_local_copies_on_every_role(role: LLMRole) -> None:
    from aiodatadist import LLMDataDist

    async with LLMDataDist(role, 409) as dd:
        fc = make_blocks_cache(dd, model_id=1, seed=1, num_tensors=2, num_blocks=4,
                               block_shape=BLOCK)
        alloc = dd.cache_manager.allocate_blocks_cache(
            CacheDesc(2, [4, *BLOCK], DataType.DT_FLOAT16, Placement.HOST), BlocksCacheKey(409, 2)
        )
        before = snapshot(fc)
        await dd.cache_manager.copy_blocks(fc.cache, {0: [3]})
        for t in range(2):
            assert np.array_equal(blocks_of(fc.tensors[t])[3], before[t][0])
        dd.cache_manager.deallocate_blocks_cache(alloc)
