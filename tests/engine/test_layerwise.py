"""pull_blocks_layerwise: each layer's exact bytes when it is handed over, layer ranges,
early exits (break, aclose, an exception in the body, cancel) that abort what is in flight
and leave the link usable, one deadline for the whole iteration, an error in layer k
raised where layer k is asked for, and argument errors at the call.

Every transfer's source is filled with a pattern seeded for that test case, and each
layer is checked at the moment it is yielded; the layers beyond the ones in flight are
checked to be still untouched then (a whole pull handed over at once would fail that).
"""

from __future__ import annotations

import asyncio
import itertools
import os

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheKeyByIdAndIndex,
    LLMException,
    LLMParamError,
    LLMStatusCode,
    LLMTimeoutError,
)
from aiodatadist._cm_layerwise import LayerPulled, LayerStream
from aiodatadist._executor import INLINE_MAX_BYTES
from aiodatadist.testing import Pair, fill_pattern, pattern_mismatches
from tests.engine._util import (
    BOUND_S,
    blocks_of,
    executor_of,
    instrument,
    link_of,
    wait_until,
)

pytestmark = pytest.mark.asyncio

BLOCK = (256, 8, 16)  # 64 KiB blocks (fp16): every layer's job runs on the executor
NB = 8
_seeds = itertools.count(1000)


def _caches(pair: Pair, *, src_tensors: int = 8, dst_tensors: int = 8, seed: int | None = None):
    """A pattern-filled source (a fresh seed per call: unique per transfer) and a zeroed dst."""
    s = next(_seeds) if seed is None else seed
    src = pair.prompt_cache(num_tensors=src_tensors, num_blocks=NB, block_shape=BLOCK)
    fill_pattern(src.tensors, s)
    dst = pair.decoder_cache(num_tensors=dst_tensors, num_blocks=NB, block_shape=BLOCK)
    return src, dst, s


def _layer_ok(dst, seed: int, t: int, layer: LayerPulled, sb: list[int], db: list[int]) -> None:
    pairs = [(layer.src_layer * t + i, layer.dst_layer * t + i) for i in range(t)]
    bad = pattern_mismatches(dst.tensors, sb, db, seed, pairs)
    assert not bad, f"layer {layer}: {bad[0]}"


def _hold_after(channel, n: int, until: int | None = None) -> None:
    """The first ``n`` transfers entering ``channel`` run; later ones (up to the
    ``until``-th, exclusive) wait for their abort."""
    count = itertools.count()

    def held(label: str) -> bool:
        k = next(count)
        return k >= n and (until is None or k < until)

    channel.hold_until_abort = held


