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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _native
from .._executor import INLINE_MAX_BYTES, INLINE_YIELD_S, ONE_SIDED_INLINE_MAX_BYTES
from ..errors import LLMException, LLMStatusCode, failure, from_native

if TYPE_CHECKING:
    from .._caches import CacheEntry, CacheTable
    from .._executor import TransferExecutor
    from ..config import DataPath

__all__ = ["Call", "CopyLane", "LayerCut", "Lane", "Path", "local_copy"]


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

    def signal(self, layers: int = 1) -> None:
        """``layers`` more layers landed (from the loop thread; native jobs write the fd)."""
        os.eventfd_write(self.fd, layers)


class Lane(abc.ABC):
    """A path's fast lane for small pulls from one remote cache into one local cache.

    The runner keeps a lane per (link, remote cache, local cache) once a pull between
    them went through the whole path (:func:`aiodatadist._runner.run`), and hands it the
    next small pulls while nothing else can be in the way: the link's slot is free and
    nobody waits for it, both caches are live and unfenced, the peer's table has not
    changed, no tracer runs. The lane then moves the bytes **synchronously, on the loop
    thread**, with no await: no slot to queue for, no executor handoff, no wake-up. The
    paths whose small transfers cannot wait on anything (a one-sided copy, an engine
    post that completes at once) offer one; so does ``tcp``, whose lane asks at once and
    takes an answer that comes within a short spin, else hands back an awaitable of the
    rest (its caller then holds the link's slot until it is in).

    Attributes:
        kind: the data path it moves bytes over (metrics).
        max_bytes: the largest plan it takes (``plan.total_bytes``).
    """

    kind: DataPath
    max_bytes: int

    @abc.abstractmethod
    def usable(self) -> bool:
        """Whether the lane can still run (its mappings, lease page, channel are up)."""

    @abc.abstractmethod
    def pull(
        self,
        src_blocks: list[int],
        dst_blocks: list[int],
        span: tuple[int, int, int],
        deadline: float | None = None,
    ) -> int | Awaitable[int]:
        """Moves blocks now, on the calling (loop) thread, GIL released while bytes move.

        Args:
            src_blocks, dst_blocks: lists of ``int`` (block ``src_blocks[i]`` of every
                selected remote tensor lands in block ``dst_blocks[i]``); not checked yet.
            span: (first remote tensor, first local tensor, tensor count), as
                :func:`~aiodatadist._plan.tensor_span` gives them.

            deadline: the call's deadline (loop time); only a lane that may have to wait
                for its peer (``tcp``) uses it.

        Returns:
            The bytes that landed (all of them); 0 when the lane did not take the pull
            and moved nothing (a block out of range or repeated, more than ``max_bytes``,
            a stale lease): the caller takes the whole path, which says what is wrong.
            A lane whose answer is not back yet (``tcp``) returns an awaitable of the
            same, which the caller awaits at once holding the link's slot.

        Raises:
            LLMException: bytes may have moved and the transfer failed (the peer died,
                the owner revoked the lease mid-copy): the destination blocks are
                undefined, as after any failed pull.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases what the lane holds (its path forgot it)."""


class CopyLane(Lane):
    """The lane of the one-sided paths: one native :class:`~aiodatadist._native.LaneCopy`
    (``process_vm_readv`` from the peer, or a memcpy from memory mapped here) under the
    remote cache's lease, at most ``ONE_SIDED_INLINE_MAX_BYTES`` (the inline bound).

    Args:
        kind: the data path (metrics).
        copy: the native copy: geometries, address lists, lease slot and bound fixed.
        alive: whether the lane may still run (its mappings and lease page are up).
        cache_id: the remote cache (messages).
        keep: objects that must stay alive while the lane can run (the mappings its
            addresses point into).
        holds: caches held while a copy runs (an in-process peer's cache).
        max_bytes: the largest pull it takes (the inline bound of its kind of copy:
            ``ONE_SIDED_INLINE_MAX_BYTES`` across processes, ``INLINE_MAX_BYTES`` in one);
            ``copy`` must have been made with the same bound.
    """

    def __init__(
        self,
        kind: DataPath,
        copy: _native.LaneCopy,
        alive: Callable[[], bool],
        cache_id: int,
        keep: tuple[Any, ...] = (),
        holds: tuple[CacheEntry, ...] = (),
        max_bytes: int = ONE_SIDED_INLINE_MAX_BYTES,
    ) -> None:
        self.kind = kind
        self.max_bytes = max_bytes
        self._copy = copy
        self.usable = alive  # type: ignore[method-assign]  # (one call less per pull)
        self._cache_id = cache_id
        self._keep = keep
        self._holds = holds

    def usable(self) -> bool:  # replaced per instance by ``alive``
        raise NotImplementedError

    def pull(
        self,
        src_blocks: list[int],
        dst_blocks: list[int],
        span: tuple[int, int, int],
        deadline: float | None = None,
    ) -> int:
        holds = self._holds
        if holds:
            return self._pull_held(src_blocks, dst_blocks, span)
        try:
            n = self._copy.pull(src_blocks, dst_blocks, *span)
        except _native.NativeError as e:
            raise from_native(e) from e
        except (TypeError, OverflowError):
            return 0  # an id the native side cannot take: the whole path's checks say why
        return n if n >= 0 else self._refused(n)

    def _pull_held(
        self, src_blocks: list[int], dst_blocks: list[int], span: tuple[int, int, int]
    ) -> int:
        held: list[CacheEntry] = []
        try:
            for entry in self._holds:
                if entry.freed:
                    return 0
                try:
                    entry.hold()
                except LLMException:  # freed meanwhile, from another thread: nothing moved
                    return 0
                held.append(entry)
            try:
                n = self._copy.pull(src_blocks, dst_blocks, *span)
            except _native.NativeError as e:
                raise from_native(e) from e
            except (TypeError, OverflowError):
                return 0
        finally:
            for entry in held:
                entry.release()
        return n if n >= 0 else self._refused(n)

    def _refused(self, code: int) -> int:
        if code != LANE_REVOKED:
            return 0  # declined, or the lease was stale before a byte moved
        raise failure(
            LLMStatusCode.LLM_FAILED,
            f"the owner revoked the lease of cache {self._cache_id} mid-copy (it was "
            "unregistered, freed or re-registered): the bytes copied are not valid",
        )


LANE_REVOKED = -3
"""``LaneCopy.pull``: the lease was revoked while the bytes moved (ext/core.hpp)."""


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

    async def pull_at_once(
        self,
        plan: _native.Plan,
        remote: CacheEntry,
        local: CacheEntry,
        call: Call,
        cut: LayerCut,
    ) -> None:
        """A layered pull too small to gain from streaming: one :meth:`pull` of the whole
        plan, then every layer signalled.

        The paths take it below the size their :meth:`pull` moves without a thread
        handoff (an inline copy, a ``tcp`` request-stream pull): there the whole lands
        sooner than a layered job's first layer would (its mover thread's start, a
        signal and the loop's wake-up per layer cost more than the bytes), and a stream
        of small layers would only add that cost to every layer.
        """
        await self.pull(plan, remote, local, call)
        cut.signal(cut.count)

    def lane(self, remote: CacheEntry, local: CacheEntry) -> Lane | None:
        """A :class:`Lane` for small pulls from ``remote`` into ``local`` over the path
        the last transfer between them took, or None (the default: no fast lane)."""
        return None

    async def refresh(self, deadline: float | None) -> bool:
        """Brings :attr:`remote_table` up to date (True); False when it always is.

        Raises:
            LLMTimeoutError: the deadline passed before the peer answered.
        """
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
