"""The per-link Unix socket that passes fds (lease pages, segments) between same-host peers.

Segment and page fds travel over one abstract Unix ``SOCK_SEQPACKET`` connection per
link (:class:`FdChannel`): the server side of the link listens (:class:`FdListener`)
and advertises the name in ``WELCOME.fd_socket``; the client connects
(:func:`connect_channel`) and sends the link token first; the server checks the token
and ``SO_PEERCRED``. Owners push fds proactively (every segment and the page at link
time, each new segment on allocate, before the table update goes out), so a peer never
maps anything by name. What the pages are for is in :mod:`aiodatadist._leases`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import resource
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from . import _native
from ._lease_book import LeaseBook, _OwnedPage
from ._leases import SLOTS, LeasePage
from .errors import LLMStatusCode, failure

__all__ = [
    "HELD_FDS_CAP",
    "HELLO_TIMEOUT",
    "MAX_BACKLOG",
    "MAX_PENDING",
    "FdChannel",
    "FdListener",
    "connect_channel",
]

log = logging.getLogger("aiodatadist.leases")

MAX_MESSAGE = 1024
"""Largest JSON body of an fd-channel message."""
MAX_FDS = 1
"""Fds one message may carry."""
MAX_HELD_FDS = 4096
"""Segment fds a peer may have us hold at once (more closes the channel)."""
HELLO_TIMEOUT = 10.0
MAX_PENDING = 64
"""Fd-channel connections that may wait for their hello at once (past it the oldest goes)."""
_soft_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
MAX_BACKLOG = min(MAX_HELD_FDS, max(64, (_soft_nofile if _soft_nofile > 0 else 1024) // 4))
"""Messages one channel may queue while its socket is full (each holds a dup'ed fd):
a quarter of the fd limit at most, so a peer that stops reading cannot exhaust ours."""
HELD_FDS_CAP = min(MAX_HELD_FDS, max(64, (_soft_nofile if _soft_nofile > 0 else 1024) // 2))
"""Segment fds one channel holds at most here: half of the fd limit (a peer sending more
gets its channel closed and tcp for the rest, rather than using up our fds)."""
_SEG_NAME = re.compile(r"/[A-Za-z0-9._-]{1,200}")
_TOKEN = re.compile(r"[0-9a-f]{32,128}")


def _peer_pid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", creds)
    return int(pid)


class FdChannel:
    """One link's Unix SEQPACKET connection: fds both ways, one JSON message each.

    Messages: ``{"t": "hello", "link_token"}`` (client -> server, first, no fd);
    ``{"t": "page", "slots"}`` + the sender's lease page for this link;
    ``{"t": "seg", "name", "size"}`` + one of the sender's segments. Anything else,
    a truncated message, more than :data:`MAX_FDS` fds or a malformed body closes the
    channel (the link then uses tcp for what it cannot map).
    """

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        peer_pid: int,
        *,
        on_hello: Callable[[FdChannel, str], None] | None = None,
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.loop = loop
        self.peer_pid = peer_pid
        self.owned: _OwnedPage | None = None
        self.page: LeasePage | None = None  # the peer's page for this link
        self.closed = False
        self._on_hello = on_hello
        self._fds: dict[str, tuple[int, int]] = {}
        self._seen: set[str] = set()
        self._events: dict[str, asyncio.Event] = {}
        self._page_event = asyncio.Event()
        self._send_lock = threading.Lock()
        # Messages the socket had no room for (each with a dup of its fd), sent in order
        # once it is writable: a burst (a new link to an owner of many segments, many
        # allocations at once) outruns the socket buffer; that is no reason to drop the
        # channel. More than MAX_BACKLOG waiting: the peer is not reading; closed.
        self._backlog: list[tuple[bytes, int]] = []
        self._writing = False
        self._reading = False
        self._book: LeaseBook | None = None

    # ---------------------------------------------------------------- plumbing

    def start(self, book: LeaseBook | None = None) -> None:
        """Starts reading; with ``book``, also starts pushing our page and segments."""
        if self.closed:
            return
        if not self._reading:
            self.loop.add_reader(self.sock.fileno(), self._on_readable)
            self._reading = True
        if book is not None and self._book is None:
            self._book = book
            try:
                book.attach(self)
            except _native.NativeError as e:
                log.debug("no lease page for the link: %s", e)
                self.close()

    def pause(self) -> None:
        if self._reading and not self.closed:
            self.loop.remove_reader(self.sock.fileno())
            self._reading = False

    def send(self, body: dict[str, Any], fd: int) -> None:
        """Sends one message with one fd; never blocks. A full socket queues it (with a
        dup of ``fd``) until the socket is writable, in order; a failed send, or more
        than :data:`MAX_BACKLOG` queued, closes the channel (the peer then cannot map
        what it was not sent, and uses tcp)."""
        if self.closed:
            return
        data = json.dumps(body).encode()
        try:
            with self._send_lock:
                if not self._backlog:
                    try:
                        socket.send_fds(self.sock, [data], [fd], socket.MSG_DONTWAIT)
                        return
                    except BlockingIOError:
                        pass
                if len(self._backlog) >= MAX_BACKLOG:
                    raise OSError(f"{len(self._backlog)} messages wait: the peer is not reading")
                self._backlog.append((data, os.dup(fd)))
                first = len(self._backlog) == 1
        except OSError as e:
            log.debug("fd channel to pid %d: send failed (%s); closing it", self.peer_pid, e)
            self._close_soon()
            return
        if first:
            self._on_loop(self._start_flush)

    def _on_loop(self, fn: Callable[[], None]) -> None:
        try:
            if asyncio.get_running_loop() is self.loop:
                fn()
                return
        except RuntimeError:
            pass
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(fn)

    def _start_flush(self) -> None:
        if self.closed or self._writing:
            return
        self._writing = True
        self.loop.add_writer(self.sock.fileno(), self._flush)

    def _flush(self) -> None:
        """The socket is writable: sends queued messages until it is full or none is left."""
        try:
            with self._send_lock:
                while self._backlog and not self.closed:
                    data, fd = self._backlog[0]
                    try:
                        socket.send_fds(self.sock, [data], [fd], socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        return
                    self._backlog.pop(0)
                    with contextlib.suppress(OSError):
                        os.close(fd)
        except OSError as e:
            log.debug("fd channel to pid %d: send failed (%s); closing it", self.peer_pid, e)
            self.close()
            return
        self._stop_flush()

    def _stop_flush(self) -> None:
        if self._writing:
            self._writing = False
            with contextlib.suppress(Exception):
                self.loop.remove_writer(self.sock.fileno())

    def _close_soon(self) -> None:
        try:
            if asyncio.get_running_loop() is self.loop:
                self.close()
                return
        except RuntimeError:
            pass
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.close)

    def _on_readable(self) -> None:
        for _ in range(64):  # bounded per wakeup: other callbacks get their turn
            if self.closed or not self._reading:
                return
            try:
                data, fds, flags, _ = socket.recv_fds(
                    self.sock, MAX_MESSAGE, MAX_FDS, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
                )
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.debug("fd channel to pid %d: %s", self.peer_pid, e)
                self.close()
                return
            if not data and not fds:
                self.close()  # the peer closed its end
                return
            if not self._handle(data, fds, flags):
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                log.debug("fd channel to pid %d: bad message; closing it", self.peer_pid)
                self.close()
                return

    def _handle(self, data: bytes, fds: list[int], flags: int) -> bool:
        """Takes one message; False when it breaks the protocol (the caller closes its fds)."""
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            return False
        try:
            body = json.loads(data)
        except ValueError:
            return False
        if not isinstance(body, dict):
            return False
        t = body.get("t")
        if t == "hello":
            token = body.get("link_token")
            if (
                fds
                or set(body) != {"t", "link_token"}
                or not isinstance(token, str)
                or _TOKEN.fullmatch(token) is None
                or self._on_hello is None
            ):
                return False
            hello, self._on_hello = self._on_hello, None
            self.pause()  # nothing more is read before the token is checked
            hello(self, token)
            return True
        if self._on_hello is not None or len(fds) != 1:
            return False  # the server reads nothing before the hello
        if t == "page":
            slots = body.get("slots")
            if set(body) != {"t", "slots"} or type(slots) is not int or not 0 < slots <= SLOTS:
                return False
            if self.page is not None:
                return False  # one page per link
            try:
                self.page = LeasePage.from_fd(fds[0], slots)
            except _native.NativeError as e:
                log.debug("fd channel to pid %d: refused a lease page: %s", self.peer_pid, e)
                return False
            finally:
                with contextlib.suppress(OSError):
                    os.close(fds[0])  # from_fd keeps its own dup
            self._page_event.set()
            return True
        if t == "seg":
            name, size = body.get("name"), body.get("size")
            if (
                set(body) != {"t", "name", "size"}
                or not isinstance(name, str)
                or _SEG_NAME.fullmatch(name) is None
                or type(size) is not int
                or not 0 < size < 2**63
            ):
                return False
            old = self._fds.pop(name, None)
            if old is not None:
                with contextlib.suppress(OSError):
                    os.close(old[0])
            if len(self._fds) >= HELD_FDS_CAP:
                return False
            self._fds[name] = (fds[0], size)
            ev = self._events.pop(name, None)
            if ev is not None:
                ev.set()
            return True
        return False

    # ---------------------------------------------------------------- use

    async def segment_fd(
        self, name: str, deadline: float | None, api: str | None = None
    ) -> tuple[int, int]:
        """The fd and size of the peer's segment ``name``, waiting (bounded by ``deadline``)
        for it to arrive: the owner sends it before the table that lists it.

        Raises:
            LLMException: LLM_TIMEOUT at the deadline; LLM_FEATURE_NOT_ENABLED when the
                channel closed.
        """
        while True:
            hit = self._fds.get(name)
            if hit is not None:
                return hit
            if self.closed:
                raise failure(
                    LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                    f"the fd channel to pid {self.peer_pid} is closed: segment {name!r} "
                    "cannot be mapped",
                    api=api,
                )
            ev = self._events.setdefault(name, asyncio.Event())
            try:
                async with asyncio.timeout_at(deadline):
                    await ev.wait()
            except TimeoutError:
                raise failure(
                    LLMStatusCode.LLM_TIMEOUT,
                    f"the peer's segment {name!r} did not arrive before the deadline",
                    api=api,
                ) from None

    async def peer_page(self, deadline: float | None, api: str | None = None) -> LeasePage:
        """The peer's lease page for this link, waiting (bounded) for it to arrive."""
        while self.page is None:
            if self.closed:
                raise failure(
                    LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                    f"the fd channel to pid {self.peer_pid} closed before the peer's lease "
                    "page arrived",
                    api=api,
                )
            try:
                async with asyncio.timeout_at(deadline):
                    await self._page_event.wait()
            except TimeoutError:
                raise failure(
                    LLMStatusCode.LLM_TIMEOUT,
                    "the peer's lease page did not arrive before the deadline",
                    api=api,
                ) from None
        return self.page

    def forget(self, live: set[str]) -> None:
        """Closes the fds of segments the peer's table listed once and lists no more (an fd
        that arrived before the table listing it is kept)."""
        self._seen |= live
        for name in [n for n in self._fds if n in self._seen and n not in live]:
            fd, _ = self._fds.pop(name)
            with contextlib.suppress(OSError):
                os.close(fd)
        # Names are never reused: one gone from the table and from our fds is done with.
        self._seen &= live | set(self._fds)

    def close(self) -> None:
        """Stops the channel: the socket and held fds close, our page for the link is
        retired, waiters wake. The peer's page stays mapped (a running copy may use it):
        :meth:`release_page` unmaps it once no copy can."""
        if self.closed:
            return
        self.closed = True
        if self._reading:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.sock.fileno())
            self._reading = False
        self._stop_flush()
        with self._send_lock:
            for _, fd in self._backlog:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._backlog.clear()
        with contextlib.suppress(OSError):
            self.sock.close()
        for fd, _ in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        if self._book is not None:
            self._book.detach(self)
        for ev in self._events.values():
            ev.set()
        self._events.clear()
        self._page_event.set()

    def release_page(self) -> None:
        """Unmaps the peer's page (only when no job under it can be running)."""
        self.close()
        if self.page is not None:
            self.page.close()


