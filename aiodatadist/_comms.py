"""Link machinery under the facade: in-process links, closing a link, the instance's
listener, the same-host rendezvous directory, and two-sided ``link`` comms.

A comm (``LLMDataDist.link``) is a set of ordinary links, one per other member: the
higher rank of each pair links to the lower rank, which waits for it (how a rank is
reached: :mod:`aiodatadist._ranktable`). ``link`` returns at once; a background task
per comm makes the links within the deadline (``llm.LinkTotalTime`` s, else 120 s),
and ``query_register_mem_status`` reads how far it got: PREPARING, then OK once every
link exists with the peer's cache table (both ends of a link have it when the
handshake completes), or FAILED (deadline, refusal, a link lost after OK).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import itertools
import json
import logging
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from ._control import ControlServer, link_to
from ._ranktable import RankTable
from ._rendezvous import (
    DEFAULT_LINK_TOTAL_TIME_S,
    comm_key,
    default_link_total_time,
    file_name,
    lookup,
    rundir,
    trusted_rundir,
)
from .config import DataPath
from .errors import API_CONTEXT, LLMException, LLMStatusCode, failure
from .links import Link, LinkState, Unreachable, _FifoSlot
from .transports.inproc import InprocPath
from .transports.select import RemotePath
from .types import RegisterMemStatus

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = [
    "DEFAULT_LINK_TOTAL_TIME_S",
    "MAX_COMMS",
    "Comms",
    "Listening",
    "drop_link",
    "inproc_runtime",
    "link_inproc",
    "register_runtime",
    "rundir",
    "unregister_runtime",
]

log = logging.getLogger("aiodatadist.comms")

MAX_COMMS = 512
_BACKOFF_FIRST_S = 0.02
_BACKOFF_MAX_S = 0.5
_FAILED_CLOSE_S = 1.0

# Initialized runtimes of this process by cluster id: in-process links.
_runtimes: weakref.WeakValueDictionary[int, Runtime] = weakref.WeakValueDictionary()
# Comms of this process by (comm_name, member cluster id), and who waits for one to appear.
_joined: dict[tuple[str, int], Comm] = {}
_join_waiters: dict[tuple[str, int], list[asyncio.Future[Comm]]] = {}


def register_runtime(rt: Runtime) -> None:
    _runtimes[rt.cluster_id] = rt


def unregister_runtime(rt: Runtime) -> None:
    if _runtimes.get(rt.cluster_id) is rt:
        del _runtimes[rt.cluster_id]


def inproc_runtime(rt: Runtime, remote_id: int) -> Runtime | None:
    """The runtime ``rt`` links to in-process for ``remote_id`` (same loop, path allowed)."""
    peer = _runtimes.get(remote_id)
    if peer is None or not peer.ready:
        return None
    if rt.options.data_path not in (DataPath.AUTO, DataPath.INPROC):
        return None
    return peer


def link_inproc(rt: Runtime, peer: Runtime) -> LLMStatusCode:
    """Links ``rt`` and ``peer`` (both in this process) with one shared FIFO slot."""
    if peer.loop is not rt.loop:
        log.warning(
            "cluster %d lives on another event loop; in-process links need both "
            "instances on one loop",
            peer.cluster_id,
        )
        return LLMStatusCode.LLM_LINK_FAILED
    if rt.cluster_id in peer.links or peer.cluster_id in rt.links:
        return LLMStatusCode.LLM_ALREADY_LINK
    mine_secret, theirs_secret = rt.options.shared_secret, peer.options.shared_secret
    if (mine_secret or theirs_secret) and not hmac.compare_digest(
        mine_secret or b"", theirs_secret or b""
    ):
        # The same rule as across processes: a secret, when set, is required of every peer.
        log.warning("cluster %d has a different shared secret", peer.cluster_id)
        return LLMStatusCode.LLM_LINK_FAILED
    slot = _FifoSlot()  # one slot for both ends: upstream's per-link mutex
    rt.links.add(Link(rt.cluster_id, peer.cluster_id, InprocPath(peer.caches.table), slot))
    peer.links.add(Link(peer.cluster_id, rt.cluster_id, InprocPath(rt.caches.table), slot))
    log.debug("linked %d <-> %d in-process", rt.cluster_id, peer.cluster_id)
    return LLMStatusCode.LLM_SUCCESS


async def drop_link(
    rt: Runtime, link: Link, *, deadline: float | None, slot_held: bool = False
) -> None:
    """Closes a link at once (queued transfers then see LLM_NOT_YET_LINK), and its
    path once the transfer in flight on it, if any, has returned.

    The path holds the peer's mapped segments and the data sockets a running native
    job uses: it is closed only inside the link's slot. If the slot is not free by
    ``deadline`` the path is left open (leaked, with a warning) rather than unmapped or
    closed under the job.
    """
    rt.links.remove(link)
    if isinstance(link.path, InprocPath):
        peer = _runtimes.get(link.remote_cluster_id)
        if peer is not None:
            other = peer.links.find(rt.cluster_id)
            if other is not None and other.slot is link.slot:
                peer.links.remove(other)
    if not slot_held:
        try:
            await link.slot.acquire(deadline)
        except LLMException:
            log.warning(
                "the link to cluster %d still runs a transfer; its path is left open",
                link.remote_cluster_id,
            )
            return
    try:
        # Closing says goodbye to a remote peer: bounded too (a peer that stopped
        # reading), and the connection is closed locally whatever the peer does.
        try:
            async with asyncio.timeout_at(deadline):
                await link.path.close()
        except TimeoutError:
            log.warning(
                "closing the link to cluster %d ran past its deadline", link.remote_cluster_id
            )
    finally:
        if not slot_held:
            link.slot.release()


class Listening:
    """The instance's link server: started by ``llm.listenIpInfo`` (configured), by a
    comm that must accept links, or by ``switch_role``; published for the rendezvous
    while comms use it."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.server: ControlServer | None = None
        self.configured = False
        # Our rendezvous files, by comm key: (path, body).
        self._published: dict[str, tuple[Path, str]] = {}
        self._lock = asyncio.Lock()

    @property
    def address(self) -> tuple[str, int] | None:
        return None if self.server is None else self.server.address

    async def start(self, host: str, port: int, *, configured: bool) -> None:
        server = ControlServer(self.rt)
        starting = asyncio.ensure_future(server.start(host, port))
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            # A start_server cancelled half-way leaves its socket open: let it finish,
            # then close it.
            with contextlib.suppress(Exception):
                await starting
            await server.close(0)
            raise
        self.server, self.configured = server, configured

    async def stop(self, timeout: float) -> None:
        self.unpublish()
        server, self.server, self.configured = self.server, None, False
        if server is not None:
            await server.close(timeout)

    async def move(self, listen: tuple[str, int] | None) -> None:
        """``switch_role``: the server stops, and starts again at ``listen`` if given (where
        it was before, best effort, when that fails)."""
        before, configured = self.address, self.configured
        await self.stop(1.0)
        if listen is None:
            return
        try:
            await self.start(*listen, configured=True)
        except LLMException:
            if before is not None:
                with contextlib.suppress(LLMException):
                    await self.start(*before, configured=configured)
            raise

    async def ensure(self, want: tuple[str, int] | None, key: str) -> None:
        """A running server (at ``want`` when given), published for the comm ``key``.

        Raises:
            LLMException: LLM_FAILED (listening elsewhere, untrusted directory),
                LLM_PARAM_INVALID (cannot listen at ``want``).
        """
        async with self._lock:
            if self.server is None:
                host, port = want if want is not None else ("127.0.0.1", 0)
                await self.start(host, port, configured=False)
            elif want is not None and self.address != want:
                raise failure(
                    LLMStatusCode.LLM_FAILED,
                    f"this instance listens at {self.address}, the rank table says {want}",
                )
            if key not in self._published:
                self._publish(key)

    def _publish(self, key: str) -> None:
        assert self.server is not None
        folder = trusted_rundir()
        host, port = self.server.address
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        body = json.dumps({"host": host, "port": port, "pid": os.getpid(), "comm": key})
        name = file_name(key, self.rt.cluster_id)
        tmp = folder / f".{name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, folder / name)
        self._published[key] = (folder / name, body)

    def unpublish(self, key: str | None = None) -> None:
        """Removes our rendezvous file of comm ``key`` (every one when None), only
        where it is still ours."""
        keys = list(self._published) if key is None else [key]
        for k in keys:
            published = self._published.pop(k, None)
            if published is None:
                continue
            path, body = published
            with contextlib.suppress(OSError):
                if path.read_text() == body:
                    path.unlink()

    async def release(self) -> None:
        """No comm needs the server any more: unpublished, and stopped unless it was
        configured or still serves links (a ``link_clusters`` client's)."""
        async with self._lock:
            self.unpublish()
            if self.server is not None and not self.configured and not self.server.peers:
                await self.stop(1.0)


