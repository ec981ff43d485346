"""pull_cache: one remote row of a non-block cache into a local row, against numpy.

Keys by request id, prefix id and cache id + row; ``size``; ``batch_index``; layer
ranges with 1, 2 and 4 tensors per layer; rows of different strides; removed keys;
every error leaves the destination unchanged.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMCacheNotFoundError,
    LLMLinkError,
    LLMParamError,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
)
from aiodatadist.testing import Pair, inproc_pair
from tests.engine._util import BOUND_S, MIB, SLOW_OPTIONS, executor_of

pytestmark = pytest.mark.asyncio

NONE = 2**64 - 1
P = 1
ROW = 8192  # fp16 elements per row: 16 KiB rows


def _random(shape: tuple[int, ...], seed: int, dtype=np.float16) -> np.ndarray:
    a = np.empty(shape, dtype=dtype)
    rng = np.random.default_rng(seed)
    a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, dtype=np.uint8)
    return a


def _rows(pair: Pair, *, tensors: int = 4, rows: int = 3, row: int = ROW, keys=None, seed=1):
    desc = CacheDesc(tensors, [rows, row], DataType.DT_FLOAT16, Placement.HOST)
    arrays = [_random((rows, row), seed + t) for t in range(tensors)]
    if keys is None:
        keys = [CacheKey(P, 10), CacheKey(P, NONE, prefix_id=20)]
    cache = pair.prompt.cache_manager.register_cache(desc, arrays, keys)
    return cache, arrays


def _local(pair: Pair, *, tensors: int = 4, rows: int = 4, row: int = ROW, seed: int = 100):
    desc = CacheDesc(tensors, [rows, row], DataType.DT_FLOAT16, Placement.HOST)
    arrays = [_random((rows, row), seed + t) for t in range(tensors)]
    return pair.decoder.cache_manager.register_cache(desc, arrays), arrays


def _b(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8)


def _expect(dst_before, src, pairs, dst_row, src_row, nbytes=None):
    """The reference: for each (src tensor, dst tensor), copy ``nbytes`` of the row."""
    out = [_b(d).copy() for d in dst_before]
    for s, d in pairs:
        n = out[d].shape[1] if nbytes is None else nbytes
        out[d][dst_row, :n] = _b(src[s])[src_row, :n]
    return out


def _check(dst_arrays, want) -> None:
    for t, (got, exp) in enumerate(zip(dst_arrays, want, strict=True)):
        assert np.array_equal(_b(got), exp), f"tensor {t}"


@pytest.mark.parametrize(
    ("key", "src_row"),
    [(CacheKey(P, 10), 0), (CacheKey(P, NONE, prefix_id=20), 1), ("by-id", 2)],
    ids=["req_id", "prefix_id", "cache_id"],
)
@pytest.mark.parametrize("batch_index", [0, 3])
async def test_row_by_key(pair: Pair, key, src_row: int, batch_index: int) -> None:
    cache, src = _rows(pair)
    dst, dst_arrays = _local(pair)
    if key == "by-id":
        key = CacheKeyByIdAndIndex(P, cache.cache_id, 2)
    want = _expect([a.copy() for a in dst_arrays], src, [(t, t) for t in range(4)],
                   batch_index, src_row)
    await pair.decoder.cache_manager.pull_cache(key, dst, batch_index)
    _check(dst_arrays, want)


@pytest.mark.parametrize("size", [2, 256, 4096, ROW * 2 - 2, ROW * 2, -1])
async def test_size_bytes_per_tensor(pair: Pair, size: int) -> None:
    _, src = _rows(pair)
    dst, dst_arrays = _local(pair)
    nbytes = ROW * 2 if size == -1 else size
    want = _expect([a.copy() for a in dst_arrays], src, [(t, t) for t in range(4)], 1, 0,
                   nbytes)
    await pair.decoder.cache_manager.pull_cache(CacheKey(P, 10), dst, batch_index=1, size=size)
    _check(dst_arrays, want)


@pytest.mark.parametrize(
    ("t", "src_lr", "dst_lr"),
    [(2, range(1, 2), range(0, 1)), (2, range(0, 2), range(0, 2)), (1, range(3, 4), range(0, 1)),
     (1, range(0, 2), range(2, 4)), (4, range(0, 1), range(0, 1))],
)
async def test_layer_ranges(pair: Pair, t: int, src_lr: range, dst_lr: range) -> None:
    _, src = _rows(pair)
    dst, dst_arrays = _local(pair)
    n = len(src_lr) * t
    pairs = [(src_lr.start * t + k, dst_lr.start * t + k) for k in range(n)]
    want = _expect([a.copy() for a in dst_arrays], src, pairs, 2, 1)
    await pair.decoder.cache_manager.pull_cache(
        CacheKey(P, NONE, prefix_id=20), dst, 2, src_layer_range=src_lr, dst_layer_range=dst_lr,
        tensor_num_per_layer=t,
    )
    _check(dst_arrays, want)


async def test_source_range_only_into_a_smaller_cache(pair: Pair) -> None:
    _, src = _rows(pair, tensors=8)
    dst, dst_arrays = _local(pair, tensors=4)
    want = _expect([a.copy() for a in dst_arrays], src, [(4 + k, k) for k in range(4)], 0, 0)
    await pair.decoder.cache_manager.pull_cache(CacheKey(P, 10), dst, 0,
                                                src_layer_range=range(2, 4))
    _check(dst_arrays, want)


async def test_rows_of_different_strides(pair: Pair) -> None:
    # A longer remote row: the local stride (size=-1) is copied from its start.
    _, src = _rows(pair, row=2 * ROW)
    dst, dst_arrays = _local(pair)
    want = _expect([a.copy() for a in dst_arrays], src, [(t, t) for t in range(4)], 3, 0,
                   ROW * 2)
    await pair.decoder.cache_manager.pull_cache(CacheKey(P, 10), dst, 3)
    _check(dst_arrays, want)


async def test_shorter_remote_row_needs_an_explicit_size(pair: Pair) -> None:
    _, src = _rows(pair, row=ROW // 2)
    dst, dst_arrays = _local(pair)
    before = [_b(a).copy() for a in dst_arrays]
    with pytest.raises(LLMParamError):
        await pair.decoder.cache_manager.pull_cache(CacheKey(P, 10), dst, 0)
    _check(dst_arrays, before)
    want = _expect(before, src, [(t, t) for t in range(4)], 0, 0, ROW)
    await pair.decoder.cache_manager.pull_cache(CacheKey(P, 10), dst, 0, size=ROW)
    _check(dst_arrays, want)


async def test_removed_key_cannot_be_pulled(pair: Pair) -> None:
    _, src = _rows(pair)
    dst, dst_arrays = _local(pair)
    cm = pair.decoder.cache_manager
    await cm.pull_cache(CacheKey(P, 10), dst, 0)
    pair.prompt.cache_manager.remove_cache_key(CacheKey(P, 10))
    pair.prompt.cache_manager.remove_cache_key(CacheKey(P, 12345))  # unknown: no-op
    before = [_b(a).copy() for a in dst_arrays]
    with pytest.raises(LLMCacheNotFoundError) as info:
        await cm.pull_cache(CacheKey(P, 10), dst, 1)
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    _check(dst_arrays, before)
    await cm.pull_cache(CacheKey(P, NONE, prefix_id=20), dst, 1)  # the other key still works
    assert np.array_equal(_b(dst_arrays[0])[1], _b(src[0])[1])


async def test_allocated_rows(pair: Pair) -> None:
    desc = CacheDesc(2, [2, 1024], DataType.DT_INT64, Placement.HOST)
    src = pair.prompt.cache_manager.allocate_cache(desc, [CacheKey(P, 1), CacheKey(P, 2)])
    for t, v in enumerate(src.tensors()):
        v[...] = np.arange(2048, dtype=np.int64).reshape(2, 1024) * (t + 3)
    dst = pair.decoder.cache_manager.allocate_cache(desc)
    await pair.decoder.cache_manager.pull_cache(CacheKey(P, 2), dst, 0)
    for t in range(2):
        assert np.array_equal(dst.tensors()[t][0], src.tensors()[t][1])
        assert not dst.tensors()[t][1].any()


def _bad(c, dst, blocks):
    return {
        "batch-index-out-of-range": ((CacheKey(P, 10), dst, 4), LLMParamError),
        "batch-index-negative": ((CacheKey(P, 10), dst, -1), LLMParamError),
        "batch-index-str": ((CacheKey(P, 10), dst, "0"), TypeError),
        "size-zero": ((CacheKey(P, 10), dst, 0, 0), LLMParamError),
        "size-minus-2": ((CacheKey(P, 10), dst, 0, -2), LLMParamError),
        "size-beyond-stride": ((CacheKey(P, 10), dst, 0, ROW * 2 + 2), LLMParamError),
        "blocks-cache": ((CacheKey(P, 10), blocks, 0), LLMParamError),
        "blocks-key": ((BlocksCacheKey(P, 0), dst, 0), TypeError),
        "key-none": ((None, dst, 0), TypeError),
        "cache-none": ((CacheKey(P, 10), None, 0), TypeError),
        "req-and-prefix": ((CacheKey(P, 10, prefix_id=20), dst, 0), LLMParamError),
        "neither-id": ((CacheKey(P, NONE), dst, 0), LLMParamError),
        "id-row-out-of-range": ((CacheKeyByIdAndIndex(P, c.cache_id, 3), dst, 0), LLMParamError),
        "unknown-req": ((CacheKey(P, 11), dst, 0), LLMCacheNotFoundError),
        "unknown-cache-id": ((CacheKeyByIdAndIndex(P, 10**9), dst, 0), LLMCacheNotFoundError),
        "own-cluster": ((CacheKey(2, 10), dst, 0), LLMParamError),
        "no-link": ((CacheKey(77, 10), dst, 0), LLMLinkError),
    }


BAD = ["batch-index-out-of-range", "batch-index-negative", "batch-index-str", "size-zero",
       "size-minus-2", "size-beyond-stride", "blocks-cache", "blocks-key", "key-none",
       "cache-none", "req-and-prefix", "neither-id", "id-row-out-of-range", "unknown-req",
       "unknown-cache-id", "own-cluster", "no-link"]
BAD_KW = {
    "range-step-2": dict(src_layer_range=range(0, 2, 2), dst_layer_range=range(0, 1)),
    "range-beyond": dict(src_layer_range=range(1, 3), dst_layer_range=range(0, 2)),
    "range-lengths": dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 2)),
    "t-not-dividing": dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 1),
                           tensor_num_per_layer=3),
    "t-zero": dict(tensor_num_per_layer=0),
    "timeout-zero": dict(timeout=0),
}


@pytest.mark.parametrize("case", BAD + list(BAD_KW))
async def test_errors_leave_the_row_unchanged(pair: Pair, case: str) -> None:
    cache, _ = _rows(pair)
    dst, dst_arrays = _local(pair)
    blocks = pair.decoder_cache(num_tensors=4, num_blocks=4)
    before = [_b(a).copy() for a in dst_arrays]
    if case in BAD_KW:
        args, kwargs, exc = (CacheKey(P, 10), dst, 0), BAD_KW[case], LLMParamError
    else:
        (args, exc), kwargs = _bad(cache, dst, blocks.cache)[case], {}
    with pytest.raises(exc):
        await pair.decoder.cache_manager.pull_cache(*args, **kwargs)
    _check(dst_arrays, before)
    await pair.decoder.cache_manager.pull_cache(CacheKey(P, 10), dst, 0)  # the link works


@pytest.mark.slow  # a big row
async def test_big_row_times_out_then_works() -> None:
    async with inproc_pair(prompt_id=1, decoder_id=2, options=dict(SLOW_OPTIONS)) as pair:
        desc = CacheDesc(2, [2, 128 * MIB], DataType.DT_UINT8, Placement.HOST)
        src = pair.prompt.cache_manager.allocate_cache(desc, [CacheKey(P, 5)])
        for t, v in enumerate(src.tensors()):
            v[0] = 7 + t
        # Never-touched destination memory (every page faults in during the copy) and a
        # 1 ms deadline: one mover moves a prefaulted 256 MiB row in ~5 ms here, which a
        # 5 ms deadline raced on a loaded machine.
        keep = [np.empty((2, 128 * MIB), np.uint8) for _ in range(2)]
        dst = pair.decoder.cache_manager.register_cache(desc, keep)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(LLMTimeoutError) as info:
            await pair.decoder.cache_manager.pull_cache(CacheKey(P, 5), dst, 1, timeout=0.001)
        assert loop.time() - start < BOUND_S
        assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert executor_of(pair.decoder).in_flight == 0
        await pair.decoder.cache_manager.pull_cache(CacheKey(P, 5), dst, 1, timeout=60)
        for t, v in enumerate(dst.tensors()):
            assert v[1].min() == v[1].max() == 7 + t