def _untouched(dst, tensors: range) -> bool:
    return all(not blocks_of(dst.tensors[k]).any() for k in tensors)


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("depth", [1, 2, 4])
async def test_each_layer_exact_when_yielded(pair: Pair, t: int, depth: int) -> None:
    src, dst, seed = _caches(pair)
    sb, db = [5, 1, 2, 7], [0, 3, 4, 6]
    n_layers = 8 // t
    got = []
    async with pair.decoder.cache_manager.pull_blocks_layerwise(
        pair.key(), dst.cache, sb, db, tensor_num_per_layer=t, depth=depth
    ) as layers:
        assert isinstance(layers, LayerStream) and len(layers) == n_layers
        async for layer in layers:
            _layer_ok(dst, seed, t, layer, sb, db)  # depth is accepted, and changes nothing
            got.append(layer)
    assert got == [
        LayerPulled(k, k, k, len(db) * t * src.cache.cache_desc.size // NB) for k in range(n_layers)
    ]


async def test_an_iteration_within_the_inline_bound_is_one_inline_copy(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At most ``INLINE_MAX_BYTES`` in all: one pull, copied on the loop thread (no mover
    thread, no executor job), every layer exact and handed over; over it, one layered job."""
    seed = next(_seeds)
    small = (16, 8, 16)  # fp16: 4 KiB per block per tensor
    src = pair.prompt_cache(model_id=1, num_tensors=8, num_blocks=NB, block_shape=small)
    fill_pattern(src.tensors, seed)
    ex = executor_of(pair.decoder)
    jobs: list[str] = []
    real_prestart, real_post = ex.prestart, ex._post

    def prestart(*a, **k):
        jobs.append("layered")
        return real_prestart(*a, **k)

    def post(*a, **k):
        jobs.append("worker")
        return real_post(*a, **k)

    monkeypatch.setattr(ex, "prestart", prestart)
    monkeypatch.setattr(ex, "_post", post)
    per_block = 8 * 4096  # all 8 tensors
    n = INLINE_MAX_BYTES // per_block
    for blocks, expect in ((n, []), (n + 1, ["layered", "worker"])):
        sb = list(range(blocks))
        db = sb[::-1]
        dst = pair.decoder_cache(num_tensors=8, num_blocks=NB, block_shape=small)
        got = []
        async for layer in pair.decoder.cache_manager.pull_blocks_layerwise(
            pair.key(1), dst.cache, sb, db, tensor_num_per_layer=1
        ):
            _layer_ok(dst, seed, 1, layer, sb, db)
            got.append(layer.index)
        assert got == list(range(8))
        assert not pattern_mismatches(dst.tensors, sb, db, seed)
        assert all(not blocks_of(t)[blocks:].any() for t in dst.tensors)  # nothing else
        assert jobs == expect, (blocks * per_block, jobs)
        jobs.clear()


@pytest.mark.parametrize(
    ("t", "src_lr", "dst_lr"),
    [
        (1, range(5, 8), range(0, 3)),
        (1, range(0, 2), range(6, 8)),
        (2, range(1, 3), range(2, 4)),
        (2, range(3, 4), range(0, 1)),
        (4, range(1, 2), range(0, 1)),
    ],
)
async def test_layer_ranges_with_offsets(pair: Pair, t: int, src_lr: range, dst_lr: range) -> None:
    _src, dst, seed = _caches(pair)
    sb, db = [0, 6], [7, 2]
    seen = []
    async for layer in pair.decoder.cache_manager.pull_blocks_layerwise(
        pair.key(),
        dst.cache,
        sb,
        db,
        src_layer_range=src_lr,
        dst_layer_range=dst_lr,
        tensor_num_per_layer=t,
    ):
        _layer_ok(dst, seed, t, layer, sb, db)
        seen.append((layer.src_layer, layer.dst_layer))
    assert seen == list(zip(src_lr, dst_lr, strict=True))
    outside = [k for k in range(8) if k // t not in dst_lr]
    assert _untouched(dst, range(0)) and all(not blocks_of(dst.tensors[k]).any() for k in outside)


async def test_one_range_only(pair: Pair) -> None:
    # 8 remote tensors into 4 local ones: src_layer_range picks 2 of 4 remote layers.
    _src, dst, seed = _caches(pair, src_tensors=8, dst_tensors=4)
    seen = [
        (layer.src_layer, layer.dst_layer)
        async for layer in pair.decoder.cache_manager.pull_blocks_layerwise(
            pair.key(), dst.cache, [1], [1], src_layer_range=range(2, 4)
        )
    ]
    assert seen == [(2, 0), (3, 1)]
    assert not pattern_mismatches(dst.tensors, [1], [1], seed, [(4, 0), (5, 1), (6, 2), (7, 3)])
    # 4 remote tensors into 8 local ones: dst_layer_range places them.
    _src, dst, seed = _caches(pair, src_tensors=4, dst_tensors=8)
    await _no_layer_left(pair, dst, [3], [3], dst_layer_range=range(2, 4))
    assert not pattern_mismatches(dst.tensors, [3], [3], seed, [(0, 4), (1, 5), (2, 6), (3, 7)])
    assert _untouched(dst, range(0, 4))


async def _no_layer_left(pair: Pair, dst, sb, db, **kw) -> list[LayerPulled]:
    return [
        layer
        async for layer in pair.decoder.cache_manager.pull_blocks_layerwise(
            pair.key(), dst.cache, sb, db, **kw
        )
    ]


async def test_mla_like_one_tensor_per_layer(pair: Pair) -> None:
    _src, dst, seed = _caches(pair, src_tensors=5, dst_tensors=5)
    layers = await _no_layer_left(pair, dst, [0, 7], [7, 0], tensor_num_per_layer=1)
    assert [la.dst_layer for la in layers] == list(range(5))
    assert not pattern_mismatches(dst.tensors, [0, 7], [7, 0], seed)


async def test_row_key_cut_into_blocks(pair: Pair) -> None:
    # A non-block remote row is cut into local blocks, layer by layer (as pull_blocks).
    from aiodatadist import CacheDesc, DataType, Placement

    seed = next(_seeds)
    row_bytes = 4 * 64 * 1024
    desc = CacheDesc(4, [2, row_bytes], DataType.DT_UINT8, Placement.HOST)
    rows = [np.zeros((2, row_bytes), dtype=np.uint8) for _ in range(4)]
    remote = pair.prompt.cache_manager.register_cache(desc, rows)
    fill_pattern(rows, seed)
    _, dst, _ = _caches(pair, dst_tensors=4)
    key = CacheKeyByIdAndIndex(pair.prompt.cluster_id, remote.cache_id, 1)
    async for layer in pair.decoder.cache_manager.pull_blocks_layerwise(key, dst.cache, [], [2, 5]):
        for k in range(layer.dst_layer * 2, layer.dst_layer * 2 + 2):
            want = pattern_blocks_row(seed, k, row_bytes)
            got = blocks_of(dst.tensors[k])
            assert np.array_equal(got[2], want[: 64 * 1024])
            assert np.array_equal(got[5], want[64 * 1024 : 128 * 1024])


def pattern_blocks_row(seed: int, tensor: int, row_bytes: int) -> np.ndarray:
    from aiodatadist.testing import pattern_blocks

    return pattern_blocks(seed, tensor, [1], row_bytes)[0]


# ----------------------------------------------------------------- leaving early


async def _link_free(pair: Pair) -> None:
    assert executor_of(pair.decoder).in_flight == 0
    assert not link_of(pair.decoder, 1).slot.busy


async def _later_pull_works(pair: Pair, dst) -> None:
    _src, _, seed = _caches(pair)  # a new source, a new pattern (replaces model 0)
    dst.tensors[0][...] = 0
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [4, 2], [1, 6], timeout=30)
    assert not pattern_mismatches(dst.tensors, [4, 2], [1, 6], seed)


async def test_break_in_async_with_aborts_and_link_usable(pair: Pair) -> None:
    _src, dst, seed = _caches(pair)
    channel = instrument(pair.decoder, 1)
    async with pair.decoder.cache_manager.pull_blocks_layerwise(
        pair.key(), dst.cache, [0, 1], [0, 1], tensor_num_per_layer=1
    ) as layers:
        async for layer in layers:
            _layer_ok(dst, seed, 1, layer, [0, 1], [0, 1])
            if layer.index == 1:
                channel.hold_until_abort = True  # the layers in flight now never finish alone
                await asyncio.sleep(0.01)
                break
    await _link_free(pair)  # __aexit__ returned: every native job has returned
    assert channel.jobs_started == channel.jobs_returned
    assert "layers" in repr(layers) and "closed" in repr(layers)
    channel.hold_until_abort = False
    with pytest.raises(StopAsyncIteration):
        await layers.__anext__()  # closed
    await _later_pull_works(pair, dst)


async def test_break_in_plain_async_for_aborts_when_dropped(pair: Pair) -> None:
    _src, dst, _seed = _caches(pair)
    channel = instrument(pair.decoder, 1)
    _hold_after(channel, 2, until=3)  # layer 2 never finishes on its own
    async for layer in pair.decoder.cache_manager.pull_blocks_layerwise(
        pair.key(), dst.cache, [3, 4], [3, 4], tensor_num_per_layer=1, depth=3, timeout=60
    ):
        if layer.index == 1:
            await channel.inside.wait()  # layer 2 is in its native job; 3 and 4 queue
            break
    # The stream is gone: its layers in flight are being aborted; a later pull queues
    # behind them on the link and succeeds (long before the held job's 20 s give up).
    loop = asyncio.get_running_loop()
    start = loop.time()
    await _later_pull_works(pair, dst)
    assert loop.time() - start < 10 * BOUND_S
    await _link_free(pair)
    assert channel.jobs_started == channel.jobs_returned


async def test_aclose_and_exception_in_body(pair: Pair) -> None:
    _src, dst, seed = _caches(pair)
    channel = instrument(pair.decoder, 1)
    stream = pair.decoder.cache_manager.pull_blocks_layerwise(
        pair.key(), dst.cache, [2, 5], [2, 5], tensor_num_per_layer=1, depth=2
    )
    first = await stream.__anext__()
    _layer_ok(dst, seed, 1, first, [2, 5], [2, 5])
    channel.hold_until_abort = True
    await asyncio.sleep(0.01)
    await stream.aclose()
    await _link_free(pair)
    await stream.aclose()  # idempotent
    channel.hold_until_abort = False

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with pair.decoder.cache_manager.pull_blocks_layerwise(
            pair.key(), dst.cache, [2, 5], [2, 5], tensor_num_per_layer=1
        ) as layers:
            async for _ in layers:
                channel.hold_until_abort = True
                raise Boom
    await _link_free(pair)
    channel.hold_until_abort = False
    await _later_pull_works(pair, dst)


async def test_cancel_mid_iteration(pair: Pair) -> None:
    _src, dst, seed = _caches(pair)
    channel = instrument(pair.decoder, 1)
    yielded: list[LayerPulled] = []
    _hold_after(channel, 1)  # layer 1 on never lands on its own

    async def consume() -> None:
        async for layer in pair.decoder.cache_manager.pull_blocks_layerwise(
            pair.key(), dst.cache, [1, 2], [1, 2], timeout=60
        ):
            yielded.append(layer)
            _layer_ok(dst, seed, 2, layer, [1, 2], [1, 2])

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    assert not task.done() and len(yielded) == 1
    loop = asyncio.get_running_loop()
    start = loop.time()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert loop.time() - start < BOUND_S
    await _link_free(pair)  # CancelledError came after every native job returned
    assert channel.jobs_started == channel.jobs_returned
    channel.hold_until_abort = False
    await _later_pull_works(pair, dst)


async def test_one_deadline_for_the_whole_iteration(pair: Pair) -> None:
    _src, dst, _seed = _caches(pair)
    channel = instrument(pair.decoder, 1)
    loop = asyncio.get_running_loop()
    start = loop.time()
    yielded = []
    _hold_after(channel, 1)
    with pytest.raises(LLMTimeoutError) as info:
        async for layer in pair.decoder.cache_manager.pull_blocks_layerwise(
            pair.key(), dst.cache, [0], [0], timeout=0.3
        ):
            yielded.append(layer.index)
            await asyncio.sleep(0.05)  # the caller's work counts against the deadline
    elapsed = loop.time() - start
    assert yielded == [0]
    assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
    assert 0.25 < elapsed < 0.3 + BOUND_S, elapsed
    await _link_free(pair)
    channel.hold_until_abort = False
    await _later_pull_works(pair, dst)


async def test_layers_landed_before_the_deadline_are_still_handed_over(pair: Pair) -> None:
    _src, dst, seed = _caches(pair)
    stream = pair.decoder.cache_manager.pull_blocks_layerwise(
        pair.key(), dst.cache, [0], [0], timeout=0.5, depth=4
    )
    first = await stream.__anext__()
    await asyncio.sleep(0.6)  # layers 1..3 landed meanwhile; the deadline passed
    rest = [layer async for layer in stream]
    assert [first.index] + [la.index for la in rest] == [0, 1, 2, 3]
    assert not pattern_mismatches(dst.tensors, [0], [0], seed)


# ------------------------------------------------------------------- errors


async def test_error_in_layer_k_surfaces_there(pair: Pair) -> None:
    src, dst, seed = _caches(pair)
    channel = instrument(pair.decoder, 1)  # the default pull_layers: one job per layer
    _hold_after(channel, 2)  # layers 0 and 1 land; layer 2's job waits for its abort
    stream = pair.decoder.cache_manager.pull_blocks_layerwise(
        pair.key(), dst.cache, [6], [6], timeout=0.5
    )
    got = [await stream.__anext__(), await stream.__anext__()]
    for layer in got:
        _layer_ok(dst, seed, 2, layer, [6], [6])
    # The iteration is one transfer: it holds the peer's cache until it ends.
    with pytest.raises(LLMException) as busy:
        pair.prompt.cache_manager.unregister_cache(src.cache.cache_id)
    assert busy.value.status_code == LLMStatusCode.LLM_LINK_BUSY
    with pytest.raises(LLMTimeoutError) as info:
        await stream.__anext__()
    assert "pull_blocks_layerwise" in str(info.value)
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    for layer in got:
        _layer_ok(dst, seed, 2, layer, [6], [6])  # the layers handed over stay valid
    assert _untouched(dst, range(4, 8))
    await _link_free(pair)
    assert channel.jobs_started == channel.jobs_returned == 3
    channel.hold_until_abort = False
    pair.prompt.cache_manager.unregister_cache(src.cache.cache_id)  # free now
    await _later_pull_works(pair, dst)


async def test_unlink_after_the_first_layer(pair: Pair) -> None:
    _src, dst, seed = _caches(pair)
    cm = pair.decoder.cache_manager
    stream = cm.pull_blocks_layerwise(pair.key(), dst.cache, [6], [6], depth=1)
    first = await stream.__anext__()
    await pair.decoder.unlink_clusters([_info(pair)], force=True)
    # The iteration's one transfer held the link's slot before the unlink (FIFO): every
    # layer lands.
    rest = [layer async for layer in stream]
    assert [la.index for la in [first, *rest]] == [0, 1, 2, 3]
    assert not pattern_mismatches(dst.tensors, [6], [6], seed)
    with pytest.raises(LLMException) as info:
        cm.pull_blocks_layerwise(pair.key(), dst.cache, [6], [6])
    assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK


def _info(pair: Pair):
    from aiodatadist.testing.caches import cluster_info

    return cluster_info(pair.prompt.cluster_id)


async def test_peer_side_checked_before_a_byte_moves(pair: Pair) -> None:
    _src, dst, _seed = _caches(pair, src_tensors=4, dst_tensors=8)
    # No src_layer_range: the peer must hold as many tensors as the 8 destination ones.
    stream = pair.decoder.cache_manager.pull_blocks_layerwise(pair.key(), dst.cache, [0], [0])
    with pytest.raises(LLMParamError):
        await stream.__anext__()
    stream = pair.decoder.cache_manager.pull_blocks_layerwise(
        pair.key(), dst.cache, [0], [0], src_layer_range=range(1, 3), dst_layer_range=range(0, 2)
    )
    with pytest.raises(LLMParamError):
        await stream.__anext__()
    stream = pair.decoder.cache_manager.pull_blocks_layerwise(
        BlocksCacheKey(pair.prompt.cluster_id, 9), dst.cache, [0], [0]
    )
    with pytest.raises(LLMException) as info:
        await stream.__anext__()
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert _untouched(dst, range(8))


async def test_argument_errors_at_the_call(pair: Pair) -> None:
    _src, dst, _ = _caches(pair, dst_tensors=6)
    cm = pair.decoder.cache_manager
    key = pair.key()
    with pytest.raises(TypeError):
        cm.pull_blocks_layerwise("key", dst.cache, [0], [0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cm.pull_blocks_layerwise(key, dst.cache, [0], [0], depth=1.5)  # type: ignore[arg-type]
    bad = [
        dict(depth=0),
        dict(tensor_num_per_layer=4),  # does not divide 6 tensors: layers undefined
        dict(tensor_num_per_layer=0),
        dict(src_layer_range=range(0, 2), dst_layer_range=range(0, 3)),
        dict(src_layer_range=range(0, 2)),  # 3 destination layers
        dict(dst_layer_range=range(2, 4)),  # tensors 4..8 of 6
        dict(timeout=-1),
    ]
    for kw in bad:
        with pytest.raises(LLMParamError):
            cm.pull_blocks_layerwise(key, dst.cache, [0], [0], **kw)
    with pytest.raises(LLMParamError):
        cm.pull_blocks_layerwise(key, dst.cache, [0], [NB])
    with pytest.raises(LLMParamError):
        cm.pull_blocks_layerwise(BlocksCacheKey(pair.decoder.cluster_id, 0), dst.cache, [0], [0])
    with pytest.raises(LLMException) as info:
        cm.pull_blocks_layerwise(BlocksCacheKey(77, 0), dst.cache, [0], [0])
    assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    assert _untouched(dst, range(6))


async def test_one_transfer_holds_the_link_for_the_iteration(pair: Pair) -> None:
    _src, dst, seed = _caches(pair)
    other = pair.decoder_cache(num_tensors=8, num_blocks=NB, block_shape=BLOCK)
    channel = instrument(pair.decoder, 1)
    stream = pair.decoder.cache_manager.pull_blocks_layerwise(
        pair.key(), dst.cache, [4], [4], depth=1
    )
    await stream.__anext__()
    side = asyncio.create_task(
        pair.decoder.cache_manager.pull_blocks(pair.key(), other.cache, [5], [5]), name="side"
    )
    rest = [layer.index async for layer in stream]
    await side
    assert rest == [1, 2, 3]
    # Upstream's one transfer per link at a time holds for the whole iteration: the
    # side pull ran after every layer (4 layer pulls of one task, in one slot hold).
    entered = channel.tracker.entered()
    assert len(entered) == 5 and entered[-1] == "pull:side", entered
    assert len(set(entered[:4])) == 1 and entered[0] != "pull:side"
    assert not pattern_mismatches(dst.tensors, [4], [4], seed)
    assert not pattern_mismatches(other.tensors, [5], [5], seed)


async def test_iterated_from_another_threads_loop(pair: Pair) -> None:
    # The instances live on this loop; a thread's own loop iterates (each step is bridged
    # here, where the layer tasks run), then breaks and closes.
    _src, dst, seed = _caches(pair)
    sb, db = [3, 4], [4, 3]

    async def on_b() -> list[int]:
        out = []
        async with pair.decoder.cache_manager.pull_blocks_layerwise(
            pair.key(), dst.cache, sb, db, tensor_num_per_layer=1
        ) as layers:
            async for layer in layers:
                _layer_ok(dst, seed, 1, layer, sb, db)
                out.append(layer.dst_layer)
                if layer.index == 5:
                    break
        return out

    got = await asyncio.to_thread(asyncio.run, on_b())
    assert got == list(range(6))
    await _link_free(pair)
    await _later_pull_works(pair, dst)


# ------------------------------------------------------ one transfer, one eventfd


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_the_iteration_is_one_native_job(pair: Pair) -> None:
    _src, dst, seed = _caches(pair)
    channel = instrument(pair.decoder, 1)
    channel.layered_job = True  # the real path's pull_layers, traced as one transfer
    m = link_of(pair.decoder, 1).metrics
    started = m.started
    got = [
        layer.index
        async for layer in pair.decoder.cache_manager.pull_blocks_layerwise(
            pair.key(), dst.cache, [7, 0, 3], [1, 6, 2], tensor_num_per_layer=1, depth=1
        )
    ]
    assert got == list(range(8))
    assert channel.jobs_started == channel.jobs_returned == 1
    assert len(channel.tracker.entered()) == 1
    assert m.started == started + 1  # counted once in the link's metrics
    assert not pattern_mismatches(dst.tensors, [7, 0, 3], [1, 6, 2], seed)


async def test_cancel_while_the_native_job_runs(pair: Pair) -> None:
    _src, dst, _seed = _caches(pair)
    channel = instrument(pair.decoder, 1)
    channel.layered_job = True
    channel.hold_until_abort = True  # the one job runs until it is aborted
    base = _fds()

    async def consume() -> None:
        async for _ in pair.decoder.cache_manager.pull_blocks_layerwise(
            pair.key(), dst.cache, [1], [1], timeout=60
        ):
            raise AssertionError("no layer lands while the job is held")

    task = asyncio.create_task(consume())
    await wait_until(lambda: channel.jobs_started >= 1, what="the job on its worker thread")
    loop = asyncio.get_running_loop()
    start = loop.time()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert loop.time() - start < BOUND_S
    await _link_free(pair)  # the CancelledError came once the native job had returned
    assert channel.jobs_started == channel.jobs_returned == 1
    assert _fds() == base
    channel.hold_until_abort = False
    await _later_pull_works(pair, dst)


async def test_eventfd_closed_after_every_outcome(pair: Pair) -> None:
    _src, dst, seed = _caches(pair)
    cm = pair.decoder.cache_manager
    key = pair.key()
    await _no_layer_left(pair, dst, [0], [0])  # anything made once per process is made
    base = _fds()
    # Every layer handed over.
    assert len(await _no_layer_left(pair, dst, [2, 3], [3, 2])) == 4
    assert _fds() == base
    assert not pattern_mismatches(dst.tensors, [2, 3], [3, 2], seed)
    # Left after the first layer (async with), and closed before the first (aclose).
    async with cm.pull_blocks_layerwise(key, dst.cache, [1], [1]) as layers:
        async for _ in layers:
            break
    assert _fds() == base
    stream = cm.pull_blocks_layerwise(key, dst.cache, [1], [1])
    await stream.aclose()
    assert _fds() == base
    # The peer's side refused before a byte moves.
    with pytest.raises(LLMException):
        await cm.pull_blocks_layerwise(
            BlocksCacheKey(pair.prompt.cluster_id, 9), dst.cache, [0], [0]
        ).__anext__()
    assert _fds() == base
    # A deadline in layer 1, and a cancel after the first layer (one job per layer, held).
    channel = instrument(pair.decoder, 1)
    _hold_after(channel, 1)
    with pytest.raises(LLMTimeoutError):
        async for _ in cm.pull_blocks_layerwise(key, dst.cache, [4], [4], timeout=0.2):
            pass
    assert _fds() == base

    async def consume() -> None:
        async for _ in cm.pull_blocks_layerwise(key, dst.cache, [4], [4], timeout=60):
            pass

    _hold_after(channel, 1)
    task = asyncio.create_task(consume())
    await wait_until(lambda: channel.jobs_started >= 2, what="layer 1's job on its thread")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _fds() == base
    # A plain async for left by break: the stream is dropped, its transfer aborted and
    # its eventfd closed once the transfer has ended.
    _hold_after(channel, 1)
    async for layer in cm.pull_blocks_layerwise(key, dst.cache, [5], [5], timeout=60):
        assert layer.index == 0
        break
    loop = asyncio.get_running_loop()
    end = loop.time() + BOUND_S
    while _fds() != base or executor_of(pair.decoder).in_flight:
        assert loop.time() < end, "the dropped stream's eventfd stayed open"
        await asyncio.sleep(0.001)
    await _link_free(pair)
