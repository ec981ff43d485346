"""Per-link serialization: one FIFO slot per link shared by pull_blocks, pull_cache,
transfer_cache_async (from the other end) and unlink; different links in parallel.

Both ends of a link are wrapped in an instrumented channel that delegates to the real
in-process channel and raises on overlap; every byte still moves through the native mover.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LayerSynchronizer,
    LLMDataDist,
    LLMLinkError,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import Pair, cluster_info, make_blocks_cache
from tests.engine._util import Tracker, blocks_of, executor_of, instrument, link_of, wait_until

pytestmark = pytest.mark.asyncio

BLOCK = (256, 8, 16)  # 64 KiB blocks: every transfer here runs on the executor


class Always(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


async def test_one_link_never_runs_two_transfers_at_once(pair: Pair) -> None:
    src = pair.prompt_cache(seed=1, num_tensors=4, num_blocks=16, block_shape=BLOCK)
    dst = pair.decoder_cache(seed=2, num_tensors=4, num_blocks=16, block_shape=BLOCK)
    pushed = make_blocks_cache(pair.decoder, model_id=5, num_tensors=4, num_blocks=16,
                               block_shape=BLOCK)
    rows_desc = CacheDesc(4, [2, 64 * 1024], DataType.DT_UINT8, Placement.HOST)
    rows_src = pair.prompt.cache_manager.allocate_cache(rows_desc, [CacheKey(1, 77)])
    for t, v in enumerate(rows_src.tensors()):
        v[...] = t + 1
    rows_dst = pair.decoder.cache_manager.allocate_cache(rows_desc)
    tracker = Tracker()
    instrument(pair.decoder, 1, tracker)
    instrument(pair.prompt, 2, tracker)  # the prompt's end of the same link
    cm = pair.decoder.cache_manager

    pulls = [
        asyncio.create_task(cm.pull_blocks(pair.key(), dst.cache, [i], [15 - i], timeout=30),
                            name=f"p{i:02d}")
        for i in range(12)
    ]
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(2, 5), range(0, 2), range(0, 2))
    task = await pair.prompt.cache_manager.transfer_cache_async(
        src.cache, Always(), [cfg], [12, 13, 14, 15], [0, 1, 2, 3]
    )
    pulls.append(asyncio.create_task(cm.pull_cache(CacheKey(1, 77), rows_dst, 1, timeout=30),
                                     name="p12"))
    pulls += [
        asyncio.create_task(cm.pull_blocks(pair.key(), dst.cache, [i], [15 - i], timeout=30),
                            name=f"p{i:02d}")
        for i in range(13, 16)
    ]
    await asyncio.wait_for(asyncio.gather(*pulls), 30)
    assert await task.synchronize(30_000) == LLMStatusCode.LLM_SUCCESS

    assert tracker.overlaps == []
    assert tracker.max_total == 1
    entered = tracker.entered()
    assert [e for e in entered if e.startswith("pull:")] == [f"pull:p{i:02d}" for i in range(16)]
    assert sum(e.startswith("push:") for e in entered) == 2  # one per layer
    for t in range(4):
        for i in (*range(12), *range(13, 16)):
            assert _same(dst.tensors[t][15 - i], src.tensors[t][i])
        assert _same(pushed.tensors[t][0:4], src.tensors[t][12:16])
        assert (rows_dst.tensors()[t][1] == t + 1).all()


async def test_a_push_waits_for_a_pull_on_the_same_link(pair: Pair) -> None:
    src = pair.prompt_cache(seed=1, num_tensors=2, num_blocks=4, block_shape=BLOCK)
    dst = make_blocks_cache(pair.decoder, model_id=5, seed=2, num_tensors=2, num_blocks=4,
                            block_shape=BLOCK)
    tracker = Tracker()
    pulling = instrument(pair.decoder, 1, tracker)
    instrument(pair.prompt, 2, tracker)
    pulling.gate = asyncio.Event()
    pull = asyncio.create_task(
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0], [0], timeout=30),
        name="pull",
    )
    await wait_until(pulling.inside.is_set, what="the pull to take the link")
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(2, 5), range(0, 1), range(0, 1))
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, Always(), [cfg],
                                                                [3], [3])
    await asyncio.sleep(0.1)
    assert not task.done(), "the push ran while the pull held the link"
    assert tracker.entered() == ["pull:pull"]
    pulling.gate.set()
    assert await task.synchronize(30_000) == LLMStatusCode.LLM_SUCCESS
    await pull
    assert tracker.overlaps == [] and tracker.entered()[0] == "pull:pull"
    for t in range(2):
        assert _same(dst.tensors[t][0], src.tensors[t][0])
        assert _same(dst.tensors[t][3], src.tensors[t][3])


async def test_unlink_takes_its_turn_in_the_fifo(pair: Pair) -> None:
    src = pair.prompt_cache(seed=1, num_tensors=2, num_blocks=8, block_shape=BLOCK)
    dst = pair.decoder_cache(num_tensors=2, num_blocks=8, block_shape=BLOCK)
    tracker = Tracker()
    channel = instrument(pair.decoder, 1, tracker)
    channel.gate = asyncio.Event()
    cm = pair.decoder.cache_manager
    before = [asyncio.create_task(cm.pull_blocks(pair.key(), dst.cache, [i], [i], timeout=30),
                                  name=f"b{i}") for i in range(3)]
    await wait_until(channel.inside.is_set, what="the first pull to take the link")
    unlink = asyncio.create_task(pair.decoder.unlink_clusters([cluster_info(1)], timeout=30_000))
    await asyncio.sleep(0.02)  # the unlink is queued now
    after = asyncio.create_task(cm.pull_blocks(pair.key(), dst.cache, [5], [5], timeout=30),
                                name="after")
    await asyncio.sleep(0.02)
    assert not unlink.done()
    channel.gate.set()

    await asyncio.wait_for(asyncio.gather(*before), 10)
    assert await unlink == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
    with pytest.raises(LLMLinkError) as info:
        await after
    assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    assert tracker.entered() == ["pull:b0", "pull:b1", "pull:b2"]
    for t in range(2):
        assert _same(dst.tensors[t][0:3], src.tensors[t][0:3])
        assert not dst.tensors[t][5].view(np.uint8).any()
    # Relinked, the pair works again.
    status, _ = await pair.decoder.link_clusters([cluster_info(1)])
    assert status == LLMStatusCode.LLM_SUCCESS
    await cm.pull_blocks(pair.key(), dst.cache, [5], [5])
    for t in range(2):
        assert _same(dst.tensors[t][5], src.tensors[t][5])


async def test_unlink_times_out_behind_a_busy_link(pair: Pair) -> None:
    src = pair.prompt_cache(seed=1, num_tensors=2, num_blocks=4, block_shape=BLOCK)
    dst = pair.decoder_cache(num_tensors=2, num_blocks=4, block_shape=BLOCK)
    channel = instrument(pair.decoder, 1)
    channel.gate = asyncio.Event()
    pull = asyncio.create_task(
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1], [1], timeout=30)
    )
    await wait_until(channel.inside.is_set, what="the pull to take the link")
    loop = asyncio.get_running_loop()
    start = loop.time()
    status, per = await pair.decoder.unlink_clusters([cluster_info(1)], timeout=50)
    assert per == [LLMStatusCode.LLM_TIMEOUT] and status == LLMStatusCode.LLM_TIMEOUT
    assert loop.time() - start < 0.05 + 0.5
    assert [lk.remote_cluster_id for lk in pair.decoder.links] == [1]  # still linked
    channel.gate.set()
    await pull
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [2], [2])
    for t in range(2):
        assert _same(dst.tensors[t][1:3], src.tensors[t][1:3])


async def test_different_links_run_in_parallel(pair: Pair) -> None:
    # The decoder is linked to two prompts. The native job on link 1 is held on its
    # executor thread; a pull on link 2 runs on the other thread and completes meanwhile.
    other = LLMDataDist(LLMRole.PROMPT, 3)
    await other.init()
    try:
        status, _ = await pair.decoder.link_clusters([cluster_info(3)])
        assert status == LLMStatusCode.LLM_SUCCESS
        src1 = pair.prompt_cache(seed=1, num_tensors=4, num_blocks=4, block_shape=BLOCK)
        src3 = make_blocks_cache(other, model_id=0, seed=3, num_tensors=4, num_blocks=4,
                                 block_shape=BLOCK)
        dst = pair.decoder_cache(num_tensors=4, num_blocks=4, block_shape=BLOCK)
        tracker = Tracker()
        link1 = instrument(pair.decoder, 1, tracker)
        instrument(pair.decoder, 3, tracker)
        gate = threading.Event()
        link1.job_gate = gate
        cm = pair.decoder.cache_manager
        slow = asyncio.create_task(
            cm.pull_blocks(BlocksCacheKey(1, 0), dst.cache, [0, 1], [0, 1], timeout=30),
            name="link1",
        )
        try:
            await wait_until(lambda: link1.jobs_started == 1, what="link 1's job to start")
            assert link_of(pair.decoder, 1).slot.busy
            await asyncio.wait_for(
                cm.pull_blocks(BlocksCacheKey(3, 0), dst.cache, [2, 3], [2, 3], timeout=30), 10
            )
            assert not slow.done(), "link 1's pull finished before link 2's"
            assert tracker.max_total == 2, "the two links' transfers were not in flight together"
            assert executor_of(pair.decoder).in_flight == 1
            assert len(set(tracker.threads)) == 2  # two executor threads, one per job
        finally:
            gate.set()
        await asyncio.wait_for(slow, 10)
        assert tracker.overlaps == []
        for t in range(4):
            assert _same(dst.tensors[t][0:2], src1.tensors[t][0:2])
            assert _same(dst.tensors[t][2:4], src3.tensors[t][2:4])
        assert blocks_of(dst.tensors[0]).shape == (4, 64 * 1024)
    finally:
        await other.finalize()


async def test_a_slow_link_does_not_hold_up_another_links_queue(pair: Pair) -> None:
    # Link 1's slot is held (no native job at all); many pulls on link 3 all complete.
    other = LLMDataDist(LLMRole.PROMPT, 3)
    await other.init()
    try:
        await pair.decoder.link_clusters([cluster_info(3)])
        pair.prompt_cache(seed=1, num_tensors=2, num_blocks=8, block_shape=BLOCK)
        src3 = make_blocks_cache(other, model_id=0, seed=3, num_tensors=2, num_blocks=8,
                                 block_shape=BLOCK)
        dst = pair.decoder_cache(num_tensors=2, num_blocks=8, block_shape=BLOCK)
        tracker = Tracker()
        link1 = instrument(pair.decoder, 1, tracker)
        instrument(pair.decoder, 3, tracker)
        link1.gate = asyncio.Event()
        cm = pair.decoder.cache_manager
        held = asyncio.create_task(cm.pull_blocks(BlocksCacheKey(1, 0), dst.cache, [0], [0],
                                                  timeout=30))
        await wait_until(link1.inside.is_set, what="link 1 to be taken")
        await asyncio.wait_for(asyncio.gather(*(
            cm.pull_blocks(BlocksCacheKey(3, 0), dst.cache, [i], [i], timeout=30)
            for i in range(1, 8)
        )), 10)
        assert not held.done()
        link1.gate.set()
        await held
        assert tracker.overlaps == []
        for t in range(2):
            assert _same(dst.tensors[t][1:8], src3.tensors[t][1:8])
    finally:
        await other.finalize()
