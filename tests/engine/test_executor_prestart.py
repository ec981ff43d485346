"""``Prestart`` jobs: the executor starts their native part from the loop thread as it
queues them when a worker is free (layered pulls: the first layer's bytes move without
waiting for the worker thread to wake and take the GIL), and the executor's rules still
hold: a job queued behind busy workers waits its turn, the call returns, times out or is
cancelled only once the native part has returned, and a refused job starts nothing.

Real bytes (seeded, unique per test) moved by ``_native.start_layered`` between numpy
arrays; every check compares exact bytes or reads the job's own progress counter.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
import time

import numpy as np
import pytest

from aiodatadist import LLMException, LLMStatusCode, _native
from aiodatadist._executor import TransferExecutor
from aiodatadist.errors import LLMTimeoutError
from aiodatadist.transports.base import LayerCut

pytestmark = pytest.mark.asyncio

BB = 1 << 20  # block bytes


class Layered:
    """src (seeded) -> dst (zeros) over ``layers`` layers of 2 tensors x ``blocks`` blocks,
    shuffled, with its eventfd and the start callable for ``TransferExecutor.prestart``."""

    def __init__(self, layers: int, blocks: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        words = np.arange(layers * 2 * blocks * BB // 8, dtype=np.uint64)
        words *= np.uint64(0x9E3779B97F4A7C15)  # a seeded pattern, cheap for 256 MiB
        words += np.uint64(seed)
        self.src = words.view(np.uint8).reshape(layers * 2, blocks * BB)
        self.dst = np.zeros_like(self.src)
        self.sb = [int(x) for x in rng.permutation(blocks)]
        self.db = [int(x) for x in rng.permutation(blocks)]
        g = _native.Geometry(layers * 2, blocks, BB)
        self.plan = _native.Plan.blocks(g, g, self.sb, self.db, 0, 0, layers * 2)
        self.layers = layers
        self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.bounds = LayerCut(self.efd, 0, 2, layers).bounds(self.plan)

    def start(
        self, lease: tuple[int, int] = (0, 0), efd: int | None = None
    ) -> functools.partial[_native.StartedJob]:
        base = self.src.ctypes.data, self.dst.ctypes.data
        rows = self.src.shape[1]
        return functools.partial(
            _native.start_layered,
            0,
            self.plan,
            [base[0] + t * rows for t in range(self.src.shape[0])],
            [base[1] + t * rows for t in range(self.dst.shape[0])],
            self.bounds,
            threads=2,
            efd=self.efd if efd is None else efd,
            lease_addr=lease[0],
            lease_gen=lease[1],
        )

    def want(self) -> np.ndarray:
        out = np.zeros_like(self.src)
        for s, d in zip(self.sb, self.db, strict=True):
            out[:, d * BB : (d + 1) * BB] = self.src[:, s * BB : (s + 1) * BB]
        return out

    def signalled(self) -> int:
        try:
            return os.eventfd_read(self.efd)
        except BlockingIOError:
            return 0

    def close(self) -> None:
        os.close(self.efd)


@pytest.fixture
def executor():
    ex = TransferExecutor(1, name="prestart-test")
    yield ex
    ex.shutdown(5.0)


def block_worker(ex: TransferExecutor) -> tuple[threading.Event, asyncio.Task[None]]:
    """Occupies the executor's one worker until the returned event is set."""
    release = threading.Event()

    def hold(_ctl: _native.Control) -> None:
        release.wait(30)

    task = asyncio.ensure_future(ex.run(hold, deadline=None))
    return release, task


async def until(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.001)


async def test_bytes_move_before_the_worker_can_run(executor: TransferExecutor) -> None:
    # The loop thread keeps the GIL (a Python spin, with the GIL switch interval raised):
    # the free worker cannot run a line of Python meanwhile, yet every layer lands, since
    # the native part was started as the job was queued. (A job the worker starts would
    # move nothing until the spin ends.)
    job = Layered(8, 4, seed=0xA11)
    try:
        ctl = _native.Control()
        interval = sys.getswitchinterval()
        sys.setswitchinterval(30.0)
        try:
            # (submit() is what run() calls; called here so that no loop iteration, which
            # lets go of the GIL in its select, runs before the spin)
            run = executor.submit(executor.prestart(job.start()), ctl)
            end = time.monotonic() + 20
            while ctl.bytes_done < job.plan.total_bytes and time.monotonic() < end:
                pass
            moved = ctl.bytes_done
        finally:
            sys.setswitchinterval(interval)
        assert moved == job.plan.total_bytes, f"{moved} bytes moved while the GIL was held"
        await run
        assert job.signalled() == job.layers
        assert np.array_equal(job.dst, job.want())
    finally:
        job.close()


