"""The interface every data path implements.

A :class:`Path` is the data path of one link. It moves the bytes of a
validated :class:`~aiodatadist._native.Plan` between a local cache and a
peer's cache, and nothing else: validation, deadlines, per-link ordering and
error mapping live above it. Blocking work goes through :meth:`Call.run`, which
runs it on the instance's dedicated executor under the call's deadline.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _native

if TYPE_CHECKING:
    from .._caches import CacheEntry, CacheTable
    from .._executor import TransferExecutor
    from ..config import DataPath

__all__ = ["Call", "Path", "local_copy"]


@dataclass
class Call:
    """One public call's budget: its API name, deadline and executor."""

    api: str
    deadline: float | None
    executor: TransferExecutor
    mover_threads: int = 2

    async def run(self, job: Callable[[_native.Control], Any], *, local_bytes: int = -1) -> Any:
        """Runs a blocking native job under this call's deadline (see TransferExecutor.run).

        ``local_bytes``: the size of a local (memcpy) job; one of at most
        ``INLINE_MAX_BYTES`` runs inline on the loop thread.
        """
        from .._executor import INLINE_MAX_BYTES

        inline = 0 <= local_bytes <= INLINE_MAX_BYTES
        return await self.executor.run(job, deadline=self.deadline, api=self.api, inline=inline)


class Path(abc.ABC):
    """The data path of one link.

    Attributes:
        kinds: the :class:`~aiodatadist.config.DataPath` values this path can move
            bytes over, in the order it prefers them (one, except for the cross-process
            selector, which picks per transfer).
    """

    kinds: tuple[DataPath, ...] = ()

    @property
    @abc.abstractmethod
    def remote_table(self) -> CacheTable:
        """The peer's registered caches, as fresh as this path can tell."""

    @abc.abstractmethod
    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        """Copies the plan's bytes from the peer's ``remote`` into ``local``.

        Returns only once every byte has landed; raises otherwise.
        """

    @abc.abstractmethod
    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        """Copies the plan's bytes from ``local`` into the peer's ``remote``."""

    async def refresh(self, deadline: float | None) -> bool:
        """Brings :attr:`remote_table` up to date; False when it always is."""
        return False

    def table_changed(self) -> None:  # noqa: B027 - optional hook
        """Our cache table changed: a path to another process tells the peer."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Releases what the path holds (connections, mappings)."""


def local_copy(
    plan: _native.Plan, src: list[int], dst: list[int], threads: int, control: _native.Control
) -> None:
    """The job of the one-address-space paths (``inproc``, ``shm``): native memcpy."""
    _native.copy_local(plan, src, dst, control, threads)
