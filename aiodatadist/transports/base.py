"""The interface every data path implements.

A :class:`Path` is the data path of one link. It moves the bytes of a
validated :class:`~aiodatadist._native.Plan` between a local cache and a
peer's cache, and nothing else: validation, deadlines, per-link ordering and
error mapping live above it. Blocking work goes through :meth:`Call.run`, which
runs it on the instance's dedicated executor under the call's deadline.
"""

from __future__ import annotations

import abc
import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _native
from .._executor import INLINE_MAX_BYTES, INLINE_YIELD_S
from ..errors import LLMStatusCode, failure

if TYPE_CHECKING:
    from .._caches import CacheEntry, CacheTable
    from .._executor import TransferExecutor
    from ..config import DataPath

__all__ = ["Call", "LayerCut", "Path", "local_copy"]


@dataclass
class Call:
    """One public call's budget: its API name, deadline and executor."""

    api: str
    deadline: float | None
    executor: TransferExecutor
    mover_threads: int = 2

    async def run(
        self,
        job: Callable[[_native.Control], Any],
        *,
        local_bytes: int = -1,
        inline_max: int = INLINE_MAX_BYTES,
        fair: bool = False,
    ) -> Any:
        """Runs a blocking native job under this call's deadline (see TransferExecutor.run).

        ``local_bytes``: the size of a job that neither waits on a socket nor on another
        process (a memcpy, a ``process_vm_readv``); one of at most ``inline_max`` bytes
        runs inline on the loop thread (``INLINE_MAX_BYTES`` for in-process copies,
        ``ONE_SIDED_INLINE_MAX_BYTES`` for the one-sided cross-process paths).
        ``fair``: an inline job first yields to the loop when the last such yield is
        ``INLINE_YIELD_S`` old: a caller's loop of tiny pulls (which never suspends)
        then cannot starve the loop's other tasks (the link's messages, the peer's
        replies, timers) for longer than that, and pays one loop iteration per
        millisecond instead of one per pull. A cancel there moves nothing.
        """
        inline = 0 <= local_bytes <= inline_max
        if inline and fair:
            now = time.monotonic()
            if now >= self.executor.yield_due:
                self.executor.yield_due = now + INLINE_YIELD_S
                await asyncio.sleep(0)
        return await self.executor.run(job, deadline=self.deadline, api=self.api, inline=inline)


@dataclass(frozen=True, slots=True)
class LayerCut:
    """How a layered pull (:meth:`Path.pull_layers`) is cut into layers and signalled.

    Layer ``k`` is the plan's segments writing destination tensors ``first_tensor +
    k * tensors`` to ``+ tensors`` (the plans of ``pull_blocks`` list their segments
    tensor by tensor, so each layer is a run of consecutive segments).

    Attributes:
        fd: an eventfd; 1 is added to it once each layer has landed in full, in order.
        first_tensor: the first destination tensor of layer 0.
        tensors: destination tensors per layer.
        count: the number of layers.
    """

    fd: int
    first_tensor: int
    tensors: int
    count: int

    def bounds(self, plan: _native.Plan) -> list[int]:
        """Each layer's end, as an index into ``plan``'s segments (the last: their count).

        Raises:
            LLMException: LLM_FAILED, the plan's segments are not cut that way (a bug).
        """
        try:
            return plan.layer_bounds(self.first_tensor, self.tensors, self.count)
        except _native.NativeError as e:
            raise failure(
                LLMStatusCode.LLM_FAILED,
                f"the plan's segments do not cut into {self.count} layers of {self.tensors} "
                f"tensors from tensor {self.first_tensor} ({e})",
            ) from e

    def plans(self, plan: _native.Plan) -> list[_native.Plan]:
        """``plan`` as one plan per layer, in order."""
        segs = plan.segments()
        out, start = [], 0
        for end in self.bounds(plan):
            out.append(_native.Plan.from_segments(plan.src, plan.dst, segs[start:end]))
            start = end
        return out

    def signal(self) -> None:
        """One more layer landed (from the loop thread; native jobs write the fd)."""
        os.eventfd_write(self.fd, 1)


class Path(abc.ABC):
    """The data path of one link.

    Attributes:
        kinds: the :class:`~aiodatadist.config.DataPath` values this path can move
            bytes over, in the order it prefers them (one, except for the cross-process
            selector, which picks per transfer).
    """

    kinds: tuple[DataPath, ...] = ()
    used: DataPath | None = None
    """The data path that moved the last transfer's bytes (for metrics; None: ``kinds[0]``).
    The cross-process selector sets it per transfer."""

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

    async def pull_layers(
        self,
        plan: _native.Plan,
        remote: CacheEntry,
        local: CacheEntry,
        call: Call,
        cut: LayerCut,
    ) -> None:
        """:meth:`pull`, signalling each layer of ``cut`` once its bytes have all landed.

        One transfer (the caller holds the link's slot and both caches throughout);
        layers land in order and each is signalled on ``cut.fd``. This default pulls the
        layers one after another (one :meth:`pull` each); the one-sided paths override
        it with one native job over the whole plan. Returns once every layer landed;
        raises otherwise (the layers signalled before are valid).
        """
        for part in cut.plans(plan):
            await self.pull(part, remote, local, call)
            cut.signal()

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
