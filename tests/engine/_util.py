"""Helpers for the engine tests: numpy references, big caches and an instrumented channel.

Every comparison is on raw bytes (``uint8`` views): random bytes read as floats
contain NaNs, which never compare equal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from aiodatadist import DataType, LLMDataDist, _native
from aiodatadist.testing import FilledCache, as_matrix, make_blocks_cache
from aiodatadist.testing import reference_pull as model_pull
from aiodatadist.transports.base import Call, Path
from aiodatadist.transports.inproc import InprocPath

MIB = 1 << 20

# Big caches: 2 tensors x 64 blocks x 4 MiB = 2 x 256 MiB, so a full pull takes long
# enough (tens of ms or more) for a 10 ms deadline or a cancel to land inside it.
BIG_TENSORS = 2
BIG_BLOCKS = 64
BIG_BLOCK_BYTES = 4 * MIB
ALL_BIG = list(range(BIG_BLOCKS))

# One mover thread: big transfers stay slow enough to be interrupted.
SLOW_OPTIONS = {"aiodatadist.MoverThreads": "1"}

# Generous bound for "the call ended soon after its deadline or cancel" (not a speed claim).
BOUND_S = 1.0  # a loaded 2-core machine (two CPU burners beside the suite) needs the room


# ------------------------------------------------------------------ bytes


def blocks_of(tensor: np.ndarray) -> np.ndarray:
    """A ``(num_blocks, block_bytes)`` uint8 view of one cache tensor."""
    return tensor.view(np.uint8).reshape(tensor.shape[0], -1)


def snapshot(fc: FilledCache) -> list[np.ndarray]:
    """A copy of every tensor of ``fc`` as ``(num_blocks, block_bytes)`` uint8 arrays."""
    return [blocks_of(t).copy() for t in fc.tensors]


def reference_pull(
    src: Sequence[np.ndarray],
    dst: Sequence[np.ndarray],
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    src_tensor_start: int,
    dst_tensor_start: int,
    tensor_count: int,
) -> list[np.ndarray]:
    """What ``dst`` must hold after a block pull, per tensor as ``(num_blocks, block_bytes)``.

    The model is :func:`aiodatadist.testing.reference_pull`; this only reshapes.
    """
    block_bytes = dst[0].shape[1]
    want = model_pull(
        as_matrix(src),
        as_matrix(dst),
        block_bytes,
        src_blocks,
        dst_blocks,
        (src_tensor_start, dst_tensor_start, tensor_count),
    )
    return [row.reshape(d.shape) for row, d in zip(want, dst, strict=True)]


def assert_bytes(fc: FilledCache, expected: Sequence[np.ndarray]) -> None:
    """Every tensor of ``fc`` equals ``expected`` byte for byte (names the first bad block)."""
    assert len(fc.tensors) == len(expected)
    for t, (tensor, want) in enumerate(zip(fc.tensors, expected, strict=True)):
        got = blocks_of(tensor)
        if not np.array_equal(got, want):
            bad = [b for b in range(got.shape[0]) if not np.array_equal(got[b], want[b])]
            raise AssertionError(f"tensor {t}: blocks {bad[:10]} differ from the reference")


# ------------------------------------------------------------- big caches


def big_value(tensor: int, block: int) -> int:
    """The byte every position of block ``block`` of tensor ``tensor`` holds in a big source."""
    return (block * 7 + tensor * 101 + 1) % 251


def big_cache(dd: LLMDataDist, *, model_id: int | None = None, fill: bool = False) -> FilledCache:
    """A 2 x 256 MiB blocks cache allocated in shared memory; ``fill`` writes big_value()."""
    fc = make_blocks_cache(
        dd,
        num_tensors=BIG_TENSORS,
        num_blocks=BIG_BLOCKS,
        block_shape=(BIG_BLOCK_BYTES,),
        data_type=DataType.DT_UINT8,
        model_id=model_id,
        allocate=True,
    )
    if fill:
        for t, arr in enumerate(fc.tensors):
            values = np.array([big_value(t, b) for b in range(BIG_BLOCKS)], dtype=np.uint8)
            arr[...] = values[:, None]
    return fc


def assert_big_pulled(
    dst: FilledCache, src_blocks: Sequence[int], dst_blocks: Sequence[int]
) -> None:
    """Block ``dst_blocks[i]`` of every tensor holds exactly source block ``src_blocks[i]``."""
    for t, arr in enumerate(dst.tensors):
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            block = arr[d]
            want = big_value(t, s)
            assert block.min() == want and block.max() == want, (
                f"tensor {t} block {d} does not hold source block {s}"
            )


# ------------------------------------------------------ waiting, bounded


async def wait_until(
    pred: Callable[[], bool], timeout: float = 10.0, what: str = "", poll: float = 0.001
) -> None:
    """Waits (bounded) until ``pred()`` holds; a test-side poll, never engine code.

    ``poll=0`` checks on every loop iteration: for a state that may last only a few
    milliseconds (a big pull in flight on a fast machine)."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(poll)


