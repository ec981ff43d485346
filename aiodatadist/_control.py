"""The control plane: listen server, link handshake, auth, cache-table exchange,
and serving the peer's requests.

One TCP control connection per link carries :mod:`aiodatadist._wire` frames.
The handshake (the linking side is the *client*)::

    client                                   server (has listen_ip_info)
    HELLO {version, cluster_id, host_id, pid, role, nonce_c, want_auth} ->
                                          <- CHALLENGE {cluster_id, nonce_s, auth_required}
    AUTH {mac_c = HMAC(secret, ...)}      ->
                                          <- WELCOME {..., table, data_paths, link_token, mac_s}
                                             or REFUSE {status, reason} and close
    TABLE {version, table}                ->

The server reveals nothing about registered memory (no table, pid or address)
before the peer proved the shared secret, when one is configured. After the
handshake both sides are symmetric: either may send PULL / PUSH requests (the
other serves them one at a time, in order), TABLE updates, UNLINK, PING.

TCP data streams: the client opens ``2 * tcp_streams`` extra connections that
start with DATA_HELLO {link_token, stream, epoch}; streams ``[0, n)`` carry the
bytes of requests the client starts, ``[n, 2n)`` those the server starts, so the
two directions never interleave bytes. A transfer that does not end cleanly leaves
its streams in an unknown state: they are retired (never reused) and the client
connects a new set with the next *epoch* (per direction). Transfer identity:

* PULL / PUSH name the epoch of the streams the requester uses; the serving side
  uses only streams of that epoch (waiting for them within the request's deadline)
  and answers a request for a retired epoch with a failed DONE, touching no stream.
* Every stream's bytes start with a header naming the request (``req``), checked
  natively before a payload byte lands (``_native.sock_recv``, ``Status.STALE``).
* A requester whose transfer ends without a clean DONE (timeout, cancel, mover
  error) sends CANCEL {req, epoch}: the serving side drops the request if queued,
  aborts it if running, and retires the streams of that epoch and older.

Serving is bounded: each peer's requests run one at a time on the instance's
serving executor (``aiodatadist.ServeThreads``, apart from its own transfers),
at most MAX_QUEUED_REQUESTS wait, a request's deadline is capped by
``aiodatadist.ServeTimeout``, and a reply the peer does not take within that
bound closes its link.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import _native, _wire
from ._caches import CacheEntry, CacheTable
from ._executor import quiesce as _quiesce
from ._leases import FdChannel, FdListener
from .errors import LLMException, LLMStatusCode, format_error, from_native, to_status_code

if TYPE_CHECKING:
    from .datadist import LLMDataDist

__all__ = ["ControlServer", "Peer", "connect", "host_identity"]

log = logging.getLogger("aiodatadist.control")

HANDSHAKE_TIMEOUT = 10.0
UNLINK_SEND_TIMEOUT = 1.0
"""How long an unlink waits for the peer to take its UNLINK before closing anyway."""
MAX_QUEUED_REQUESTS = 8
CANCEL_TIMEOUT = 2.0
"""How long a requester tries to send a CANCEL (in the background) before closing the link."""
MAX_HANDSHAKES = 64
"""Accepted connections that have not sent their first message yet, at once; past it the
oldest is closed."""
_ACK = b"\x01"
_req_ids = itertools.count(1)
# DATA_HELLO.stream = direction * _STREAM_SLOTS + i: the layout does not depend on
# either side's TcpStreams, so peers configured differently still agree on it.
_STREAM_SLOTS = 8


def _ns_inode(name: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{name}").st_ino)
    except OSError:
        return "?"


def host_identity() -> str:
    """Names the machine and namespaces this process lives in.

    Two processes with the same identity can use the one-sided same-host paths
    (shared memory, CMA). The network namespace is part of it, so processes in
    separate namespaces are treated as separate hosts (and use TCP).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    parts = [socket.gethostname(), boot] + [_ns_inode(n) for n in ("pid", "ipc", "mnt", "net")]
    return "/".join(parts)[:256]


def _refused(api: str, body: dict[str, Any]) -> LLMException:
    """A server's REFUSE: its status, but never success, and LLM_FAILED for one it made up."""
    code = to_status_code(int(body["status"]))
    if code == LLMStatusCode.LLM_SUCCESS:
        code = LLMStatusCode.LLM_LINK_FAILED
    return _link_error(api, f"refused: {body['reason']}", code)


