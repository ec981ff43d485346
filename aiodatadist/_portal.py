"""The portal: one event loop thread, owned by the library, that runs every blocking call.

:mod:`aiodatadist.sync` is a thin layer over the async API: each of its calls hands
``fn(*args, **kwargs)`` to :meth:`Portal.call`, which runs it on the portal loop (a
daemon thread named ``aiodatadist-portal``, started on first use) and blocks the caller
(GIL released) until it is done. A coroutine ``fn`` returns is awaited there as a task.
The result, or the exception with its original type, comes back to the caller's thread.

The hand-off is lean on purpose (a sync tiny pull must cost at most 50 us more than an
async one): one ``call_soon_threadsafe`` to the portal and one lock released by the
portal, no ``concurrent.futures.Future`` in between.

Interrupts: an exception raised in the caller's thread while it waits (``KeyboardInterrupt``,
a test timeout's signal) cancels the call on the portal with the async API's cancel
semantics (a transfer's native job is aborted and awaited), waits for it to end, and
then propagates.

Kinds: the loop is plain asyncio unless ``AIODATADIST_PORTAL_LOOP=uvloop`` is set when the
portal starts, or :func:`set_portal_loop` chose one before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Awaitable, Callable, Coroutine
from types import CoroutineType
from typing import Any

__all__ = ["PORTAL_THREAD_NAME", "Portal", "portal", "set_portal_loop"]

log = logging.getLogger("aiodatadist.sync")

PORTAL_THREAD_NAME = "aiodatadist-portal"
ENV_PORTAL_LOOP = "AIODATADIST_PORTAL_LOOP"
_KINDS = ("asyncio", "uvloop")
# Python >= 3.12 runs a task's first step at creation (one loop iteration less per call).
_EAGER = sys.version_info >= (3, 12)
# How long stopping the portal waits for its thread (a daemon: exit never hangs on it).
_JOIN_TIMEOUT_S = 5.0


def _check_kind(kind: object) -> str:
    if not isinstance(kind, str):
        raise TypeError(f"the portal loop kind must be a str, got {type(kind).__name__}")
    if kind not in _KINDS:
        raise ValueError(f"the portal loop kind must be 'asyncio' or 'uvloop', got {kind!r}")
    return kind


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop  # optional: only when asked for

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()


class _Call:
    """One blocking call in flight: the caller waits on ``lock``, the portal releases it."""

    __slots__ = ("done", "exc", "lock", "result", "task")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.result: Any = None
        self.exc: BaseException | None = None
        self.task: asyncio.Task[None] | None = None
        self.done = False

    def finish(self) -> None:
        self.done = True
        self.lock.release()


class Portal:
    """One event loop in one daemon thread; :meth:`call` runs a function on it, blocking.

    Thread-safe. Started on the first :meth:`call` (or :meth:`loop`); stopped by
    :meth:`stop` (at interpreter exit, through :mod:`aiodatadist.sync`), after which every
    call raises ``RuntimeError``.
    """

    def __init__(self, kind: str | None = None) -> None:
        self._kind = kind
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._start_lock = threading.Lock()
        self._stopped = False

    # ------------------------------------------------------------------ state

    @property
    def kind(self) -> str:
        """``asyncio`` or ``uvloop``: the kind the portal runs (or will run when it starts)."""
        if self._kind is not None:
            return self._kind
        return _check_kind(os.environ.get(ENV_PORTAL_LOOP, "asyncio") or "asyncio")

    def set_kind(self, kind: str) -> None:
        """Chooses the loop kind; only before the portal started.

        Raises:
            TypeError, ValueError: not ``asyncio`` or ``uvloop``.
            RuntimeError: the portal already started.
        """
        kind = _check_kind(kind)
        with self._start_lock:
            if self._loop is not None or self._stopped:
                raise RuntimeError(
                    "the aiodatadist portal loop already started; choose its kind before "
                    "the first aiodatadist.sync call"
                )
            self._kind = kind

    @property
    def started(self) -> bool:
        return self._loop is not None

    @property
    def stopped(self) -> bool:
        return self._stopped

    def in_portal_thread(self) -> bool:
        return self._ident is not None and threading.get_ident() == self._ident

    def loop(self) -> asyncio.AbstractEventLoop:
        """The portal loop, started now if it is not yet running.

        Raises:
            RuntimeError: the portal was stopped (interpreter exit).
        """
        loop = self._loop
        if loop is not None and not self._stopped:
            return loop
        with self._start_lock:
            if self._stopped:
                raise RuntimeError(
                    "the aiodatadist portal is shut down (interpreter exit); no sync call "
                    "can run any more"
                )
            if self._loop is None:
                self._start()
            assert self._loop is not None
            return self._loop

    def _start(self) -> None:
        kind = self.kind
        loop = _new_loop(kind)
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            self._ident = threading.get_ident()
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                self._close_loop(loop)

        thread = threading.Thread(target=run, name=PORTAL_THREAD_NAME, daemon=True)
        thread.start()
        ready.wait()
        self._thread = thread
        self._loop = loop
        log.debug("portal started (%s)", kind)

    @staticmethod
    def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
        # Whatever is left (nothing, once every instance was finalized) is cancelled.
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            with contextlib.suppress(BaseException):
                loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
        with contextlib.suppress(BaseException):
            loop.run_until_complete(loop.shutdown_asyncgens())
        # uvloop's close() warns about transports left open from inside libuv; a warning
        # raised there (warnings as errors) would leave close() waiting forever.
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            loop.close()

    def stop(self, timeout: float = _JOIN_TIMEOUT_S, *, final: bool = True) -> None:
        """Stops the loop and joins its thread (at most ``timeout`` s; it is a daemon).

        ``final=False`` (tests only) lets a later call start a new portal.
        """
        with self._start_lock:
            loop, thread = self._loop, self._thread
            self._stopped = True
            self._loop = self._thread = None
        if loop is not None and thread is not None:
            with contextlib.suppress(RuntimeError):  # closed already
                loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
            if thread.is_alive():
                log.warning("the aiodatadist portal thread did not stop within %.1f s", timeout)
        self._ident = None
        if not final:
            with self._start_lock:
                self._stopped = False

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's portal thread does not exist here. Forget it
        (a call would otherwise wait forever for a loop nobody runs); the next call starts
        the child's own portal. Instances made before the fork are not usable (as upstream)."""
        if self._loop is not None:
            _orphans.append(self._loop)  # never closed here: it shares the parent's state
        self._loop = None
        self._thread = None
        self._ident = None
        self._start_lock = threading.Lock()
        self._stopped = False

    # ------------------------------------------------------------------ calls

    def call(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        on_abandoned: Callable[[Any], Awaitable[None]] | None = None,
    ) -> Any:
        """Runs ``fn(*args, **kwargs)`` on the portal (awaiting what it returns if that is
        awaitable) and returns its result, or raises its exception, in this thread.

        ``on_abandoned(result)`` runs on the portal (awaited) when this thread was
        interrupted but the call had already produced a result nobody will get (a
        ``CacheTask`` whose pipeline must then be stopped).

        Raises:
            RuntimeError: called from the portal thread itself (it would wait for itself
                forever), or the portal was shut down.
            BaseException: what the call raised, or what interrupted this thread's wait
                (the call was cancelled on the portal and has ended).
        """
        if self._ident is not None and threading.get_ident() == self._ident:
            raise RuntimeError(
                f"{getattr(fn, '__name__', 'this call')}: a blocking aiodatadist.sync call "
                "cannot run on the portal thread (it would wait for itself); await the "
                "async API (the .aio object) there instead"
            )
        loop = self._loop  # read once: stop() may clear it meanwhile
        if loop is None or self._stopped:
            loop = self.loop()
        c = _Call()
        try:
            loop.call_soon_threadsafe(self._begin, loop, c, fn, args, kwargs)
        except RuntimeError:  # closed between the check and the hand-off
            raise RuntimeError(
                "the aiodatadist portal is shut down; no sync call can run"
            ) from None
        try:
            c.lock.acquire()
        except BaseException:
            self._interrupted(loop, c, on_abandoned)
            raise
        exc = c.exc
        if exc is not None:
            c.exc = None  # no cycle through the traceback
            try:
                raise exc
            finally:
                del exc
        return c.result

    @staticmethod
    def _begin(
        loop: asyncio.AbstractEventLoop,
        c: _Call,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
    ) -> None:
        try:
            r = fn(*args, **kwargs) if kwargs else fn(*args)
        except BaseException as e:
            c.exc = e
            c.finish()
            return
        if type(r) is CoroutineType or asyncio.isfuture(r) or hasattr(r, "__await__"):
            if _EAGER:  # a call that never suspends (a tiny inline pull) ends right here
                c.task = asyncio.Task(_await(c, r), loop=loop, eager_start=True)  # type: ignore[call-arg,unused-ignore]
            else:
                c.task = loop.create_task(_await(c, r))
            return
        c.result = r
        c.finish()

    def _interrupted(
        self,
        loop: asyncio.AbstractEventLoop,
        c: _Call,
        on_abandoned: Callable[[Any], Awaitable[None]] | None,
    ) -> None:
        """The caller's wait was interrupted: cancel the call on the portal, wait for it."""

        def cancel() -> None:
            # FIFO with _begin: the call has started (its task exists) or already ended.
            if c.task is not None and not c.task.done():
                c.task.cancel()

        with contextlib.suppress(RuntimeError):  # the loop closed: nothing runs there
            loop.call_soon_threadsafe(cancel)
            # A second interrupt here propagates (the cancel goes on, on the portal).
            c.lock.acquire()
            if on_abandoned is not None and c.exc is None and c.result is not None:
                result, c.result = c.result, None
                self.call(on_abandoned, (result,))
        c.exc = None


async def _await(c: _Call, aw: Awaitable[Any] | Coroutine[Any, Any, Any]) -> None:
    try:
        c.result = await aw
    except BaseException as e:  # CancelledError included: the caller asked for it
        c.exc = e
    finally:
        c.finish()


portal = Portal()
"""The process's one portal."""

# Loops inherited from a parent process through fork: kept, never used or closed.
_orphans: list[asyncio.AbstractEventLoop] = []

os.register_at_fork(after_in_child=portal._forget_after_fork)


def set_portal_loop(kind: str) -> None:
    """Chooses the portal's event loop, ``"asyncio"`` (default) or ``"uvloop"``, before the
    first :mod:`aiodatadist.sync` call (``AIODATADIST_PORTAL_LOOP`` does the same).

    Raises:
        TypeError, ValueError: an unknown kind.
        RuntimeError: the portal already started.
    """
    portal.set_kind(kind)
