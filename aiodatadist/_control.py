"""The control plane: the listen server, links' control connections, table sync, routing.

One TCP control connection per link carries :mod:`aiodatadist._wire` frames; it starts
with the handshake (:mod:`aiodatadist._handshake`). Then either side may send PULL /
PUSH, TABLE, UNLINK, PING, LEASE. The read loop routes PULL / PUSH / CANCEL to the tcp
serving half (:mod:`aiodatadist.transports.tcp_serve`), LEASE / UNLEASE to
:mod:`aiodatadist._engine_lease`, each DONE / LEASED to its requester. The tcp data
streams are opened by the client and arrive at the server's listener (DATA_HELLO).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import resource
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from . import _engine_lease, _handshake, _wire
from ._caches import CacheTable
from ._fdchannel import FdChannel, FdListener
from ._handshake import Agreed, client_handshake, has_spoken, offered_paths, server_handshake
from ._peer_requests import PeerRequests
from .config import DataPath
from .errors import API_CONTEXT, API_CONTEXT_NONE, LLMException, LLMStatusCode, failure
from .links import Link, Unreachable
from .transports.host import host_identity, verified_same_host
from .transports.peer import PeerInfo
from .transports.select import RemotePath
from .transports.tcp_serve import TcpServing
from .transports.tcp_streams import TcpStreams

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ["ControlServer", "Peer", "PeerInfo", "connect", "host_identity", "link_to"]

log = logging.getLogger("aiodatadist.control")

HANDSHAKE_TIMEOUT = 10.0
UNLINK_SEND_TIMEOUT = 1.0
"""How long an unlink waits for the peer to take its UNLINK before closing anyway."""
MAX_HANDSHAKES = max(64, min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 16))
"""Silent accepted connections held at once (a 16th of the fd limit, so that a burst does not
crowd out an honest client); past it the oldest silent one is closed."""


class Peer(PeerRequests):
    """One control connection to a linked peer, on either side of the link (the client's
    has the server's ``endpoint``), made of what its handshake ``agreed``.

    It satisfies :class:`~aiodatadist.transports.peer.ControlLink`: the link's data
    paths use it through that, and own their state (``streams``: the tcp data
    streams; ``serving``: the tcp serving half).
    """

    def __init__(
        self,
        rt: Runtime,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        agreed: Agreed,
        *,
        endpoint: tuple[str, int] | None,
    ) -> None:
        self.rt = rt
        self.reader = reader
        self.writer = writer
        self.info = info = agreed.info
        self.is_client = endpoint is not None
        self.link_token = agreed.link_token
        self.table = agreed.table
        self.endpoint = endpoint
        # The server's fd socket (aiodatadist._fdchannel): on the client, the name WELCOME
        # gave; on the server, the name it offered (None: no fd channel for this link).
        self.fd_socket = agreed.fd_socket
        # Same host, and the pid the peer gave really holds the other end of this
        # connection: only then may the one-sided paths act on that process.
        self.same_host = verified_same_host(info.cluster_id, info.host_id, info.pid, writer)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pongs: dict[int, asyncio.Future[None]] = {}
        self._send_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = asyncio.Event()
        self.unlinking = False  # our unlink closes it: not a lost link
        self.on_close: Callable[[Peer], Awaitable[None]] | None = None
        self._table_dirty = False
        self._loop = asyncio.get_running_loop()
        self._waiting_since: float | None = None  # (see PeerRequests)
        # The version of our table the peer was last sent (in the handshake or a TABLE).
        self.table_version_sent = agreed.table_version
        self.streams = TcpStreams(self, rt.options.tcp_streams)
        self.serving = TcpServing(
            self,
            self.streams,
            table=lambda: rt.caches.table,
            executor=rt.serve_executor,
            cap_s=rt.options.serve_timeout_ms / 1000,
            require_ready=rt.require_ready,
            book=rt.caches.leases.serve,
        )

    # ------------------------------------------------------------ plumbing

    def start(self) -> None:
        if self.table_version_sent not in (None, self.rt.caches.table.version):
            # A registration made during the handshake reached no link (this one was not
            # adopted yet): send the table before anything the read loop answers, so a
            # peer's refresh (PING) sees it.
            self._send_table_soon()
        self._spawn(self._read_loop(), "aiodatadist-peer-read")
        self._spawn(self.serving.run(), "aiodatadist-peer-serve")
        timeout_ms = self.rt.options.heartbeat_timeout_ms
        if timeout_ms > 0:
            self._spawn(self._heartbeat(timeout_ms / 1000), "aiodatadist-peer-heartbeat")

    def _spawn(self, coro: Any, name: str | None = None) -> None:
        # A fresh context: the link's tasks belong to no public call (a context copied
        # from link_clusters or a pull would name that call in their errors).
        task = self._loop.create_task(coro, name=name, context=contextvars.Context())
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def send(
        self, msg_type: _wire.MsgType, body: dict[str, Any], binary: bytes = b""
    ) -> None:
        """Sends one message.

        Raises:
            LLMLinkError: the link is closed, or the write failed (which closes it).
        """
        gone = f"the link to cluster {self.info.cluster_id} is closed"
        if self.closed.is_set():
            raise failure(LLMStatusCode.LLM_LINK_FAILED, gone)
        async with self._send_lock:
            # The link may have closed while we waited for the lock: uvloop raises
            # RuntimeError for a write to a closed transport (asyncio ignores it).
            if self.closed.is_set() or self.writer.transport.is_closing():
                raise failure(LLMStatusCode.LLM_LINK_FAILED, gone)
            try:
                await _wire.write_message(self.writer, msg_type, body, binary)
            except (OSError, ConnectionError, _wire.ConnectionClosed) as e:
                await self.close(f"write failed: {e}")
                raise failure(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"the link to cluster {self.info.cluster_id} broke: {e}",
                ) from e

    def table_changed(self) -> None:
        """Coalesces table updates: one TABLE message per loop iteration.

        Registration is synchronous and may run outside the loop (a sync fixture, another
        thread): the update is handed to the link's own loop either way.
        """
        if self._table_dirty or self.closed.is_set():
            return
        self._table_dirty = True
        try:
            self._loop.call_soon_threadsafe(self._send_table_soon)
        except RuntimeError:  # the loop is closed: the link is gone with it
            self._table_dirty = False

    def _send_table_soon(self) -> None:
        self._table_dirty = False
        if self.closed.is_set():
            return
        self._spawn(self._send_table())

    async def _send_table(self) -> None:
        own = self.rt.caches.table
        if own.version == self.table_version_sent:
            return  # the peer has this version already
        self.table_version_sent = own.version
        with contextlib.suppress(LLMException):
            await self.send(_wire.MsgType.TABLE, _handshake.table_body(self.rt))

    async def _read_loop(self) -> None:
        reason = "connection closed by the peer"
        try:
            while True:
                self._waiting_since = self._loop.time()
                msg = await _wire.read_message(self.reader, timeout=None)
                self._waiting_since = None
                t = msg.type
                if t in (_wire.MsgType.DONE, _wire.MsgType.LEASED):
                    fut = self._pending.pop(int(msg.body["req"]), None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg.body)
                elif t in (_wire.MsgType.PULL, _wire.MsgType.PUSH):
                    await self.serving.enqueue(msg)
                elif t == _wire.MsgType.CANCEL:
                    self.serving.on_cancel(int(msg.body["req"]), int(msg.body["epoch"]))
                elif t in _engine_lease.LEASE_TYPES:
                    await _engine_lease.serve(self, msg)
                elif t == _wire.MsgType.TABLE:
                    self._apply_table(msg.body)
                elif t == _wire.MsgType.PING:
                    # A table update still queued goes first: the peer's refresh (a PING
                    # round trip) then sees every registration made before its PING arrived.
                    await self._send_table()
                    await self.send(_wire.MsgType.PONG, {"t": msg.body["t"]})
                elif t == _wire.MsgType.PONG:
                    pong = self._pongs.get(int(msg.body["t"]))
                    if pong is not None and not pong.done():
                        pong.set_result(None)
                elif t == _wire.MsgType.UNLINK:
                    reason = "the peer unlinked"
                    break
                else:
                    reason = f"unexpected message {t!r}"
                    break
        except (_wire.WireError, OSError, ConnectionError, LLMException) as e:
            reason = str(e) or type(e).__name__
        except asyncio.CancelledError:
            reason = "closed"
            raise
        finally:
            await self.close(reason)

    def _apply_table(self, body: dict[str, Any]) -> None:
        self.info.engines = body.get("engines", self.info.engines)  # (before the table)
        items = [_wire.check_cache_description(d) for d in body["table"]]
        self.table.replace_with(CacheTable.from_description(items))

    async def close(self, reason: str = "closed") -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        lost = self.on_close is not None and not self.unlinking  # (an unlink logs itself)
        level, what = (logging.INFO, "lost") if lost else (logging.DEBUG, "closed")
        log.log(level, "link to cluster %d %s: %s", self.info.cluster_id, what, reason)
        for fut in self._pending.values():
            if not fut.done():
                # Set from whatever task closes the link (often the read loop): not a
                # public call, so the API is named here.
                fut.set_exception(
                    failure(
                        LLMStatusCode.LLM_LINK_FAILED,
                        f"the link to cluster {self.info.cluster_id} closed: {reason}",
                        api="transfer",
                    )
                )
        self._pending.clear()
        for pong in self._pongs.values():
            if not pong.done():
                pong.set_result(None)
        with contextlib.suppress(Exception):
            self.writer.close()
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        self.streams.close()
        self.serving.close()
        if self.on_close is not None:
            cb, self.on_close = self.on_close, None
            await cb(self)

    async def unlink(self) -> None:
        """Says goodbye and waits (at most ``UNLINK_SEND_TIMEOUT``) for the peer to close its
        end, which it does once its link is gone, as upstream's server answers an unlink.
        Cancel: the connection is closed all the same, then it propagates."""
        self.unlinking = True
        try:
            with contextlib.suppress(LLMException, TimeoutError):
                async with asyncio.timeout(UNLINK_SEND_TIMEOUT):
                    await self.send(_wire.MsgType.UNLINK, {"cluster_id": self.rt.cluster_id})
                    await self.closed.wait()
        finally:
            await self.close("unlinked")


async def connect(rt: Runtime, host: str, port: int, expect_cluster: int, timeout: float) -> Peer:
    """Client side: connects, runs the handshake, and opens the tcp data streams.

    Raises:
        LLMLinkError: LLM_LINK_FAILED (unreachable, refused, auth failed, wrong peer),
            or the status the server refused with (e.g. LLM_ALREADY_LINK).
    """
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        async with asyncio.timeout_at(deadline):
            reader, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError) as e:
        why = f"cannot reach {host}:{port}: {e or 'timed out'}"
        raise failure(LLMStatusCode.LLM_LINK_FAILED, why, kind=Unreachable) from e
    ok = False
    try:
        async with asyncio.timeout_at(deadline):
            got = await client_handshake(rt, reader, writer, expect_cluster, f"{host}:{port}")
            peer = Peer(rt, reader, writer, got, endpoint=(host, port))
            if DataPath.TCP in got.info.data_paths and DataPath.TCP in offered_paths(rt):
                await peer.streams.connect(0, deadline)
                await peer.streams.connect(1, deadline)
        ok = True
        return peer
    except LLMException:
        raise  # already says why (a refusal keeps the server's status)
    except TimeoutError as e:
        raise failure(
            LLMStatusCode.LLM_LINK_FAILED, f"handshake with {host}:{port} timed out"
        ) from e
    except (_wire.WireError, OSError) as e:
        raise failure(
            LLMStatusCode.LLM_LINK_FAILED, f"handshake with {host}:{port} failed: {e}"
        ) from e
    finally:
        if not ok:
            writer.close()


async def _adopt(rt: Runtime, peer: Peer, server: ControlServer | None) -> None:
    """Registers a cross-process link (either side of the handshake) and starts serving it."""
    remote_id = peer.info.cluster_id
    if remote_id in rt.links:
        await peer.close("already linked")
        # The server side runs no public call: the API is named here.
        raise failure(
            LLMStatusCode.LLM_ALREADY_LINK,
            f"cluster {remote_id} is already linked",
            api="link_clusters",
        )
    path = RemotePath(peer, rt.options.data_path, rt.engines)
    link = Link(rt.cluster_id, remote_id, path)

    async def on_close(_peer: Peer) -> None:
        rt.links.remove(link, lost=True)
        path.peer_closed()
        if server is not None:
            server.forget(_peer)

    peer.on_close = on_close
    rt.links.add(link)
    if peer.is_client:
        # Same host: the fd channel (segments, lease pages) goes up now, so the first
        # one-sided transfer finds it; without it the link still works (tcp).
        path.connect_fds(peer.fd_socket, rt.caches.leases)
    elif peer.fd_socket is None:
        path.fds_settled.set()  # none offered: none will come
    peer.start()
    log.debug("linked %d <-> %d over %s", rt.cluster_id, remote_id, link.data_path)


async def link_to(rt: Runtime, host: str, port: int, expect_cluster: int, timeout: float) -> None:
    """Links to the instance listening at ``host:port`` (which must be ``expect_cluster``).

    Raises:
        LLMLinkError: as :func:`connect`, or LLM_ALREADY_LINK.
    """
    peer = await connect(rt, host, port, expect_cluster, timeout)
    await _adopt(rt, peer, None)


class ControlServer:
    """Accepts links on ``listen_ip_info`` and serves them."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._server: asyncio.Server | None = None
        self.peers: dict[str, Peer] = {}  # by link token
        self._handshakes: set[asyncio.Task[Any]] = set()
        # Connections that have not sent their first message (HELLO or DATA_HELLO) yet,
        # oldest first: at most MAX_HANDSHAKES (anyone who reaches the port can open them,
        # no secret needed; idle ones must not use up our fds). Past the bound the oldest
        # silent one is closed (see _evict). An honest peer sends its first message with
        # the connection.
        self._unwelcomed: dict[
            asyncio.Task[Any], tuple[asyncio.StreamReader, asyncio.StreamWriter]
        ] = {}
        # fd channels (aiodatadist._leases): the listener, made on the first same-host
        # handshake, and links welcomed but not yet adopted, by token.
        self._fd_listener: FdListener | None = None
        self._fd_waiting: dict[str, asyncio.Future[Peer]] = {}

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None
        sock = self._server.sockets[0]
        host, port = sock.getsockname()[:2]
        return str(host), int(port)

    async def start(self, host: str, port: int) -> None:
        try:
            self._server = await asyncio.start_server(self._accept, host, port, reuse_address=True)
        except OSError as e:
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID, f"cannot listen on {host}:{port}: {e}"
            ) from e

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Accepted connections run in the context the server was started in (init's):
        # they belong to no public call.
        API_CONTEXT.set(API_CONTEXT_NONE)
        task = asyncio.current_task()
        assert task is not None
        self._handshakes.add(task)
        while len(self._unwelcomed) >= MAX_HANDSHAKES:
            self._evict()
        self._unwelcomed[task] = (reader, writer)
        try:
            await self._handshake(reader, writer)
        # RuntimeError: uvloop's answer to a write on a transport closed above.
        except (_wire.WireError, OSError, TimeoutError, LLMException, RuntimeError) as e:
            log.debug("handshake from %s failed: %s", writer.get_extra_info("peername"), e)
            writer.close()
        finally:
            self._unwelcomed.pop(task, None)
            self._handshakes.discard(task)

    def _evict(self) -> None:
        """Closes the oldest connection that has sent nothing (ending its read of the first
        message); the oldest of all when every one has sent something. A flood is accepted
        many per loop pass, before any handshake runs: an honest peer whose first message
        is already here (in the kernel's buffer or the reader's) is not silent.
        """
        victim = next(
            (t for t, (r, w) in self._unwelcomed.items() if not has_spoken(r, w)),
            next(iter(self._unwelcomed)),
        )
        log.debug("%d connections have said nothing: closing the oldest", MAX_HANDSHAKES)
        with contextlib.suppress(Exception):
            self._unwelcomed.pop(victim)[1].transport.abort()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rt = self.rt
        msg = await _wire.read_message(
            reader,
            timeout=HANDSHAKE_TIMEOUT,
            accept=(_wire.MsgType.HELLO, _wire.MsgType.DATA_HELLO),
        )
        me = asyncio.current_task()
        if me is not None:
            self._unwelcomed.pop(me, None)  # it spoke: no longer evictable
        if msg.type == _wire.MsgType.DATA_HELLO:
            await self._data_stream(msg, writer)
            return
        if msg.type != _wire.MsgType.HELLO:
            writer.close()
            return
        got = await server_handshake(
            rt, reader, writer, msg.body, HANDSHAKE_TIMEOUT, self._fd_offer
        )
        if got is None:
            return
        token = got.link_token
        peer = Peer(rt, reader, writer, got, endpoint=None)
        self.peers[token] = peer
        await _adopt(rt, peer, self)
        waiting = self._fd_waiting.pop(token, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(peer)

    async def _data_stream(self, msg: _wire.Message, writer: asyncio.StreamWriter) -> None:
        peer = self.peers.get(str(msg.body["link_token"]))
        sock = writer.get_extra_info("socket")
        if peer is None or peer.closed.is_set() or sock is None:
            writer.close()
            return
        dup = socket.socket(fileno=os.dup(sock.fileno()))
        writer.transport.abort()  # closes asyncio's fd; the dup stays connected
        await peer.streams.accept(int(msg.body["stream"]), int(msg.body["epoch"]), dup)

    # ---------------------------------------------------------------- fd channels

    def _fd_offer(self, host_id: str, token: str) -> str | None:
        """The fd socket name to put in WELCOME for a client on this host, else None."""
        if host_id != host_identity():
            return None
        if self._fd_listener is None:
            try:
                self._fd_listener = FdListener(asyncio.get_running_loop(), self._fd_hello)
            except OSError as e:
                log.debug("no fd socket (%s): one-sided paths are not used", e)
                return None
        fut: asyncio.Future[Peer] = asyncio.get_running_loop().create_future()
        self._fd_waiting[token] = fut
        # Bounded: a welcomed client that never completes its handshake.
        asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT * 2, lambda: self._fd_waiting.pop(token, None)
        )
        return self._fd_listener.name

    def _fd_hello(self, chan: FdChannel, token: str) -> None:
        """A client's fd channel said hello with ``token``: attached to that link once its
        peer is adopted, if the connecting process is that peer (``SO_PEERCRED``)."""
        peer = self.peers.get(token)
        if peer is not None:
            self._fd_claim(chan, peer)
            return
        fut = self._fd_waiting.get(token)
        if fut is None:
            chan.close()
            return

        async def later() -> None:
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                    found = await asyncio.shield(fut)
            except TimeoutError:
                chan.close()  # the link never came: nothing to attach it to
                return
            except asyncio.CancelledError:
                chan.close()
                raise
            self._fd_claim(chan, found)

        task = asyncio.get_running_loop().create_task(later())
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    def _fd_claim(self, chan: FdChannel, peer: Peer) -> None:
        link = self.rt.links.find(peer.info.cluster_id)
        path = None if link is None else link.path
        if (
            chan.peer_pid != peer.info.pid
            or not peer.same_host
            or peer.fd_socket is None
            or not isinstance(path, RemotePath)
            or path.peer is not peer
        ):
            log.debug("refused an fd channel from pid %d", chan.peer_pid)
            chan.close()
            return
        path.attach_fds(chan, self.rt.caches.leases)

    def forget(self, peer: Peer) -> None:
        self.peers.pop(peer.link_token, None)

    async def close(self, timeout: float = 1.0) -> None:
        """Stops listening and closes every link; waits at most ``timeout`` s for the
        listening socket to close (finalize passes what is left of its bound)."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), max(0.0, timeout))
            self._server = None
        for task in list(self._handshakes):
            task.cancel()
        if self._fd_listener is not None:
            self._fd_listener.close()
            self._fd_listener = None
        for fut in self._fd_waiting.values():
            fut.cancel()
        self._fd_waiting.clear()
        for peer in list(self.peers.values()):
            await peer.close("server closed")
        self.peers.clear()
