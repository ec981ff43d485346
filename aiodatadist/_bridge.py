"""The thread bridge: instance coroutines awaited on a foreign loop run on their own loop."""

from __future__ import annotations

import asyncio
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
    before ``init``. A cancel on the awaiting side cancels the call on the home loop
    (``run_coroutine_threadsafe`` chains cancellation), whose own cleanup rules apply.

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
        fut = asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), home)
        return await asyncio.wrap_future(fut)

    return wrapper
