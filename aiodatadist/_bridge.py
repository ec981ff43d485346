"""The thread bridge: instance coroutines awaited on a foreign loop run on their own loop."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, Protocol, TypeVar, cast, overload

from ._executor import quiesce
from .errors import API_CONTEXT

__all__ = ["bridged", "note_home", "public"]

log = logging.getLogger("aiodatadist.bridge")

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])


# The process each home loop belongs to (by id: loops live as long as their instances),
# so a call on an instance made before a fork fails at once in the child instead of
# waiting forever for a loop whose thread stayed in the parent.
_HOME_PIDS: dict[int, int] = {}
_PID = [os.getpid()]


def _after_fork_in_child() -> None:
    _PID[0] = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def note_home(loop: asyncio.AbstractEventLoop) -> None:
    """Records that ``loop`` is a home loop of this process (``LLMDataDist.init``)."""
    _HOME_PIDS[id(loop)] = _PID[0]


class _HasHomeLoop(Protocol):
    def _home_loop(self) -> asyncio.AbstractEventLoop | None: ...


@overload
def bridged(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]: ...
@overload
def bridged(
    *, on_abandoned: Callable[[R], Awaitable[None]]
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]: ...
def bridged(
    fn: Callable[P, Coroutine[Any, Any, R]] | None = None,
    *,
    on_abandoned: Callable[[R], Awaitable[None]] | None = None,
) -> Any:
    """Runs a method coroutine on its instance's home loop when awaited from another loop.

    The instance (first argument) has ``_home_loop()``: the loop ``init`` ran on, or None
    before ``init``. A cancel on the awaiting side cancels the call on the home loop,
    whose own cleanup rules apply, and ``CancelledError`` (the one the awaiting side
    caught) reaches the awaiting side only once the home-side call has finished (so a
    cancelled transfer's native job has returned by then, as on the home loop).

    Use as ``@bridged`` or ``@bridged(on_abandoned=stop)``. ``stop(result)`` is for a
    result that owns something running (a ``CacheTask``'s pipeline): when the awaiting
    side was cancelled but the home side had already produced the result, nobody would
    ever get it, so ``stop`` runs on the home loop (and is awaited) before the cancel
    propagates.

    Raises:
        RuntimeError: the home loop is closed or no longer running.
        asyncio.CancelledError: the awaiting side was cancelled; after the home-side call
            (and ``on_abandoned`` of its result) finished.
    """

    def decorate(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            owner: _HasHomeLoop = args[0]  # type: ignore[assignment]
            home = owner._home_loop()
            running = asyncio.get_running_loop()
            if home is None or home is running:
                return await fn(*args, **kwargs)
            if _HOME_PIDS.get(id(home), _PID[0]) != _PID[0]:
                # Its loop and threads stayed in the parent: nothing would ever run it.
                raise RuntimeError(
                    f"{fn.__name__}: this LLMDataDist was created before a fork; it is not "
                    "usable in the child process (create a new instance there)"
                )
            if home.is_closed() or not home.is_running():
                raise RuntimeError(
                    f"{fn.__name__}: this LLMDataDist belongs to an event loop that is not "
                    "running any more; create and init instances on the loop that uses them"
                )
            return await _call_on(home, lambda: fn(*args, **kwargs), on_abandoned)

        return wrapper

    return decorate if fn is None else decorate(fn)


async def _call_on(
    home: asyncio.AbstractEventLoop,
    make: Callable[[], Coroutine[Any, Any, R]],
    on_abandoned: Callable[[R], Awaitable[None]] | None,
) -> R:
    home_task: asyncio.Task[R] | None = None
    abandoned = False

    async def on_home() -> R:
        nonlocal home_task
        if abandoned:  # cancelled before it started: it never runs
            raise asyncio.CancelledError
        home_task = asyncio.current_task()
        return await make()

    fut = asyncio.run_coroutine_threadsafe(on_home(), home)
    waiter = asyncio.wrap_future(fut)
    try:
        return await asyncio.shield(waiter)
    except asyncio.CancelledError as exc:
        cancelled = exc
    # Cancelling ``fut`` itself would settle it at once, before the home-side call has
    # cleaned up (or even while it runs: its result would be lost): cancel the home
    # task instead, on the home loop, and wait for it to end. ``cancel_home`` and the
    # first step of ``on_home`` both run on the home loop, one after the other: either
    # the call never starts, or it is cancelled (and its result, if it still produced
    # one, goes to ``on_abandoned``).

    def cancel_home() -> None:
        nonlocal abandoned
        abandoned = True
        if home_task is not None:
            home_task.cancel()

    try:
        home.call_soon_threadsafe(cancel_home)
    except RuntimeError:  # the home loop is closed: nothing runs there any more
        raise cancelled from None
    try:
        await quiesce(waiter, cancelled=cancelled)
    finally:
        # Reached with the cancel on its way out. A call that had already finished
        # with a result (the cancel came too late to stop it) leaves that result to
        # nobody: whatever it started is stopped before the cancel propagates.
        if on_abandoned is not None and not waiter.cancelled() and waiter.exception() is None:
            stop = _stop(on_abandoned, waiter.result())
            try:
                stopping = asyncio.run_coroutine_threadsafe(stop, home)
            except RuntimeError:  # the home loop closed meanwhile: nothing runs there
                stop.close()
            else:
                await quiesce(asyncio.wrap_future(stopping), cancelled=cancelled)
    raise cancelled  # not reached: quiesce raised it


async def _stop(on_abandoned: Callable[[R], Awaitable[None]], result: R) -> None:
    try:
        await on_abandoned(result)
    except Exception:
        log.exception("stopping what an abandoned cross-loop call started failed")


def public(
    name: str, *, on_abandoned: Callable[[Any], Awaitable[None]] | None = None
) -> Callable[[F], F]:
    """Marks a public call of the facade: ``name`` goes into every error raised inside
    (:data:`aiodatadist.errors.API_CONTEXT`), once, here; a coroutine is also
    :func:`bridged` (run on the instance's home loop when awaited from another loop).
    The decorated function keeps its signature.
    """

    def decorate(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def scoped(*args: Any, **kwargs: Any) -> Any:
                token = API_CONTEXT.set(name)
                try:
                    return await fn(*args, **kwargs)
                finally:
                    API_CONTEXT.reset(token)

            if on_abandoned is None:
                across = bridged(scoped)
            else:
                across = bridged(on_abandoned=on_abandoned)(scoped)

            @functools.wraps(fn)
            async def entry(*args: Any, **kwargs: Any) -> Any:
                owner: _HasHomeLoop = args[0]
                home = owner._home_loop()
                if home is not None and home is not asyncio.get_running_loop():
                    return await across(*args, **kwargs)
                # On the home loop (the common case): one frame, no bridge.
                token = API_CONTEXT.set(name)
                try:
                    return await fn(*args, **kwargs)
                finally:
                    API_CONTEXT.reset(token)

            return cast(F, entry)

        @functools.wraps(fn)
        def scoped_sync(*args: Any, **kwargs: Any) -> Any:
            token = API_CONTEXT.set(name)
            try:
                return fn(*args, **kwargs)
            finally:
                API_CONTEXT.reset(token)

        return cast(F, scoped_sync)

    return decorate
