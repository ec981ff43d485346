"""Every way to call pull_blocks wrongly, and what each one raises.

For each case: the documented exception type (``TypeError``; ``LLMParamError``, which
is a ``ValueError`` and ``LLMException(LLM_PARAM_INVALID)``; ``LLMCacheNotFoundError``;
``LLMLinkError``), nothing entered the link (an instrumented channel saw no transfer),
and the destination is byte-for-byte unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LLMCacheNotFoundError,
    LLMException,
    LLMLinkError,
    LLMParamError,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import FilledCache, Pair, make_blocks_cache
from tests.engine._util import Tracker, instrument, snapshot

pytestmark = pytest.mark.asyncio

NONE = 2**64 - 1
BLOCK = (64, 8, 16)  # 16 KiB per block
P = 1  # prompt cluster id
D = 2  # decoder cluster id


@dataclass(repr=False)
class Ctx:
    pair: Pair
    src: FilledCache  # prompt, model 0, 8 tensors x 16 blocks
    dst: FilledCache  # decoder, 8 tensors x 16 blocks, random bytes
    rows: KvCache  # prompt, non-block, rows keyed req 100
    local_rows: KvCache  # decoder, non-block
    gone: KvCache  # decoder, unregistered
    tracker: Tracker

    def pull(self, *args: Any, **kwargs: Any) -> Any:
        return self.pair.decoder.cache_manager.pull_blocks(*args, **kwargs)


@pytest_asyncio.fixture
async def ctx(pair: Pair) -> Ctx:
    src = pair.prompt_cache(model_id=0, seed=1, num_tensors=8, num_blocks=16, block_shape=BLOCK)
    # A remote cache whose blocks are half the size, under model 3.
    make_blocks_cache(pair.prompt, model_id=3, seed=2, num_tensors=8, num_blocks=16,
                      block_shape=(32, 8, 16))
    dst = pair.decoder_cache(seed=3, num_tensors=8, num_blocks=16, block_shape=BLOCK)
    desc = CacheDesc(8, [2, 64 * 8 * 16 * 2], DataType.DT_FLOAT16, Placement.HOST)
    rows = pair.prompt.cache_manager.register_cache(
        desc, [np.zeros(desc.shape, np.float16) for _ in range(8)], [CacheKey(P, 100)]
    )
    local_rows = pair.decoder.cache_manager.register_cache(
        desc, [np.zeros(desc.shape, np.float16) for _ in range(8)]
    )
    gone_fc = pair.decoder_cache(num_tensors=8, num_blocks=16, block_shape=BLOCK)
    pair.decoder.cache_manager.unregister_cache(gone_fc.cache.cache_id)
    tracker = Tracker()
    instrument(pair.decoder, P, tracker)
    return Ctx(pair, src, dst, rows, local_rows, gone_fc.cache, tracker)


K = BlocksCacheKey(P, 0)
Case = tuple[str, Callable[[Ctx], Any], type[BaseException], LLMStatusCode | None]

TYPE_CASES: list[Case] = [
    ("key-tuple", lambda c: c.pull((P, 0), c.dst.cache, [0], [0]), TypeError, None),
    ("key-none", lambda c: c.pull(None, c.dst.cache, [0], [0]), TypeError, None),
    ("key-int", lambda c: c.pull(P, c.dst.cache, [0], [0]), TypeError, None),
    ("cache-ndarray", lambda c: c.pull(K, c.dst.tensors[0], [0], [0]), TypeError, None),
    ("cache-none", lambda c: c.pull(K, None, [0], [0]), TypeError, None),
    ("src-blocks-set", lambda c: c.pull(K, c.dst.cache, {0}, [0]), TypeError, None),
    ("src-blocks-str", lambda c: c.pull(K, c.dst.cache, "0", [0]), TypeError, None),
    ("src-block-float", lambda c: c.pull(K, c.dst.cache, [0.0], [0]), TypeError, None),
    ("src-block-bool", lambda c: c.pull(K, c.dst.cache, [True], [0]), TypeError, None),
    # 1-D integer arrays are block lists (test_input_contract.py); these are not.
    ("dst-blocks-float-ndarray", lambda c: c.pull(K, c.dst.cache, [0], np.array([0.0])),
     TypeError, None),
    ("dst-blocks-2d-ndarray", lambda c: c.pull(K, c.dst.cache, [0], np.array([[0]])),
     TypeError, None),
    ("dst-blocks-bool-ndarray", lambda c: c.pull(K, c.dst.cache, [0], np.array([True])),
     TypeError, None),
    ("dst-block-str", lambda c: c.pull(K, c.dst.cache, [0], ["0"]), TypeError, None),
    ("src-range-list", lambda c: c.pull(K, c.dst.cache, [0], [0], src_layer_range=[0, 1]),
     TypeError, None),
    ("dst-range-tuple", lambda c: c.pull(K, c.dst.cache, [0], [0], dst_layer_range=(0, 1)),
     TypeError, None),
    ("t-str", lambda c: c.pull(K, c.dst.cache, [0], [0], tensor_num_per_layer="2"), TypeError,
     None),
    ("t-bool", lambda c: c.pull(K, c.dst.cache, [0], [0], tensor_num_per_layer=True),
     TypeError, None),
    ("t-float", lambda c: c.pull(K, c.dst.cache, [0], [0], tensor_num_per_layer=2.0),
     TypeError, None),
    ("timeout-str", lambda c: c.pull(K, c.dst.cache, [0], [0], timeout="1"), TypeError, None),
    ("timeout-bool", lambda c: c.pull(K, c.dst.cache, [0], [0], timeout=True), TypeError, None),
    # Issue 9, finding 9: bools (Python's and numpy's) are not ids.
    ("src-block-np-bool", lambda c: c.pull(K, c.dst.cache, [np.True_], [0]), TypeError, None),
    ("dst-block-np-bool", lambda c: c.pull(K, c.dst.cache, [0], [np.False_]), TypeError, None),
    ("timeout-np-bool", lambda c: c.pull(K, c.dst.cache, [0], [0], timeout=np.True_),
     TypeError, None),
    ("dst-blocks-bytes", lambda c: c.pull(K, c.dst.cache, [0], b"\x00"), TypeError, None),
]

PI = LLMStatusCode.LLM_PARAM_INVALID
VALUE_CASES: list[Case] = [
    ("dst-blocks-empty", lambda c: c.pull(K, c.dst.cache, [0], []), LLMParamError, PI),
    ("src-blocks-empty", lambda c: c.pull(K, c.dst.cache, [], [0]), LLMParamError, PI),
    ("both-empty", lambda c: c.pull(K, c.dst.cache, [], []), LLMParamError, PI),
    ("lengths-differ", lambda c: c.pull(K, c.dst.cache, [0, 1], [0]), LLMParamError, PI),
    ("negative-src", lambda c: c.pull(K, c.dst.cache, [-1], [0]), LLMParamError, PI),
    ("negative-dst", lambda c: c.pull(K, c.dst.cache, [0], [-1]), LLMParamError, PI),
    ("src-beyond-uint64", lambda c: c.pull(K, c.dst.cache, [2**64], [0]), LLMParamError, PI),
    ("src-out-of-range", lambda c: c.pull(K, c.dst.cache, [16], [0]), LLMParamError, PI),
    ("dst-out-of-range", lambda c: c.pull(K, c.dst.cache, [0], [16]), LLMParamError, PI),
    ("dst-out-of-range-late", lambda c: c.pull(K, c.dst.cache, [0, 1, 2], [3, 4, 99]),
     LLMParamError, PI),
    ("duplicate-dst", lambda c: c.pull(K, c.dst.cache, [0, 1], [5, 5]), LLMParamError, PI),
    ("duplicate-dst-apart", lambda c: c.pull(K, c.dst.cache, [0, 1, 2, 3], [5, 6, 7, 5]),
     LLMParamError, PI),
    ("range-step-2", lambda c: c.pull(K, c.dst.cache, [0], [0], src_layer_range=range(0, 4, 2),
                                      dst_layer_range=range(0, 2)), LLMParamError, PI),
    ("range-step-minus-1", lambda c: c.pull(K, c.dst.cache, [0], [0],
                                            dst_layer_range=range(3, 1, -1)), LLMParamError, PI),
    ("range-empty", lambda c: c.pull(K, c.dst.cache, [0], [0], src_layer_range=range(2, 2)),
     LLMParamError, PI),
    ("src-range-beyond-layers", lambda c: c.pull(K, c.dst.cache, [0], [0],
                                                 src_layer_range=range(3, 5),
                                                 dst_layer_range=range(0, 2)), LLMParamError, PI),
    ("dst-range-beyond-layers", lambda c: c.pull(K, c.dst.cache, [0], [0],
                                                 src_layer_range=range(0, 2),
                                                 dst_layer_range=range(3, 5)), LLMParamError, PI),
    ("range-lengths-differ", lambda c: c.pull(K, c.dst.cache, [0], [0],
                                              src_layer_range=range(0, 2),
                                              dst_layer_range=range(0, 3)), LLMParamError, PI),
    ("src-range-only-too-few", lambda c: c.pull(K, c.dst.cache, [0], [0],
                                                src_layer_range=range(0, 1)), LLMParamError, PI),
    ("t-does-not-divide", lambda c: c.pull(K, c.dst.cache, [0], [0], src_layer_range=range(0, 1),
                                           dst_layer_range=range(0, 1), tensor_num_per_layer=3),
     LLMParamError, PI),
    ("t-zero", lambda c: c.pull(K, c.dst.cache, [0], [0], tensor_num_per_layer=0),
     LLMParamError, PI),
    ("t-negative", lambda c: c.pull(K, c.dst.cache, [0], [0], tensor_num_per_layer=-2),
     LLMParamError, PI),
    ("t-beyond-uint32", lambda c: c.pull(K, c.dst.cache, [0], [0], tensor_num_per_layer=2**32),
     LLMParamError, PI),
    ("timeout-zero", lambda c: c.pull(K, c.dst.cache, [0], [0], timeout=0), LLMParamError, PI),
    ("timeout-negative", lambda c: c.pull(K, c.dst.cache, [0], [0], timeout=-1.0),
     LLMParamError, PI),
    # Issue 9, finding 9: inputs that escaped the contract (OverflowError, MemoryError,
    # a pybind TypeError from native code) are parameter errors now, changing nothing.
    ("timeout-inf", lambda c: c.pull(K, c.dst.cache, [0], [0], timeout=float("inf")),
     LLMParamError, PI),
    ("timeout-nan", lambda c: c.pull(K, c.dst.cache, [0], [0], timeout=float("nan")),
     LLMParamError, PI),
    ("timeout-huge-int", lambda c: c.pull(K, c.dst.cache, [0], [0], timeout=10**400),
     LLMParamError, PI),
    ("timeout-np-inf", lambda c: c.pull(K, c.dst.cache, [0], [0], timeout=np.float64("inf")),
     LLMParamError, PI),
    ("src-range-10e12", lambda c: c.pull(K, c.dst.cache, range(10**12), range(10**12)),
     LLMParamError, PI),
    ("dst-range-10e12", lambda c: c.pull(K, c.dst.cache, [0], range(10**12)), LLMParamError, PI),
    ("dst-range-10e20", lambda c: c.pull(K, c.dst.cache, [0], range(10**20)), LLMParamError, PI),
    ("src-2e63", lambda c: c.pull(K, c.dst.cache, [2**63], [0]), LLMParamError, PI),
    ("dst-2e63", lambda c: c.pull(K, c.dst.cache, [0], [2**63]), LLMParamError, PI),
    ("dst-2e64", lambda c: c.pull(K, c.dst.cache, [0], [2**64]), LLMParamError, PI),
    ("src-np-uint64-max", lambda c: c.pull(K, c.dst.cache, np.array([2**64 - 1], np.uint64),
                                           [0]), LLMParamError, PI),
    ("dst-np-negative", lambda c: c.pull(K, c.dst.cache, [0], np.array([-1])), LLMParamError,
     PI),
    ("block-size-differs", lambda c: c.pull(BlocksCacheKey(P, 3), c.dst.cache, [0], [0]),
     LLMParamError, PI),
    ("cachekey-req-and-prefix", lambda c: c.pull(CacheKey(P, 100, prefix_id=5), c.dst.cache,
                                                 [], [0]), LLMParamError, PI),
    ("cachekey-neither", lambda c: c.pull(CacheKey(P, NONE), c.dst.cache, [], [0]),
     LLMParamError, PI),
    ("cachekey-with-src-blocks", lambda c: c.pull(CacheKey(P, 100), c.dst.cache, [0], [0]),
     LLMParamError, PI),
    ("id-key-with-src-blocks", lambda c: c.pull(CacheKeyByIdAndIndex(P, c.rows.cache_id),
                                                c.dst.cache, [0], [0]), LLMParamError, PI),
    ("id-key-row-out-of-range", lambda c: c.pull(CacheKeyByIdAndIndex(P, c.rows.cache_id, 2),
                                                 c.dst.cache, [], [0]), LLMParamError, PI),
    ("row-shorter-than-blocks", lambda c: c.pull(CacheKey(P, 100), c.dst.cache, [],
                                                 [0, 1, 2]), LLMParamError, PI),
    ("own-cluster-id", lambda c: c.pull(BlocksCacheKey(D, 0), c.dst.cache, [0], [0]),
     LLMParamError, PI),
    ("dst-not-blocks-cache", lambda c: c.pull(K, c.local_rows, [0], [0]), LLMParamError, PI),
    ("dst-of-another-instance", lambda c: c.pull(K, c.src.cache, [0], [0]), LLMParamError, PI),
    ("dst-unregistered", lambda c: c.pull(K, c.gone, [0], [0]), LLMParamError, PI),
    # Parameters are checked before the link is looked up.
    ("bad-params-before-link", lambda c: c.pull(BlocksCacheKey(99, 0), c.dst.cache, [0], []),
     LLMParamError, PI),
]

LOOKUP_CASES: list[Case] = [
    ("unknown-model-id", lambda c: c.pull(BlocksCacheKey(P, 42), c.dst.cache, [0], [0]),
     LLMCacheNotFoundError, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
    ("unknown-req-id", lambda c: c.pull(CacheKey(P, 101), c.dst.cache, [], [0]),
     LLMCacheNotFoundError, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
    ("unknown-model-of-req", lambda c: c.pull(CacheKey(P, 100, 1), c.dst.cache, [], [0]),
     LLMCacheNotFoundError, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
    ("unknown-cache-id", lambda c: c.pull(CacheKeyByIdAndIndex(P, 10**9), c.dst.cache, [], [0]),
     LLMCacheNotFoundError, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
    ("no-link", lambda c: c.pull(BlocksCacheKey(99, 0), c.dst.cache, [0], [0]), LLMLinkError,
     LLMStatusCode.LLM_NOT_YET_LINK),
    ("no-link-cachekey", lambda c: c.pull(CacheKey(99, 100), c.dst.cache, [], [0]),
     LLMLinkError, LLMStatusCode.LLM_NOT_YET_LINK),
]

ALL = TYPE_CASES + VALUE_CASES + LOOKUP_CASES


@pytest.mark.parametrize(("call", "exc", "status"), [c[1:] for c in ALL], ids=[c[0] for c in ALL])
async def test_rejected_before_anything_moves(
    ctx: Ctx, call: Callable[[Ctx], Any], exc: type[BaseException], status: LLMStatusCode | None
) -> None:
    before = snapshot(ctx.dst)
    link = ctx.pair.decoder._rt.links.find(P)
    done = link.transfers

    with pytest.raises(exc) as info:
        await call(ctx)

    if status is None:
        assert not isinstance(info.value, LLMException)
    else:
        assert isinstance(info.value, LLMException)
        assert info.value.status_code == status
    if status == PI:
        assert isinstance(info.value, ValueError)
    assert ctx.tracker.events == [], "the call reached the link"
    assert link.transfers == done
    for t, tensor in enumerate(ctx.dst.tensors):
        assert np.array_equal(tensor.view(np.uint8).reshape(16, -1), before[t]), t
    # And the link is fine: a correct pull right after works.
    await ctx.pull(K, ctx.dst.cache, [4], [9])
    for t in range(8):
        assert np.array_equal(ctx.dst.tensors[t][9].view(np.uint8),
                              ctx.src.tensors[t][4].view(np.uint8))


async def test_param_error_is_value_error_and_llm_exception(ctx: Ctx) -> None:
    with pytest.raises(ValueError) as info:
        await ctx.pull(K, ctx.dst.cache, [0], [0, 1])
    assert isinstance(info.value, LLMParamError)
    assert isinstance(info.value, LLMException)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "src_blocks" in str(info.value) and "dst_blocks" in str(info.value)


async def test_not_yet_link_after_unlink(ctx: Ctx) -> None:
    from aiodatadist.testing import cluster_info

    before = snapshot(ctx.dst)
    status, _ = await ctx.pair.decoder.unlink_clusters([cluster_info(P)])
    assert status == LLMStatusCode.LLM_SUCCESS
    with pytest.raises(LLMLinkError) as info:
        await ctx.pull(K, ctx.dst.cache, [0], [0])
    assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    for t, tensor in enumerate(ctx.dst.tensors):
        assert np.array_equal(tensor.view(np.uint8).reshape(16, -1), before[t])