async def fire_when_in_flight(
    executor: Any,
    ended: Callable[[], bool],
    action: Callable[[], object],
    timeout: float = 20.0,
) -> float | None:
    """Calls ``action()`` (a cancel) as soon as ``executor`` has a job in flight, and returns
    the loop time it did; ``None`` when the pull ended first (``ended()``), untouched.

    The check runs on every loop iteration, yet a pull that moves a few hundred MiB in
    tens of milliseconds can still end unseen when the loop thread is descheduled that
    long (CI's noisy neighbours, two CPU burners): the caller then tries again rather than
    waiting for a job that has come and gone."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while executor.in_flight < 1:
        if ended():
            return None
        if loop.time() > end:
            raise AssertionError("timed out waiting for the big pull's native job")
        await asyncio.sleep(0)
    fired = loop.time()
    action()
    return fired


SCOPE_KINDS = ("asyncio.timeout", "task.cancel", "move_on_after", "fail_after", "task_group")
"""The ways a caller cancels a pull in flight (:func:`cancel_in_flight`)."""

CANCEL_ATTEMPTS = 5
"""A pull that ends before its cancel could land is tried again, at most this often."""


@dataclasses.dataclass
class Cancelled:
    """What :func:`cancel_in_flight` saw."""

    caught: bool  # the scope caught the cancel it fired (and nothing escaped it)
    fired: float | None  # the loop time the cancel was asked for (None: never)
    landed: bool  # the pull returned: its bytes all landed
    done: float  # the loop time code after the scope ran


async def cancel_in_flight(
    executor: Any, kind: str, pull: Callable[[], Awaitable[object]]
) -> Cancelled:
    """Runs ``pull()`` inside the cancel scope ``kind`` (:data:`SCOPE_KINDS`) and cancels
    it by that scope as soon as ``executor`` has a job in flight (:func:`fire_when_in_flight`).

    A scope that did not catch a cancel it fired, or caught one it never fired, fails
    here. ``caught`` False: the pull ended before the cancel could land (unseen, or its
    job ended in the iteration the cancel was asked for and it returned first): it must
    then have landed whole, and the caller tries again (a library that ignored cancels
    would fail every attempt)."""
    import anyio

    loop = asyncio.get_running_loop()
    fired: list[float] = []
    ended = [False]
    landed = [False]

    async def watched() -> None:
        try:
            await pull()
            landed[0] = True
        finally:
            ended[0] = True

    async def when_in_flight(action: Callable[[], object]) -> None:
        at = await fire_when_in_flight(executor, lambda: ended[0], action)
        if at is not None:
            fired.append(at)

    watchers: list[asyncio.Task[None]] = []
    caught = False
    if kind == "asyncio.timeout":
        try:
            async with asyncio.timeout(None) as cm:
                watchers.append(
                    asyncio.create_task(when_in_flight(lambda: cm.reschedule(loop.time())))
                )
                await watched()
        except TimeoutError:
            caught = True
        assert caught == cm.expired(), kind
    elif kind == "task.cancel":
        task = asyncio.create_task(watched())
        watchers.append(asyncio.create_task(when_in_flight(task.cancel)))
        try:
            await task
        except asyncio.CancelledError:
            caught = True
        assert caught == task.cancelled(), kind
    elif kind in ("move_on_after", "fail_after"):
        ctx = anyio.move_on_after(60) if kind == "move_on_after" else anyio.fail_after(60)
        timed_out = False
        try:
            with ctx as scope:
                watchers.append(
                    asyncio.create_task(
                        when_in_flight(lambda: setattr(scope, "deadline", anyio.current_time()))
                    )
                )
                await watched()
        except TimeoutError:
            assert kind == "fail_after"
            timed_out = True
        caught = scope.cancelled_caught
        assert kind == "move_on_after" or timed_out == caught, kind
    elif kind == "task_group":
        async with anyio.create_task_group() as tg:
            tg.start_soon(watched)
            await when_in_flight(tg.cancel_scope.cancel)
        caught = tg.cancel_scope.cancelled_caught
    else:  # pragma: no cover
        raise AssertionError(kind)
    done = loop.time()  # code after the scope runs: nothing escaped it
    for w in watchers:
        await w
    assert fired or not caught, f"{kind}: a scope caught a cancel that never fired"
    assert caught or landed[0], f"{kind}: the pull neither landed nor raised into its scope"
    if caught:
        # The task is not left cancelling: a later await is not cancelled.
        current = asyncio.current_task()
        assert current is not None and current.cancelling() == 0, kind
    return Cancelled(caught, fired[0] if fired else None, landed[0], done)


def executor_of(dd: LLMDataDist) -> Any:
    """The instance's dedicated transfer executor."""
    ex = dd._rt.executor
    assert ex is not None
    return ex


