"""``push_blocks``: local blocks written into a linked peer's blocks cache.

Bytes are checked against the reference model (``tests.engine._util.reference_pull``,
which is the model of a block copy whichever side drives it) with a pattern unique per
transfer: the named destination blocks of the selected layers hold the source's, every
other byte is as before. Every bad argument raises its type / status before a byte moves.
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
from tests.engine._util import (
    BOUND_S,
    Tracker,
    assert_bytes,
    executor_of,
    instrument,
    link_of,
    reference_pull,
    snapshot,
)

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
P, D = 1, 2  # the pair fixture's prompt and decoder cluster ids
BLOCK = (256, 8, 16)  # fp16: 64 KiB blocks, so every push runs on the executor
MODEL = 7


def _caches(pair: Pair, seed: int, *, src_tensors: int = 8, dst_tensors: int = 8, nb: int = 8):
    """A pattern-filled source on the decoder, a pattern-filled destination on the prompt
    (registered under ``MODEL``): distinct seeds, so every landed byte is recognisable."""
    src = make_blocks_cache(
        pair.decoder, seed=seed, pattern=True, num_tensors=src_tensors, num_blocks=nb,
        block_shape=BLOCK,
    )  # fmt: skip
    dst = make_blocks_cache(
        pair.prompt, model_id=MODEL, seed=seed + 1000, pattern=True, num_tensors=dst_tensors,
        num_blocks=nb, block_shape=BLOCK,
    )  # fmt: skip
    return src, dst


async def _push_and_check(
    pair: Pair, src, dst, s: list[int], d: list[int], span: tuple[int, int, int], **kw
) -> None:
    want = reference_pull(snapshot(src), snapshot(dst), s, d, *span)
    await pair.decoder.cache_manager.push_blocks(BlocksCacheKey(P, MODEL), src.cache, **kw)
    assert_bytes(dst, want)


@pytest.mark.parametrize("path", ["inproc", "tcp"])
async def test_named_blocks_of_every_layer_land(path: str) -> None:
    async with inproc_pair(data_path=path) as pair:
        src, dst = _caches(pair, seed=101)
        s, d = [6, 0, 3], [1, 7, 4]
        await _push_and_check(pair, src, dst, s, d, (0, 0, 8), src_blocks=s, dst_blocks=d)
        # Positional, as upstream's signature.
        want = reference_pull(snapshot(src), snapshot(dst), [2], [2], 0, 0, 8)
        await pair.decoder.cache_manager.push_blocks(BlocksCacheKey(P, MODEL), src.cache, [2], [2])
        assert_bytes(dst, want)


async def test_layer_ranges_with_a_destination_offset(pair: Pair) -> None:
    src, dst = _caches(pair, seed=102)
    # Source layers 1, 2 (tensors 2..5) -> destination layers 2, 3 (tensors 4..7).
    await _push_and_check(
        pair, src, dst, [5, 1], [0, 6], (2, 4, 4), src_blocks=[5, 1], dst_blocks=[0, 6],
        src_layer_range=range(1, 3), dst_layer_range=range(2, 4),
    )  # fmt: skip
    # tensor_num_per_layer=1: "layer" 3 is tensor 3 -> tensor 0.
    await _push_and_check(
        pair, src, dst, [4], [4], (3, 0, 1), src_blocks=[4], dst_blocks=[4],
        src_layer_range=range(3, 4), dst_layer_range=range(0, 1), tensor_num_per_layer=1,
    )  # fmt: skip


async def test_a_missing_dst_range_defaults_to_every_source_layer(pair: Pair) -> None:
    # A 4-tensor source into an 8-tensor destination: None = the source's 2 layers, so
    # tensors 0..3 -> 0..3 with src_layer_range None and dst_layer_range None...
    src, dst = _caches(pair, seed=103, src_tensors=4)
    await _push_and_check(pair, src, dst, [1], [2], (0, 0, 4), src_blocks=[1], dst_blocks=[2])
    # ...and src_layer_range given alone, the destination's range is still the source's
    # every layer (upstream's default), so its length must match.
    with pytest.raises(LLMParamError, match="differ in length"):
        await pair.decoder.cache_manager.push_blocks(
            BlocksCacheKey(P, MODEL), src.cache, [1], [2], src_layer_range=range(0, 1)
        )


async def test_empty_src_blocks_means_contiguous(pair: Pair) -> None:
    src, dst = _caches(pair, seed=104)
    d = [5, 2, 7]
    await _push_and_check(pair, src, dst, [0, 1, 2], d, (0, 0, 8), dst_blocks=d)
    await _push_and_check(pair, src, dst, [0], [3], (0, 0, 8), src_blocks=[], dst_blocks=[3])


async def test_one_transfer_under_one_slot_for_every_layer(pair: Pair) -> None:
    src, dst = _caches(pair, seed=105)
    tracker = Tracker()
    instrument(pair.decoder, P, tracker)
    await _push_and_check(pair, src, dst, [0, 1], [2, 3], (0, 0, 8), src_blocks=[0, 1],
                          dst_blocks=[2, 3])  # fmt: skip
    assert len(tracker.entered()) == 1
    assert tracker.entered()[0].startswith("push:")


def _bad_calls(pair: Pair, src, rows, small):
    key = BlocksCacheKey(P, MODEL)
    return {
        "key-type": ((CacheKeyByIdAndIndex(P, 1, 0), src.cache, [0], [0]), {}, TypeError, None),
        "src-type": ((key, src.tensors[0], [0], [0]), {}, TypeError, None),
        "src-not-blocks": ((key, rows, [0], [0]), {}, LLMParamError, None),
        "src-foreign": ((key, small.cache, [0], [0]), {}, LLMParamError, None),
        "dst-empty": ((key, src.cache, [], []), {}, LLMParamError, None),
        "lengths-differ": ((key, src.cache, [0, 1], [0]), {}, LLMParamError, None),
        "src-block-range": ((key, src.cache, [8], [0]), {}, LLMParamError, None),
        "src-block-negative": ((key, src.cache, [-1], [0]), {}, LLMParamError, None),
        "dst-block-remote-range": ((key, src.cache, [0], [8]), {}, LLMParamError, None),
        "contiguous-too-many": ((key, src.cache, [], list(range(9))), {}, LLMParamError, None),
        "dst-duplicate": ((key, src.cache, [0, 1], [3, 3]), {}, LLMParamError, None),
        "blocks-not-ints": ((key, src.cache, [0.0], [0]), {}, TypeError, None),
        "tpl-zero": ((key, src.cache, [0], [0]), {"tensor_num_per_layer": 0}, LLMParamError, None),
        "tpl-negative": ((key, src.cache, [0], [0]), {"tensor_num_per_layer": -1},
                         LLMParamError, None),
        "tpl-type": ((key, src.cache, [0], [0]), {"tensor_num_per_layer": "2"}, TypeError, None),
        "range-step": ((key, src.cache, [0], [0]),
                       {"src_layer_range": range(0, 4, 2), "dst_layer_range": range(0, 2)},
                       LLMParamError, None),
        "ranges-differ": ((key, src.cache, [0], [0]),
                          {"src_layer_range": range(0, 2), "dst_layer_range": range(0, 3)},
                          LLMParamError, None),
        "src-range-beyond": ((key, src.cache, [0], [0]),
                             {"src_layer_range": range(3, 5), "dst_layer_range": range(0, 2)},
                             LLMParamError, None),
        "dst-range-beyond-remote": ((key, src.cache, [0], [0]),
                                    {"src_layer_range": range(0, 2),
                                     "dst_layer_range": range(3, 5)},
                                    LLMParamError, None),
        "block-size-differs": ((BlocksCacheKey(P, MODEL + 1), src.cache, [0], [0]), {},
                               LLMParamError, None),
        "unknown-model": ((BlocksCacheKey(P, 99), src.cache, [0], [0]), {},
                          LLMCacheNotFoundError, S.LLM_KV_CACHE_NOT_EXIST),
        "not-linked": ((BlocksCacheKey(77, MODEL), src.cache, [0], [0]), {}, LLMLinkError,
                       S.LLM_NOT_YET_LINK),
        "own-cluster": ((BlocksCacheKey(D, MODEL), src.cache, [0], [0]), {}, LLMParamError,
                        None),
        "timeout-negative": ((key, src.cache, [0], [0]), {"timeout": -1.0}, LLMParamError,
                             None),
        "timeout-type": ((key, src.cache, [0], [0]), {"timeout": "1"}, TypeError, None),
        "unknown-keyword": ((key, src.cache, [0], [0]), {"prompt_blocks": [0]}, TypeError, None),
    }  # fmt: skip


BAD = [
    "key-type", "src-type", "src-not-blocks", "src-foreign", "dst-empty", "lengths-differ",
    "src-block-range", "src-block-negative", "dst-block-remote-range", "contiguous-too-many",
    "dst-duplicate", "blocks-not-ints", "tpl-zero", "tpl-negative", "tpl-type", "range-step",
    "ranges-differ", "src-range-beyond", "dst-range-beyond-remote", "block-size-differs",
    "unknown-model", "not-linked", "own-cluster", "timeout-negative", "timeout-type",
    "unknown-keyword",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD)
async def test_bad_arguments_change_nothing(pair: Pair, case: str) -> None:
    src, dst = _caches(pair, seed=106)
    # A second prompt cache whose blocks are twice as big, and a non-block local cache.
    make_blocks_cache(pair.prompt, model_id=MODEL + 1, seed=5, num_tensors=8, num_blocks=8,
                      block_shape=(512, 8, 16))  # fmt: skip
    rows = pair.decoder.cache_manager.register_cache(
        CacheDesc(8, [2, 1024], DataType.DT_UINT8, Placement.HOST),
        [np.zeros((2, 1024), np.uint8) for _ in range(8)],
    )
    small = make_blocks_cache(pair.prompt, seed=9, num_tensors=8, num_blocks=8, block_shape=BLOCK)
    args, kw, exc, status = _bad_calls(pair, src, rows, small)[case]
    tracker = Tracker()
    instrument(pair.decoder, P, tracker)
    before = snapshot(dst)
    with pytest.raises(exc) as info:
        await pair.decoder.cache_manager.push_blocks(*args, **kw)
    if isinstance(info.value, LLMException):
        want = status if status is not None else S.LLM_PARAM_INVALID
        assert info.value.status_code == want, info.value
    assert tracker.events == []
    assert_bytes(dst, before)
    # The link is fine afterwards.
    await _push_and_check(pair, src, dst, [3], [4], (0, 0, 8), src_blocks=[3], dst_blocks=[4])


async def test_timeout_aborts_and_the_link_stays_usable(pair: Pair) -> None:
    src, dst = _caches(pair, seed=107)
    ch = instrument(pair.decoder, P)
    ch.hold_until_abort = True  # the native job waits for its abort: a deadline must fire
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(LLMTimeoutError) as info:
        await pair.decoder.cache_manager.push_blocks(
            BlocksCacheKey(P, MODEL), src.cache, [0, 1], [0, 1], timeout=0.05
        )
    assert loop.time() - start < 0.05 + BOUND_S
    assert isinstance(info.value, TimeoutError)
    assert info.value.status_code == S.LLM_TIMEOUT
    assert ch.jobs_started == ch.jobs_returned == 1
    assert executor_of(pair.decoder).in_flight == 0
    assert not link_of(pair.decoder, P).slot.busy
    ch.hold_until_abort = False
    await _push_and_check(pair, src, dst, [2, 5], [2, 5], (0, 0, 8), src_blocks=[2, 5],
                          dst_blocks=[2, 5])  # fmt: skip


async def test_cancel_waits_for_the_job_and_the_link_stays_usable(pair: Pair) -> None:
    src, dst = _caches(pair, seed=108)
    ch = instrument(pair.decoder, P)
    ch.hold_until_abort = True
    task = asyncio.create_task(
        pair.decoder.cache_manager.push_blocks(
            BlocksCacheKey(P, MODEL), src.cache, [0], [0], timeout=30
        )
    )
    await asyncio.wait_for(ch.inside.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ch.jobs_started == ch.jobs_returned
    assert not link_of(pair.decoder, P).slot.busy
    ch.hold_until_abort = False
    await _push_and_check(pair, src, dst, [6], [1], (0, 0, 8), src_blocks=[6], dst_blocks=[1])
