"""``copy_cache``: bytes of one row of a local non-block cache into a row of another (or
the same) cache, at the same offset, for every tensor; bounds and argument checks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio

from aiodatadist import (
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMParamError,
    LLMRole,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
)
from aiodatadist.testing import make_blocks_cache
from aiodatadist.testing.patterns import fill_pattern

pytestmark = pytest.mark.asyncio

ROWS = 4
ROW = 4096


def _rows(dd: LLMDataDist, n: int, seed: int, rows: int = ROWS, row: int = ROW):
    tensors = [np.zeros((rows, row), np.uint8) for _ in range(n)]
    fill_pattern(tensors, seed)
    desc = CacheDesc(n, [rows, row], DataType.DT_UINT8, Placement.HOST)
    return dd.cache_manager.register_cache(desc, tensors), tensors


def _copy(tensors) -> list[np.ndarray]:
    return [t.copy() for t in tensors]


def _same(got, want) -> None:
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"tensor {t} differs from the reference"


@pytest_asyncio.fixture
async def dd():
    async with LLMDataDist(LLMRole.DECODER, 61) as d:
        yield d


async def test_a_whole_row_and_a_slice(dd: LLMDataDist) -> None:
    src, st = _rows(dd, 3, seed=301)
    dst, dt = _rows(dd, 3, seed=1301)
    want = _copy(dt)
    for t in range(3):
        want[t][2] = st[t][1]
    await dd.cache_manager.copy_cache(dst, src, 2, 1)
    _same(dt, want)
    # offset + size: only those bytes, the rest of the row untouched.
    for t in range(3):
        want[t][0][100:600] = st[t][3][100:600]
    await dd.cache_manager.copy_cache(dst, src, dst_batch_index=0, src_batch_index=3, offset=100,
                                      size=500, req_id=7)  # fmt: skip
    _same(dt, want)
    # size -1 with an offset: the rest of the row.
    for t in range(3):
        want[t][1][4000:] = st[t][0][4000:]
    await dd.cache_manager.copy_cache(dst, src, 1, 0, offset=4000)
    _same(dt, want)
    _same(st, _copy(st))  # the source is never written


async def test_rows_of_one_cache(dd: LLMDataDist) -> None:
    c, ct = _rows(dd, 2, seed=302)
    want = _copy(ct)
    for t in range(2):
        want[t][3][8:72] = ct[t][0][8:72]
    await dd.cache_manager.copy_cache(c, c, 3, 0, offset=8, size=64)
    _same(ct, want)
    with pytest.raises(LLMParamError, match="overlap"):
        await dd.cache_manager.copy_cache(c, c, 1, 1)
    _same(ct, want)


async def test_different_row_strides(dd: LLMDataDist) -> None:
    src, st = _rows(dd, 2, seed=303, row=2 * ROW)
    dst, dt = _rows(dd, 2, seed=1303)
    want = _copy(dt)
    for t in range(2):
        want[t][1][:ROW] = st[t][2][:ROW]
    await dd.cache_manager.copy_cache(dst, src, 1, 2, size=ROW)
    _same(dt, want)
    # -1 = the source row's rest, which does not fit the smaller destination row.
    with pytest.raises(LLMParamError, match="exceeds a row"):
        await dd.cache_manager.copy_cache(dst, src, 1, 2)
    _same(dt, want)


async def test_bad_arguments_change_nothing(dd: LLMDataDist) -> None:
    src, _ = _rows(dd, 2, seed=304)
    dst, dt = _rows(dd, 2, seed=1304)
    three, _ = _rows(dd, 3, seed=5)
    blocks = make_blocks_cache(dd, num_tensors=2, num_blocks=4, block_shape=(ROW,),
                               data_type=DataType.DT_UINT8)  # fmt: skip
    before = _copy(dt)
    cm = dd.cache_manager
    bad = [
        ((dst, src, 0, 0, 0, 0), {}, LLMParamError),  # size 0
        ((dst, src, 0, 0, 0, -2), {}, LLMParamError),
        ((dst, src, 0, 0, ROW, -1), {}, LLMParamError),  # offset past the row
        ((dst, src, 0, 0, 10, ROW), {}, LLMParamError),  # offset + size past the row
        ((dst, src, ROWS, 0), {}, LLMParamError),
        ((dst, src, 0, ROWS), {}, LLMParamError),
        ((dst, src, -1, 0), {}, LLMParamError),
        ((dst, src, 0, 0, -1), {}, LLMParamError),
        ((dst, three), {}, LLMParamError),  # tensor counts differ
        ((blocks.cache, src), {}, LLMParamError),
        ((dst, blocks.cache), {}, LLMParamError),
        ((dst, src), {"req_id": -1}, LLMParamError),
        ((dst, src), {"req_id": "r"}, TypeError),
        ((dst, src, 0.0), {}, TypeError),
        ((dst, object()), {}, TypeError),
        ((dst, src), {"timeout": -1}, LLMParamError),
    ]
    for args, kw, exc in bad:
        with pytest.raises(exc) as info:
            await cm.copy_cache(*args, **kw)
        if isinstance(info.value, LLMParamError):
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        _same(dt, before)
    # A freed cache is not live.
    gone, _ = _rows(dd, 2, seed=6)
    cm.unregister_cache(gone.cache_id)
    with pytest.raises(LLMParamError, match="not a live cache"):
        await cm.copy_cache(dst, gone)
    _same(dt, before)


async def test_a_deadline_holds_while_the_loop_is_blocked() -> None:
    # The loop is blocked (a callback sleeping 0.5 s, as a CPU-bound handler would) right
    # after the copy's job was queued: the loop's timer cannot abort it, the job's own
    # deadline does. Without it the 256 MiB copy (one thread, into pages never touched:
    # 25-130 ms here) ran to the end and the call returned success 0.5 s past its 20 ms
    # deadline.
    import time

    dd = LLMDataDist(LLMRole.DECODER, 63)
    await dd.init({"aiodatadist.MoverThreads": "1"})
    try:
        row = 128 << 20
        desc = CacheDesc(2, [1, row], DataType.DT_UINT8, Placement.HOST)
        ta = [np.ones((1, row), np.uint8) for _ in range(2)]
        tb = [np.zeros((1, row), np.uint8) for _ in range(2)]
        a = dd.cache_manager.register_cache(desc, ta)
        b = dd.cache_manager.register_cache(desc, tb)
        loop = asyncio.get_running_loop()
        copy = asyncio.ensure_future(dd.cache_manager.copy_cache(b, a, 0, 0, timeout=0.02))
        await asyncio.sleep(0)  # the copy's job is queued
        loop.call_soon(time.sleep, 0.5)
        with pytest.raises(LLMTimeoutError) as info:
            await copy
        assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert not all(t[0].all() for t in tb), "the whole row landed: nothing ended the job"
        assert dd._rt.executor.in_flight == 0
        for t in ta:
            t[0][:] = 7  # this copy's own bytes: a late landing of the aborted one fails it
        await dd.cache_manager.copy_cache(b, a, 0, 0, timeout=30)  # usable after it
        assert all(bool((t[0] == 7).all()) for t in tb)
    finally:
        await dd.finalize()


async def test_timeout_aborts_and_a_copy_after_it_works() -> None:
    # One mover thread and 2 x 32 MiB per row of never-touched memory (every page faults
    # in during the copy): a 1 ms deadline fires long before the copy could end.
    dd = LLMDataDist(LLMRole.DECODER, 62)
    await dd.init({"aiodatadist.MoverThreads": "1"})
    try:
        row = 32 << 20
        desc = CacheDesc(2, [2, row], DataType.DT_UINT8, Placement.HOST)
        ta = [np.empty((2, row), np.uint8) for _ in range(2)]
        tb = [np.empty((2, row), np.uint8) for _ in range(2)]
        a = dd.cache_manager.register_cache(desc, ta)
        b = dd.cache_manager.register_cache(desc, tb)
        with pytest.raises(LLMTimeoutError) as info:
            await dd.cache_manager.copy_cache(b, a, 0, 1, timeout=0.001)
        assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert dd._rt.executor.in_flight == 0
        for t in range(2):
            ta[t][1][:16] = 9 + t
        await dd.cache_manager.copy_cache(b, a, 0, 1, size=16, timeout=30)
        for t in range(2):
            assert (tb[t][0][:16] == 9 + t).all()
        dd.cache_manager.unregister_cache(a.cache_id)
        dd.cache_manager.unregister_cache(b.cache_id)
    finally:
        await dd.finalize()
