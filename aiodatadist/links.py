"""The link registry: one :class:`Link` per remote cluster.

Every operation that moves bytes over a link (``pull_blocks``, ``pull_cache``,
each layer of ``transfer_cache_async``) and ``unlink_clusters`` takes the
link's FIFO slot first, so upstream's rule "not concurrently on one link" holds
by construction, while different links run in parallel. The slot is held until
the native job has returned, even when the caller timed out or was cancelled.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from time import perf_counter
from typing import TYPE_CHECKING

from .errors import API_CONTEXT_NONE, LLMLinkError, LLMStatusCode, current_api, failure
from .metrics._core import InstanceMetrics, LinkMetrics

if TYPE_CHECKING:
    from .config import DataPath
    from .transports.base import Path

__all__ = ["Link", "LinkRegistry", "LinkState", "Unreachable"]

log = logging.getLogger("aiodatadist.links")


class Unreachable(LLMLinkError):
    """LLM_LINK_FAILED because nothing accepted the connection (the peer may not listen
    yet): a two-sided link retries it, unlike a refusal or a failed handshake."""


class LinkState(enum.Enum):
    ACTIVE = "active"
    CLOSED = "closed"


class _FifoSlot:
    """A FIFO mutex for one event loop, acquired under an absolute deadline."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()  # asyncio.Lock hands over in FIFO order, without barging
        # Callers queued on the lock. Right after a release the lock reads unlocked while
        # the woken waiter has not run yet: a newcomer then queues behind it, so "unlocked"
        # alone does not mean "free".
        self._waiting = 0
        # Seconds the holder waited for the slot (metrics): timed only when it had to queue.
        self.waited = 0.0

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    @property
    def waiting(self) -> int:
        """Callers queued for the slot (a free slot with waiters is not free)."""
        return self._waiting

    async def acquire(self, deadline: float | None) -> None:
        if not self._lock.locked() and not self._waiting:
            await self._lock.acquire()  # free and nobody queued: taken at once, no timer
            self.waited = 0.0
            return
        self._waiting += 1
        asked = perf_counter()
        try:
            async with asyncio.timeout_at(deadline):
                await self._lock.acquire()
            self.waited = perf_counter() - asked
        except TimeoutError:
            raise failure(
                LLMStatusCode.LLM_TIMEOUT,
                "deadline passed while waiting for the link (other transfers hold it)",
            ) from None
        finally:
            self._waiting -= 1

    def release(self) -> None:
        self._lock.release()


class Link:
    """A link to one remote cluster: its state, data path and FIFO slot.

    Attributes:
        local_cluster_id: this instance's cluster id.
        remote_cluster_id: the peer's cluster id (keys name it).
        path: the link's data path (:class:`~aiodatadist.transports.base.Path`).
    """

    def __init__(
        self,
        local_cluster_id: int,
        remote_cluster_id: int,
        path: Path,
        slot: _FifoSlot | None = None,
    ) -> None:
        self.local_cluster_id = local_cluster_id
        self.remote_cluster_id = remote_cluster_id
        self.path = path
        self.state = LinkState.ACTIVE
        # Both ends of an in-process link share one slot, so a pull on one side
        # and transfer_cache_async on the other never overlap.
        self.slot = slot if slot is not None else _FifoSlot()
        # Counters of this link (aiodatadist.metrics), registered with the instance's
        # by LinkRegistry.add; they fold into its totals when the link goes.
        self.metrics = LinkMetrics()

    @property
    def transfers(self) -> int:
        """Transfers completed on this link (its metrics' count)."""
        return sum(n for n, _ in list(self.metrics.counts.values()))

    @property
    def data_paths(self) -> tuple[DataPath, ...]:
        """The data paths this link can use, in the order it prefers them."""
        return self.path.kinds

    @property
    def data_path(self) -> DataPath:
        """The data path this link prefers (the first of :attr:`data_paths`)."""
        return self.path.kinds[0]

    @asynccontextmanager
    async def exclusive(self, deadline: float | None) -> AsyncIterator[Link]:
        """Holds the link's FIFO slot; raises LLM_NOT_YET_LINK once it is closed.

        Raises:
            LLMTimeoutError: the deadline passed while waiting for the slot.
            LLMLinkError: the link was closed (unlinked) while waiting.
        """
        await self.slot.acquire(deadline)
        try:
            if self.state is not LinkState.ACTIVE:
                raise failure(
                    LLMStatusCode.LLM_NOT_YET_LINK,
                    f"the link to cluster {self.remote_cluster_id} was closed",
                )
            yield self
        finally:
            self.slot.release()

    def __repr__(self) -> str:
        return (
            f"<Link {self.local_cluster_id}->{self.remote_cluster_id} "
            f"{self.data_path} {self.state.value}>"
        )