def _proc_addr(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``/proc/net/tcp*`` address ``HEX_IP:HEX_PORT`` (the IP in 32-bit host-order words)."""
    hex_ip, hex_port = field.split(":")
    raw = bytes.fromhex(hex_ip)
    ip = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(ip), int(hex_port, 16)


def _socket_inode(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The inode of this namespace's TCP socket with that local and remote end."""
    want = (
        (ipaddress.ip_address(local[0]), local[1]),
        (ipaddress.ip_address(remote[0]), remote[1]),
    )
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            with contextlib.suppress(ValueError, IndexError):
                if (_proc_addr(parts[1]), _proc_addr(parts[2])) == want:
                    return int(parts[9])
    return None


def _holds_socket(pid: int, target: str) -> bool | None:
    """Whether process ``pid`` has an fd on ``target``; None when its fds cannot be read."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False  # no such process
    except OSError:
        return None  # another user's process, or no /proc
    for name in names:
        with contextlib.suppress(OSError):  # an fd closed while we look
            if os.readlink(f"/proc/{pid}/fd/{name}") == target:
                return True
    return False


def peer_owns_connection(pid: int, writer: asyncio.StreamWriter) -> bool | None:
    """Whether process ``pid`` holds the other end of this control connection.

    The one-sided paths (shm, cma) act on the process and segments the peer names: a
    peer claiming someone else's pid could make us read or write that process's memory.
    Checked once per link through /proc. Returns:

    * True: ``pid`` holds it;
    * False: the other end is open, held by some process, and ``pid`` is not one of
      them: the peer claims a pid that is not its own;
    * None: it cannot be told: the other end was already closed (a short-lived peer
      that linked and left before we looked: its socket has no owner any more), or
      /proc does not show it (not the same network namespace, another user's process).

    Only True lets the one-sided paths act on ``pid``.
    """
    sock = writer.get_extra_info("socket")
    try:
        ours, theirs = sock.getsockname()[:2], sock.getpeername()[:2]
    except (OSError, AttributeError):
        return None  # closed already, or not a socket
    inode = _socket_inode(local=theirs, remote=ours)
    if not inode:  # None: not in the table; 0: closed, no process owns it (TIME_WAIT, ...)
        return None
    held = _holds_socket(pid, f"socket:[{inode}]")
    if held is not False:
        return held
    # Not among pid's fds. A lie, unless the peer closed its end meanwhile (or exited):
    # then the socket left the table, or lost its inode, since we read it above.
    if _socket_inode(local=theirs, remote=ours) != inode:
        return None
    return False


def _link_error(
    api: str, info: str, code: LLMStatusCode = LLMStatusCode.LLM_LINK_FAILED
) -> LLMException:
    return LLMException(format_error(api, code, info), status_code=code)


async def quiesce(task: asyncio.Future[Any]) -> None:
    """Waits until ``task`` is done, even through cancels of the waiting task.

    The one wait-for-quiescence of the package (:func:`aiodatadist._executor.quiesce`):
    a cancel raises the ``CancelledError`` that was caught, once ``task`` is done.
    """
    await _quiesce(task)
    if not task.cancelled():
        task.exception()  # retrieved: the caller reports what matters


@dataclass
class ServeStats:
    """What the serving side of one link did with the peer's requests (for tests and tools)."""

    served: int = 0  # ended with a successful DONE
    failed: int = 0  # ended with a failed DONE (refused, timed out, mover error, stale)
    stale: int = 0  # of those: named streams of a retired epoch; no stream was touched
    cancelled_queued: int = 0  # CANCEL arrived while queued: never started
    cancelled_running: int = 0  # CANCEL arrived while running: aborted


@dataclass
class PeerInfo:
    cluster_id: int
    host_id: str
    pid: int
    role: int
    data_paths: list[str] = field(default_factory=list)


class Peer:
    """One control connection to a linked peer, on either side of the link."""

    def __init__(
        self,
        dd: LLMDataDist,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        info: PeerInfo,
        *,
        is_client: bool,
        link_token: str,
        table: CacheTable,
        endpoint: tuple[str, int] | None,
    ) -> None:
        self.dd = dd
        self.reader = reader
        self.writer = writer
        self.info = info
        self.is_client = is_client
        self.link_token = link_token
        self.table = table
        self.endpoint = endpoint
        # The server's fd socket (aiodatadist._leases): on the client, the name WELCOME
        # gave; on the server, the name it offered (None: no fd channel for this link).
        self.fd_socket: str | None = None
        # Same host, and the pid the peer gave really holds the other end of this
        # connection: only then may the one-sided paths act on that process.
        owns = peer_owns_connection(info.pid, writer) if info.host_id == host_identity() else None
        self.same_host = owns is True
        if owns is False:
            # Only a peer that is verifiably lying: an honest peer that already closed its
            # end (linked and left) or one /proc cannot show is not accused (tcp only).
            log.warning(
                "cluster %d claims pid %d on this host, which does not hold its connection: "
                "using tcp only",
                info.cluster_id,
                info.pid,
            )
        elif owns is None and info.host_id == host_identity():
            log.debug(
                "cluster %d (pid %d): its end of the connection cannot be checked (closed, "
                "or not visible here): using tcp only",
                info.cluster_id,
                info.pid,
            )
        self.n_streams = max(1, min(_STREAM_SLOTS, dd.options.tcp_streams))
        # streams[0]: client-initiated transfers; streams[1]: server-initiated.
        # The client opens its own TcpStreams per direction; the server takes what comes.
        slots = self.n_streams if is_client else _STREAM_SLOTS
        self.streams: list[list[socket.socket | None]] = [[None] * slots, [None] * slots]
        self.streams_ready = [asyncio.Event(), asyncio.Event()]
        # Per direction: the epoch of the current stream set, and the newest retired one
        # (every epoch up to it is dead). A socket's epoch is in _stream_epoch.
        self.epoch = [0, 0]
        self._dead_epoch = [0, 0]
        self._stream_epoch: dict[socket.socket, int] = {}
        # Set (and replaced) whenever a direction's streams change: wakes serve waits.
        self._streams_changed = [asyncio.Event(), asyncio.Event()]
        self._connecting = [False, False]
        self._reconnect: asyncio.Task[None] | None = None
        # Data-stream sockets a native job is using (with a count), and those dropped
        # meanwhile: closing one under the job would free its fd number for reuse, and the
        # job's bytes could then go to (or come from) whatever gets that number next.
        self._streams_in_use: dict[socket.socket, int] = {}
        self._streams_retired: set[socket.socket] = set()
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pongs: dict[int, asyncio.Future[None]] = {}
        self._send_lock = asyncio.Lock()
        # (request, loop time it arrived): its deadline counts from arrival, queueing included.
        # A well-behaved peer has at most one request in flight per direction (its link
        # slot orders them); a full queue stops reading from a peer that floods us.
        self._requests: asyncio.Queue[tuple[_wire.Message, float]] = asyncio.Queue(
            maxsize=MAX_QUEUED_REQUESTS
        )
        # Serving state for CANCEL: req ids queued (with a count), cancelled while queued,
        # and the running one (req, its abort token).
        self._queued: dict[int, int] = {}
        self._cancelled: set[int] = set()
        self._running: tuple[int, _native.Control] | None = None
        self.serve_stats = ServeStats()
        self._serve_cap = dd.options.serve_timeout_ms / 1000
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = asyncio.Event()
        self.on_close: Callable[[Peer], Awaitable[None]] | None = None
        self._table_dirty = False
        self._loop = asyncio.get_running_loop()
        # The version of our table the peer was last sent (in the handshake or a TABLE).
        self.table_version_sent: int | None = None

    # ------------------------------------------------------------ plumbing

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.table_version_sent not in (None, self.dd.cache_manager.table.version):
            # A registration made during the handshake reached no link (this one was not
            # adopted yet): send the table before anything the read loop answers, so a
            # peer's refresh (PING) sees it.
            self._send_table_soon()
        self._tasks.append(loop.create_task(self._read_loop(), name="aiodatadist-peer-read"))
        self._tasks.append(loop.create_task(self._serve_loop(), name="aiodatadist-peer-serve"))

    @property
    def my_direction(self) -> int:
        """Index of the stream set carrying transfers this side starts."""
        return 0 if self.is_client else 1

    async def send(
        self, msg_type: _wire.MsgType, body: dict[str, Any], binary: bytes = b""
    ) -> None:
        if self.closed.is_set():
            raise _link_error("send", f"the link to cluster {self.info.cluster_id} is closed")
        async with self._send_lock:
            # The link may have closed while we waited for the lock: uvloop raises
            # RuntimeError for a write to a closed transport (asyncio ignores it).
            if self.closed.is_set() or self.writer.transport.is_closing():
                raise _link_error("send", f"the link to cluster {self.info.cluster_id} is closed")
            try:
                await _wire.write_message(self.writer, msg_type, body, binary)
            except (OSError, ConnectionError, _wire.ConnectionClosed) as e:
                await self.close(f"write failed: {e}")
                raise _link_error(
                    "send", f"the link to cluster {self.info.cluster_id} broke: {e}"
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
        task = self._loop.create_task(self._send_table())
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _send_table(self) -> None:
        own = self.dd.cache_manager.table
        if own.version == self.table_version_sent:
            return  # the peer has this version already
        self.table_version_sent = own.version
        with contextlib.suppress(LLMException):
            await self.send(_wire.MsgType.TABLE, {"version": own.version, "table": own.describe()})

    async def refresh(self, deadline: float | None) -> None:
        """A PING round trip: every TABLE the peer sent before our PING is applied after it."""
        t = next(_req_ids)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pongs[t] = fut
        try:
            async with asyncio.timeout_at(deadline):
                await self.send(_wire.MsgType.PING, {"t": t})
                await fut
        except TimeoutError:
            pass
        finally:
            self._pongs.pop(t, None)

    async def _read_loop(self) -> None:
        reason = "connection closed by the peer"
        try:
            while True:
                msg = await _wire.read_message(self.reader, timeout=None)
                t = msg.type
                if t == _wire.MsgType.DONE:
                    fut = self._pending.pop(int(msg.body["req"]), None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg.body)
                elif t in (_wire.MsgType.PULL, _wire.MsgType.PUSH):
                    req = int(msg.body["req"])
                    self._queued[req] = self._queued.get(req, 0) + 1
                    await self._requests.put((msg, asyncio.get_running_loop().time()))
                elif t == _wire.MsgType.CANCEL:
                    self._on_cancel(int(msg.body["req"]), int(msg.body["epoch"]))
                elif t == _wire.MsgType.TABLE:
                    self._apply_table(msg.body["table"])
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

    def _apply_table(self, items: list[dict[str, Any]]) -> None:
        fresh = CacheTable.from_description([_wire.check_cache_description(d) for d in items])
        self.table.replace_with(fresh)

    def _on_cancel(self, req: int, epoch: int) -> None:
        """The peer gave up ``req`` and its streams of ``epoch`` and older: drop or abort
        the request, retire those streams (they are never used again)."""
        if req in self._queued:
            self._cancelled.add(req)
        running = self._running
        if running is not None and running[0] == req:
            self._cancelled.add(req)
            running[1].abort()
        peer_dir = 1 - self.my_direction
        self._retire_epoch(peer_dir, epoch)
        if self.is_client and peer_dir == 1 and not self.streams_ready[1].is_set():
            self._reconnect_soon()  # we own the streams: the peer cannot make new ones
        self._notify_streams(peer_dir)

    def cancel_soon(self, req: int, epoch: int) -> None:
        """Sends CANCEL {req, epoch} in the background (never blocking the caller, which may
        be unwinding a cancellation); a peer that does not take it in CANCEL_TIMEOUT is
        dropped."""
        if self.closed.is_set():
            return

        async def send_cancel() -> None:
            try:
                async with asyncio.timeout(CANCEL_TIMEOUT):
                    await self.send(_wire.MsgType.CANCEL, {"req": req, "epoch": epoch})
            except TimeoutError:
                await self.close("the peer did not take a CANCEL")
            except LLMException:
                pass  # the link is closed: nothing left to cancel

        self._spawn(send_cancel())

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _serve_loop(self) -> None:
        while not self.closed.is_set():  # _serve may close the link (a peer not reading)
            msg, arrived = await self._requests.get()
            req = int(msg.body["req"])
            left = self._queued.pop(req, 1) - 1
            if left > 0:
                self._queued[req] = left
            if req in self._cancelled:
                self._cancelled.discard(req)
                self.serve_stats.cancelled_queued += 1
                continue  # the requester gave up on it: nothing to send, nothing to answer
            try:
                await self._serve(msg, arrived)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("serving a request from cluster %d failed", self.info.cluster_id)

    async def _serve(self, msg: _wire.Message, arrived: float) -> None:
        """Serves one PULL (we send) or PUSH (we receive) against our registered memory.

        Its deadline is the one the peer asked for, capped by ``aiodatadist.ServeTimeout``,
        counted from its arrival. Waiting for its streams, the native job and the DONE
        reply are all bounded: a peer that stops reading cannot hold this loop, or a
        serving thread, past that (the reply's bound closes the link).
        """
        body = msg.body
        req = int(body["req"])
        loop = asyncio.get_running_loop()
        deadline = arrived + min(int(body["deadline_ms"]) / 1000, self._serve_cap)
        pull = msg.type == _wire.MsgType.PULL
        api = "serve_pull" if pull else "serve_push"
        status, info = LLMStatusCode.LLM_SUCCESS, ""
        peer_dir = 1 - self.my_direction
        entry: CacheEntry | None = None
        # The streams this job used: a failure retires just these (the requester may
        # already have connected their replacements).
        held: list[socket.socket] = []
        # Refused because the requester's table is stale: it may refresh and retry.
        stale = False
        try:
            entry = self.dd.cache_manager.table.by_id(int(body["cache_id"]))
            stale = entry is None or (
                body.get("gen") is not None
                and entry.lease is not None
                and entry.lease[1] != body["gen"]
            )
            if entry is None:
                raise _link_error(
                    api,
                    f"no cache with id {body['cache_id']}",
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                )
            if stale:
                # The requester resolved its key through a binding this cache has lost
                # (a later registration took its model_id, a row key was removed): it
                # would get (or overwrite) another registration's bytes under that key.
                raise _link_error(
                    api,
                    f"cache {body['cache_id']} was re-bound since the requester's table "
                    f"(generation {body.get('gen')}, now {entry.lease})",
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                )
            segs = _wire.segments_from_bytes(msg.binary)
            try:
                geo = _native.Geometry(
                    *(int(x) for x in body["dst_geometry" if pull else "src_geometry"])
                )
                # Every segment is checked against *our* registered geometry: a peer can
                # never make us read or write outside registered memory.
                if pull:
                    plan = _native.Plan.from_segments(entry.geometry, geo, segs)
                else:
                    plan = _native.Plan.from_segments(geo, entry.geometry, segs)
            except _native.NativeError as e:
                raise from_native(e, api) from e
            n = int(body["streams"])
            if loop.time() >= deadline:
                raise _link_error(
                    api, "request arrived after its deadline", LLMStatusCode.LLM_TIMEOUT
                )
            socks = await self._streams_of(peer_dir, int(body["epoch"]), n, req, deadline, api)
            addrs = entry.addrs
            entry.hold(api)
            try:
                gen = body.get("gen")
                if gen is not None and entry.lease is not None and entry.lease[1] != gen:
                    # Re-bound while we waited for the streams (none touched yet).
                    stale = True
                    raise _link_error(
                        api,
                        f"cache {body['cache_id']} was re-bound since the requester's table",
                        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    )
                executor = self.dd._serve_executor_or_raise()
                held[:] = socks
                fds = self.hold_streams(held)
                ctl = _native.Control()
                self._running = (req, ctl)
                try:
                    if pull:
                        job = lambda c: _native.sock_send(fds, plan, addrs, c, tag=req)  # noqa: E731
                    else:
                        job = lambda c: _native.sock_recv(fds, plan, addrs, c, tag=req)  # noqa: E731
                    await executor.run(job, deadline=deadline, api=api, control=ctl)
                finally:
                    # executor.run returns (even when cancelled) only once the job has.
                    self._running = None
                    self.release_streams(held)
            finally:
                entry.release()
        except TimeoutError as e:
            status, info = LLMStatusCode.LLM_TIMEOUT, str(e) or "deadline passed"
            self._drop_streams(peer_dir, only=held)
        except LLMException as e:
            status, info = e.status_code, str(e)
            if status not in (
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                LLMStatusCode.LLM_PARAM_INVALID,
            ):
                self._drop_streams(peer_dir, only=held)
        except _wire.WireError as e:
            status, info = LLMStatusCode.LLM_PARAM_INVALID, str(e)
        if req in self._cancelled:
            # The requester gave up (CANCEL) and will not read a reply.
            self._cancelled.discard(req)
            self.serve_stats.cancelled_running += 1
            return
        if status == LLMStatusCode.LLM_SUCCESS:
            self.serve_stats.served += 1
        else:
            self.serve_stats.failed += 1
        try:
            # A peer that stopped reading must not hold this loop: the reply is bounded.
            async with asyncio.timeout(self._serve_cap):
                done: dict[str, Any] = {"req": req, "status": int(status), "info": info[:1000]}
                if stale and status == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                    done["stale"] = True
                await self.send(_wire.MsgType.DONE, done)
        except TimeoutError:
            await self.close("the peer did not take a reply in time")
        except LLMException:
            pass  # the link is closed

    async def _streams_of(
        self, direction: int, epoch: int, n: int, req: int, deadline: float, api: str
    ) -> list[socket.socket]:
        """The first ``n`` data streams of ``direction``, all of ``epoch``: waits for them
        until ``deadline``; refuses (touching none) when that epoch was retired."""
        while True:
            if req in self._cancelled:
                raise _link_error(api, "cancelled by the requester", LLMStatusCode.LLM_FAILED)
            if epoch <= self._dead_epoch[direction] or epoch < self.epoch[direction]:
                self.serve_stats.stale += 1
                raise _link_error(
                    api,
                    f"stale request {req}: its data streams (epoch {epoch}) were replaced "
                    f"(current epoch {self.epoch[direction]}); nothing was sent",
                    LLMStatusCode.LLM_FAILED,
                )
            socks = self.streams[direction][:n]
            if len(socks) == n and all(
                s is not None and self._stream_epoch.get(s) == epoch for s in socks
            ):
                return [s for s in socks if s is not None]
            if n > len(self.streams[direction]):
                raise _link_error(
                    api, f"{n} data streams asked for, {len(self.streams[direction])} exist",
                    LLMStatusCode.LLM_PARAM_INVALID,
                )
            if self.is_client and not self.streams_ready[direction].is_set():
                self._reconnect_soon()  # ours to connect: the peer is waiting for them
            changed = self._streams_changed[direction]
            async with asyncio.timeout_at(deadline):
                await changed.wait()

    def _drop_streams(self, direction: int, only: list[socket.socket] | None = None) -> None:
        """Retires the data streams of ``direction`` (with ``only``: just those sockets, if
        they are still in place: the client may already have replaced them). A retired
        stream's epoch is dead: no request naming it is served again."""
        dropped = False
        for i, s in enumerate(self.streams[direction]):
            if s is None or (only is not None and s not in only):
                continue
            self.streams_ready[direction].clear()
            self._dead_epoch[direction] = max(
                self._dead_epoch[direction], self._stream_epoch.pop(s, 0)
            )
            self._close_stream(s)
            self.streams[direction][i] = None
            dropped = True
        if only is None:
            self.streams_ready[direction].clear()
            self._dead_epoch[direction] = max(self._dead_epoch[direction], self.epoch[direction])
        if dropped:
            self._notify_streams(direction)
            if self.is_client and direction == 1 and not self._connecting[1]:
                # The peer starts transfers on these and cannot connect new ones itself.
                self._reconnect_soon()

    def _retire_epoch(self, direction: int, epoch: int) -> None:
        """Retires the streams of ``direction`` whose epoch is ``epoch`` or older."""
        old = [
            s
            for s in self.streams[direction]
            if s is not None and self._stream_epoch.get(s, 0) <= epoch
        ]
        if old:
            self._drop_streams(direction, only=old)
        dead = min(epoch, self.epoch[direction])
        self._dead_epoch[direction] = max(self._dead_epoch[direction], dead)

    def _notify_streams(self, direction: int) -> None:
        changed = self._streams_changed[direction]
        self._streams_changed[direction] = asyncio.Event()
        changed.set()

    def _reconnect_soon(self) -> None:
        """Client side: connects a new set of the peer-started direction (1) in the background."""
        if self.closed.is_set() or self._connecting[1]:
            return
        if self._reconnect is not None and not self._reconnect.done():
            return

        async def reconnect() -> None:
            try:
                await self.connect_streams(1, self._loop.time() + HANDSHAKE_TIMEOUT)
            except (OSError, TimeoutError, LLMException) as e:
                # The peer's next request naming a dead epoch fails; a later failure or
                # CANCEL tries again.
                log.warning(
                    "cannot reconnect data streams to cluster %d: %s", self.info.cluster_id, e
                )

        task = self._loop.create_task(reconnect(), name="aiodatadist-peer-streams")
        self._reconnect = task
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    def _close_stream(self, s: socket.socket) -> None:
        """Closes a data stream, or, while a native job uses it, shuts it down (which ends
        the job's wait at once) and closes it when the job has returned."""
        if s in self._streams_in_use:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            self._streams_retired.add(s)
            return
        with contextlib.suppress(OSError):
            s.close()

    def hold_streams(self, socks: list[socket.socket]) -> list[int]:
        """Keeps ``socks`` open (their fd numbers ours) until :meth:`release_streams`,
        which must come only after the native job given the returned fds has returned."""
        for s in socks:
            self._streams_in_use[s] = self._streams_in_use.get(s, 0) + 1
        return [s.fileno() for s in socks]

    def release_streams(self, socks: list[socket.socket]) -> None:
        for s in socks:
            left = self._streams_in_use.pop(s, 1) - 1
            if left:
                self._streams_in_use[s] = left
            elif s in self._streams_retired:
                self._streams_retired.discard(s)
                with contextlib.suppress(OSError):
                    s.close()

    def attach_stream(self, index: int, sock: socket.socket, epoch: int) -> bool:
        """Puts a connected data stream of ``epoch`` in its slot. A newer epoch retires the
        direction's older streams; a stream of a dead or older epoch is refused."""
        direction, i = divmod(index, _STREAM_SLOTS)
        if direction > 1 or i >= len(self.streams[direction]):
            return False
        if epoch <= self._dead_epoch[direction] or epoch < self.epoch[direction]:
            return False
        if epoch > self.epoch[direction]:
            self._drop_streams(direction)  # the peer replaced the whole set
            self.epoch[direction] = epoch
        old = self.streams[direction][i]
        if old is not None:
            self._stream_epoch.pop(old, None)
            self._close_stream(old)
        self.streams[direction][i] = sock
        self._stream_epoch[sock] = epoch
        # The client opened them all before it uses them; the server uses those that came.
        need = self.streams[direction] if self.is_client else self.streams[direction][:1]
        if all(s is not None for s in need):
            self.streams_ready[direction].set()
        self._notify_streams(direction)
        return True

    async def connect_streams(self, direction: int, deadline: float | None) -> None:
        """Client side: opens a new set of data streams of one direction (the next epoch);
        the old set is retired first."""
        assert self.is_client and self.endpoint is not None
        self._connecting[direction] = True
        try:
            self._drop_streams(direction)
            self.epoch[direction] += 1
            epoch = self.epoch[direction]
            loop = asyncio.get_running_loop()
            host, port = self.endpoint
            base = direction * _STREAM_SLOTS
            async with asyncio.timeout_at(deadline):
                for i in range(self.n_streams):
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                    family, stype, proto, _, addr = infos[0]
                    sock = socket.socket(family, stype, proto)
                    try:
                        sock.setblocking(False)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        await loop.sock_connect(sock, addr)
                        frame = _wire.encode(
                            _wire.MsgType.DATA_HELLO,
                            {"link_token": self.link_token, "stream": base + i, "epoch": epoch},
                        )
                        await loop.sock_sendall(sock, frame)
                        ack = await loop.sock_recv(sock, 1)
                        if ack != _ACK:
                            raise _link_error("link_clusters", "the peer refused a data stream")
                        if self.closed.is_set() or not self.attach_stream(base + i, sock, epoch):
                            raise _link_error(
                                "link_clusters", "the data streams were replaced meanwhile"
                            )
                    except BaseException:
                        sock.close()
                        raise
        finally:
            self._connecting[direction] = False

    async def ensure_streams(
        self, direction: int, deadline: float | None
    ) -> tuple[list[socket.socket], int]:
        """The leading run of connected streams of ``direction`` (connecting them if needed)
        and their epoch; a job on them holds them with :meth:`hold_streams`."""
        if not self.streams_ready[direction].is_set():
            if self.is_client:
                await self.connect_streams(direction, deadline)
            else:
                async with asyncio.timeout_at(deadline):
                    await self.streams_ready[direction].wait()
        epoch = self.epoch[direction]
        socks = []
        for s in self.streams[direction]:  # the leading run of connected streams
            if s is None or self._stream_epoch.get(s) != epoch:
                break
            socks.append(s)
        return socks, epoch

    async def request(
        self, msg_type: _wire.MsgType, body: dict[str, Any], binary: bytes
    ) -> tuple[int, asyncio.Future[dict[str, Any]]]:
        req = next(_req_ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req] = fut
        try:
            await self.send(msg_type, {"req": req, **body}, binary)
        except BaseException:
            self._pending.pop(req, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # a failed send closed the link and failed it: retrieved
            fut.cancel()
            raise
        return req, fut

    def forget_request(self, req: int) -> None:
        """Stops tracking ``req``: its DONE, if one still comes, is dropped."""
        self._pending.pop(req, None)

    async def close(self, reason: str = "closed") -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        log.debug("link to cluster %d closed: %s", self.info.cluster_id, reason)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(
                    _link_error(
                        "transfer", f"the link to cluster {self.info.cluster_id} closed: {reason}"
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
        for d in (0, 1):
            self._drop_streams(d)
        if self.on_close is not None:
            cb, self.on_close = self.on_close, None
            await cb(self)

    async def unlink(self) -> None:
        """Says goodbye (best effort) and closes the connection.

        The goodbye waits for the peer to take it at most ``UNLINK_SEND_TIMEOUT``: a peer
        that stopped reading must not hold an unlink or ``finalize`` forever. Cancel (a
        caller's deadline): the connection is closed all the same, then it propagates.
        """
        try:
            with contextlib.suppress(LLMException, TimeoutError):
                async with asyncio.timeout(UNLINK_SEND_TIMEOUT):
                    await self.send(_wire.MsgType.UNLINK, {"cluster_id": self.dd.cluster_id})
        finally:
            await self.close("unlinked")


def _my_paths(dd: LLMDataDist) -> list[str]:
    forced = dd.options.data_path
    if forced in ("shm", "cma", "tcp"):
        return [forced]
    return ["shm", "cma", "tcp"]


def _secret(dd: LLMDataDist) -> bytes | None:
    return dd.options.shared_secret


async def connect(
    dd: LLMDataDist, host: str, port: int, expect_cluster: int, timeout: float
) -> Peer:
    """Client side of the handshake.

    Raises:
        LLMLinkError: LLM_LINK_FAILED (unreachable, refused, auth failed, wrong peer),
            or the status the server refused with (e.g. LLM_ALREADY_LINK).
    """
    api = "link_clusters"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    secret = _secret(dd)
    try:
        async with asyncio.timeout_at(deadline):
            reader, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError) as e:
        raise _link_error(api, f"cannot reach {host}:{port}: {e or 'timed out'}") from e
    ok = False
    try:
        nonce_c = _wire.new_nonce()
        async with asyncio.timeout_at(deadline):
            await _wire.write_message(
                writer,
                _wire.MsgType.HELLO,
                {
                    "version": _wire.PROTOCOL_VERSION,
                    "cluster_id": dd.cluster_id,
                    "host_id": host_identity(),
                    "pid": os.getpid(),
                    "role": int(dd.role),
                    "nonce": nonce_c,
                    "want_auth": secret is not None,
                },
            )
            msg = await _wire.read_message(reader, timeout=None)
            if msg.type == _wire.MsgType.REFUSE:
                raise _refused(api, msg.body)
            if msg.type != _wire.MsgType.CHALLENGE:
                raise _link_error(api, f"unexpected {msg.type!r} during the handshake")
            server_id = int(msg.body["cluster_id"])
            nonce_s = str(msg.body["nonce"])
            if msg.body["auth_required"] and secret is None:
                raise _link_error(api, "the peer requires a shared secret and none is configured")
            mac = (
                _wire.client_mac(secret, nonce_c, nonce_s, dd.cluster_id, server_id)
                if secret
                else ""
            )
            await _wire.write_message(writer, _wire.MsgType.AUTH, {"mac": mac})
            msg = await _wire.read_message(reader, timeout=None)
            if msg.type == _wire.MsgType.REFUSE:
                raise _refused(api, msg.body)
            if msg.type != _wire.MsgType.WELCOME:
                raise _link_error(api, f"unexpected {msg.type!r} during the handshake")
            w = msg.body
            if secret is not None:
                expected = _wire.server_mac(secret, nonce_c, nonce_s, dd.cluster_id, server_id)
                if not _wire.verify_mac(expected, w.get("mac") or ""):
                    raise _link_error(api, "the peer could not prove the shared secret")
            if int(w["cluster_id"]) != expect_cluster:
                raise _link_error(
                    api, f"{host}:{port} is cluster {w['cluster_id']}, not {expect_cluster}"
                )
            table = CacheTable.from_description(list(w["table"]))
            info = PeerInfo(
                int(w["cluster_id"]),
                str(w["host_id"]),
                int(w["pid"]),
                int(w["role"]),
                list(w["data_paths"]),
            )
            peer = Peer(
                dd,
                reader,
                writer,
                info,
                is_client=True,
                link_token=str(w["link_token"]),
                table=table,
                endpoint=(host, port),
            )
            fd_socket = w.get("fd_socket")
            peer.fd_socket = fd_socket if isinstance(fd_socket, str) else None
            own = dd.cache_manager.table
            peer.table_version_sent = own.version
            await _wire.write_message(
                writer, _wire.MsgType.TABLE, {"version": own.version, "table": own.describe()}
            )
            if "tcp" in info.data_paths and "tcp" in _my_paths(dd):
                await peer.connect_streams(0, deadline)
                await peer.connect_streams(1, deadline)
        ok = True
        return peer
    except LLMException:
        raise  # already says why (a refusal keeps the server's status)
    except TimeoutError as e:
        raise _link_error(api, f"handshake with {host}:{port} timed out") from e
    except (_wire.WireError, OSError) as e:
        raise _link_error(api, f"handshake with {host}:{port} failed: {e}") from e
    finally:
        if not ok:
            writer.close()


class ControlServer:
    """Accepts links on ``listen_ip_info`` and serves them."""

    def __init__(self, dd: LLMDataDist) -> None:
        self.dd = dd
        self._server: asyncio.Server | None = None
        self.peers: dict[str, Peer] = {}  # by link token
        self._handshakes: set[asyncio.Task[Any]] = set()
        # Connections that have not sent their first message (HELLO or DATA_HELLO) yet,
        # oldest first: at most MAX_HANDSHAKES (anyone who reaches the port can open them,
        # no secret needed; idle ones must not use up our fds). Past the bound the oldest
        # is closed. An honest peer sends its first message with the connection.
        self._unwelcomed: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
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
            raise LLMException(
                format_error(
                    "init", LLMStatusCode.LLM_PARAM_INVALID, f"cannot listen on {host}:{port}: {e}"
                ),
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            ) from e

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handshakes.add(task)
        while len(self._unwelcomed) >= MAX_HANDSHAKES:
            # Closing the connection ends its read of the first message.
            oldest = next(iter(self._unwelcomed))
            log.debug("%d connections have said nothing: closing the oldest", MAX_HANDSHAKES)
            with contextlib.suppress(Exception):
                self._unwelcomed.pop(oldest).transport.abort()
        self._unwelcomed[task] = writer
        try:
            await self._handshake(reader, writer)
        # RuntimeError: uvloop's answer to a write on a transport closed above.
        except (_wire.WireError, OSError, TimeoutError, LLMException, RuntimeError) as e:
            log.debug("handshake from %s failed: %s", writer.get_extra_info("peername"), e)
            writer.close()
        finally:
            self._unwelcomed.pop(task, None)
            self._handshakes.discard(task)

    async def _refuse(
        self, writer: asyncio.StreamWriter, status: LLMStatusCode, reason: str
    ) -> None:
        with contextlib.suppress(Exception):
            await _wire.write_message(
                writer, _wire.MsgType.REFUSE, {"status": int(status), "reason": reason}
            )
        writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dd = self.dd
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
        hello = msg.body
        if int(hello["version"]) != _wire.PROTOCOL_VERSION:
            await self._refuse(
                writer,
                LLMStatusCode.LLM_LINK_FAILED,
                f"protocol version {hello['version']} != {_wire.PROTOCOL_VERSION}",
            )
            return
        client_id = int(hello["cluster_id"])
        secret = _secret(dd)
        nonce_s = _wire.new_nonce()
        await _wire.write_message(
            writer,
            _wire.MsgType.CHALLENGE,
            {
                "cluster_id": dd.cluster_id,
                "nonce": nonce_s,
                "auth_required": secret is not None,
            },
        )
        auth = await _wire.read_message(
            reader, timeout=HANDSHAKE_TIMEOUT, accept=(_wire.MsgType.AUTH,)
        )
        if auth.type != _wire.MsgType.AUTH:
            writer.close()
            return
        if secret is not None:
            expected = _wire.client_mac(secret, hello["nonce"], nonce_s, client_id, dd.cluster_id)
            if not _wire.verify_mac(expected, str(auth.body["mac"])):
                await self._refuse(writer, LLMStatusCode.LLM_LINK_FAILED, "authentication failed")
                return
        if client_id == dd.cluster_id:
            await self._refuse(
                writer, LLMStatusCode.LLM_PARAM_INVALID, "same cluster id as the server"
            )
            return
        existing = dd._registry.find(client_id)
        if existing is not None:
            await self._refuse(
                writer, LLMStatusCode.LLM_ALREADY_LINK, f"cluster {client_id} is already linked"
            )
            return
        token = secrets.token_hex(16)
        fd_socket = self._fd_offer(str(hello["host_id"]), token)
        own = dd.cache_manager.table
        welcomed_version = own.version
        mac = (
            _wire.server_mac(secret, hello["nonce"], nonce_s, client_id, dd.cluster_id)
            if secret is not None
            else None
        )
        await _wire.write_message(
            writer,
            _wire.MsgType.WELCOME,
            {
                "cluster_id": dd.cluster_id,
                "host_id": host_identity(),
                "pid": os.getpid(),
                "role": int(dd.role),
                "table": own.describe(),
                "data_paths": _my_paths(dd),
                "link_token": token,
                "mac": mac,
                "fd_socket": fd_socket,
            },
        )
        first = await _wire.read_message(
            reader, timeout=HANDSHAKE_TIMEOUT, accept=(_wire.MsgType.TABLE,)
        )
        if first.type != _wire.MsgType.TABLE:
            writer.close()
            return
        table = CacheTable.from_description(
            [_wire.check_cache_description(d) for d in first.body["table"]]
        )
        info = PeerInfo(
            client_id, str(hello["host_id"]), int(hello["pid"]), int(hello["role"]), _my_paths(dd)
        )
        peer = Peer(
            dd, reader, writer, info, is_client=False, link_token=token, table=table, endpoint=None
        )
        peer.table_version_sent = welcomed_version
        peer.fd_socket = fd_socket
        self.peers[token] = peer
        await dd._adopt_peer(peer)
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
        dup.setblocking(False)
        try:
            dup.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not peer.attach_stream(int(msg.body["stream"]), dup, int(msg.body["epoch"])):
                dup.close()
                return
            await asyncio.get_running_loop().sock_sendall(dup, _ACK)
        except OSError:
            dup.close()

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
        link = self.dd._registry.find(peer.info.cluster_id)
        channel = None if link is None else link.channel
        if (
            chan.peer_pid != peer.info.pid
            or not peer.same_host
            or peer.fd_socket is None
            or getattr(channel, "peer", None) is not peer
        ):
            log.debug("refused an fd channel from pid %d", chan.peer_pid)
            chan.close()
            return
        attach = getattr(channel, "attach_fds", None)
        if attach is None:
            chan.close()
            return
        attach(chan, self.dd.cache_manager.leases)

    def forget(self, peer: Peer) -> None:
        self.peers.pop(peer.link_token, None)

    def table_changed(self) -> None:
        for peer in list(self.peers.values()):
            peer.table_changed()

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
