"""Leases for one-sided access, and the per-link Unix socket that passes fds.

The rule (docs/concepts.md, "Leases: one-sided access"): a peer reads or writes a
cache of ours through ``shm`` or ``cma`` only under a lease we granted for that
cache's *current* registration.

* A **lease page** is a sealed memfd segment of :data:`SLOTS` slots of 16 bytes,
  ``{atomic u64 gen; atomic u32 readers; u32 pad}``. Every same-host link has two:
  each side creates one for the link (it *owns* it, and writes only its own caches'
  generations into it) and passes it to the other side, which maps it read-write.
* Every registration gets a slot (per instance, reused after a free) and a
  generation from a per-instance counter (never reused); cache descriptions carry
  ``lease: [slot, gen]``.
* A peer's one-sided job brackets its copy: ``lease_enter(slot, gen)`` (counts a
  reader, refuses a generation that is not current), copy, check the generation is
  still the same, ``lease_exit``. A refused enter happens before any byte moves (the
  caller refreshes its table and retries once); a generation changed during the copy
  is an error, never a success.
* The owner revokes (unregister, deallocate, losing an index binding) by marking the
  generation revoked and waiting (a shared futex, no polling) until no reader is left,
  on every page it wrote the slot to, bounded; past the bound it restores every
  generation and the call fails with ``LLM_LINK_BUSY``, registration unchanged.

Segment and page fds travel over one abstract Unix ``SOCK_SEQPACKET`` connection per
link (:class:`FdChannel`): the server side of the link listens (:class:`FdListener`)
and advertises the name in ``WELCOME.fd_socket``; the client connects and sends the
link token first; the server checks the token and ``SO_PEERCRED``. Owners push fds
proactively (every segment and the page at link time, each new segment on allocate,
before the table update goes out), so a peer never maps anything by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import resource
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _native
from .errors import LLMCacheNotFoundError, LLMException, LLMStatusCode, format_error

if TYPE_CHECKING:
    from ._caches import CacheEntry

__all__ = [
    "REVOKED",
    "SLOTS",
    "FdChannel",
    "FdListener",
    "LeaseBook",
    "LeasePage",
    "LeaseStale",
    "leased",
]

log = logging.getLogger("aiodatadist.leases")

SLOTS = 4096
"""Slots per lease page: at most this many caches of one instance at a time."""
SLOT_BYTES = 16
REVOKED = 1 << 63
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
MAX_BACKLOG = min(
    MAX_HELD_FDS, max(64, (_soft_nofile if _soft_nofile > 0 else 1024) // 4)
)
"""Messages one channel may queue while its socket is full (each holds a dup'ed fd):
a quarter of the fd limit at most, so a peer that stops reading cannot exhaust ours."""
HELD_FDS_CAP = min(MAX_HELD_FDS, max(64, (_soft_nofile if _soft_nofile > 0 else 1024) // 2))
"""Segment fds one channel holds at most here: half of the fd limit (a peer sending more
gets its channel closed and tcp for the rest, rather than using up our fds)."""
_SEG_NAME = re.compile(r"/[A-Za-z0-9._-]{1,200}")
_TOKEN = re.compile(r"[0-9a-f]{32,128}")
_page_ids = itertools.count(1)
_LEAKED_PAGES: list[_OwnedPage] = []


def _err(api: str, code: LLMStatusCode, info: str) -> LLMException:
    return LLMException(format_error(api, code, info), status_code=code)


class LeaseStale(LLMCacheNotFoundError):
    """A one-sided job found the cache's lease no longer current before moving a byte:
    the owner re-registered or freed the cache (the caller refreshes and retries once)."""


def _stale(api: str, cache_id: int) -> LeaseStale:
    code = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    return LeaseStale(
        format_error(
            api,
            code,
            f"the peer re-registered or freed cache {cache_id} (its lease is no longer current)",
        ),
        status_code=code,
    )


# ------------------------------------------------------------------------------- pages


class LeasePage:
    """A mapped lease page (ours or a peer's)."""

    def __init__(self, seg: _native.ShmSegment, slots: int) -> None:
        self.seg = seg
        self.slots = slots

    @classmethod
    def create(cls, label: str, slots: int = SLOTS) -> LeasePage:
        return cls(_native.ShmSegment.create(label, slots * SLOT_BYTES), slots)

    @classmethod
    def from_fd(cls, fd: int, slots: int) -> LeasePage:
        """Maps a peer's page read-write (the reader counts live in it)."""
        return cls(_native.ShmSegment.from_fd(fd, slots * SLOT_BYTES, True, "lease-page"), slots)

    def addr(self, slot: int, api: str = "lease") -> int:
        """The address of ``slot``, bounds-checked against the page."""
        if not 0 <= slot < self.slots or self.seg.closed:
            raise _err(
                api,
                LLMStatusCode.LLM_PARAM_INVALID,
                f"lease slot {slot} is outside the peer's lease page of {self.slots} slots",
            )
        return self.seg.addr + slot * SLOT_BYTES

    def close(self) -> None:
        self.seg.close()


def leased(
    page: LeasePage, slot: int, gen: int, api: str, cache_id: int, job: Callable[[Any], None]
) -> Callable[[_native.Control], None]:
    """Wraps a one-sided copy job: enter the lease, copy, check it held, exit.

    The returned job raises :class:`LeaseStale` before any byte moves when the lease is
    not current, and ``LLM_FAILED`` when the owner revoked it while the copy ran (the
    bytes copied are then not to be trusted).
    """
    addr = page.addr(slot, api)

    # ``_page`` keeps the page mapped for as long as the job can run.
    def run(control: _native.Control, _page: LeasePage = page) -> None:
        if not _native.lease_enter(addr, gen):
            raise _stale(api, cache_id)
        try:
            job(control)
            if _native.lease_gen(addr) != gen:
                raise _err(
                    api,
                    LLMStatusCode.LLM_FAILED,
                    f"the owner revoked the lease of cache {cache_id} mid-copy (it was "
                    "unregistered, freed or re-registered): the bytes copied are not valid",
                )
        finally:
            _native.lease_exit(addr)

    return run


def _pid_dead(pidfd: int | None) -> bool:
    """Whether the process behind ``pidfd`` has exited (a pidfd polls readable then)."""
    if pidfd is None:
        return False
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    with contextlib.suppress(OSError):
        return bool(poller.poll(0))
    return False


@dataclass(eq=False)
class _OwnedPage:
    """A page this instance owns for one link."""

    page: LeasePage
    pidfd: int | None
    retired: bool = False
    gone: bool = False  # the peer had exited before we could watch it

    def dead(self) -> bool:
        return self.gone or _pid_dead(self.pidfd)

    def close(self) -> None:
        self.page.close()
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None


class LeaseBook:
    """The owner side of leases for one instance: slots, generations, pages, channels.

    Thread-safe: registration is synchronous and may run off the event loop.
    """

    def __init__(self, label: str) -> None:
        self._label = label
        self._lock = threading.RLock()
        self._gens = itertools.count(1)
        self._free: list[int] = []
        self._next = 0
        self._leases: dict[int, tuple[int, int]] = {}  # cache_id -> (slot, gen)
        self._pages: list[_OwnedPage] = []
        self._channels: list[FdChannel] = []
        self._segments: Callable[[], list[tuple[str, int, int]]] = list

    def set_segments(self, fn: Callable[[], list[tuple[str, int, int]]]) -> None:
        """``fn()``: ``(name, size, fd)`` of every live segment, pushed to each new link."""
        self._segments = fn

    def _publish(self, entry: CacheEntry, slot: int, gen: int) -> None:
        """Records ``entry``'s lease and writes it into every live page (lock held)."""
        self._leases[entry.cache_id] = (slot, gen)
        entry.lease = (slot, gen)
        self._publish_live(slot, gen)

    def _publish_live(self, slot: int, gen: int) -> None:
        """Writes ``gen`` into ``slot`` of every page whose link is still up (lock held)."""
        for p in self._pages:
            if not p.retired:
                _native.lease_publish(p.page.addr(slot), gen)

    # ---------------------------------------------------------------- grants

    def grant(self, entry: CacheEntry) -> None:
        """Gives ``entry`` a slot and a fresh generation, published on every page.

        Raises:
            LLMException: LLM_OUT_OF_MEMORY when every slot is taken.
        """
        with self._lock:
            if self._free:
                slot = self._free.pop()
            elif self._next < SLOTS:
                slot = self._next
                self._next += 1
            else:
                raise _err(
                    "register",
                    LLMStatusCode.LLM_OUT_OF_MEMORY,
                    f"at most {SLOTS} caches can be registered at once",
                )
            self._publish(entry, slot, next(self._gens))

    def renew(self, entry: CacheEntry) -> None:
        """A new generation for a live cache (it lost an index binding): peers that resolved
        it through the old binding fail their next enter and refresh their table. A copy
        already running was of live memory; it finishes (and then reports an error)."""
        with self._lock:
            held = self._leases.get(entry.cache_id)
            if held is None:
                return
            slot, _ = held
            self._publish(entry, slot, next(self._gens))

    def revoke(self, entry: CacheEntry, timeout: float) -> bool:
        """Revokes ``entry``'s lease on every page and waits until no peer copy under it
        is left, at most ``timeout`` seconds in all (the GIL is released while waiting).

        Returns False (every generation restored, nothing changed) when some page still
        had readers at the bound. Pages of peers that died are skipped.
        """
        with self._lock:
            held = self._leases.get(entry.cache_id)
            if held is None:
                return True
            slot, gen = held
            end = time.monotonic() + max(0.0, timeout)
            done: list[tuple[int, int]] = []
            for p in list(self._pages):
                if p.dead():
                    continue
                addr = p.page.addr(slot)
                # What the slot holds by our own book (the peer can write the page too).
                done.append((addr, gen | REVOKED if p.retired else gen))
                if not _native.lease_revoke(addr, max(0.0, end - time.monotonic())):
                    for a, g in done:
                        _native.lease_publish(a, g)
                    return False
            return True

    def restore(self, entry: CacheEntry) -> None:
        """Undoes a successful :meth:`revoke` (the free failed for another reason)."""
        with self._lock:
            held = self._leases.get(entry.cache_id)
            if held is None:
                return
            self._publish(entry, *held)

    def release(self, entry: CacheEntry) -> None:
        """After a successful :meth:`revoke`: empties the slot and frees it for reuse."""
        with self._lock:
            held = self._leases.pop(entry.cache_id, None)
            entry.lease = None
            if held is None:
                return
            slot, _ = held
            # Revoked (retired) pages stay revoked: a stale reader's enter must keep failing.
            self._publish_live(slot, 0)
            self._free.append(slot)
            self._prune()

    def _prune(self) -> None:
        """Drops retired pages nobody can be reading under any more."""
        for p in list(self._pages):
            if not p.retired:
                continue
            if p.dead() or all(
                _native.lease_readers(p.page.addr(s)) == 0 for s, _ in self._leases.values()
            ):
                self._pages.remove(p)
                p.close()

    # ---------------------------------------------------------------- links

    def attach(self, chan: FdChannel) -> None:
        """A new same-host link: a page for it (filled with every current lease), sent to
        the peer with every current segment; later segments follow as they are made."""
        with self._lock:
            page = LeasePage.create(f"{self._label}-lease{next(_page_ids)}")
            for slot, gen in self._leases.values():
                _native.lease_publish(page.addr(slot), gen)
            pidfd: int | None = None
            gone = False
            try:
                pidfd = os.pidfd_open(chan.peer_pid)
            except ProcessLookupError:
                gone = True
            except (OSError, AttributeError):
                pass  # no pidfds here: the peer counts as alive
            owned = _OwnedPage(page, pidfd, gone=gone)
            self._pages.append(owned)
            chan.owned = owned
            self._channels.append(chan)
            chan.send({"t": "page", "slots": page.slots}, page.seg.fd)
            for name, size, fd in self._segments():
                chan.send({"t": "seg", "name": name, "size": size}, fd)

    def detach(self, chan: FdChannel) -> None:
        """The link is gone: its page is revoked as a whole (no new enter can succeed)
        and dropped once no copy under it is left (or its peer died)."""
        with self._lock:
            if chan in self._channels:
                self._channels.remove(chan)
            owned, chan.owned = chan.owned, None
            if owned is None:
                return
            owned.retired = True
            for slot, gen in self._leases.values():
                _native.lease_publish(owned.page.addr(slot), gen | REVOKED)
            self._prune()

    def push_segment(self, name: str, size: int, fd: int) -> None:
        """Sends a new segment's fd to every linked peer (before its table update)."""
        with self._lock:
            for chan in list(self._channels):
                chan.send({"t": "seg", "name": name, "size": size}, fd)

    def close(self) -> None:
        """Finalize: every page goes (after the caches were freed or leaked)."""
        with self._lock:
            for chan in list(self._channels):
                chan.close()
            for p in self._pages:
                if p.retired and not p.dead():
                    busy = any(
                        _native.lease_readers(p.page.addr(s)) for s, _ in self._leases.values()
                    )
                    if busy:
                        # A peer still copies under it: leaked (kept mapped for the life of
                        # the process), never unmapped under the copy.
                        _LEAKED_PAGES.append(p)
                        continue
                p.close()
            self._pages.clear()


# ------------------------------------------------------------------------------- channel


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

    async def segment_fd(self, name: str, deadline: float | None, api: str) -> tuple[int, int]:
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
                raise _err(
                    api,
                    LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                    f"the fd channel to pid {self.peer_pid} is closed: segment {name!r} "
                    "cannot be mapped",
                )
            ev = self._events.setdefault(name, asyncio.Event())
            try:
                async with asyncio.timeout_at(deadline):
                    await ev.wait()
            except TimeoutError:
                raise _err(
                    api,
                    LLMStatusCode.LLM_TIMEOUT,
                    f"the peer's segment {name!r} did not arrive before the deadline",
                ) from None

    async def peer_page(self, deadline: float | None, api: str) -> LeasePage:
        """The peer's lease page for this link, waiting (bounded) for it to arrive."""
        while self.page is None:
            if self.closed:
                raise _err(
                    api,
                    LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                    f"the fd channel to pid {self.peer_pid} closed before the peer's lease "
                    "page arrived",
                )
            try:
                async with asyncio.timeout_at(deadline):
                    await self._page_event.wait()
            except TimeoutError:
                raise _err(
                    api,
                    LLMStatusCode.LLM_TIMEOUT,
                    "the peer's lease page did not arrive before the deadline",
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
            log.debug("fd listener: %d connections wait for their hello; closed the oldest",
                      MAX_PENDING)
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
