"""The dedicated transfer executor: named threads that run native jobs.

Every transfer runs here, never on the loop's default executor. A job is a
blocking callable taking a :class:`~aiodatadist._native.Control`; the native
movers release the GIL, so the event loop keeps running while bytes move.

Completion wakes the awaiting task through ``loop.call_soon_threadsafe``: no
polling. A deadline is a loop timer that sets the job's abort token; a cancel
sets it too. In both cases :meth:`TransferExecutor.run` waits until the native
job has really returned before it raises (the quiescence rule), so the memory
and the link a job uses are never released under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import queue
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final

from . import _native
from .errors import LLMException, LLMStatusCode, failure, from_native

__all__ = [
    "INLINE_MAX_BYTES",
    "INLINE_YIELD_S",
    "ONE_SIDED_INLINE_MAX_BYTES",
    "Job",
    "Prestart",
    "TransferExecutor",
    "quiesce",
]

log = logging.getLogger("aiodatadist.executor")

Job = Callable[[_native.Control], Any]

_STOP: Final = object()

WORKER_NICE: Final = 5
"""How much lower than the loop thread the transfer threads run (a nice increment)."""

INLINE_MAX_BYTES: Final = 64 * 1024
"""Local copies up to this size run inline on the loop thread (a few microseconds)."""

ONE_SIDED_INLINE_MAX_BYTES: Final = 256 * 1024
"""One-sided cross-process copies (``shm``, ``cma``) up to this size run inline on the
loop thread, GIL released: at most ~30 us of copying (a 256 KiB ``process_vm_readv``),
against ~60-150 us of thread handoffs and wakeups it saves. The loop is blocked for that
long; the copy is bounded by its size, and cannot be aborted mid-way."""

INLINE_YIELD_S: Final = 0.001
"""Back-to-back inline one-sided transfers yield to the loop at least this often (a
loop of tiny pulls that never suspends would starve the loop's other tasks)."""
NO_DEADLINE_S: Final = float("inf")
"""``Control.expire_in`` of a job without a deadline (clears an earlier one)."""

_pool_ids = itertools.count(1)


class Prestart:
    """A job whose native part the executor starts from the loop thread as it queues it.

    ``start(control)`` hands the bytes to a native mover thread at once (a
    ``_native.StartedJob``) without waiting for a worker thread to wake and take the GIL,
    which costs ~50-100 us before the first byte moves (the layered pulls' first layer
    waits on it). The worker then only waits for the started job (GIL released), so the
    executor's rules hold unchanged: it runs when a worker is free for it (FIFO, at most
    one job per worker), the deadline and a cancel abort it through its ``Control``, and
    the awaiting task resumes only once its native part has returned.

    Args:
        start: starts the native part on a mover thread, at the workers' priority
            (:data:`WORKER_NICE`); called once, by :meth:`TransferExecutor.submit` when a
            worker is free, else by the worker that takes the job.
        translate: maps a native error of the job to the exception to raise (None: the
            native error itself).
    """

    __slots__ = ("_error", "_handle", "_lock", "_start", "_translate")

    def __init__(
        self,
        start: Callable[[_native.Control], _native.StartedJob],
        translate: Callable[[_native.NativeError], BaseException | None] | None = None,
    ) -> None:
        self._start = start
        self._translate = translate
        self._handle: _native.StartedJob | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def begin(self, control: _native.Control) -> None:
        """Starts the native part (once; an error is kept for the worker to raise)."""
        with self._lock:
            if self._handle is None and self._error is None:
                try:
                    self._handle = self._start(control)
                except BaseException as exc:  # raised where the job runs (the worker)
                    self._error = exc

    def __call__(self, control: _native.Control) -> Any:
        with self._lock:
            started = self._handle is not None or self._error is not None
        if not started:
            if control.aborted:
                raise _native.NativeError(_native.Status.ABORTED, "aborted before it started")
            self.begin(control)
        if self._error is not None:
            raise self._error
        assert self._handle is not None
        try:
            return self._handle.wait()
        except _native.NativeError as err:
            mapped = self._translate(err) if self._translate is not None else None
            if mapped is None:
                raise
            raise mapped from err


def _start_at_worker_nice(
    start: Callable[..., _native.StartedJob], control: _native.Control
) -> _native.StartedJob:
    # Mover threads run below the loop's thread, as the workers do.
    return start(control, nice=WORKER_NICE)


class _Work:
    """A queued job; :meth:`settle` runs on the job's loop once the job has returned.

    A ``submit`` job settles :attr:`future` with the job's outcome. A ``run`` job
    (``wake=True``) keeps its outcome here and only wakes :attr:`future`, which the
    awaiting task awaits directly (one loop iteration from the worker's callback to the
    task, where a wait on the outcome future would take two more); a cancel of that task
    cancels the wake future, and :meth:`TransferExecutor.run` gives it a new one.
    """

    __slots__ = ("control", "done", "future", "job", "loop", "ok", "value", "wake")

    def __init__(
        self,
        job: Job,
        control: _native.Control,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        wake: bool = False,
    ) -> None:
        self.job = job
        self.control = control
        self.loop = loop
        self.future = future
        self.wake = wake
        self.done = False  # set on the loop thread, with ok and value
        self.ok = False
        self.value: Any = None

    def settle(self, ok: bool, value: Any) -> None:
        if not self.wake:
            _settle(self.future, ok, value)
            return
        self.done, self.ok, self.value = True, ok, value
        if not self.future.done():
            self.future.set_result(None)


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


@contextlib.contextmanager
def _cancel_shield() -> Iterator[None]:
    """A scope that keeps anyio's cancel scopes from cancelling the current task again.

    anyio re-delivers a scope's cancellation to a task inside it on every loop iteration
    while the task waits on a future: a wait that must outlast a cancel (quiescence)
    would wake, catch and wait again at the loop's full speed. A shielded anyio scope
    stops the re-delivery; anyio restarts it when the scope exits. Without anyio loaded
    nobody re-delivers, and a plain ``Task.cancel()`` passes through this shield anyway.
    """
    anyio = sys.modules.get("anyio")
    scope: Any = None
    if anyio is not None and asyncio.current_task() is not None:
        try:
            scope = anyio.CancelScope(shield=True)
            scope.__enter__()
        except Exception:  # a loop anyio does not know: it cannot be cancelling us either
            scope = None
    try:
        yield
    finally:
        if scope is not None:
            scope.__exit__(None, None, None)


async def quiesce(
    fut: asyncio.Future[Any],
    *,
    on_cancel: Callable[[], None] | None = None,
    cancelled: asyncio.CancelledError | None = None,
) -> None:
    """Waits until ``fut`` is done, through any number of cancels of the waiting task.

    ``fut`` itself is never cancelled here: whoever owns it (a native job, a task on
    another loop) decides when it ends; ``on_cancel`` is called once, on the first
    cancel, to ask it to (set an abort token, cancel a task).

    Args:
        fut: what must have finished before the caller may go on (its outcome is not
            raised here; the caller reads it).
        on_cancel: called on the first cancel of the waiting task.
        cancelled: a ``CancelledError`` the caller already caught (the wait then starts
            as cancelled; ``on_cancel`` is not called for it).

    Raises:
        asyncio.CancelledError: the waiting task was cancelled (or ``cancelled`` was
            given); raised only once ``fut`` is done, and it is the first one caught,
            the same object: anyio and ``asyncio.timeout`` recognise their own
            cancellation by it (its message), and would let a new one escape.
    """
    first = await _through_cancels(
        fut.done, lambda: asyncio.wait({fut}), on_cancel=on_cancel, cancelled=cancelled
    )
    if first is not None:
        if not fut.cancelled():
            fut.exception()  # retrieved: the caller's cancel is what propagates
        try:
            raise first
        finally:
            del first


async def _wait_work(work: _Work, on_cancel: Callable[[], None]) -> None:
    """:func:`quiesce` for a ``run`` job: waits on its wake future itself (a cancel of
    the task cancels that future; a new one is made), until the job has returned."""

    def wake() -> asyncio.Future[Any]:
        if work.future.done():  # (cancelled with the task: the job still runs)
            work.future = work.loop.create_future()
        return work.future

    first = await _through_cancels(lambda: work.done, wake, on_cancel=on_cancel)
    if first is not None:
        try:
            raise first
        finally:
            del first


async def _through_cancels(
    done: Callable[[], bool],
    wait: Callable[[], Awaitable[Any]],
    *,
    on_cancel: Callable[[], None] | None = None,
    cancelled: asyncio.CancelledError | None = None,
) -> asyncio.CancelledError | None:
    """Awaits ``wait()`` until ``done()``, through any number of cancels of the task;
    returns the first ``CancelledError`` caught (or ``cancelled``), None without one.
    ``on_cancel`` is called on the first cancel caught here; after it, anyio's scopes
    are kept from cancelling the task again (:func:`_cancel_shield`)."""
    first = cancelled
    with contextlib.ExitStack() as stack:
        if first is not None:
            stack.enter_context(_cancel_shield())
        while not done():
            try:
                await wait()
            except asyncio.CancelledError as exc:
                if first is None:
                    first = exc
                    stack.enter_context(_cancel_shield())
                    if on_cancel is not None:
                        on_cancel()
    return first


class TransferExecutor:
    """A fixed pool of named threads running native transfer jobs.

    Args:
        threads: number of worker threads (jobs beyond that wait in FIFO order).
        name: a label used in the thread names (``aiodatadist-<name>-<i>``).
    """

    def __init__(self, threads: int = 2, name: str = "xfer") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._queue: queue.SimpleQueue[_Work | object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._closed = False
        # time.monotonic() from which the next fair inline job yields first (Call.run).
        self.yield_due = 0.0
        pool = next(_pool_ids)
        self._threads = [
            threading.Thread(
                target=self._worker, name=f"aiodatadist-{name}-{pool}-{i}", daemon=True
            )
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._threads)

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet returned from native code."""
        return self._in_flight

    def _worker(self) -> None:
        # Movers yield the CPU to the event loop: on a machine with fewer cores than
        # busy threads the loop thread would otherwise wait a whole timeslice to run.
        # (Linux nice values are per thread; the mover's helper threads inherit it.)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            assert isinstance(item, _Work)
            try:
                # A Prestart may be moving bytes already: it is always waited for (it
                # checks the abort itself when it has not started).
                if item.control.aborted and not isinstance(item.job, Prestart):
                    # Its deadline passed (or it was cancelled) while queued.
                    raise _native.NativeError(_native.Status.ABORTED, "aborted before it started")
                value = item.job(item.control)
                ok = True
            except BaseException as exc:  # delivered to the awaiting task
                value, ok = exc, False
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.notify_all()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
                item.loop.call_soon_threadsafe(item.settle, ok, value)
            del item, value

    @staticmethod
    def prestart(
        start: Callable[..., _native.StartedJob],
        translate: Callable[[_native.NativeError], BaseException | None] | None = None,
    ) -> Prestart:
        """A :class:`Prestart` job for :meth:`run`: ``start(control, nice=WORKER_NICE)``
        starts its native part (``functools.partial(_native.start_layered, ...)``)."""
        return Prestart(functools.partial(_start_at_worker_nice, start), translate)

    def submit(self, job: Job, control: _native.Control) -> asyncio.Future[Any]:
        """Queues ``job``; returns a loop future settled when it has returned.

        A :class:`Prestart` job that a worker would take at once (one is free) has its
        native part started here, on the calling thread, before the worker is woken.
        One queued behind busy workers waits for its turn as any job does (the pool
        bounds how many transfers move bytes at once); its worker starts it.
        """
        return self._post(job, control, wake=False).future

    def _post(self, job: Job, control: _native.Control, *, wake: bool) -> _Work:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if self._closed:
                raise LLMException(
                    "the transfer executor is shut down (finalize was called)",
                    status_code=LLMStatusCode.LLM_FAILED,
                )
            free = self._in_flight < len(self._threads)
            self._in_flight += 1
        if free and isinstance(job, Prestart):
            # Never raises (an error is raised by the worker); before the worker is woken,
            # which then competes with the mover for a CPU (and with this thread for the GIL).
            job.begin(control)
        work = _Work(job, control, loop, fut, wake)
        self._queue.put(work)
        return work

    async def run(
        self,
        job: Job,
        *,
        deadline: float | None,
        api: str | None = None,
        control: _native.Control | None = None,
        inline: bool = False,
    ) -> Any:
        """Runs ``job`` on a worker thread and returns its result.

        Args:
            job: blocking callable taking the job's ``Control``.
            deadline: absolute ``loop.time()`` after which the job is aborted, or None.
            api: the public API name for error messages; by default the one the facade
                set (:func:`~aiodatadist.errors.api_scope`).
            control: an existing abort/progress token, or None for a new one.
            inline: run the job on the calling (loop) thread. Only for jobs that take
                microseconds (a local copy of at most ``INLINE_MAX_BYTES``): they cannot
                be aborted, and cost less than the thread handoff.

        Raises:
            LLMTimeoutError: the deadline passed; the native job has returned by then.
            LLMException: the native job failed (status from the native status table).
            asyncio.CancelledError: the awaiting task was cancelled: the job is aborted
                and this raises the caught ``CancelledError`` itself (the first one, so
                anyio's scopes and ``asyncio.timeout`` recognise it), only after the
                native job has returned.
        """
        loop = asyncio.get_running_loop()
        if deadline is not None and loop.time() >= deadline:
            # Spent before a byte moved (a slot wait, or a budget too small to start):
            # the call's one deadline holds however fast the job would have been.
            raise failure(
                LLMStatusCode.LLM_TIMEOUT, "deadline passed before the transfer started", api=api
            )
        ctl = control if control is not None else _native.Control()
        if inline:
            # A job this small costs less than the two thread handoffs it would need.
            try:
                return job(ctl)
            except _native.NativeError as err:
                raise from_native(err, api) from err
        if deadline is not None or control is not None:
            # The job's own copy of the deadline: its movers end it there between chunks
            # even while this loop, whose timer below would abort it, does not run (a
            # given control's earlier deadline does not carry over: NO_DEADLINE_S).
            ctl.expire_in(deadline - loop.time() if deadline is not None else NO_DEADLINE_S)
        work = self._post(job, ctl, wake=True)
        expired = False

        def on_deadline() -> None:
            nonlocal expired
            expired = True
            ctl.abort()

        timer = loop.call_at(deadline, on_deadline) if deadline is not None else None
        try:
            # A cancel aborts the job and keeps waiting: the slot and the buffers stay
            # held until native code has let go of them. A job that finished in the same
            # iteration as the cancel still honours the cancel.
            await _wait_work(work, ctl.abort)
        finally:
            if timer is not None:
                timer.cancel()
        if work.ok:
            return work.value
        error = work.value
        if isinstance(error, _native.NativeError):
            if error.status == _native.Status.ABORTED and (expired or ctl.expired):
                done = (
                    f"after {ctl.bytes_done} of {ctl.total} bytes"
                    if ctl.total
                    else "(no progress reported: the transfer had not started yet, or its "
                    "engine does not report progress)"
                )
                why = f"deadline passed {done}"
                raise failure(LLMStatusCode.LLM_TIMEOUT, why, api=api) from None
            raise from_native(error, api) from error
        raise error

    async def aclose(self, timeout: float | None = 5.0) -> bool:
        """:meth:`shutdown` without blocking the loop: the wait runs on a helper thread."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()

        def wait() -> None:
            idle = self.shutdown(timeout)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, fut, True, idle)

        threading.Thread(target=wait, name="aiodatadist-shutdown", daemon=True).start()
        return await asyncio.shield(fut)

    def shutdown(self, timeout: float | None = 5.0) -> bool:
        """Stops accepting work, waits up to ``timeout`` s for running jobs, stops the threads.

        Returns True when every job had returned in time.
        """
        with self._lock:
            self._closed = True
            idle = self._idle.wait_for(lambda: self._in_flight == 0, timeout)
        for _ in self._threads:
            self._queue.put(_STOP)
        if idle:
            for t in self._threads:
                t.join(timeout)
        else:
            log.warning("executor shut down with %d job(s) still running", self._in_flight)
        return idle