async def test_a_job_queued_behind_a_busy_worker_waits_its_turn(
    executor: TransferExecutor,
) -> None:
    # The executor's one worker is busy: the job waits in the queue like any other (the
    # workers bound how many transfers move bytes at once), then moves every byte.
    job = Layered(4, 2, seed=0xA17)
    try:
        release, held = block_worker(executor)
        await until(lambda: executor.in_flight == 1)
        ctl = _native.Control()
        run = asyncio.ensure_future(
            executor.run(executor.prestart(job.start()), deadline=None, control=ctl)
        )
        await asyncio.sleep(0.1)
        assert ctl.bytes_done == 0 and not job.dst.any() and not run.done()
        release.set()
        await run
        await held
        assert job.signalled() == job.layers
        assert np.array_equal(job.dst, job.want())
    finally:
        job.close()


async def test_cancel_returns_once_the_native_part_has(executor: TransferExecutor) -> None:
    # 64 layers x 4 MiB = 256 MiB, cancelled mid-way: CancelledError only once the job has
    # returned (its progress never moves again), and the executor takes the next job.
    job = Layered(64, 2, seed=0xA12)
    try:
        ctl = _native.Control()
        run = asyncio.ensure_future(
            executor.run(executor.prestart(job.start()), deadline=None, control=ctl)
        )
        await until(lambda: ctl.bytes_done >= 16 * BB)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        done = ctl.bytes_done
        assert ctl.aborted and done < job.plan.total_bytes
        await asyncio.sleep(0.05)
        assert ctl.bytes_done == done
        assert executor.in_flight == 0
    finally:
        job.close()
    again = Layered(2, 2, seed=0xA13)
    try:
        await executor.run(executor.prestart(again.start()), deadline=None)
        assert again.signalled() == 2 and np.array_equal(again.dst, again.want())
    finally:
        again.close()


async def test_deadline_while_queued_starts_nothing(executor: TransferExecutor) -> None:
    # The worker is busy past the deadline: the job, still queued, is aborted at the
    # deadline and never starts (LLMTimeoutError once the worker has taken it).
    job = Layered(4, 2, seed=0xA14)
    try:
        release, held = block_worker(executor)
        await until(lambda: executor.in_flight == 1)
        loop = asyncio.get_running_loop()
        ctl = _native.Control()
        run = asyncio.ensure_future(
            executor.run(executor.prestart(job.start()), deadline=loop.time() + 0.005, control=ctl)
        )
        await until(lambda: ctl.aborted)
        release.set()
        with pytest.raises(LLMTimeoutError):
            await run
        assert ctl.bytes_done == 0 and not job.dst.any() and job.signalled() == 0
        await held
    finally:
        job.close()


async def test_a_refused_job_is_stopped_before_the_refusal(executor: TransferExecutor) -> None:
    job = Layered(4, 2, seed=0xA15)
    try:
        executor.shutdown(5.0)
        ctl = _native.Control()
        with pytest.raises(LLMException) as info:
            await executor.run(executor.prestart(job.start()), deadline=None, control=ctl)
        assert info.value.status_code == LLMStatusCode.LLM_FAILED
        assert "shut down" in str(info.value)
        # Refused before anything started: nothing moved.
        await asyncio.sleep(0.05)
        assert ctl.bytes_done == 0 and not job.dst.any() and job.signalled() == 0
    finally:
        job.close()


async def test_translate_maps_the_native_error(executor: TransferExecutor) -> None:
    # A lease slot holding another generation: STALE from the job, raised as translated;
    # other errors pass through untranslated.
    job = Layered(2, 2, seed=0xA16)
    slot = np.zeros(2, dtype=np.uint64)
    slot[0] = 3

    class Stale(Exception):
        pass

    def translate(err: _native.NativeError) -> BaseException | None:
        return Stale(str(err)) if err.status == _native.Status.STALE else None

    try:
        with pytest.raises(Stale, match="not current"):
            await executor.run(
                executor.prestart(job.start((slot.ctypes.data, 4)), translate), deadline=None
            )
        assert not job.dst.any() and job.signalled() == 0
        with pytest.raises(LLMException) as info:  # no signal fd: PARAM_INVALID, untranslated
            await executor.run(executor.prestart(job.start(efd=-1), translate), deadline=None)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        await executor.run(executor.prestart(job.start((slot.ctypes.data, 3))), deadline=None)
        assert job.signalled() == 2 and np.array_equal(job.dst, job.want())
    finally:
        job.close()
