"""The owner's side of leases: the book of one instance (slots, generations, fence
counts) and the pages it writes them into, one per same-host link.

The rule and the page layout: :mod:`aiodatadist._leases`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from . import _native
from ._leases import REVOKED, SLOTS, LeasePage
from .errors import LLMStatusCode, failure

if TYPE_CHECKING:
    from ._caches import CacheEntry

__all__ = ["Channel", "LeaseBook"]

_page_ids = itertools.count(1)
_LEAKED_PAGES: list[_OwnedPage] = []


class Channel(Protocol):
    """What the book needs of a link's fd channel (:class:`aiodatadist._fdchannel.FdChannel`)."""

    peer_pid: int
    owned: _OwnedPage | None

    def send(self, body: dict[str, Any], fd: int) -> None: ...

    def close(self) -> None: ...


def _pid_dead(pidfd: int | None) -> bool:
    """Whether the process behind ``pidfd`` has exited (a pidfd polls readable then)."""
    if pidfd is None:
        return False
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    with contextlib.suppress(OSError):
        return bool(poller.poll(0))
    return False


class _BookPage:
    """The lease words of this instance's serve book (``_native.ServeBook``: what the
    native tcp serving threads read under, :mod:`aiodatadist.transports.tcp_serve`),
    granted, renewed and revoked like a linked peer's page; process memory, never a peer's."""

    def __init__(self, book: _native.ServeBook) -> None:
        self.book = book

    def addr(self, slot: int, api: str | None = None) -> int:
        return self.book.slot_addr(slot)

    def close(self) -> None:
        """(The words live as long as the book, which the serving threads share.)"""


@dataclass(eq=False)
class _OwnedPage:
    """A page this instance owns for one link (or its serve book's words)."""

    page: LeasePage | _BookPage
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
        self._fenced: dict[int, int] = {}  # slot -> its cache's fences (none: absent)
        self._pages: list[_OwnedPage] = []
        self._channels: list[Channel] = []
        self._segments: Callable[[], list[tuple[str, int, int]]] = list
        # What the native tcp serving threads may read: every granted cache, under its
        # lease in the book's own words (revoked like any page: a free waits for them).
        self.serve = _native.ServeBook(SLOTS)
        self._pages.append(_OwnedPage(_BookPage(self.serve), None))

    def set_segments(self, fn: Callable[[], list[tuple[str, int, int]]]) -> None:
        """``fn()``: ``(name, size, fd)`` of every live segment, pushed to each new link."""
        self._segments = fn

    def _publish(self, entry: CacheEntry, slot: int, gen: int) -> None:
        """Records ``entry``'s lease and writes it into every live page (lock held)."""
        self._leases[entry.cache_id] = (slot, gen)
        entry.lease = (slot, gen)
        entry.fences_changed = functools.partial(self.set_fences, entry)
        # (before the generation is published: a request served under it finds this one)
        self.serve.put(
            entry.cache_id, slot, gen, entry.geometry, entry.addrs, entry.device_id is not None
        )
        self._publish_live(slot, gen)

    def _publish_live(self, slot: int, gen: int) -> None:
        """Writes ``gen`` into ``slot`` of every page whose link is still up (lock held)."""
        for p in self._pages:
            if not p.retired:
                _native.lease_publish(p.page.addr(slot), gen)

    def set_fences(self, entry: CacheEntry) -> None:
        """Writes how many fences ``entry`` has (:meth:`CacheEntry.fence`) into its slot of
        every live page: a peer's one-sided write (a push over ``shm`` / ``cma``, an
        engine's under the page) refuses while it is not 0 (:func:`leased`). Called after
        every change, from any thread; the count is read here, so the last write wins
        with the current one."""
        with self._lock:
            held = self._leases.get(entry.cache_id)
            if held is None:
                return
            slot, n = held[0], entry.late_writes
            if n:
                self._fenced[slot] = n
            else:
                self._fenced.pop(slot, None)
            for p in self._pages:
                if not p.retired:
                    _native.lease_set_fences(p.page.addr(slot), n)

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
                raise failure(
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
            entry.fences_changed = None
            self.serve.remove(entry.cache_id)
            if held is None:
                return
            slot, _ = held
            if self._fenced.pop(slot, 0):
                for p in self._pages:
                    if not p.retired:
                        _native.lease_set_fences(p.page.addr(slot), 0)
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

    def attach(self, chan: Channel) -> None:
        """A new same-host link: a page for it (filled with every current lease), sent to
        the peer with every current segment; later segments follow as they are made."""
        with self._lock:
            page = LeasePage.create(f"{self._label}-lease{next(_page_ids)}")
            for slot, gen in self._leases.values():
                _native.lease_publish(page.addr(slot), gen)
            for slot, n in self._fenced.items():
                _native.lease_set_fences(page.addr(slot), n)
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

    def detach(self, chan: Channel) -> None:
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
