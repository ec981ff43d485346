"""``push_cache``: a local non-block row written into a row of a linked peer's cache.

Bytes are checked with a pattern unique per transfer: the destination row of the selected
tensors holds the source row, every other byte is as before.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMCacheNotFoundError,
    LLMException,
    LLMLinkError,
    LLMParamError,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
)
from aiodatadist.testing import Pair, inproc_pair, make_blocks_cache
from aiodatadist.testing.patterns import fill_pattern
from tests.engine._util import BOUND_S, Tracker, executor_of, instrument, link_of

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
P, D = 1, 2
ROWS = 4
ROW_BYTES = 64 * 1024  # every push runs on the executor


class Rows:
    """A registered non-block cache of ``n`` tensors x ``ROWS`` rows, pattern-filled."""

    def __init__(self, dd, n: int, seed: int, row_bytes: int = ROW_BYTES) -> None:
        desc = CacheDesc(n, [ROWS, row_bytes], DataType.DT_UINT8, Placement.HOST)
        self.tensors = [np.zeros((ROWS, row_bytes), np.uint8) for _ in range(n)]
        fill_pattern(self.tensors, seed)
        self.cache = dd.cache_manager.register_cache(desc, self.tensors)

    def copy(self) -> list[np.ndarray]:
        return [t.copy() for t in self.tensors]

    def key(self, cluster_id: int, row: int) -> CacheKeyByIdAndIndex:
        return CacheKeyByIdAndIndex(cluster_id, self.cache.cache_id, row)


def _assert_rows(got: Rows, want: list[np.ndarray]) -> None:
    for t, (g, w) in enumerate(zip(got.tensors, want, strict=True)):
        bad = [r for r in range(ROWS) if not np.array_equal(g[r], w[r])]
        assert not bad, f"tensor {t}: rows {bad} differ from the reference"


async def _push(pair: Pair, src: Rows, dst: Rows, src_row: int, dst_row: int, span, **kw) -> None:
    """Pushes and checks: tensors ``span = (s0, d0, n)``."""
    s0, d0, n = span
    want = dst.copy()
    for k in range(n):
        want[d0 + k][dst_row] = src.tensors[s0 + k][src_row]
    await pair.decoder.cache_manager.push_cache(dst.key(P, dst_row), src.cache, src_row, **kw)
    _assert_rows(dst, want)


@pytest.mark.parametrize("path", ["inproc", "tcp"])
async def test_a_row_lands_in_the_named_row(path: str) -> None:
    async with inproc_pair(data_path=path) as pair:
        src, dst = Rows(pair.decoder, 4, seed=201), Rows(pair.prompt, 4, seed=1201)
        await _push(pair, src, dst, 2, 1, (0, 0, 4))
        await _push(pair, src, dst, 0, 3, (0, 0, 4), size=-1)


async def test_layer_ranges_with_a_destination_offset(pair: Pair) -> None:
    src, dst = Rows(pair.decoder, 4, seed=202), Rows(pair.prompt, 8, seed=1202)
    await _push(
        pair, src, dst, 3, 0, (2, 6, 2), src_layer_range=range(1, 2), dst_layer_range=range(3, 4)
    )
    await _push(
        pair, src, dst, 1, 2, (1, 4, 3), src_layer_range=range(1, 4),
        dst_layer_range=range(4, 7), tensor_num_per_layer=1,
    )  # fmt: skip
    # Defaults: every source layer (2) into destination layers 0, 1.
    await _push(pair, src, dst, 1, 3, (0, 0, 4))


async def test_a_smaller_source_row_fills_the_start_of_the_remote_row(pair: Pair) -> None:
    src = Rows(pair.decoder, 2, seed=203, row_bytes=ROW_BYTES // 2)
    dst = Rows(pair.prompt, 2, seed=1203)
    want = dst.copy()
    for t in range(2):
        want[t][1][: ROW_BYTES // 2] = src.tensors[t][0]
    await pair.decoder.cache_manager.push_cache(dst.key(P, 1), src.cache, 0)
    _assert_rows(dst, want)


def _bad_calls(src: Rows, dst: Rows, blocks, big: Rows):
    key = dst.key(P, 1)
    return {
        "key-type": ((BlocksCacheKey(P, 0), src.cache), {}, TypeError, None),
        "src-type": ((key, src.tensors[0]), {}, TypeError, None),
        "src-blocks": ((key, blocks.cache), {}, LLMParamError, None),
        "src-foreign": ((key, dst.cache), {}, LLMParamError, None),
        "row-range": ((key, src.cache, ROWS), {}, LLMParamError, None),
        "row-negative": ((key, src.cache, -1), {}, LLMParamError, None),
        "row-type": ((key, src.cache, 1.0), {}, TypeError, None),
        "size-positive": ((key, src.cache, 0), {"size": 16}, LLMParamError, None),
        "size-type": ((key, src.cache, 0), {"size": "x"}, TypeError, None),
        "tpl-zero": ((key, src.cache), {"tensor_num_per_layer": 0}, LLMParamError, None),
        "range-step": ((key, src.cache), {"src_layer_range": range(0, 2, 2)}, LLMParamError,
                       None),
        "ranges-differ": ((key, src.cache), {"src_layer_range": range(0, 1),
                                             "dst_layer_range": range(0, 2)},
                          LLMParamError, None),
        "remote-row-range": ((dst.key(P, ROWS), src.cache), {}, LLMParamError, None),
        "remote-range-beyond": ((key, src.cache), {"src_layer_range": range(0, 1),
                                                   "dst_layer_range": range(2, 3)},
                                LLMParamError, None),
        "remote-row-too-small": ((dst.key(P, 0), big.cache), {}, LLMParamError, None),
        "remote-is-blocks": ((CacheKeyByIdAndIndex(P, -5, 0), src.cache), {},
                             LLMParamError, None),
        "unknown-cache": ((CacheKeyByIdAndIndex(P, 12345, 0), src.cache), {},
                          LLMCacheNotFoundError, S.LLM_KV_CACHE_NOT_EXIST),
        "not-linked": ((CacheKeyByIdAndIndex(77, 1, 0), src.cache), {}, LLMLinkError,
                       S.LLM_NOT_YET_LINK),
        "own-cluster": ((CacheKeyByIdAndIndex(D, 1, 0), src.cache), {}, LLMParamError, None),
        "timeout-zero": ((key, src.cache), {"timeout": 0}, LLMParamError, None),
    }  # fmt: skip


BAD = [
    "key-type", "src-type", "src-blocks", "src-foreign", "row-range", "row-negative",
    "row-type", "size-positive", "size-type", "tpl-zero", "range-step", "ranges-differ",
    "remote-row-range", "remote-range-beyond", "remote-row-too-small", "remote-is-blocks",
    "unknown-cache", "not-linked", "own-cluster", "timeout-zero",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD)
async def test_bad_arguments_change_nothing(pair: Pair, case: str) -> None:
    src, dst = Rows(pair.decoder, 4, seed=204), Rows(pair.prompt, 4, seed=1204)
    blocks = make_blocks_cache(pair.decoder, seed=3, num_tensors=4, num_blocks=4,
                               block_shape=(1024,), data_type=DataType.DT_UINT8)  # fmt: skip
    remote_blocks = make_blocks_cache(
        pair.prompt,
        model_id=3,
        num_tensors=4,
        num_blocks=4,
        block_shape=(ROW_BYTES,),
        data_type=DataType.DT_UINT8,
    )
    big = Rows(pair.decoder, 4, seed=5, row_bytes=2 * ROW_BYTES)
    args, kw, exc, status = _bad_calls(src, dst, blocks, big)[case]
    if case == "remote-is-blocks":
        args = (CacheKeyByIdAndIndex(P, remote_blocks.cache.cache_id, 0), *args[1:])
    tracker = Tracker()
    instrument(pair.decoder, P, tracker)
    before = dst.copy()
    with pytest.raises(exc) as info:
        await pair.decoder.cache_manager.push_cache(*args, **kw)
    if isinstance(info.value, LLMException):
        assert info.value.status_code == (status or S.LLM_PARAM_INVALID), info.value
    assert tracker.events == []
    _assert_rows(dst, before)
    await _push(pair, src, dst, 1, 2, (0, 0, 4))  # the link is fine afterwards


async def test_timeout_aborts_and_the_link_stays_usable(pair: Pair) -> None:
    src, dst = Rows(pair.decoder, 4, seed=205), Rows(pair.prompt, 4, seed=1205)
    ch = instrument(pair.decoder, P)
    ch.hold_until_abort = True
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(LLMTimeoutError) as info:
        await pair.decoder.cache_manager.push_cache(dst.key(P, 0), src.cache, 0, timeout=0.05)
    assert loop.time() - start < 0.05 + BOUND_S
    assert info.value.status_code == S.LLM_TIMEOUT
    assert ch.jobs_started == ch.jobs_returned == 1
    assert executor_of(pair.decoder).in_flight == 0
    assert not link_of(pair.decoder, P).slot.busy
    ch.hold_until_abort = False
    await _push(pair, src, dst, 3, 0, (0, 0, 4))


async def test_cancel_waits_for_the_job_and_the_link_stays_usable(pair: Pair) -> None:
    src, dst = Rows(pair.decoder, 4, seed=206), Rows(pair.prompt, 4, seed=1206)
    ch = instrument(pair.decoder, P)
    ch.hold_until_abort = True
    task = asyncio.create_task(
        pair.decoder.cache_manager.push_cache(dst.key(P, 0), src.cache, 0, timeout=30)
    )
    await asyncio.wait_for(ch.inside.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ch.jobs_started == ch.jobs_returned
    assert not link_of(pair.decoder, P).slot.busy
    ch.hold_until_abort = False
    await _push(pair, src, dst, 2, 2, (0, 0, 4))