# ------------------------------------------------------------------------ comms


class Comm:
    """One two-sided ``link``: its members, links and state."""

    def __init__(
        self, comm_id: int, name: str, members: dict[int, int], table: RankTable, me: int
    ) -> None:
        self.comm_id = comm_id
        self.name = name
        self.members = members
        self.table = table
        self.me = me
        self.key = comm_key(name, members, table)
        self.links: dict[int, Link] = {}
        self.ok = False
        self.failed: str | None = None
        self.task: asyncio.Task[None] | None = None

    def status(self) -> RegisterMemStatus:
        if self.failed is None and self.ok:
            lost = [c for c, link in self.links.items() if link.state is not LinkState.ACTIVE]
            if lost:
                self.failed = f"the link to cluster {lost[0]} was lost"
                log.warning("comm %r: %s", self.name, self.failed)
        if self.failed is not None:
            return RegisterMemStatus.FAILED
        return RegisterMemStatus.OK if self.ok else RegisterMemStatus.PREPARING


def _join(comm: Comm, cluster_id: int) -> None:
    key = (comm.name, cluster_id)
    _joined[key] = comm
    for fut in _join_waiters.pop(key, []):
        if not fut.done():
            fut.set_result(comm)


def _leave(comm: Comm, cluster_id: int) -> None:
    if _joined.get((comm.name, cluster_id)) is comm:
        del _joined[(comm.name, cluster_id)]


