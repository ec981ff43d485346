"""How ``TransferExecutor.run`` waits for its job (the quiescence rule, one loop hop).

The awaiting task waits on its job's own wake future, which a cancel of the task
cancels; the wait goes on with a new one until the job has returned. These tests hold a
job on a worker thread with an event and check, against a real pool:

* cancels (one, then more while the job still runs) never let ``run`` return before the
  job has, the job's abort token is set once, and the ``CancelledError`` raised is the
  first one caught (its message: anyio and ``asyncio.timeout`` recognise their own by it);
* a job that returned in the very iteration a cancel came still honours the cancel (its
  result is not handed out);
* the job's value, or its error, is what ``run`` returns or raises, and the pool works
  after each case.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from aiodatadist import LLMException, LLMStatusCode, _native
from aiodatadist._executor import TransferExecutor

pytestmark = pytest.mark.asyncio

BOUND_S = 5.0  # generous: a held job is released well within it


@pytest_asyncio.fixture
async def executor() -> AsyncIterator[TransferExecutor]:
    ex = TransferExecutor(2, name="wait-test")
    yield ex
    assert await ex.aclose(BOUND_S)


class Held:
    """A job that blocks on an event; records what it saw of its abort token."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.go = threading.Event()
        self.started = threading.Event()
        self.returned = threading.Event()
        self.aborted_seen = False
        self.value, self.error = value, error

    def __call__(self, control: _native.Control) -> Any:
        self.started.set()
        try:
            assert self.go.wait(BOUND_S), "never released"
            self.aborted_seen = control.aborted
            if self.error is not None:
                raise self.error
            return self.value
        finally:
            self.returned.set()


async def _until(cond: Any) -> None:
    end = time.monotonic() + BOUND_S
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.001)


async def test_value_and_error_of_the_job(executor: TransferExecutor) -> None:
    job = Held(value=0x5EED)
    job.go.set()
    assert await executor.run(job, deadline=None) == 0x5EED
    failing = Held(error=_native.NativeError(_native.Status.PEER_CLOSED, "gone"))
    failing.go.set()
    with pytest.raises(LLMException) as ei:
        await executor.run(failing, deadline=None)
    assert ei.value.status_code == LLMStatusCode.LLM_LINK_FAILED, ei.value
    assert executor.in_flight == 0


async def test_cancels_wait_for_the_job_and_raise_the_first(executor: TransferExecutor) -> None:
    job = Held(value="late")
    ctl = _native.Control()
    task = asyncio.create_task(executor.run(job, deadline=None, control=ctl))
    await _until(job.started.is_set)
    task.cancel("the first")
    for i in range(5):  # more cancels while the job still runs: the wait goes on
        await asyncio.sleep(0.01)
        assert not task.done() and not job.returned.is_set()
        task.cancel(f"again {i}")
    assert ctl.aborted  # the first cancel asked the job to stop
    job.go.set()
    with pytest.raises(asyncio.CancelledError) as ei:
        await asyncio.wait_for(task, BOUND_S)
    assert job.returned.is_set() and job.aborted_seen
    assert ei.value.args == ("the first",), ei.value.args
    assert executor.in_flight == 0
    again = Held(value=7)
    again.go.set()
    assert await executor.run(again, deadline=None) == 7


async def test_a_job_that_returned_as_the_cancel_came_honours_it(
    executor: TransferExecutor,
) -> None:
    loop = asyncio.get_running_loop()
    job = Held(value="not handed out")
    task = asyncio.create_task(executor.run(job, deadline=None))
    await _until(job.started.is_set)
    # Release the job and wait for it without yielding: its completion callback is queued
    # on the loop; the cancel is queued right behind it, so both land in one iteration.
    job.go.set()
    assert job.returned.wait(BOUND_S)
    end = time.monotonic() + BOUND_S
    while executor.in_flight:
        assert time.monotonic() < end
        time.sleep(0.0005)  # noqa: ASYNC251 - the loop must not run
    time.sleep(0.01)  # noqa: ASYNC251 - (its call_soon_threadsafe follows in_flight)
    loop.call_soon(task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, BOUND_S)
    again = Held(value=8)
    again.go.set()
    assert await executor.run(again, deadline=None) == 8


async def test_deadline_with_cancels_meanwhile(executor: TransferExecutor) -> None:
    # The deadline aborts the job; the call raises LLMTimeoutError once it returned.
    loop = asyncio.get_running_loop()
    job = Held()
    ctl = _native.Control()

    def returns_when_aborted(control: _native.Control) -> None:
        job.started.set()
        end = time.monotonic() + BOUND_S
        while not control.aborted and time.monotonic() < end:
            time.sleep(0.001)
        job.aborted_seen = control.aborted
        raise _native.NativeError(_native.Status.ABORTED, "aborted")

    started = loop.time()
    with pytest.raises(LLMException) as ei:
        await executor.run(returns_when_aborted, deadline=loop.time() + 0.05, control=ctl)
    assert ei.value.status_code == LLMStatusCode.LLM_TIMEOUT, ei.value
    assert job.aborted_seen and loop.time() - started < BOUND_S
    assert executor.in_flight == 0