def connect_channel(
    name: str, token: str, loop: asyncio.AbstractEventLoop, peer_pid: int
) -> FdChannel:
    """Client side: connects to the peer's abstract socket and sends the link token.

    Raises:
        OSError: the socket cannot be reached.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.setblocking(False)  # on the loop thread: a full backlog is a failure, not a wait
        sock.connect("\0" + name)  # abstract: nothing in the file system to leak
        if _peer_pid(sock) != peer_pid:
            raise OSError(f"the fd socket {name!r} is not held by pid {peer_pid}")
        sock.send(json.dumps({"t": "hello", "link_token": token}).encode())
    except BaseException:
        sock.close()
        raise
    return FdChannel(sock, loop, peer_pid)


class FdListener:
    """Server side: the instance's abstract listening socket for fd channels."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_hello: Callable[[FdChannel, str], None]
    ) -> None:
        self.name = f"aiodd-{os.getpid()}-{os.urandom(8).hex()}"
        self.loop = loop
        self._on_hello = on_hello
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind("\0" + self.name)
            self.sock.listen(64)
            self.sock.setblocking(False)
            loop.add_reader(self.sock.fileno(), self._on_accept)
        except BaseException:
            self.sock.close()
            raise
        # Connections waiting for their hello, oldest first.
        self.pending: dict[FdChannel, None] = {}

    def _on_accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.debug("fd listener: accept failed: %s", e)
            return
        # Any local process can reach an abstract socket: connections that have not said
        # hello are bounded, or idle ones could use up our fds. Past the bound the oldest
        # goes (an honest client says hello right after connecting: it is never the oldest
        # for long).
        for gone in [c for c in self.pending if c.closed]:
            del self.pending[gone]
        while len(self.pending) >= MAX_PENDING:
            oldest = next(iter(self.pending))
            del self.pending[oldest]
            log.debug(
                "fd listener: %d connections wait for their hello; closed the oldest", MAX_PENDING
            )
            oldest.close()
        try:
            pid = _peer_pid(conn)
        except OSError:
            conn.close()
            return
        chan = FdChannel(conn, self.loop, pid, on_hello=self._hello)
        self.pending[chan] = None
        # A connection that never says hello is closed after a bound.
        self.loop.call_later(HELLO_TIMEOUT, self._expire, chan)
        chan.start()

    def _hello(self, chan: FdChannel, token: str) -> None:
        self.pending.pop(chan, None)
        self._on_hello(chan, token)

    def _expire(self, chan: FdChannel) -> None:
        if chan in self.pending:
            del self.pending[chan]
            chan.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.sock.fileno())
        with contextlib.suppress(OSError):
            self.sock.close()
        for chan in list(self.pending):
            chan.close()
        self.pending.clear()
