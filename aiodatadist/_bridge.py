"""The thread bridge: instance coroutines awaited on a foreign loop run on their own loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, Protocol, TypeVar

__all__ = ["bridged"]

P = ParamSpec("P")
R = TypeVar("R")


class _HasHomeLoop(Protocol):
    def _home_loop(self) -> asyncio.AbstractEventLoop | None: ...


def bridged(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Runs a method coroutine on its instance's home loop when awaited from another loop.

    The instance (first argument) has ``_home_loop()``: the loop ``init`` ran on, or None
    before ``init``. A cancel on the awaiting side cancels the call on the home loop,
    whose own cleanup rules apply, and ``CancelledError`` reaches the awaiting side only
    once the home-side call has finished (so a cancelled transfer's native job has
    returned by then, as on the home loop).

    Raises:
        RuntimeError: the home loop is closed or no longer running.
    """

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        owner: _HasHomeLoop = args[0]  # type: ignore[assignment]
        home = owner._home_loop()
        running = asyncio.get_running_loop()
        if home is None or home is running:
            return await fn(*args, **kwargs)
        if home.is_closed() or not home.is_running():
            raise RuntimeError(
                f"{fn.__name__}: this LLMDataDist belongs to an event loop that is not running "
                "any more; create and init instances on the loop that uses them"
            )
        home_task: asyncio.Task[R] | None = None

        async def on_home() -> R:
            nonlocal home_task
            home_task = asyncio.current_task()
            return await fn(*args, **kwargs)

        fut = asyncio.run_coroutine_threadsafe(on_home(), home)
        waiter = asyncio.wrap_future(fut)
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            # Cancelling ``fut`` itself would settle it at once, before the home-side
            # call has cleaned up: cancel the home task instead and wait for it to end.
            def cancel_home() -> None:
                if home_task is not None:
                    home_task.cancel()
                else:
                    fut.cancel()  # not started yet: it will never run

            try:
                home.call_soon_threadsafe(cancel_home)
            except RuntimeError:  # the home loop is closed: nothing runs there any more
                raise asyncio.CancelledError() from None
            while not waiter.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({waiter})
            raise

    return wrapper