class LinkRegistry:
    """Links of one :class:`~aiodatadist.LLMDataDist`, by remote cluster id."""

    def __init__(self, local_cluster_id: int) -> None:
        self.local_cluster_id = local_cluster_id
        self.metrics = InstanceMetrics(local_cluster_id)  # every link's, gone ones too
        self._links: dict[int, Link] = {}
        # wait_for() callers by cluster id, woken by add().
        self._waiters: dict[int, list[asyncio.Future[Link]]] = {}

    def __contains__(self, cluster_id: object) -> bool:
        return cluster_id in self._links

    def __iter__(self) -> Iterator[Link]:
        return iter(list(self._links.values()))

    def __len__(self) -> int:
        return len(self._links)

    def add(self, link: Link) -> None:
        if link.remote_cluster_id in self._links:
            raise failure(
                LLMStatusCode.LLM_ALREADY_LINK,
                f"already linked to cluster {link.remote_cluster_id}",
            )
        self._links[link.remote_cluster_id] = link
        self.metrics.register(link.remote_cluster_id, link.metrics, link.data_paths)
        peer = getattr(link.path, "peer", None)  # a cross-process link's control connection
        how = "in-process" if peer is None else "we linked" if peer.is_client else "peer linked"
        log.info(
            "link up: cluster %d -> %d (%s), data paths %s",
            self.local_cluster_id,
            link.remote_cluster_id,
            how,
            "/".join(link.data_paths),
        )
        for fut in self._waiters.pop(link.remote_cluster_id, []):
            if not fut.done():
                fut.set_result(link)

    async def wait_for(self, cluster_id: int, deadline: float | None) -> Link:
        """The active link to ``cluster_id`` once there is one (woken by :meth:`add`).

        Raises:
            LLMTimeoutError: LLM_TIMEOUT, none came by ``deadline``.
        """
        link = self._links.get(cluster_id)
        if link is not None and link.state is LinkState.ACTIVE:
            return link
        fut: asyncio.Future[Link] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(cluster_id, [])
        waiters.append(fut)
        try:
            async with asyncio.timeout_at(deadline):
                return await fut
        except TimeoutError:
            raise failure(
                LLMStatusCode.LLM_TIMEOUT, f"no link from cluster {cluster_id} came in time"
            ) from None
        finally:
            if fut in waiters:
                waiters.remove(fut)
            if not waiters and self._waiters.get(cluster_id) is waiters:
                del self._waiters[cluster_id]

    def get(self, cluster_id: int) -> Link:
        """The active link to ``cluster_id``.

        Raises:
            LLMLinkError: LLM_NOT_YET_LINK when there is none.
        """
        link = self._links.get(cluster_id)
        if link is None or link.state is not LinkState.ACTIVE:
            raise failure(LLMStatusCode.LLM_NOT_YET_LINK, f"no link to cluster {cluster_id}")
        return link

    def find(self, cluster_id: int) -> Link | None:
        return self._links.get(cluster_id)

    def remove(self, link: Link, *, lost: bool = False) -> None:
        """Closes ``link`` and drops it; ``lost``: it went without an unlink (the control
        connection's own INFO line says why), else the unlink is logged (INFO)."""
        if not lost and link.state is LinkState.ACTIVE:
            who = current_api()
            log.info(
                "unlink: cluster %d -> %d (asked by %s)",
                self.local_cluster_id,
                link.remote_cluster_id,
                who if who != API_CONTEXT_NONE else "the library",
            )
        link.state = LinkState.CLOSED
        if self._links.get(link.remote_cluster_id) is link:
            del self._links[link.remote_cluster_id]
        self.metrics.retire(link.remote_cluster_id, link.metrics)
