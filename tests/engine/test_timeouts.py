"""Deadlines: one budget per call (waiting for the link included), sync_kv_timeout as the
default, a per-call timeout overriding it, LLM_TIMEOUT (a TimeoutError) soon after the
deadline, the native job aborted and returned first, and the link usable afterwards.

Every test asserts the bound AND that a normal pull on the same link then succeeds.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from aiodatadist import LLMException, LLMStatusCode, LLMTimeoutError
from aiodatadist.testing import Pair, inproc_pair
from tests.engine._util import (
    ALL_BIG,
    BOUND_S,
    SLOW_OPTIONS,
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

BLOCK = (256, 8, 16)  # 64 KiB blocks: even a 1-block pull (4 tensors) runs on the executor


def _assert_timeout(err: BaseException) -> None:
    assert isinstance(err, LLMTimeoutError)
    assert isinstance(err, TimeoutError)
    assert isinstance(err, LLMException)
    assert err.status_code == LLMStatusCode.LLM_TIMEOUT


def _small(pair: Pair):
    src = pair.prompt_cache(seed=1, num_tensors=4, num_blocks=8, block_shape=BLOCK)
    dst = pair.decoder_cache(seed=2, num_tensors=4, num_blocks=8, block_shape=BLOCK)
    return src, dst


def _pulled(src, dst, src_blocks, dst_blocks) -> bool:
    return all(
        np.array_equal(blocks_of(dst.tensors[t])[dst_blocks], blocks_of(src.tensors[t])[src_blocks])
        for t in range(len(dst.tensors))
    )


async def _normal_pull_works(pair: Pair, src, dst, s: list[int], d: list[int]) -> None:
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, s, d, timeout=30)
    assert _pulled(src, dst, s, d)


@pytest.mark.slow  # a big pull
async def test_deadline_aborts_a_big_native_pull(slow_pair: Pair) -> None:
    pair = slow_pair
    big_cache(pair.prompt, model_id=0, fill=True)
    dst = big_cache(pair.decoder)
    loop = asyncio.get_running_loop()
    link = link_of(pair.decoder, 1)

    # A loaded machine may not start the native job within 10 ms: the message then says
    # no progress was reported; the next try (a few at most) is caught mid-copy.
    for _ in range(5):
        start = loop.time()
        with pytest.raises(LLMTimeoutError) as info:
            await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, ALL_BIG,
                                                         ALL_BIG, timeout=0.01)
        elapsed = loop.time() - start

        _assert_timeout(info.value)
        assert elapsed < BOUND_S, f"the deadline was honoured after {elapsed:.3f} s"
        if "deadline passed after" in str(info.value):
            break
        assert "the transfer had not started yet" in str(info.value), info.value
    assert "deadline passed after" in str(info.value)
    # The native job has returned (quiescence) and the slot is free.
    assert executor_of(pair.decoder).in_flight == 0
    assert not link.slot.busy
    # The same link then moves the whole cache correctly.
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, ALL_BIG, ALL_BIG,
                                                 timeout=60)
    assert_big_pulled(dst, ALL_BIG, ALL_BIG)


@pytest.mark.slow  # a big pull
async def test_sync_kv_timeout_is_the_default_and_timeout_overrides_it() -> None:
    options = {**SLOW_OPTIONS, "llm.SyncKvCacheWaitTime": "10"}
    async with inproc_pair(prompt_id=501, decoder_id=502, options=options) as pair:
        assert pair.decoder.options.sync_kv_timeout_ms == 10
        big_cache(pair.prompt, model_id=0, fill=True)
        dst = big_cache(pair.decoder)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(LLMTimeoutError) as info:
            await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, ALL_BIG, ALL_BIG)
        assert loop.time() - start < BOUND_S
        _assert_timeout(info.value)
        assert executor_of(pair.decoder).in_flight == 0
        # A per-call timeout (seconds) overrides the 10 ms default.
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, ALL_BIG, ALL_BIG,
                                                     timeout=60)
        assert_big_pulled(dst, ALL_BIG, ALL_BIG)


@pytest.mark.slow  # waits out the 1 s default
async def test_default_sync_kv_timeout_is_1000_ms(pair: Pair) -> None:
    src, dst = _small(pair)
    assert pair.decoder.options.sync_kv_timeout_ms == 1000
    channel = instrument(pair.decoder, 1)
    channel.gate = asyncio.Event()
    holder = asyncio.create_task(
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0], [0], timeout=30)
    )
    await wait_until(channel.inside.is_set, what="the holder to take the link")
    loop = asyncio.get_running_loop()

    start = loop.time()
    with pytest.raises(LLMTimeoutError) as info:
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1], [1])
    elapsed = loop.time() - start

    _assert_timeout(info.value)
    assert 0.5 <= elapsed < 1.0 + BOUND_S, elapsed  # it waited: half the 1 s at least
    channel.gate.set()
    await holder
    assert _pulled(src, dst, [0], [0])
    await _normal_pull_works(pair, src, dst, [1, 2], [1, 2])


@pytest.mark.parametrize("how", ["timeout", "sync_kv_timeout"])
async def test_deadline_while_waiting_for_the_link(how: str) -> None:
    options = {"llm.SyncKvCacheWaitTime": "60"} if how == "sync_kv_timeout" else {}
    async with inproc_pair(prompt_id=503, decoder_id=504, options=options) as pair:
        src, dst = _small(pair)
        tracker = Tracker()
        channel = instrument(pair.decoder, 503, tracker)
        channel.gate = asyncio.Event()
        holder = asyncio.create_task(
            pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0], [0], timeout=30),
            name="holder",
        )
        await wait_until(channel.inside.is_set, what="the holder to take the link")
        loop = asyncio.get_running_loop()
        kwargs = {"timeout": 0.06} if how == "timeout" else {}

        start = loop.time()
        with pytest.raises(LLMTimeoutError) as info:
            await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1], [1],
                                                         **kwargs)
        elapsed = loop.time() - start

        _assert_timeout(info.value)
        assert "waiting for the link" in str(info.value)
        assert 0.03 <= elapsed < 0.06 + BOUND_S, elapsed  # it waited: half the 60 ms at least
        assert tracker.entered() == ["pull:holder"], "the timed-out call never reached the link"
        assert not holder.done()
        channel.gate.set()
        await holder
        assert _pulled(src, dst, [0], [0])
        await _normal_pull_works(pair, src, dst, [1, 5], [1, 5])


@pytest.mark.slow  # waits out a 0.8 s deadline
async def test_one_deadline_covers_the_wait_and_the_transfer(pair: Pair) -> None:
    # The link is busy for 0.5 s; a pull with timeout=0.8 then gets a job that runs
    # until aborted. With one budget it fails ~0.8 s after the call, not 0.5 + 0.8.
    src, dst = _small(pair)
    channel = instrument(pair.decoder, 1)
    channel.gate = asyncio.Event()
    channel.hold_until_abort = lambda label: label == "pull:late"
    holder = asyncio.create_task(
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0], [0], timeout=30),
        name="holder",
    )
    await wait_until(channel.inside.is_set, what="the holder to take the link")
    loop = asyncio.get_running_loop()
    loop.call_later(0.5, channel.gate.set)

    start = loop.time()
    late = asyncio.create_task(
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1], [1], timeout=0.8),
        name="late",
    )
    with pytest.raises(LLMTimeoutError) as info:
        await late
    elapsed = loop.time() - start

    _assert_timeout(info.value)
    assert "deadline passed after" in str(info.value)  # it failed in the transfer step
    assert 0.4 <= elapsed < 1.2, elapsed  # it waited: half the 0.8 s at least
    await holder
    assert executor_of(pair.decoder).in_flight == 0
    channel.hold_until_abort = False
    await _normal_pull_works(pair, src, dst, [1, 2, 3], [1, 2, 3])


async def test_timed_out_call_holds_the_link_until_its_job_returns(pair: Pair) -> None:
    # The native job ignores the abort until job_gate opens: the caller must not get
    # its LLM_TIMEOUT, and the link must not serve anyone else, before the job returned.
    src, dst = _small(pair)
    tracker = Tracker()
    channel = instrument(pair.decoder, 1, tracker)
    gate = threading.Event()
    channel.job_gate = gate
    first = asyncio.create_task(
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0], [0], timeout=0.05),
        name="first",
    )
    await wait_until(lambda: channel.jobs_started == 1, what="the first job to start")
    channel.job_gate = None
    second = asyncio.create_task(
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1], [1], timeout=30),
        name="second",
    )
    try:
        await asyncio.sleep(0.25)  # well past the first call's deadline
        assert not first.done(), "LLM_TIMEOUT was raised while the native job still ran"
        assert executor_of(pair.decoder).in_flight == 1
        assert link_of(pair.decoder, 1).slot.busy
        assert tracker.entered() == ["pull:first"], "another transfer entered the busy link"
    finally:
        gate.set()
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(LLMTimeoutError) as info:
        await first
    assert loop.time() - start < BOUND_S
    _assert_timeout(info.value)
    await second
    assert tracker.entered() == ["pull:first", "pull:second"]
    assert _pulled(src, dst, [1], [1])
    await _normal_pull_works(pair, src, dst, [2, 3, 4], [7, 6, 5])


@pytest.mark.slow  # big pulls, timed out in a row
async def test_many_timeouts_in_a_row_leave_the_link_healthy(slow_pair: Pair) -> None:
    pair = slow_pair
    big_cache(pair.prompt, model_id=0, fill=True)
    dst = big_cache(pair.decoder)
    loop = asyncio.get_running_loop()
    for timeout in (0.001, 0.002, 0.005):  # a 512 MiB pull on one thread takes >= 20 ms
        start = loop.time()
        with pytest.raises(LLMTimeoutError):
            await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, ALL_BIG,
                                                         ALL_BIG, timeout=timeout)
        assert loop.time() - start < timeout + BOUND_S
        assert executor_of(pair.decoder).in_flight == 0
    s, d = [63, 0, 17], [0, 63, 18]
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, s, d, timeout=30)
    assert_big_pulled(dst, s, d)


async def test_deadline_holds_for_a_call_arriving_as_the_link_changes_hands(pair: Pair) -> None:
    # A call that arrives in the instant the slot is released, while the next waiter
    # has been woken but has not run yet, must still wait under its deadline.
    src, dst = _small(pair)
    tracker = Tracker()
    channel = instrument(pair.decoder, 1, tracker)
    channel.gate = asyncio.Event()
    cm = pair.decoder.cache_manager
    holder = asyncio.create_task(cm.pull_blocks(pair.key(), dst.cache, [0], [0], timeout=30),
                                 name="holder")
    await wait_until(channel.inside.is_set, what="the holder to take the link")
    next_job = threading.Event()
    channel.job_gate = next_job  # the next waiter's native job runs long
    waiter = asyncio.create_task(cm.pull_blocks(pair.key(), dst.cache, [1], [1], timeout=30),
                                 name="waiter")
    await asyncio.sleep(0.01)
    slot = link_of(pair.decoder, 1).slot
    release = slot.release
    loop = asyncio.get_running_loop()
    late: dict[str, Any] = {}

    def release_and_arrive() -> None:
        if "task" not in late:  # scheduled before the woken waiter resumes
            late["start"] = loop.time()
            late["task"] = asyncio.create_task(
                cm.pull_blocks(pair.key(), dst.cache, [2], [2], timeout=0.05), name="late"
            )
        release()

    slot.release = release_and_arrive
    try:
        channel.gate.set()
        await holder
        await wait_until(lambda: channel.jobs_started == 2, what="the waiter's job to start")
        await asyncio.wait({late["task"]}, timeout=0.05 + BOUND_S)
        if not late["task"].done():
            pytest.fail("the late call waited past its deadline behind the waiter")
        with pytest.raises(LLMTimeoutError) as info:
            await late["task"]
        _assert_timeout(info.value)
        assert not waiter.done()
    finally:
        next_job.set()
        slot.release = release
    await waiter
    assert tracker.entered() == ["pull:holder", "pull:waiter"]
    assert _pulled(src, dst, [0, 1], [0, 1])
    await _normal_pull_works(pair, src, dst, [2], [2])


async def test_a_deadline_spent_before_the_transfer_starts_moves_nothing(pair: Pair) -> None:
    # However fast the copy would be (this one is tiny and runs inline), a budget that is
    # gone by the time the job would start is a timeout, and no byte lands.
    if any(c.__module__.startswith("uvloop") for c in type(asyncio.get_running_loop()).__mro__):
        pytest.skip("uvloop's loop.time() is the iteration's cached millisecond clock")
    src, dst = _small(pair)
    before = [t.view(np.uint8).copy() for t in dst.tensors]
    with pytest.raises(LLMTimeoutError) as info:
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1], [2], timeout=1e-9)
    _assert_timeout(info.value)
    after = [t.view(np.uint8) for t in dst.tensors]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    await _normal_pull_works(pair, src, dst, [1], [2])
