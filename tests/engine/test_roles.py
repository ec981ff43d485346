"""The role is a label (upstream v2): any role may pull, push and copy.

A PROMPT pulls from a DECODER, a DECODER pushes (``push_blocks``, ``transfer_cache_async``)
to a PROMPT, MIX does both; the bytes are checked. A pull from the instance's own
cluster id stays ``LLM_PARAM_INVALID`` (upstream's C++ check).
"""

from __future__ import annotations

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMParamError,
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


async def test_prompt_pulls_from_decoder() -> None:
    async with inproc_pair(prompt_id=401, decoder_id=402) as pair:
        # The decoder serves a blocks cache and a row cache; the PROMPT pulls both.
        src = make_blocks_cache(
            pair.decoder, model_id=5, seed=11, num_tensors=2, num_blocks=4, block_shape=BLOCK
        )
        dst = pair.prompt_cache(model_id=0, seed=12, num_tensors=2, num_blocks=4, block_shape=BLOCK)
        want = snapshot(dst)
        await pair.prompt.cache_manager.pull_blocks(BlocksCacheKey(402, 5), dst.cache, [3], [1])
        desc = CacheDesc(2, [2, 1024], DataType.DT_UINT8, Placement.HOST)
        rows_src = [np.arange(2048, dtype=np.uint8).reshape(2, 1024) ^ (t + 7) for t in range(2)]
        served = pair.decoder.cache_manager.register_cache(desc, rows_src)
        rows_dst = [np.zeros((2, 1024), np.uint8) for _ in range(2)]
        local = pair.prompt.cache_manager.register_cache(desc, rows_dst)
        await pair.prompt.cache_manager.pull_cache(
            CacheKeyByIdAndIndex(402, served.cache_id, 1), local, 0
        )
        for t in range(2):
            want[t][1] = blocks_of(src.tensors[t])[3]
            assert np.array_equal(blocks_of(dst.tensors[t]), want[t])
            assert np.array_equal(rows_dst[t][0], rows_src[t][1])
            assert not rows_dst[t][1].any()


async def test_decoder_pushes_to_prompt() -> None:
    async with inproc_pair(prompt_id=403, decoder_id=404) as pair:
        target = pair.prompt_cache(
            model_id=0, seed=21, num_tensors=2, num_blocks=4, block_shape=BLOCK
        )
        src = pair.decoder_cache(seed=22, num_tensors=2, num_blocks=4, block_shape=BLOCK)
        want = snapshot(target)
        cm = pair.decoder.cache_manager
        await cm.push_blocks(BlocksCacheKey(403, 0), src.cache, [2], [0])
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(403, 0), range(0, 1), range(0, 1))
        task = await cm.transfer_cache_async(src.cache, Always(), [cfg], [1], [3])
        assert await task.synchronize() == LLMStatusCode.LLM_SUCCESS
        for t in range(2):
            want[t][0] = blocks_of(src.tensors[t])[2]
            want[t][3] = blocks_of(src.tensors[t])[1]
            assert np.array_equal(blocks_of(target.tensors[t]), want[t])


async def test_pull_from_own_cluster_id_is_param_invalid() -> None:
    async with inproc_pair(prompt_id=405, decoder_id=406) as pair:
        pair.prompt_cache(num_tensors=2, num_blocks=4, block_shape=BLOCK)
        dst = pair.decoder_cache(seed=3, num_tensors=2, num_blocks=4, block_shape=BLOCK)
        tracker = Tracker()
        instrument(pair.decoder, 405, tracker)
        before = snapshot(dst)
        with pytest.raises(LLMParamError) as info:
            await pair.decoder.cache_manager.pull_blocks(
                BlocksCacheKey(406, 0), dst.cache, [0], [0]
            )
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert "own cluster_id 406" in str(info.value)
        assert tracker.events == []
        for t in range(2):
            assert np.array_equal(blocks_of(dst.tensors[t]), before[t])


async def test_mix_does_both_in_both_directions() -> None:
    async with inproc_pair(
        prompt_id=407, decoder_id=408, prompt_role=LLMRole.MIX, decoder_role=LLMRole.MIX
    ) as pair:
        a = make_blocks_cache(
            pair.prompt, model_id=0, seed=1, num_tensors=2, num_blocks=4, block_shape=BLOCK
        )
        b = make_blocks_cache(
            pair.decoder, model_id=0, seed=2, num_tensors=2, num_blocks=4, block_shape=BLOCK
        )
        wa, wb = snapshot(a), snapshot(b)
        # MIX pulls both ways over the one link.
        await pair.decoder.cache_manager.pull_blocks(BlocksCacheKey(407, 0), b.cache, [0], [1])
        await pair.prompt.cache_manager.pull_blocks(BlocksCacheKey(408, 0), a.cache, [2], [3])
        # And pushes both ways.
        cfg_ab = TransferWithCacheKeyConfig(BlocksCacheKey(408, 0), range(0, 1), range(0, 1))
        cfg_ba = TransferWithCacheKeyConfig(BlocksCacheKey(407, 0), range(0, 1), range(0, 1))
        t1 = await pair.prompt.cache_manager.transfer_cache_async(
            a.cache, Always(), [cfg_ab], [0], [2]
        )
        t2 = await pair.decoder.cache_manager.transfer_cache_async(
            b.cache, Always(), [cfg_ba], [3], [1]
        )
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
        fc = make_blocks_cache(
            dd, model_id=1, seed=1, num_tensors=2, num_blocks=4, block_shape=BLOCK
        )
        alloc = dd.cache_manager.allocate_blocks_cache(
            CacheDesc(2, [4, *BLOCK], DataType.DT_FLOAT16, Placement.HOST), BlocksCacheKey(409, 2)
        )
        before = snapshot(fc)
        await dd.cache_manager.copy_blocks(fc.cache, {0: [3]})
        for t in range(2):
            assert np.array_equal(blocks_of(fc.tensors[t])[3], before[t][0])
        dd.cache_manager.deallocate_blocks_cache(alloc)