async def _wait_joined(name: str, cluster_id: int) -> Comm:
    found = _joined.get((name, cluster_id))
    if found is not None:
        return found
    fut: asyncio.Future[Comm] = asyncio.get_running_loop().create_future()
    waiters = _join_waiters.setdefault((name, cluster_id), [])
    waiters.append(fut)
    try:
        return await fut
    finally:
        if fut in waiters:
            waiters.remove(fut)
        if not waiters:
            _join_waiters.pop((name, cluster_id), None)


class Comms:
    """The two-sided comms of one instance."""

    def __init__(self, rt: Runtime, listening: Listening) -> None:
        self.rt = rt
        self.listening = listening
        self._comms: dict[int, Comm] = {}
        self._ids = itertools.count(1)

    @property
    def establishing(self) -> bool:
        return any(not c.ok and c.failed is None for c in self._comms.values())

    def get(self, comm_id: int) -> Comm:
        comm = self._comms.get(comm_id)
        if comm is None:
            raise failure(LLMStatusCode.LLM_NOT_YET_LINK, f"no comm with id {comm_id}")
        return comm

    def start(self, name: str, members: dict[int, int], table: RankTable) -> int:
        """Checks what only this instance knows, then starts establishing; the comm id.

        Raises:
            LLMParamError: this instance's cluster id is not a member.
            LLMLinkError: LLM_ALREADY_LINK (name in use, a member already linked).
            LLMException: LLM_CLUSTER_NUM_EXCEED_LIMIT past ``MAX_COMMS``.
        """
        rt = self.rt
        if rt.cluster_id not in members:
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"this instance's cluster id {rt.cluster_id} is not in cluster_rank_info",
            )
        if any(c.name == name for c in self._comms.values()):
            raise failure(LLMStatusCode.LLM_ALREADY_LINK, f"comm_name {name!r} is in use")
        me = members[rt.cluster_id]
        for cid, rank in members.items():
            if cid == rt.cluster_id:
                continue
            if any(cid in c.members for c in self._comms.values()):
                raise failure(
                    LLMStatusCode.LLM_ALREADY_LINK, f"cluster {cid} is a member of another comm"
                )
            link = rt.links.find(cid)
            # An inbound link from a higher rank that came before our call (it linked
            # first) is this comm's: taken over below. Anything else is another link.
            if link is not None and not (rank > me and _inbound(link)):
                raise failure(LLMStatusCode.LLM_ALREADY_LINK, f"cluster {cid} is already linked")
        if len(self._comms) >= MAX_COMMS:
            raise failure(LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, f"at most {MAX_COMMS} comms")
        comm = Comm(next(self._ids), name, dict(members), table, me)
        self._comms[comm.comm_id] = comm
        _join(comm, rt.cluster_id)
        total = rt.options.link_total_time_s or default_link_total_time()
        deadline = rt.loop.time() + total
        comm.task = rt.loop.create_task(
            self._establish(comm, deadline),
            name=f"aiodatadist-comm-{comm.comm_id}",
            context=contextvars.Context(),  # belongs to no public call
        )
        return comm.comm_id

    async def _establish(self, comm: Comm, deadline: float) -> None:
        API_CONTEXT.set("link")
        loop = self.rt.loop
        tasks = [
            loop.create_task(self._member(comm, cid, rank, deadline))
            for cid, rank in comm.members.items()
            if cid != self.rt.cluster_id
        ]
        try:
            done, pending = await asyncio.wait(
                tasks,
                timeout=max(0.0, deadline - loop.time()),
                return_when=asyncio.FIRST_EXCEPTION,
            )
            errors = [t.exception() for t in done if t.exception() is not None]
            if errors:
                comm.failed = str(errors[0]) or type(errors[0]).__name__
            elif pending:
                comm.failed = "the link deadline passed before every member was linked"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if comm.failed is None:
            comm.ok = True
            log.info("comm %r (id %d) is linked", comm.name, comm.comm_id)
            return
        log.warning("comm %r (id %d) failed: %s", comm.name, comm.comm_id, comm.failed)
        _leave(comm, self.rt.cluster_id)  # an in-process member calling late must not join it
        self.listening.unpublish(comm.key)
        stop = loop.time() + _FAILED_CLOSE_S
        for link in list(comm.links.values()):
            await drop_link(self.rt, link, deadline=stop)

    async def _member(self, comm: Comm, cid: int, rank: int, deadline: float) -> None:
        if comm.me > rank:
            link = await self._connect(comm, cid, rank, deadline)
        else:
            link = await self._accept(comm, cid, deadline)
        comm.links[cid] = link

    async def _connect(self, comm: Comm, cid: int, rank: int, deadline: float) -> Link:
        rt = self.rt
        entry = comm.table.ranks[rank]
        peer = None if entry.listen is not None else inproc_runtime(rt, cid)
        if peer is not None and peer.loop is rt.loop:
            theirs = await _wait_joined(comm.name, cid)
            if theirs.failed is not None or theirs.members != comm.members:
                raise failure(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"cluster {cid}'s link({comm.name!r}) failed or has another cluster_rank_info",
                )
            code = link_inproc(rt, peer)
            if code != LLMStatusCode.LLM_SUCCESS:
                raise failure(code, f"cannot link cluster {cid} in-process")
            return rt.links.get(cid)
        delay = _BACKOFF_FIRST_S
        while True:
            address = entry.listen if entry.listen is not None else lookup(comm.key, cid)
            if address is not None:
                remaining = max(0.001, deadline - rt.loop.time())
                try:
                    await link_to(rt, address[0], address[1], cid, remaining)
                    return rt.links.get(cid)
                except Unreachable:
                    pass  # not listening (yet): try again
                except LLMException as e:
                    # The peer still holds our previous link (its unlink is on the way).
                    if e.status_code != LLMStatusCode.LLM_ALREADY_LINK:
                        raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)

    async def _accept(self, comm: Comm, cid: int, deadline: float) -> Link:
        rt = self.rt
        mine = comm.table.ranks[comm.me]
        connector = _runtimes.get(cid)
        inproc = (
            connector is not None
            and connector.loop is rt.loop
            and inproc_runtime(connector, rt.cluster_id) is rt
        )
        if mine.listen is not None or not inproc:
            await self.listening.ensure(mine.listen, comm.key)
        return await rt.links.wait_for(cid, deadline)

    def status(self, comm_id: int) -> RegisterMemStatus:
        return self.get(comm_id).status()

    async def unlink(self, comm_id: int, deadline: float) -> None:
        """Ends a comm: establishment cancelled, its links closed in their FIFO turn."""
        comm = self.get(comm_id)
        del self._comms[comm_id]
        _leave(comm, self.rt.cluster_id)
        self.listening.unpublish(comm.key)
        await self._stop_task(comm)
        for link in list(comm.links.values()):
            if link.state is not LinkState.ACTIVE:
                continue  # the peer unlinked first: already closed
            try:
                async with link.exclusive(deadline):
                    await drop_link(self.rt, link, deadline=deadline, slot_held=True)
            except LLMException as e:
                if e.status_code == LLMStatusCode.LLM_NOT_YET_LINK:
                    continue  # closed while we waited for our turn
                # Still busy at the deadline: closed at once, as a forced unlink does (the
                # path itself once the transfer in flight has returned).
                log.warning("unlink: the link to cluster %d stayed busy", link.remote_cluster_id)
                await drop_link(self.rt, link, deadline=self.rt.loop.time() + _FAILED_CLOSE_S)
        if not self._comms:
            await self.listening.release()

    @staticmethod
    async def _stop_task(comm: Comm) -> None:
        task = comm.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])  # (our own cancel, unlike the task's, propagates)

    async def close(self) -> None:
        """Finalize: every establishment cancelled (finalize closes the links)."""
        comms, self._comms = list(self._comms.values()), {}
        for comm in comms:
            _leave(comm, self.rt.cluster_id)
            if comm.task is not None:
                comm.task.cancel()
        for comm in comms:
            await self._stop_task(comm)
        self.listening.unpublish()


def _inbound(link: Link) -> bool:
    """Whether ``link`` was accepted by our server (the peer linked to us)."""
    return isinstance(link.path, RemotePath) and not getattr(link.path.peer, "is_client", True)
