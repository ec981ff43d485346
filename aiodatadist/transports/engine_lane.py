"""What lets an engine path skip the executor for small pulls (see :mod:`.engine`).

* :class:`EngineLane`: the fast lane (:class:`~aiodatadist.transports.base.Lane`) of an
  engine whose small reads complete inside the post (NIXL over UCX's CMA, one host): a
  pull is posted on the loop thread under the lease page and has landed when it returns.
* :class:`Begun`: a small pull an engine submitted on the loop thread (Mooncake: a
  submit only queues), whose completion the executor waits for.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .. import _native
from .._caches import Region
from .._executor import ONE_SIDED_INLINE_MAX_BYTES
from .._leases import LeaseHold, holding, page_lease
from ..errors import LLMStatusCode, failure
from .base import Lane

if TYPE_CHECKING:
    from .._caches import CacheEntry
    from .._leases import LeasePage

__all__ = ["LANE_REQUESTS", "Begun", "EngineLane", "InlineRead", "lease_end"]

LANE_REQUESTS = 64
"""Engine requests an :class:`EngineLane` keeps by their exact blocks."""


class InlineRead:
    """A request made by :meth:`EngineConn.prepare_inline` (engine-specific)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    @property
    def live(self) -> bool:
        """Whether it can still be posted (the connection has not released it)."""
        return False


class LaneConn(Protocol):
    """What a lane needs of an engine connection (``engine.EngineConn``)."""

    completes_inline: bool

    def prepare_inline(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry
    ) -> InlineRead | None: ...

    def post_inline(self, req: InlineRead) -> bool: ...


