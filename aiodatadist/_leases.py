"""Leases for one-sided access: the pages, the holds, and the lease-guarded copy.

The rule (docs/concepts.md, "Leases: one-sided access"): a peer reads or writes a
cache of ours through ``shm`` or ``cma`` only under a lease we granted for that
cache's *current* registration.

* A **lease page** is a sealed memfd segment of :data:`SLOTS` slots of 16 bytes,
  ``{atomic u64 gen; atomic u32 readers; atomic u32 fences}``. Every same-host link
  has two: each side creates one for the link (it *owns* it, and writes only its own
  caches' generations and fence counts into it) and passes it to the other side, which
  maps it read-write.
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
* While an aborted engine transfer may still write into a cache (it is fenced,
  ``CacheEntry.fence``), the owner counts its fences in the slot; a one-sided *write*
  that entered the lease refuses with ``LLM_LINK_BUSY`` while the count is not 0.

The owner's side (slots, generations, its pages, the fence counts) is
:mod:`aiodatadist._lease_book`. The fds of pages and segments travel over the per-link
Unix socket of :mod:`aiodatadist._fdchannel`, which uses both (never the other way round).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _native
from .errors import LLMCacheNotFoundError, LLMException, LLMStatusCode, current_api, failure

if TYPE_CHECKING:
    pass

__all__ = [
    "REVOKED",
    "SLOTS",
    "LeaseHold",
    "LeasePage",
    "LeaseStale",
    "holding",
    "keep_current",
    "leased",
    "page_lease",
]

SLOTS = 4096
"""Slots per lease page: at most this many caches of one instance at a time."""
SLOT_BYTES = 16
REVOKED = 1 << 63


class LeaseStale(LLMCacheNotFoundError):
    """A one-sided job found the cache's lease no longer current before moving a byte:
    the owner re-registered or freed the cache (the caller refreshes and retries once)."""


def _stale(api: str, cache_id: int) -> LLMException:
    return failure(
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        f"the peer re-registered or freed cache {cache_id} (its lease is no longer current)",
        api=api,
        kind=LeaseStale,
    )


def stale_as_lease_stale(
    api: str, cache_id: int, keep: tuple[Any, ...]
) -> Callable[[_native.NativeError], BaseException | None]:
    """For a layered job started natively under the lease (``_executor.Prestart``): its
    ``Status.STALE`` (the lease was not current, nothing moved) as :class:`LeaseStale`, on
    which the runner refreshes and retries; other errors as they are. ``keep`` (the lease
    page, a mapping) stays referenced, so mapped, while the job can run."""

    def translate(err: _native.NativeError, _keep: tuple[Any, ...] = keep) -> BaseException | None:
        return _stale(api, cache_id) if err.status == _native.Status.STALE else None

    return translate


def _fenced(api: str | None, cache_id: int) -> LLMException:
    return failure(
        LLMStatusCode.LLM_LINK_BUSY,
        f"the peer's cache {cache_id} is fenced: an engine transfer into it that was "
        "cancelled or timed out is still in flight and may still write into it, over what "
        "this push would land; pushes into it are taken again once that ended",
        api=api,
    )


# ------------------------------------------------------------------------------- pages


class LeasePage:
    """A mapped lease page (ours or a peer's).

    A lease kept past its transfer (:class:`LeaseHold`) pins the page: :meth:`close`
    then only marks it closed (no new lease is entered on it) and the last unpin unmaps
    it, so a lease can always be left.
    """

    def __init__(self, seg: _native.ShmSegment, slots: int) -> None:
        self.seg = seg
        self.slots = slots
        self._lock = threading.Lock()
        self._pins = 0
        self._closing = False

    @classmethod
    def create(cls, label: str, slots: int = SLOTS) -> LeasePage:
        return cls(_native.ShmSegment.create(label, slots * SLOT_BYTES), slots)

    @classmethod
    def from_fd(cls, fd: int, slots: int) -> LeasePage:
        """Maps a peer's page read-write (the reader counts live in it)."""
        return cls(_native.ShmSegment.from_fd(fd, slots * SLOT_BYTES, True, "lease-page"), slots)

    def addr(self, slot: int, api: str | None = None) -> int:
        """The address of ``slot``, bounds-checked against the page."""
        if not 0 <= slot < self.slots or self.closed:
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"lease slot {slot} is outside the peer's lease page of {self.slots} slots",
                api=api,
            )
        return self.seg.addr + slot * SLOT_BYTES

    @property
    def closed(self) -> bool:
        """Closed (or closing while pinned): no lease is entered on it any more."""
        return self._closing or self.seg.closed

    def pin(self) -> None:
        """Keeps the page mapped until :meth:`unpin`, even past :meth:`close`."""
        with self._lock:
            if self.seg.closed:
                raise failure(LLMStatusCode.LLM_FAILED, "the lease page is unmapped")
            self._pins += 1

    def unpin(self) -> None:
        with self._lock:
            self._pins -= 1
            unmap = self._closing and self._pins == 0
        if unmap:
            self.seg.close()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            if self._pins:
                return  # the last unpin unmaps it
        self.seg.close()


