"""The dedicated executor: named threads owned by each instance, sized by
``aiodatadist.ExecutorThreads``, never the loop's default executor; the loop keeps
running while bytes move, and a completion wakes the awaiting task by itself."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aiodatadist import BlocksCacheKey, LLMDataDist, LLMRole
from aiodatadist.testing import Pair, cluster_info, inproc_pair, make_blocks_cache
from tests.engine._util import (
    ALL_BIG,
    BOUND_S,
    Tracker,
    assert_big_pulled,
    big_cache,
    blocks_of,
    executor_of,
    instrument,
    wait_until,
)

pytestmark = pytest.mark.asyncio

BLOCK = (256, 8, 16)  # 64 KiB blocks: above the inline threshold


async def test_jobs_run_on_the_instances_named_threads(pair: Pair) -> None:
    src = pair.prompt_cache(seed=1, num_tensors=4, num_blocks=8, block_shape=BLOCK)
    dst = pair.decoder_cache(num_tensors=4, num_blocks=8, block_shape=BLOCK)
    tracker = Tracker()
    instrument(pair.decoder, 1, tracker)
    executor = executor_of(pair.decoder)
    own = {t.name for t in executor.threads}
    assert len(own) == 2  # the default size
    assert all(n.startswith("aiodatadist-2-") for n in own)
    assert all(t.daemon and t.is_alive() for t in executor.threads)
    loop_thread = threading.current_thread().name

    for i in range(6):
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [i], [i])

    assert len(tracker.threads) == 6
    assert set(tracker.threads) <= own, tracker.threads
    assert loop_thread not in tracker.threads
    # Not the loop's default executor (asyncio names its threads "asyncio_N").
    assert not any(n.startswith(("asyncio_", "ThreadPoolExecutor")) for n in tracker.threads)
    for t in range(4):
        assert (blocks_of(dst.tensors[t])[:6] == blocks_of(src.tensors[t])[:6]).all()


async def test_tiny_local_copies_run_inline(pair: Pair) -> None:
    # Below the inline threshold the job costs less than a thread handoff.
    pair.prompt_cache(seed=1, num_tensors=2, num_blocks=4, block_shape=(4, 2, 8))
    dst = pair.decoder_cache(num_tensors=2, num_blocks=4, block_shape=(4, 2, 8))
    tracker = Tracker()
    instrument(pair.decoder, 1, tracker)
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1], [2])
    assert tracker.threads == [threading.current_thread().name]


@pytest.mark.parametrize("threads", [1, 3, 5])
async def test_thread_count_from_the_option(threads: int) -> None:
    opts = {"aiodatadist.ExecutorThreads": str(threads)}
    async with LLMDataDist(LLMRole.DECODER, 801) as default:
        assert len(executor_of(default).threads) == 2
    dd = LLMDataDist(LLMRole.DECODER, 802)
    await dd.init(opts)
    try:
        ex = executor_of(dd)
        assert dd.options.executor_threads == threads
        assert len(ex.threads) == threads
        names = [t.name for t in ex.threads]
        assert len(set(names)) == threads
        assert all(n.startswith("aiodatadist-802-") for n in names)
        running = [t for t in threading.enumerate() if t.name in names]
        assert len(running) == threads
    finally:
        await dd.finalize()
    assert not any(t.is_alive() for t in ex.threads)


async def test_one_thread_runs_one_job_at_a_time() -> None:
    # With ExecutorThreads=1 a held job on one link keeps another link's job queued:
    # the pool size is what bounds native concurrency.
    async with inproc_pair(prompt_id=803, decoder_id=804,
                           options={"aiodatadist.ExecutorThreads": "1"}) as pair:
        other = LLMDataDist(LLMRole.PROMPT, 805)
        await other.init()
        try:
            await pair.decoder.link_clusters([cluster_info(805)])
            src1 = pair.prompt_cache(seed=1, num_tensors=2, num_blocks=4, block_shape=BLOCK)
            src2 = make_blocks_cache(other, model_id=0, seed=2, num_tensors=2, num_blocks=4,
                                     block_shape=BLOCK)
            dst = pair.decoder_cache(num_tensors=2, num_blocks=4, block_shape=BLOCK)
            tracker = Tracker()
            ch1 = instrument(pair.decoder, 803, tracker)
            ch2 = instrument(pair.decoder, 805, tracker)
            gate = threading.Event()
            ch1.job_gate = gate
            cm = pair.decoder.cache_manager
            first = asyncio.create_task(cm.pull_blocks(BlocksCacheKey(803, 0), dst.cache, [0],
                                                       [0], timeout=30))
            await wait_until(lambda: ch1.jobs_started == 1, what="the first job")
            second = asyncio.create_task(cm.pull_blocks(BlocksCacheKey(805, 0), dst.cache, [1],
                                                        [1], timeout=30))
            try:
                await asyncio.sleep(0.1)
                assert ch2.jobs_started == 0 and not second.done()
                assert executor_of(pair.decoder).in_flight == 2
            finally:
                gate.set()
            await asyncio.wait_for(asyncio.gather(first, second), 10)
            assert len(set(tracker.threads)) == 1
            for t in range(2):
                assert (blocks_of(dst.tensors[t])[0] == blocks_of(src1.tensors[t])[0]).all()
                assert (blocks_of(dst.tensors[t])[1] == blocks_of(src2.tensors[t])[1]).all()
        finally:
            await other.finalize()


@pytest.mark.slow  # a big pull
async def test_the_loop_keeps_ticking_during_a_big_pull(slow_pair: Pair) -> None:
    pair = slow_pair
    big_cache(pair.prompt, model_id=0, fill=True)
    dst = big_cache(pair.decoder)
    executor = executor_of(pair.decoder)
    loop = asyncio.get_running_loop()
    ticks_in_flight = 0
    gaps: list[float] = []
    stop = False

    async def ticker() -> None:
        nonlocal ticks_in_flight
        last = loop.time()
        while not stop:
            await asyncio.sleep(0.001)
            now = loop.time()
            if executor.in_flight:
                ticks_in_flight += 1
                gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        for _ in range(2):
            await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, ALL_BIG,
                                                         ALL_BIG, timeout=60)
    finally:
        stop = True
        await tick
    assert ticks_in_flight >= 10, f"the loop ticked only {ticks_in_flight} times"
    assert max(gaps) < BOUND_S, f"the loop stalled for {max(gaps):.3f} s"
    assert_big_pulled(dst, ALL_BIG, ALL_BIG)


async def test_completion_wakes_the_awaiting_task(pair: Pair) -> None:
    # The job is held, then released from a plain thread while the loop sits idle:
    # the awaiting task wakes at once, not at some polling interval.
    src = pair.prompt_cache(seed=1, num_tensors=4, num_blocks=4, block_shape=BLOCK)
    dst = pair.decoder_cache(num_tensors=4, num_blocks=4, block_shape=BLOCK)
    channel = instrument(pair.decoder, 1)
    gate = threading.Event()
    channel.job_gate = gate
    pull = asyncio.create_task(pair.decoder.cache_manager.pull_blocks(
        pair.key(), dst.cache, [3], [0], timeout=30))
    await wait_until(lambda: channel.jobs_started == 1, what="the job to start")
    released_at: list[float] = []

    def release() -> None:
        time.sleep(0.05)
        released_at.append(time.monotonic())
        gate.set()

    threading.Thread(target=release, daemon=True).start()
    await pull  # nothing else runs on the loop meanwhile
    woke = time.monotonic() - released_at[0]
    assert woke < BOUND_S, f"woke {woke:.3f} s after the job returned"
    for t in range(4):
        assert (blocks_of(dst.tensors[t])[0] == blocks_of(src.tensors[t])[3]).all()


async def test_instances_have_separate_executors(pair: Pair) -> None:
    a, b = executor_of(pair.prompt), executor_of(pair.decoder)
    assert a is not b
    assert not ({t.name for t in a.threads} & {t.name for t in b.threads})
    assert all(t.name.startswith("aiodatadist-1-") for t in a.threads)
