"""The input contract on every public call that takes ids (issue 9, finding 9).

Every bad input is a ``TypeError`` or an ``LLMParamError`` (a ``ValueError`` and
``LLMException(LLM_PARAM_INVALID)``), raised before anything moves and without
allocating in proportion to a hostile length; numpy integer scalars and 1-D integer
arrays are ids wherever ids are taken (``operator.index``), bools (Python's and numpy's)
never are. Accepted numpy ids move the right bytes: every transfer here has a pattern
seed of its own, so a stale or misdirected block shows.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMException,
    LLMParamError,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)
from aiodatadist import _validate as v
from aiodatadist.testing import FilledCache, Pair, make_blocks_cache, pattern_mismatches
from tests.engine._util import snapshot

P, D = 1, 2
BLOCK = (16, 2, 64)  # 4 KiB blocks
NB = 8
PI = LLMStatusCode.LLM_PARAM_INVALID


def _param_error(info: pytest.ExceptionInfo[BaseException]) -> None:
    assert isinstance(info.value, LLMParamError)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, LLMException) and info.value.status_code == PI


def _src(pair: Pair, seed: int, model_id: int = 0) -> FilledCache:
    return make_blocks_cache(pair.prompt, model_id=model_id, seed=seed, pattern=True,
                             num_tensors=4, num_blocks=NB, block_shape=BLOCK)


def _dst(pair: Pair, model_id: int | None = None) -> FilledCache:
    return make_blocks_cache(pair.decoder, model_id=model_id, num_tensors=4, num_blocks=NB,
                             block_shape=BLOCK)


def _unchanged(fc: FilledCache, before: list[np.ndarray]) -> None:
    for t, want in enumerate(before):
        assert np.array_equal(fc.tensors[t].view(np.uint8).reshape(NB, -1), want), t


# ------------------------------------------------------------------ numpy ids are ids

@pytest.mark.parametrize(
    "make_ids",
    [
        pytest.param(lambda s, d: ([np.int64(x) for x in s], [np.int64(x) for x in d]),
                     id="np-int64-scalars"),
        pytest.param(lambda s, d: (tuple(np.uint32(x) for x in s), np.array(d, np.int32)),
                     id="np-uint32-tuple-and-int32-array"),
        pytest.param(lambda s, d: (np.array(s, np.uint64), np.array(d, np.int64)),
                     id="np-arrays"),
        pytest.param(lambda s, d: (np.array(s, np.int64)[::-1][::-1], np.array(d, object)),
                     id="np-strided-and-object-arrays"),
    ],
)
@pytest.mark.asyncio
async def test_pull_blocks_takes_numpy_ids_and_moves_the_right_bytes(
    pair: Pair, make_ids: Callable[[list[int], list[int]], tuple[Any, Any]]
) -> None:
    seed = 0x1D5_0001
    _src(pair, seed)
    dst = _dst(pair)
    s, d = [6, 1, 3], [0, 7, 2]
    src_ids, dst_ids = make_ids(s, d)
    await pair.decoder.cache_manager.pull_blocks(BlocksCacheKey(P, 0), dst.cache, src_ids,
                                                 dst_ids, timeout=10)
    assert pattern_mismatches(dst.tensors, s, d, seed) == []


@pytest.mark.asyncio
async def test_numpy_ids_in_keys_pull_cache_copy_blocks_and_unregister(pair: Pair) -> None:
    cm = pair.decoder.cache_manager
    # Keys built from numpy integers equal (and hash like) the same keys from ints.
    k = BlocksCacheKey(np.int64(P), np.uint64(0))
    assert k == BlocksCacheKey(P, 0) and hash(k) == hash(BlocksCacheKey(P, 0))
    assert type(k.cluster_id) is int and type(k.model_id) is int
    assert CacheKey(np.uint16(P), np.int64(100)) == CacheKey(P, 100)
    info = LLMClusterInfo()
    info.remote_cluster_id = np.int32(P)
    assert info.remote_cluster_id == P and type(info.remote_cluster_id) is int

    # pull_cache with a numpy batch index and a key of numpy ids.
    desc = CacheDesc(2, [3, 4096], DataType.DT_UINT8, Placement.HOST)
    rows = [np.arange(3 * 4096, dtype=np.uint32).astype(np.uint8).reshape(3, 4096) ^ (t + 0x5A)
            for t in range(2)]
    remote = pair.prompt.cache_manager.register_cache(desc, rows)
    local = [np.zeros((3, 4096), np.uint8) for _ in range(2)]
    local_cache = cm.register_cache(desc, local)
    key = CacheKeyByIdAndIndex(np.int64(P), np.int64(remote.cache_id), np.uint8(2))
    await cm.pull_cache(key, local_cache, np.int64(1), timeout=np.float64(10.0))
    for t in range(2):
        assert np.array_equal(local[t][1], rows[t][2])
        assert not local[t][0].any() and not local[t][2].any()

    # copy_blocks with numpy keys and a numpy array of destinations.
    seed = 0x1D5_0002
    fc = make_blocks_cache(pair.decoder, seed=seed, pattern=True, num_tensors=4, num_blocks=NB,
                           block_shape=BLOCK)
    await cm.copy_blocks(fc.cache, {np.int64(1): np.array([4, 6]), np.uint8(2): [np.int16(5)]})
    assert pattern_mismatches(fc.tensors, [1, 1, 2, 3], [4, 6, 5, 3], seed) == []

    # unregister_cache with a numpy id removes the cache.
    cm.unregister_cache(np.int64(local_cache.cache_id))
    with pytest.raises(LLMParamError):
        await cm.pull_cache(key, local_cache, 0, timeout=10)


class _Yes(LayerSynchronizer):
    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


@pytest.mark.asyncio
async def test_transfer_cache_async_takes_numpy_block_indices(pair: Pair) -> None:
    seed = 0x1D5_0003
    src = make_blocks_cache(pair.prompt, seed=seed, pattern=True, num_tensors=4, num_blocks=NB,
                            block_shape=BLOCK)
    dst = _dst(pair, model_id=5)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(np.int64(D), np.int64(5)), range(0, 2),
                                     range(0, 2))
    task = await pair.prompt.cache_manager.transfer_cache_async(
        src.cache, _Yes(), [cfg], np.array([0, 3], np.int64), (np.uint64(7), np.int8(1))
    )
    assert await task.synchronize(10_000) == LLMStatusCode.LLM_SUCCESS
    assert pattern_mismatches(dst.tensors, [0, 3], [7, 1], seed) == []


# ------------------------------------------------- bad ids on every call that takes them

def _bad_calls(pair: Pair, src: FilledCache, dst: FilledCache) -> list[tuple[str, Any]]:
    cm_d = pair.decoder.cache_manager
    cm_p = pair.prompt.cache_manager
    k = BlocksCacheKey(P, 0)
    huge = range(10**12)

    def push(src_ids: Any, dst_ids: Any) -> Any:
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 2), range(0, 2))
        return cm_p.transfer_cache_async(src.cache, _Yes(), [cfg], src_ids, dst_ids)

    return [
        ("pull-huge-range", lambda: cm_d.pull_blocks(k, dst.cache, huge, huge)),
        ("pull-2e63", lambda: cm_d.pull_blocks(k, dst.cache, [2**63], [0])),
        ("pull-2e64", lambda: cm_d.pull_blocks(k, dst.cache, [0], [2**64])),
        ("pull-minus-1", lambda: cm_d.pull_blocks(k, dst.cache, [0], [-1])),
        ("pull-bool", lambda: cm_d.pull_blocks(k, dst.cache, [0], [True])),
        ("pull-np-bool", lambda: cm_d.pull_blocks(k, dst.cache, [np.bool_(0)], [0])),
        ("pull-inf", lambda: cm_d.pull_blocks(k, dst.cache, [0], [0], timeout=float("inf"))),
        ("pull-nan", lambda: cm_d.pull_blocks(k, dst.cache, [0], [0], timeout=float("nan"))),
        ("copy-huge-range", lambda: cm_d.copy_blocks(dst.cache, {0: huge})),
        ("copy-2e63-key", lambda: cm_d.copy_blocks(dst.cache, {2**63: [1]})),
        ("copy-2e64", lambda: cm_d.copy_blocks(dst.cache, {0: [2**64]})),
        ("copy-minus-1", lambda: cm_d.copy_blocks(dst.cache, {-1: [1]})),
        ("copy-bool-key", lambda: cm_d.copy_blocks(dst.cache, {True: [1]})),
        ("copy-np-bool", lambda: cm_d.copy_blocks(dst.cache, {0: [np.True_]})),
        ("copy-inf", lambda: cm_d.copy_blocks(dst.cache, {0: [1]}, timeout=float("inf"))),
        ("copy-nan", lambda: cm_d.copy_blocks(dst.cache, {0: [1]}, timeout=float("nan"))),
        ("push-huge-range", lambda: push(huge, huge)),
        ("push-2e63", lambda: push([0], [2**63])),
        ("push-2e64", lambda: push([2**64], [0])),
        ("push-minus-1", lambda: push([-1], [0])),
        ("push-bool", lambda: push([0], [False])),
        ("push-np-bool", lambda: push(np.array([True]), [0])),
        ("pull-cache-2e63", lambda: cm_d.pull_cache(CacheKeyByIdAndIndex(P, 1), dst.cache,
                                                    2**63)),
    ]


BAD_IDS = [
    "pull-huge-range", "pull-2e63", "pull-2e64", "pull-minus-1", "pull-bool", "pull-np-bool",
    "pull-inf", "pull-nan", "copy-huge-range", "copy-2e63-key", "copy-2e64", "copy-minus-1",
    "copy-bool-key", "copy-np-bool", "copy-inf", "copy-nan", "push-huge-range", "push-2e63",
    "push-2e64", "push-minus-1", "push-bool", "push-np-bool", "pull-cache-2e63",
]


@pytest.mark.parametrize("case", BAD_IDS)
@pytest.mark.asyncio
async def test_bad_ids_are_refused_and_change_nothing(pair: Pair, case: str) -> None:
    seed = 0x1D5_0100 + BAD_IDS.index(case)
    src = _src(pair, seed)
    dst = _dst(pair, model_id=5)
    before = snapshot(dst)
    decoder_link = pair.decoder._rt.links.find(P)
    prompt_link = pair.prompt._rt.links.find(D)
    done = (decoder_link.transfers, prompt_link.transfers)
    caches = (set(pair.decoder._rt.caches.entries), set(pair.prompt._rt.caches.entries))
    call = dict(_bad_calls(pair, src, dst))[case]

    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises((TypeError, ValueError)) as info:
            await call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5.0  # generous: nothing iterated 10**12 ids
    assert peak < 8 << 20, f"{peak} bytes allocated for a refused call"
    if "bool" in case:
        assert type(info.value) is TypeError
    else:
        _param_error(info)
    assert (decoder_link.transfers, prompt_link.transfers) == done
    assert pair.prompt.cache_manager._pipelines.tasks == set()
    assert caches == (set(pair.decoder._rt.caches.entries),
                      set(pair.prompt._rt.caches.entries))
    _unchanged(dst, before)
    # And the link is fine: a correct pull right after moves this test's own pattern.
    await pair.decoder.cache_manager.pull_blocks(BlocksCacheKey(P, 0), dst.cache,
                                                 np.array([2]), [np.int64(3)], timeout=10)
    assert pattern_mismatches(dst.tensors, [2], [3], seed) == []


@pytest.mark.parametrize(
    ("value", "exc"),
    [(2**63, LLMParamError), (-(2**63) - 1, LLMParamError), (True, TypeError),
     (np.True_, TypeError), (1.0, TypeError)],
)
@pytest.mark.asyncio
async def test_unregister_cache_bad_ids(pair: Pair, value: Any, exc: type[Exception]) -> None:
    dst = _dst(pair)
    entries = set(pair.decoder._rt.caches.entries)
    with pytest.raises(exc):
        pair.decoder.cache_manager.unregister_cache(value)
    assert set(pair.decoder._rt.caches.entries) == entries
    assert dst.cache.cache_id in entries


@pytest.mark.asyncio
async def test_cache_task_timeout_bounds(pair: Pair) -> None:
    src = _src(pair, 0x1D5_0200)
    _dst(pair, model_id=5)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 2), range(0, 2))
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, _Yes(), [cfg],
                                                                [0], [1])
    for bad, exc in [(2**63, LLMParamError), (-1, LLMParamError), (True, TypeError),
                     (float("inf"), TypeError)]:
        with pytest.raises(exc):
            await task.synchronize(bad)
    assert await task.synchronize(np.int64(10_000)) == LLMStatusCode.LLM_SUCCESS


# ------------------------------------------------------------------- keys and checkers

@pytest.mark.parametrize(
    ("make", "exc"),
    [
        (lambda: BlocksCacheKey(2**64, 0), LLMParamError),
        (lambda: BlocksCacheKey(1, -1), LLMParamError),
        (lambda: BlocksCacheKey(np.True_, 0), TypeError),
        (lambda: BlocksCacheKey(1, np.float64(0)), TypeError),
        (lambda: CacheKey(1, 2**64), LLMParamError),
        (lambda: CacheKey(np.bool_(1), 2), TypeError),
        (lambda: CacheKeyByIdAndIndex(1, 2**63), LLMParamError),
        (lambda: CacheKeyByIdAndIndex(1, 1, 2**32), LLMParamError),
        (lambda: CacheKeyByIdAndIndex(1, np.True_), TypeError),
    ],
)
def test_key_constructors_keep_the_contract(make: Callable[[], Any], exc: type[Exception]) -> None:
    with pytest.raises(exc):
        make()


def test_cluster_info_setter_keeps_the_contract() -> None:
    info = LLMClusterInfo()
    for bad, exc in [(2**64, LLMParamError), (-1, LLMParamError), (np.True_, TypeError),
                     (True, TypeError)]:
        with pytest.raises(exc):
            info.remote_cluster_id = bad
    assert info.remote_cluster_id is None


def test_check_int_list_is_bounded_before_it_reads() -> None:
    class Liar:
        """A sequence whose length says 3 and whose iteration never ends."""

        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> int:
            return 0

    from collections.abc import Sequence

    Sequence.register(Liar)
    with pytest.raises(LLMParamError, match="changed length"):
        v.check_int_list("ids", Liar())
    with pytest.raises(LLMParamError, match="more than the 5 allowed"):
        v.check_int_list("ids", range(10**30), max_len=5)
    with pytest.raises(LLMParamError, match="more than"):
        v.check_int_list("ids", np.zeros(10, np.int64), max_len=9)
    assert v.check_int_list("ids", np.array([1, 2], np.uint8)) == [1, 2]
    assert all(type(x) is int for x in v.check_int_list("ids", np.array([1, 2], np.uint64)))
    with pytest.raises(LLMParamError, match=r"ids\[1\] must be in \[0, 3\], got 4"):
        v.check_int_list("ids", np.array([1, 4]), max_value=3)
    with pytest.raises(TypeError, match="2-D"):
        v.check_int_list("ids", np.zeros((2, 2), np.int64))
    with pytest.raises(TypeError, match="float64"):
        v.check_int_list("ids", np.zeros(2))
    with pytest.raises(TypeError):
        v.check_int_list("ids", "12")
    assert v.check_uint("x", np.uint64(2**64 - 1)) == 2**64 - 1
    with pytest.raises(TypeError):
        v.check_int("x", np.bool_(True))


@pytest.mark.parametrize(
    ("value", "exc"),
    [(float("inf"), LLMParamError), (float("-inf"), LLMParamError), (float("nan"), LLMParamError),
     (np.float32("nan"), LLMParamError), (0, LLMParamError),
     pytest.param(10**400, LLMParamError, id="10e400"),
     (v.MAX_TIMEOUT_S * 2, LLMParamError), (True, TypeError), (np.True_, TypeError),
     ("1", TypeError)],
)
def test_check_timeout(value: Any, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        v.check_timeout("timeout", value)


def test_check_timeout_accepts_numbers() -> None:
    assert v.check_timeout("timeout", np.float32(0.5)) == 0.5
    assert v.check_timeout("timeout", np.int64(3)) == 3.0
    assert v.check_timeout("timeout", None) is None