def link_of(dd: LLMDataDist, remote_cluster_id: int) -> Any:
    link = dd._rt.links.find(remote_cluster_id)
    assert link is not None, f"cluster {dd.cluster_id} has no link to {remote_cluster_id}"
    return link


# ------------------------------------------------- the instrumented channel


class OverlapError(AssertionError):
    """Two transfers were inside one link's channel at the same time."""


class Tracker:
    """Records transfers entering and leaving link channels; fails on overlap per link.

    ``key`` names a link (both ends of one in-process link share a key); transfers on
    different keys may overlap, and ``max_total`` says how many were inside at once.
    """

    def __init__(self) -> None:
        self.active: dict[object, int] = {}
        self.events: list[tuple[str, object, str]] = []
        self.overlaps: list[str] = []
        self.total = 0
        self.max_total = 0
        self.threads: list[str] = []
        self._lock = threading.Lock()

    def enter(self, key: object, label: str) -> None:
        if self.active.get(key, 0):
            msg = f"{label} entered link {key!r} while another transfer was inside it"
            self.overlaps.append(msg)
            raise OverlapError(msg)
        self.active[key] = 1
        self.total += 1
        self.max_total = max(self.max_total, self.total)
        self.events.append(("enter", key, label))

    def exit(self, key: object, label: str) -> None:
        self.active[key] -= 1
        self.total -= 1
        self.events.append(("exit", key, label))

    def entered(self, key: object | None = None) -> list[str]:
        """Labels in the order they entered (on ``key`` only, when given)."""
        return [lab for ev, k, lab in self.events if ev == "enter" and (key is None or k == key)]

    def record_thread(self, name: str) -> None:
        with self._lock:
            self.threads.append(name)


class _TracedCall(Call):
    """The call a traced channel hands to the real channel: wraps each native job."""

    def __init__(
        self, base: Call, channel: TracedChannel, job_gate: threading.Event | None, hold: bool
    ) -> None:
        super().__init__(base.api, base.deadline, base.executor, base.mover_threads)
        self._channel = channel
        self._job_gate = job_gate
        self._hold = hold

    async def run(self, job: Callable[[_native.Control], Any], *, local_bytes: int = -1) -> Any:
        wrapped = self._channel._wrap_job(job, self._job_gate, self._hold)
        return await super().run(wrapped, local_bytes=local_bytes)


