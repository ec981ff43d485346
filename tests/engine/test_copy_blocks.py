"""copy_blocks: block-to-blocks copies inside one local blocks cache, against numpy."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiodatadist import CacheDesc, DataType, LLMParamError, LLMStatusCode, Placement
from aiodatadist.testing import Pair
from tests.engine._util import (
    BOUND_S,
    assert_bytes,
    big_cache,
    big_value,
    executor_of,
    snapshot,
)

pytestmark = pytest.mark.asyncio

BLOCK = (64, 8, 16)


def _reference(before: list[np.ndarray], info: dict[int, list[int]]) -> list[np.ndarray]:
    out = [b.copy() for b in before]
    for t in range(len(out)):
        for s, dsts in info.items():
            for d in dsts:
                out[t][d] = before[t][s]
    return out


@pytest.mark.parametrize(
    "info",
    [
        {0: [1]},
        {0: [1, 2, 3]},  # one source fanned out
        {5: [0], 6: [1], 7: [2]},  # a run
        {7: [1], 0: [6]},
        {3: [15], 14: [4, 9], 2: [12]},
    ],
    ids=["one", "fan-out", "run", "ends", "mixed"],
)
@pytest.mark.parametrize("role", ["prompt", "decoder"])
async def test_copies_match_numpy(pair: Pair, info: dict[int, list[int]], role: str) -> None:
    make = pair.prompt_cache if role == "prompt" else pair.decoder_cache
    fc = make(seed=4, num_tensors=4, num_blocks=16, block_shape=BLOCK)
    dd = pair.prompt if role == "prompt" else pair.decoder
    want = _reference(snapshot(fc), info)
    await dd.cache_manager.copy_blocks(fc.cache, info)
    assert_bytes(fc, want)


async def test_allocated_cache_and_dtypes(pair: Pair) -> None:
    cm = pair.decoder.cache_manager
    desc = CacheDesc(3, [6, 5, 7], DataType.DT_DOUBLE, Placement.HOST)
    cache = cm.allocate_blocks_cache(desc)
    views = cache.tensors()
    for t, v in enumerate(views):
        v[...] = np.arange(6 * 35, dtype=np.float64).reshape(6, 5, 7) + 1000 * t
    before = [v.copy() for v in views]
    await cm.copy_blocks(cache, {1: [4, 5]})
    for t, v in enumerate(views):
        assert np.array_equal(v[4], before[t][1]) and np.array_equal(v[5], before[t][1])
        assert np.array_equal(v[:4], before[t][:4])


@pytest.mark.parametrize(
    ("info", "exc"),
    [
        ({}, LLMParamError),
        ({0: []}, LLMParamError),
        ({0: [0]}, LLMParamError),  # a block onto itself
        ({0: [1], 1: [2]}, LLMParamError),  # 1 is both a source and a destination
        ({0: [2], 1: [2]}, LLMParamError),  # destination twice
        ({0: [2, 2]}, LLMParamError),
        ({0: [16]}, LLMParamError),
        ({16: [0]}, LLMParamError),
        ({-1: [0]}, LLMParamError),
        ({0: [-1]}, LLMParamError),
        ([(0, [1])], TypeError),
        ({0: 1}, TypeError),
        ({"0": [1]}, TypeError),
        ({0: [1.0]}, TypeError),
    ],
    ids=["empty", "no-dst", "self", "src-is-dst", "dst-twice", "dst-twice-one-src",
         "dst-out-of-range", "src-out-of-range", "negative-src", "negative-dst",
         "not-a-mapping", "dst-not-a-list", "key-str", "dst-float"],
)
async def test_bad_copies_change_nothing(pair: Pair, info, exc: type[BaseException]) -> None:
    fc = pair.decoder_cache(seed=5, num_tensors=2, num_blocks=16, block_shape=BLOCK)
    before = snapshot(fc)
    with pytest.raises(exc) as err:
        await pair.decoder.cache_manager.copy_blocks(fc.cache, info)
    if exc is LLMParamError:
        assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert_bytes(fc, before)


async def test_wrong_caches(pair: Pair) -> None:
    cm = pair.decoder.cache_manager
    rows = cm.allocate_cache(CacheDesc(2, [4, 64], DataType.DT_FLOAT16, Placement.HOST))
    with pytest.raises(LLMParamError):
        await cm.copy_blocks(rows, {0: [1]})  # not a blocks cache
    other = pair.prompt_cache(seed=1, num_tensors=2, num_blocks=4, block_shape=BLOCK)
    with pytest.raises(LLMParamError):
        await cm.copy_blocks(other.cache, {0: [1]})  # another instance's cache
    with pytest.raises(TypeError):
        await cm.copy_blocks(None, {0: [1]})
    fc = pair.decoder_cache(seed=1, num_tensors=2, num_blocks=4, block_shape=BLOCK)
    with pytest.raises(TypeError):
        await cm.copy_blocks(fc.cache, {0: [1]}, timeout="1")


async def test_big_copy_times_out_then_works(slow_pair: Pair) -> None:
    pair = slow_pair
    fc = big_cache(pair.decoder, fill=True)
    cm = pair.decoder.cache_manager
    info = {b: [b + 32] for b in range(32)}
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError) as err:  # (a 256 MiB copy takes ~5 ms here: 1 ms)
        await cm.copy_blocks(fc.cache, info, timeout=0.001)
    assert loop.time() - start < BOUND_S
    assert err.value.status_code == LLMStatusCode.LLM_TIMEOUT
    assert executor_of(pair.decoder).in_flight == 0
    await cm.copy_blocks(fc.cache, info, timeout=60)
    for t, arr in enumerate(fc.tensors):
        for b in range(32):
            assert arr[b + 32].min() == arr[b + 32].max() == big_value(t, b)
            assert arr[b].min() == arr[b].max() == big_value(t, b)
