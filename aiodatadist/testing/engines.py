"""Whether a transfer engine (NIXL, Mooncake) can run here: one answer for every test."""

from __future__ import annotations

import functools

from ..transports.engine import engine_problem

__all__ = ["engine_unavailable"]


@functools.cache
def engine_unavailable(name: str) -> str | None:
    """Why engine ``name`` (``"nixl"``, ``"mooncake"``) cannot run here, None when it can.

    Tests skip with this reason (it names the command that installs what is missing).
    The answer is computed once per process (the check imports the engine in a child).
    """
    return engine_problem(name)