class TracedChannel(InprocPath):
    """An in-process channel that records transfers and delegates to the real one.

    Args:
        inner: the link's real channel (every byte still moves through it).
        tracker: where enter/exit and worker thread names are recorded.
        key: the link's name in ``tracker``.

    Knobs a test may set at any time (each transfer takes their values when it enters):
        gate: an ``asyncio.Event`` awaited inside the slot, before the real transfer
            (holds the link's slot without any native job running).
        job_gate: a ``threading.Event`` the worker thread waits on before running the
            real native job (a native job that is "still running", deaf to aborts).
        hold_until_abort: True, or a predicate on the transfer's label: the worker thread
            waits until the job's abort token is set (its deadline passed or it was
            cancelled) before running the real job, which then fails ABORTED.
    """

    def __init__(self, inner: InprocPath, tracker: Tracker, key: object) -> None:
        super().__init__(inner.remote_table)
        self.inner = inner
        self.tracker = tracker
        self.key = key
        self.gate: asyncio.Event | None = None
        self.job_gate: threading.Event | None = None
        self.hold_until_abort: bool | Callable[[str], bool] = False
        self.layered_job = False  # pull_layers: the real one native job (else one per layer)
        self.inside = asyncio.Event()  # set while a transfer is inside (after enter)
        self.jobs_started = 0
        self.jobs_returned = 0

    @property  # type: ignore[override]
    def kinds(self) -> Any:
        return self.inner.kinds

    @property
    def remote_table(self) -> Any:
        return self.inner.remote_table

    async def refresh(self, deadline: float | None) -> bool:
        return await self.inner.refresh(deadline)

    async def close(self) -> None:
        await self.inner.close()

    def _wrap_job(
        self, job: Callable[[_native.Control], Any], job_gate: threading.Event | None, hold: bool
    ) -> Callable[[_native.Control], Any]:
        def wrapped(ctl: _native.Control) -> Any:
            name = threading.current_thread().name
            self.tracker.record_thread(name)
            if (job_gate is not None or hold) and not name.startswith("aiodatadist-"):
                raise AssertionError("a gated job ran inline on the loop thread: use a bigger plan")
            self.jobs_started += 1
            try:
                if job_gate is not None:
                    assert job_gate.wait(20), "job_gate was never opened"
                if hold:
                    end = time.monotonic() + 20
                    while not ctl.aborted:
                        assert time.monotonic() < end, "the job was never aborted"
                        time.sleep(0.001)
                return job(ctl)
            finally:
                self.jobs_returned += 1

        return wrapped

    async def _traced(self, kind: str, fn: Any, a: Any, b: Any, call: Call, plan: Any) -> None:
        task = asyncio.current_task()
        label = f"{kind}:{task.get_name() if task is not None else '?'}"
        job_gate = self.job_gate
        hold = self.hold_until_abort
        held = hold(label) if callable(hold) else hold
        self.tracker.enter(self.key, label)
        self.inside.set()
        try:
            if self.gate is not None:
                await self.gate.wait()
            await fn(plan, a, b, _TracedCall(call, self, job_gate, held))
        finally:
            self.inside.clear()
            self.tracker.exit(self.key, label)

    async def pull(self, plan: Any, remote: Any, local: Any, call: Call) -> None:
        await self._traced("pull", self.inner.pull, remote, local, call, plan)

    async def pull_layers(self, plan: Any, remote: Any, local: Any, call: Call, cut: Any) -> None:
        """A layered pull: one traced ``pull`` per layer (the default ``Path.pull_layers``,
        which tcp and the engines use), so each layer's job can be held; with
        ``layered_job`` set, the real path's one native job, traced as one transfer."""
        if not self.layered_job:
            await Path.pull_layers(self, plan, remote, local, call, cut)
            return

        async def one(p: Any, r: Any, lo: Any, c: Call) -> None:
            await self.inner.pull_layers(p, r, lo, c, cut)

        await self._traced("pull", one, remote, local, call, plan)

    async def push(self, plan: Any, local: Any, remote: Any, call: Call) -> None:
        await self._traced("push", self.inner.push, local, remote, call, plan)


def instrument(
    dd: LLMDataDist, remote_cluster_id: int, tracker: Tracker | None = None
) -> TracedChannel:
    """Wraps ``dd``'s channel to ``remote_cluster_id`` in a :class:`TracedChannel`.

    The tracker key is the link's FIFO slot, so both ends of one in-process link
    (the decoder's pulls and the prompt's pushes) count as one link.
    """
    link = link_of(dd, remote_cluster_id)
    inner = link.path
    if isinstance(inner, TracedChannel):
        return inner
    assert isinstance(inner, InprocPath), inner
    ch = TracedChannel(inner, tracker if tracker is not None else Tracker(), id(link.slot))
    link.path = ch
    return ch
