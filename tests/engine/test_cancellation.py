"""Cancellation: CancelledError propagates only after the native job has returned, the
link's slot is held until then, a call cancelled while queued never reaches the link,
and the link works afterwards (asyncpg's pattern: a bound AND a working link)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from aiodatadist.testing import Pair
from tests.engine._util import (
    ALL_BIG,
    BOUND_S,
    Tracker,
    assert_big_pulled,
    big_cache,
    blocks_of,
    executor_of,
    instrument,
    link_of,
    wait_until,
)

pytestmark = pytest.mark.asyncio

BLOCK = (256, 8, 16)  # 64 KiB blocks: every pull here runs on the executor


def _small(pair: Pair):
    src = pair.prompt_cache(seed=1, num_tensors=4, num_blocks=8, block_shape=BLOCK)
    dst = pair.decoder_cache(seed=2, num_tensors=4, num_blocks=8, block_shape=BLOCK)
    return src, dst


def _pulled(src, dst, s: list[int], d: list[int]) -> bool:
    return all(
        np.array_equal(blocks_of(dst.tensors[t])[d], blocks_of(src.tensors[t])[s])
        for t in range(len(dst.tensors))
    )


@pytest.mark.slow  # a big pull
async def test_cancel_mid_big_pull(slow_pair: Pair) -> None:
    pair = slow_pair
    big_cache(pair.prompt, model_id=0, fill=True)
    dst = big_cache(pair.decoder)
    executor = executor_of(pair.decoder)
    link = link_of(pair.decoder, 1)
    loop = asyncio.get_running_loop()
    for _ in range(5):  # a pull that ends before it is seen in flight is tried again
        task = asyncio.create_task(
            pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, ALL_BIG, ALL_BIG,
                                                   timeout=60)
        )
        await wait_until(lambda t=task: executor.in_flight == 1 or t.done(),
                         what="the native job to start", poll=0)
        if not task.done():
            break
        await task
    else:
        pytest.fail("the big pull ended before it could be cancelled, 5 times")

    start = loop.time()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    elapsed = loop.time() - start

    # Right after the CancelledError: the native job has returned and the slot is free.
    assert executor.in_flight == 0
    assert not link.slot.busy
    assert task.cancelled()
    assert elapsed < BOUND_S, f"the cancel took {elapsed:.3f} s"
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, ALL_BIG, ALL_BIG,
                                                 timeout=60)
    assert_big_pulled(dst, ALL_BIG, ALL_BIG)


async def test_cancelled_call_holds_the_link_until_its_job_returns(pair: Pair) -> None:
    src, dst = _small(pair)
    tracker = Tracker()
    channel = instrument(pair.decoder, 1, tracker)
    gate = threading.Event()
    channel.job_gate = gate  # the first job is "in native code" and deaf to the abort
    first = asyncio.create_task(
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0, 1], [0, 1],
                                               timeout=30),
        name="first",
    )
    await wait_until(lambda: channel.jobs_started == 1, what="the first job to start")
    channel.job_gate = None
    queued = asyncio.create_task(
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [2], [5], timeout=30),
        name="queued",
    )
    executor = executor_of(pair.decoder)
    try:
        first.cancel()
        for _ in range(20):
            await asyncio.sleep(0.01)
            assert not first.done(), "CancelledError came before the native job returned"
            assert executor.in_flight == 1
            assert link_of(pair.decoder, 1).slot.busy
            assert tracker.entered() == ["pull:first"], "the queued pull entered a busy link"
    finally:
        gate.set()
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert loop.time() - start < BOUND_S
    assert first.cancelled()
    # Its job returned (the queued pull, which got the link as it let go, may have run
    # and returned its own job by now too: on a loaded machine the loop thread can lose
    # its CPU between the two tasks' steps).
    assert channel.jobs_returned >= 1
    await asyncio.wait_for(queued, 10)
    assert tracker.entered() == ["pull:first", "pull:queued"]
    assert _pulled(src, dst, [2], [5])
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [6, 7], [6, 7])
    assert _pulled(src, dst, [6, 7], [6, 7])


async def test_cancel_while_queued_for_the_link(pair: Pair) -> None:
    src, dst = _small(pair)
    tracker = Tracker()
    channel = instrument(pair.decoder, 1, tracker)
    channel.gate = asyncio.Event()
    cm = pair.decoder.cache_manager
    holder = asyncio.create_task(cm.pull_blocks(pair.key(), dst.cache, [0], [0], timeout=30),
                                 name="holder")
    await wait_until(channel.inside.is_set, what="the holder to take the link")
    waiters = {
        name: asyncio.create_task(cm.pull_blocks(pair.key(), dst.cache, [i], [i], timeout=30),
                                  name=name)
        for i, name in ((1, "w1"), (2, "w2"), (3, "w3"))
    }
    await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()

    start = loop.time()
    waiters["w2"].cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiters["w2"]
    assert loop.time() - start < BOUND_S
    assert not holder.done() and link_of(pair.decoder, 1).slot.busy
    channel.gate.set()
    await asyncio.wait_for(asyncio.gather(holder, waiters["w1"], waiters["w3"]), 10)

    # The cancelled call never reached the link; the others kept their FIFO order.
    assert tracker.entered() == ["pull:holder", "pull:w1", "pull:w3"]
    assert _pulled(src, dst, [0, 1, 3], [0, 1, 3])
    await cm.pull_blocks(pair.key(), dst.cache, [7], [2])
    assert _pulled(src, dst, [7], [2])


async def test_wait_for_times_out_by_cancelling(slow_pair: Pair) -> None:
    pair = slow_pair
    big_cache(pair.prompt, model_id=0, fill=True)
    dst = big_cache(pair.decoder)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(
            pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, ALL_BIG, ALL_BIG,
                                                   timeout=60),
            0.01,
        )
    assert loop.time() - start < BOUND_S
    assert executor_of(pair.decoder).in_flight == 0
    assert not link_of(pair.decoder, 1).slot.busy
    s, d = [5, 6, 7, 40], [40, 41, 42, 0]
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, s, d, timeout=30)
    assert_big_pulled(dst, s, d)


async def test_cancel_with_asyncio_timeout_context(slow_pair: Pair) -> None:
    pair = slow_pair
    big_cache(pair.prompt, model_id=0, fill=True)
    dst = big_cache(pair.decoder)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, ALL_BIG,
                                                         ALL_BIG, timeout=60)
    assert loop.time() - start < BOUND_S
    assert executor_of(pair.decoder).in_flight == 0
    # The current task is not left cancelling: it goes on awaiting normally.
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1], [2], timeout=30)
    assert_big_pulled(dst, [1], [2])
