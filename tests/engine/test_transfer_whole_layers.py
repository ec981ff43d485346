"""``transfer_cache_async`` from a blocks cache without block indices (upstream sends empty
lists): every block ``i`` of each source layer lands in block ``i`` of the destination
layer; the destination must hold at least that many blocks of the same size."""

from __future__ import annotations

import pytest

from aiodatadist import (
    BlocksCacheKey,
    LayerSynchronizer,
    LLMParamError,
    LLMStatusCode,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import Pair, make_blocks_cache
from tests.engine._util import assert_bytes, reference_pull, snapshot

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
P, D = 1, 2
BLOCK = (256, 8, 16)  # 64 KiB blocks
LAYERS = 4
NB = 6


class Always(LayerSynchronizer):
    def __init__(self) -> None:
        self.calls: list[int] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append(layer_index)
        return True


def _src(pair: Pair, seed: int):
    return pair.prompt_cache(
        seed=seed, pattern=True, num_tensors=2 * LAYERS, num_blocks=NB, block_shape=BLOCK
    )


def _dst(pair: Pair, seed: int, *, nb: int = NB + 2, block=BLOCK, model: int = 5):
    return make_blocks_cache(
        pair.decoder, model_id=model, seed=seed, pattern=True, num_tensors=2 * LAYERS,
        num_blocks=nb, block_shape=block,
    )  # fmt: skip


async def test_every_block_of_every_layer(pair: Pair) -> None:
    src, dst = _src(pair, 601), _dst(pair, 1601)
    every = list(range(NB))
    want = reference_pull(snapshot(src), snapshot(dst), every, every, 0, 0, 2 * LAYERS)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, LAYERS), range(0, LAYERS))
    sync = Always()
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, sync, [cfg])
    assert await task.synchronize() == S.LLM_SUCCESS
    assert await task.get_results() == [S.LLM_SUCCESS]
    assert sync.calls == list(range(LAYERS))
    assert_bytes(dst, want)  # blocks NB, NB + 1 untouched


async def test_layer_ranges_and_a_matching_block_memory_size(pair: Pair) -> None:
    src, dst = _src(pair, 602), _dst(pair, 1602, nb=NB)
    every = list(range(NB))
    # Source layers 1, 2 -> destination layers 2, 3 (tensors 2..5 -> 4..7).
    want = reference_pull(snapshot(src), snapshot(dst), every, every, 2, 4, 4)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(1, 3), range(2, 4))
    bb = 256 * 8 * 16 * 2
    task = await pair.prompt.cache_manager.transfer_cache_async(
        src.cache, Always(), [cfg], dst_block_memory_size=bb
    )
    assert await task.synchronize() == S.LLM_SUCCESS
    assert_bytes(dst, want)


async def test_raw_addresses_get_the_whole_layer(pair: Pair) -> None:
    src, dst = _src(pair, 603), _dst(pair, 1603)
    every = list(range(NB))
    # Layer 1 -> the destination's tensors 6, 7 from block 1 on (blocks 1..6).
    addrs = [dst.tensors[6][1:].ctypes.data, dst.tensors[7][1:].ctypes.data]
    cfg = TransferConfig(D, addrs, range(1, 2))
    want = reference_pull(snapshot(src), snapshot(dst), every, [i + 1 for i in every], 2, 6, 2)
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, Always(), [cfg])
    assert await task.synchronize() == S.LLM_SUCCESS
    assert_bytes(dst, want)


@pytest.mark.parametrize("case", ["fewer-blocks", "block-size", "raw-past-the-end"])
async def test_a_destination_that_cannot_hold_the_layer(pair: Pair, case: str) -> None:
    src = _src(pair, 604)
    if case == "fewer-blocks":
        dst = _dst(pair, 1604, nb=NB - 1)
        cfg: object = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 1), range(0, 1))
    elif case == "block-size":
        dst = _dst(pair, 1604, block=(128, 8, 16), nb=2 * NB)
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 1), range(0, 1))
    else:
        dst = _dst(pair, 1604)
        addrs = [dst.tensors[0][3:].ctypes.data, dst.tensors[1][3:].ctypes.data]
        cfg = TransferConfig(D, addrs, range(0, 1))
    before = snapshot(dst)
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, Always(), [cfg])
    assert await task.synchronize() == S.LLM_PARAM_INVALID
    assert await task.get_results() == [S.LLM_PARAM_INVALID]
    assert_bytes(dst, before)


async def test_other_checks_still_apply(pair: Pair) -> None:
    src, dst = _src(pair, 605), _dst(pair, 1605)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 1), range(0, 1))
    before = snapshot(dst)
    cm = pair.prompt.cache_manager
    with pytest.raises(LLMParamError, match="dst_block_memory_size"):
        await cm.transfer_cache_async(src.cache, Always(), [cfg], dst_block_memory_size=123)
    with pytest.raises(LLMParamError):
        await cm.transfer_cache_async(src.cache, Always(), [cfg], [0], None)
    with pytest.raises(LLMParamError):
        await cm.transfer_cache_async(src.cache, Always(), [cfg], None, [0])
    beyond = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(3, 5), range(0, 2))
    with pytest.raises(LLMParamError):
        await cm.transfer_cache_async(src.cache, Always(), [beyond])
    assert not cm._pipelines.tasks
    assert_bytes(dst, before)