class Begun(abc.ABC):
    """A transfer whose first requests were submitted on the loop thread
    (:meth:`EngineConn.begin`). Its executor job (:meth:`job`) waits for them (and submits
    the rest); when that job never runs (the call's deadline passed or it was cancelled
    while queued), :meth:`abandon` waits for them on a thread of its own instead.

    Attributes:
        on_end: called once the engine is done with the requests (``True``), or once
            abandoned ones ended (``False``): ends the lease the caller took.
        hold: the caller's lease (a :class:`~aiodatadist._leases.LeaseHold`), current
            while the job waits: requests an abort hands to a reaper keep it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claimed = False
        self.on_end: Callable[[bool], None] | None = None
        self.hold: LeaseHold | None = None

    @abc.abstractmethod
    def _wait(self, control: _native.Control) -> None:
        """Blocks until the engine is done with every request; raises as ``read``."""

    def _claim(self) -> bool:
        with self._lock:
            claimed, self._claimed = self._claimed, True
        return not claimed

    def _end(self, done: bool) -> None:
        end, self.on_end = self.on_end, None
        if end is not None:
            end(done)

    def job(self, control: _native.Control) -> None:
        """The executor job: waits for the transfer (see ``EngineConn.read``)."""
        if not self._claim():
            raise _native.NativeError(_native.Status.ABORTED, "transfer abandoned")
        try:
            with holding(self.hold) if self.hold is not None else contextlib.nullcontext():
                self._wait(control)
        finally:
            self._end(True)

    def abandon(
        self,
        local: CacheEntry,
        plan: _native.Plan,
        keep: Callable[[], Callable[[], None]] | None = None,
    ) -> None:
        """Unless :meth:`job` ran: the requests may still write the blocks of ``local``
        that ``plan`` names, which are fenced (``CacheEntry.fence``) until a thread of
        its own saw them end; the lease ends then too (``on_end``, or ``keep``'s: a
        control-plane lease's ``LeaseHold.keep``), as after an aborted NIXL request (see
        ``nixl.py``)."""
        if not self._claim():
            return
        let_go = keep() if keep is not None else None

        def end() -> None:  # once the wait, and what it handed to a reaper, are over
            self._end(False)
            if let_go is not None:
                let_go()

        hold = LeaseHold(end)
        fence = local.fence(Region.of(local.addrs, plan, "dst"))
        control = _native.Control()
        control.abort()

        def wait() -> None:
            try:
                with holding(hold):
                    self._wait(control)
            except BaseException:
                pass  # aborted, or failed: either way over
            finally:
                local.unfence(fence)
                hold.close()

        threading.Thread(target=wait, name="aiodatadist-engine-reaper", daemon=True).start()


def lease_end(hold: LeaseHold, addr: int, gen: int, remote: CacheEntry, done: bool) -> None:
    """Ends a begun transfer's lease (``hold``: :func:`~aiodatadist._leases.page_lease`,
    which keeps the page mapped until then); ``done``: the transfer ended, so its bytes
    are checked to have been read under it."""
    try:
        if done and _native.lease_gen(addr) != gen:
            raise failure(
                LLMStatusCode.LLM_FAILED,
                f"the owner revoked the lease of cache {remote.cache_id} mid-copy (it was "
                "unregistered, freed or re-registered): the bytes copied are not valid",
            )
    finally:
        hold.close()


class EngineLane(Lane):
    """The fast lane of an engine path (same host, host memory, an engine whose small
    reads complete inside the post: NIXL over UCX's CMA): a small pull is posted on the
    loop thread under the remote cache's lease page and lands before :meth:`pull`
    returns. Offered by :meth:`EnginePath.lane` only once a small read on the
    connection completed inside its post; never between hosts (a lease there is a
    control-plane round trip per transfer, which cannot be synchronous).

    The engine requests it made are kept by their exact blocks and span (at most
    :data:`LANE_REQUESTS`, the oldest dropped first): a repeated pull only posts again.
    They belong to the connection, which releases them (and the lane makes them again)
    when the peer's agent changes or the local cache goes.
    """

    max_bytes = ONE_SIDED_INLINE_MAX_BYTES

    def __init__(
        self,
        path: Any,
        conn: LaneConn,
        info: dict[str, Any],
        page: LeasePage,
        remote: CacheEntry,
        local: CacheEntry,
    ) -> None:
        assert path.fds is not None and remote.lease is not None  # (checked by lane())
        self.kind = path.agent.kind
        self.path, self.conn, self.info, self.fds = path, conn, info, path.fds
        self.page, self.remote, self.local = page, remote, local
        self._geoms = (remote.geometry, local.geometry)
        slot, self.gen = remote.lease
        self.addr = page.addr(slot)  # (bounds-checked)
        self._reqs: dict[tuple[Any, ...], InlineRead] = {}

    def usable(self) -> bool:
        path, fds = self.path, self.fds
        return (
            path._conn is self.conn
            and self.conn.completes_inline
            and path._seen is self.info
            and path.peer.info.engines.get(self.kind.value) is self.info  # no news since
            and path.fds is fds
            and not fds.closed
            and fds.page is self.page
            and not self.page.closed
        )

    def _prepare(
        self, key: tuple[Any, ...], src: list[int], dst: list[int], span: tuple[int, int, int]
    ) -> InlineRead | None:
        try:
            plan = _native.Plan.blocks(*self._geoms, src, dst, *span)
        except (_native.NativeError, TypeError, OverflowError, ValueError):
            return None  # the whole path's checks say what is wrong
        if not plan.num_segments or plan.total_bytes > self.max_bytes:
            return None
        req = self.conn.prepare_inline(plan, self.remote, self.local)
        if req is not None:
            if len(self._reqs) >= LANE_REQUESTS:
                del self._reqs[next(iter(self._reqs))]
            self._reqs[key] = req
        return req

    def pull(
        self,
        src_blocks: list[int],
        dst_blocks: list[int],
        span: tuple[int, int, int],
        deadline: float | None = None,
    ) -> int:
        key = (tuple(src_blocks), tuple(dst_blocks), span)
        req = self._reqs.get(key)
        if req is None or not req.live:
            req = self._prepare(key, src_blocks, dst_blocks, span)
            if req is None:
                return 0
        addr, gen = self.addr, self.gen
        if self.page.closed or not _native.lease_enter(addr, gen):
            return 0  # re-registered or freed: nothing moved (the whole path refreshes)
        try:
            hold = page_lease(self.page, addr)  # (kept by a request that goes to a reaper)
        except BaseException:
            _native.lease_exit(addr)
            raise
        try:
            with holding(hold):
                if not self.conn.post_inline(req):
                    return 0
            if _native.lease_gen(addr) != gen:
                raise failure(
                    LLMStatusCode.LLM_FAILED,
                    f"the owner revoked the lease of cache {self.remote.cache_id} mid-copy "
                    "(it was unregistered, freed or re-registered): the bytes copied are "
                    "not valid",
                )
            return req.nbytes
        finally:
            hold.close()

    def close(self) -> None:
        self._reqs.clear()  # (the connection owns and releases the requests)