class LeaseHold:
    """A remote cache's lease, held by one transfer and ended exactly once.

    Normally it ends when the transfer's bracket closes (:meth:`close`). An engine
    request that cannot be cancelled (NIXL over UCX's tcp transport: its bytes keep
    moving after an abort) is handed to a reaper thread; the reaper :meth:`keep` s the
    lease, and it ends only when both the bracket closed and every kept request ended.
    So the owner's free waits for (or refuses, ``LLM_LINK_BUSY``) memory an aborted
    request may still read or write, exactly as for a running one.

    ``end`` runs on whichever thread lets go last (the loop, a worker or a reaper).
    """

    __slots__ = ("_end", "_kept", "_lock", "_open")

    def __init__(self, end: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._end: Callable[[], None] | None = end
        self._kept = 0
        self._open = True

    def keep(self) -> Callable[[], None]:
        """Keeps the lease past :meth:`close`; the returned callable lets go (call it once)."""
        with self._lock:
            if self._end is None:
                raise AssertionError("keep() after the lease ended")
            self._kept += 1
        return self._let_go

    @property
    def kept(self) -> int:
        """Requests that keep it (handed to reapers, not ended yet)."""
        return self._kept

    def _let_go(self) -> None:
        with self._lock:
            self._kept -= 1
            end = self._take()
        if end is not None:
            end()

    def close(self) -> None:
        """The transfer's bracket is over: ends the lease unless a request keeps it."""
        with self._lock:
            self._open = False
            end = self._take()
        if end is not None:
            end()

    def _take(self) -> Callable[[], None] | None:
        if self._open or self._kept or self._end is None:
            return None
        end, self._end = self._end, None
        return end

    def around(self, job: Callable[[Any], None]) -> Callable[[Any], None]:
        """``job`` run with this hold as the thread's current one (see :func:`keep_current`)."""

        def run(control: Any) -> None:
            with holding(self):
                job(control)

        return run


_current = threading.local()


@contextlib.contextmanager
def holding(hold: LeaseHold) -> Any:
    """The lease ``hold`` is this thread's current one for the body."""
    prev = getattr(_current, "hold", None)
    _current.hold = hold
    try:
        yield
    finally:
        _current.hold = prev


def keep_current() -> Callable[[], None] | None:
    """Where an aborted engine request goes to a reaper thread: keeps the lease the
    transfer running on this thread holds until the returned callable is called (None:
    no lease is held here)."""
    hold: LeaseHold | None = getattr(_current, "hold", None)
    return hold.keep() if hold is not None else None


def page_lease(page: LeasePage, addr: int) -> LeaseHold:
    """The hold of a lease entered at ``addr`` of ``page``: it pins the page until the
    lease is left (a kept lease may outlive the link's use of the page)."""
    page.pin()
    return LeaseHold(functools.partial(_exit_pinned, page, addr))


def _exit_pinned(page: LeasePage, addr: int) -> None:
    try:
        _native.lease_exit(addr)
    finally:
        page.unpin()


def leased(
    page: LeasePage,
    slot: int,
    gen: int,
    api: str | None,
    cache_id: int,
    job: Callable[[Any], None],
    *,
    keepable: bool = False,
    writes: bool = False,
) -> Callable[[_native.Control], None]:
    """Wraps a one-sided copy job: enter the lease, copy, check it held, exit.

    The returned job raises :class:`LeaseStale` before any byte moves when the lease is
    not current, and ``LLM_FAILED`` when the owner revoked it while the copy ran (the
    bytes copied are then not to be trusted). ``api`` (by default the public call
    running now) is taken here: the job runs on a worker thread, outside that call's
    context.

    ``writes`` (a push: the job writes into the owner's cache): refused with
    ``LLM_LINK_BUSY``, before any byte moves, while the owner has a fence on the cache
    (an aborted engine transfer may still write into it and would overwrite what this
    one lands: ``_lease_book.LeaseBook.set_fences``). The page carries a count per
    cache, not the fenced blocks: every write into that cache waits for the fences to
    lift.

    ``keepable``: the job may hand a request it cannot recall to a reaper, which then
    keeps the lease (an engine job: :class:`LeaseHold`, :func:`keep_current`); a plain
    copy (cma, shm) never does, and skips the hold's few microseconds.
    """
    api = api or current_api()
    addr = page.addr(slot, api)

    def revoked() -> None:
        if _native.lease_gen(addr) != gen:
            raise failure(
                LLMStatusCode.LLM_FAILED,
                f"the owner revoked the lease of cache {cache_id} mid-copy (it was "
                "unregistered, freed or re-registered): the bytes copied are not valid",
                api=api,
            )

    def enter() -> None:
        if not _native.lease_enter(addr, gen):
            raise _stale(api, cache_id)
        if writes and _native.lease_fences(addr):
            _native.lease_exit(addr)
            raise _fenced(api, cache_id)

    # ``_page`` keeps the page mapped for as long as the job can run.
    def run(control: _native.Control, _page: LeasePage = page) -> None:
        enter()
        try:
            job(control)
            revoked()
        finally:
            _native.lease_exit(addr)

    # The hold pins the page for as long as a request handed to a reaper keeps the lease.
    def run_keepable(control: _native.Control) -> None:
        enter()
        try:
            hold = page_lease(page, addr)
        except BaseException:
            _native.lease_exit(addr)
            raise
        try:
            with holding(hold):
                job(control)
            revoked()
        finally:
            hold.close()

    return run_keepable if keepable else run
