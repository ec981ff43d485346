"""``CacheRegistry``: the caches one instance registered or allocated, and their memory.

Holds what every part of the instance shares about local caches: the entries by
``cache_id``, the :class:`~aiodatadist._caches.CacheTable` peers see (and pull
from), and the leases one-sided peers copy under. It turns user buffers into
addresses, refuses overlapping memory, creates the shared-memory segments of
allocated caches, and frees caches only once no transfer (ours, or a peer's
one-sided copy) uses them. A change peers must hear about calls ``on_change``
(the runtime's table-change hook).

Arguments reach it checked for type by the facade; the checks that need the
registry's state (overlap, duplicate keys, liveness) raise here, before anything
changed.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import _native
from ._buffers import TensorMemory, tensor_memory
from ._caches import CacheEntry, CacheTable, require_host_memory
from ._lease_book import LeaseBook
from ._plan import row_key
from ._validate import INVALID_ID, check_int_list, check_type, require
from .errors import LLMStatusCode, failure, from_native
from .types import CacheDesc, CacheKey, KvCache, Placement

__all__ = ["CacheRegistry", "buffers_to_addrs"]

log = logging.getLogger("aiodatadist.cache_manager")

_cache_ids = itertools.count(1)  # upstream: int64 ids starting at 1, per process
_shm_ids = itertools.count(1)
# Caches finalize could not free (a copy still ran): kept alive, never unmapped under it.
_LEAKED: list[CacheEntry] = []
_TENSOR_ALIGN = 4096
LEASE_PAUSE_S = 1.0
"""After a free refused because transfers held the cache: how long no new control-plane
lease is granted on it (a retry within that finds the transfers in flight ended)."""
# Tensors of 2 MiB and more start on a 2 MiB boundary (the segment's mapping does) where that
# wastes at most a 16th of them: huge pages can then back whole tensors (shmem_enabled).
_HUGE_ALIGN = 2 << 20


def _tensor_stride(size: int) -> int:
    """Bytes between the tensors of an allocated cache: ``size`` rounded up to 4 KiB or 2 MiB."""
    huge = -(-size // _HUGE_ALIGN) * _HUGE_ALIGN
    if size >= _HUGE_ALIGN and (huge - size) * 16 <= size:
        return huge
    return -(-size // _TENSOR_ALIGN) * _TENSOR_ALIGN


def buffers_to_addrs(
    desc: CacheDesc, addrs: object, device_engines: Sequence[str] = ()
) -> tuple[list[int], list[Any] | None, int | None]:
    """``addrs`` as tensor addresses, the buffers to keep alive (None for ints), and the
    CUDA device they live on (None: host memory).

    Each entry is an int address (host memory), or a tensor object read by
    :func:`~aiodatadist._buffers.tensor_memory` (buffer protocol, array interfaces,
    DLPack, ``data_ptr()``). Every entry is checked before anything is registered.
    Device memory is accepted only when ``device_engines`` (the engines this instance
    runs that move it) is not empty, only CUDA memory, all tensors on one device; it is
    never read or written here.

    Raises:
        TypeError: not a list, or a mix of ints and objects, or an object that is not
            a tensor this can read.
        LLMParamError: a count, null address, device memory no engine here moves, or a
            tensor that is not contiguous, writable and large enough.
    """
    check_type("addrs", addrs, (list, tuple))
    assert isinstance(addrs, (list, tuple))
    require(len(addrs) > 0, "addrs must not be empty")
    require(
        len(addrs) == desc.num_tensors,
        f"addrs must have cache_desc.num_tensors ({desc.num_tensors}) entries, got {len(addrs)}",
    )
    if all(isinstance(a, int) and not isinstance(a, bool) for a in addrs):
        out = check_int_list("addrs", addrs)
        for i, a in enumerate(out):
            require(a != 0, f"addrs[{i}] is a null address")
        return out, None, None
    result: list[int] = []
    keep: list[Any] = []
    devices: set[int | None] = set()
    for i, obj in enumerate(addrs):
        if isinstance(obj, int) and not isinstance(obj, bool):
            raise TypeError(
                "addrs must be all int addresses or all tensor objects, "
                f"got a mix (addrs[{i}] is int)"
            )
        mem = tensor_memory(obj, f"addrs[{i}]", export_device=bool(device_engines))
        where = f"addrs[{i}] ({mem.source})"
        device = None
        if mem.placement is Placement.DEVICE:
            require(
                bool(device_engines),
                f"{where}: device memory ({mem.device}) needs a fabric data path "
                "that moves it (NIXL; the non-CUDA Mooncake build does not); the host "
                "paths cannot move it (start NIXL with aiodatadist.Engines=nixl)",
            )
            device = _cuda_device(mem.device, where, device_engines)
        devices.add(device)
        require(
            len(devices) == 1,
            f"{where}: the tensors of one cache must all be host memory or all on one "
            f"device (found {sorted(str(d) if d is not None else 'host' for d in devices)})",
        )
        require(mem.contiguous, f"{where} is not C-contiguous")
        require(mem.writable is not False, f"{where} is read-only; a cache must be writable")
        require(
            mem.nbytes >= desc.size,
            f"{where} holds {mem.nbytes} bytes, cache_desc needs {desc.size} per tensor",
        )
        require(mem.addr != 0, f"{where} is at a null address")
        result.append(mem.addr)
        if device is not None or mem.source == "buffer":
            keep.append(mem.keep)  # (device memory: never viewed from the host)
        else:
            keep.append(_host_view(mem))
    return result, keep, devices.pop()


def _cuda_device(label: str, where: str, engines: Sequence[str]) -> int:
    """The CUDA device id of a device label (``cuda``, ``cuda:N``), or LLM_PARAM_INVALID."""
    kind, _, index = label.partition(":")
    require(
        kind == "cuda",
        f"{where}: device memory of type {kind!r} ({label}); the engines here "
        f"({', '.join(engines)}) move CUDA device memory only",
    )
    return int(index) if index.isdigit() else 0


def _host_view(mem: TensorMemory) -> Any:
    # A buffer over the tensor's bytes (what tensors() views) that keeps the object alive.
    view = (ctypes.c_ubyte * mem.nbytes).from_address(mem.addr)
    view.owner = mem.keep  # type: ignore[attr-defined]
    return view


class CacheRegistry:
    """Local caches of one instance: entries, the served table, leases.

    Args:
        cluster_id: the instance's cluster id (labels its shared memory).
        on_change: called after every change peers must hear about.
    """

    def __init__(self, cluster_id: int, on_change: Callable[[], None]) -> None:
        self.cluster_id = cluster_id
        self.on_change = on_change
        self.table = CacheTable()
        self.entries: dict[int, CacheEntry] = {}
        # Leases of our caches for one-sided peers (aiodatadist._leases).
        self.leases = LeaseBook(f"/aiodd-{os.getpid()}-{cluster_id}")
        self.leases.set_segments(self.live_segments)
        # The transfer engines the instance runs (Runtime.engines, transports/engine.py):
        # every cache is registered with each, and deregistered once its lease is revoked.
        self.engines: list[Any] = []

    def live_segments(self) -> list[tuple[str, int, int]]:
        """``(name, size, fd)`` of every live shared-memory segment (pushed to new links)."""
        return [
            (e.segment.name, e.segment.size, e.segment.fd)
            for e in list(self.entries.values())
            if e.segment is not None and not e.freed
        ]

    def live(self, name: str, cache: object) -> CacheEntry:
        """The entry of ``cache``, an argument called ``name``.

        Raises:
            TypeError: not a ``KvCache``.
            LLMParamError: not a live cache of this instance.
        """
        check_type(name, cache, KvCache)
        assert isinstance(cache, KvCache)
        entry = self.entries.get(cache.cache_id)
        if entry is None or entry.cache is not cache or entry.freed:
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"{name} (cache_id {cache.cache_id}) is not a live cache of this instance",
            )
        return entry

    # ------------------------------------------------------------ registration

    def register(
        self,
        desc: CacheDesc,
        addrs: object,
        *,
        is_blocks: bool,
        model_id: int | None,
        row_keys: Sequence[CacheKey],
    ) -> KvCache:
        """User memory (addresses or buffers) as a new cache.

        Raises:
            TypeError, LLMParamError: as :func:`buffers_to_addrs`; overlapping memory;
                duplicate or already bound row keys.
        """
        movers = [str(a.kind) for a in self.engines if a.moves_device_memory]
        addr_list, buffers, device_id = buffers_to_addrs(desc, addrs, movers)
        self._check_no_overlap(addr_list, desc.size)
        return self._add(
            desc,
            addr_list,
            is_blocks,
            model_id=model_id,
            row_keys=row_keys,
            buffers=buffers,
            device_id=device_id,
        )

    def allocate(
        self,
        desc: CacheDesc,
        *,
        is_blocks: bool,
        model_id: int | None,
        row_keys: Sequence[CacheKey],
    ) -> KvCache:
        """A new cache in a shared-memory segment (zero-filled, page-aligned tensors;
        2 MiB-aligned from 2 MiB on where that wastes at most a 16th; every page mapped).

        Raises:
            LLMException: the segment could not be created (the native status's code).
            LLMParamError: duplicate or already bound row keys.
        """
        stride = _tensor_stride(desc.size)
        total = stride * desc.num_tensors
        name = f"/aiodd-{os.getpid()}-{self.cluster_id}-{next(_shm_ids)}"
        try:
            segment = _native.ShmSegment.create(name, total)
        except _native.NativeError as e:
            raise from_native(e) from e
        offsets = [t * stride for t in range(desc.num_tensors)]
        addrs = [segment.addr + o for o in offsets]
        try:
            return self._add(
                desc,
                addrs,
                is_blocks,
                model_id=model_id,
                row_keys=row_keys,
                segment=segment,
                shm_offsets=offsets,
            )
        except BaseException:
            segment.close()
            raise

    def _check_no_overlap(self, addrs: list[int], size: int) -> None:
        spans = sorted((a, a + size) for a in addrs)
        for (_, end), (start, _) in itertools.pairwise(spans):
            require(start >= end, "the tensors of one cache overlap each other")
        for entry in self.entries.values():
            other = entry.tensor_bytes
            for b in entry.addrs:
                for a in addrs:
                    if a < b + other and b < a + size:
                        raise failure(
                            LLMStatusCode.LLM_PARAM_INVALID,
                            f"address {a:#x} overlaps tensor memory of registered cache "
                            f"{entry.cache_id}",
                        )

    def _add(
        self,
        desc: CacheDesc,
        addrs: list[int],
        is_blocks: bool,
        *,
        model_id: int | None,
        row_keys: Sequence[CacheKey],
        buffers: list[Any] | None = None,
        segment: _native.ShmSegment | None = None,
        shm_offsets: list[int] | None = None,
        device_id: int | None = None,
    ) -> KvCache:
        cache = KvCache(next(_cache_ids), desc, addrs, is_blocks_cache=is_blocks)
        entry = CacheEntry.for_cache(cache, desc, addrs)
        entry.model_id = model_id
        entry.device_id = device_id
        for row, key in enumerate(row_keys):
            rk = row_key(key)
            if rk[0] == INVALID_ID:
                continue  # upstream's placeholder for an unused row
            require(rk not in entry.row_keys, f"cache_keys[{row}] {key!r} is given twice")
            require(self.table.row(rk) is None, f"cache_keys[{row}] {key!r} is already bound")
            entry.row_keys[rk] = row
        entry.buffers = buffers
        entry.segment = segment
        if segment is not None:
            entry.shm_name = segment.name
            entry.shm_size = segment.size
            entry.shm_offsets = list(shm_offsets or [])
        cache._owner = self
        cache._buffers = buffers if buffers is not None else segment
        cache._views_factory = lambda: self.views(entry)
        self._engines_register(entry)  # (may refuse: nothing has changed yet)
        # The lease is granted before the table lists the cache: no peer can see the
        # cache without a current lease for it.
        self.leases.grant(entry)
        displaced = self.table.blocks(model_id) if model_id is not None else None
        self.entries[cache.cache_id] = entry
        self.table.add(entry)
        if displaced is not None and displaced is not entry:
            # It lost its model_id binding (last registration wins): peers that resolved
            # the key to it must not keep reading it under the key's old meaning.
            self.leases.renew(displaced)
        if segment is not None:
            # Same-host peers get the segment's fd before the table update that lists it
            # (and only once nothing can fail: an fd never listed would pin the memory).
            self.leases.push_segment(segment.name, segment.size, segment.fd)
        self.on_change()
        return cache

    def _engines_register(self, entry: CacheEntry) -> None:
        done = []
        try:
            for agent in self.engines:
                if entry.device_id is not None and not agent.moves_device_memory:
                    continue  # (it never moves this cache: the path choice skips it)
                agent.register(entry)
                done.append(agent)
        except BaseException:
            for agent in done:
                agent.deregister(entry)
            raise

    def _engines_deregister(self, entry: CacheEntry) -> None:
        for agent in self.engines:
            if entry.device_id is not None and not agent.moves_device_memory:
                continue  # (never registered with it)
            try:
                agent.deregister(entry)
            except Exception:
                log.warning("engine %s: deregistering cache %d failed", agent.kind, entry.cache_id)

    def views(self, entry: CacheEntry) -> list[Any]:
        """``KvCache.tensors()``: one numpy view per tensor of a live cache.

        Raises:
            LLMCacheNotFoundError: the cache was freed.
        """
        import numpy as np

        if entry.freed:
            raise failure(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"cache {entry.cache_id} was freed",
                api="tensors",
            )
        assert entry.cache is not None
        require_host_memory("tensors", entry)
        desc = entry.cache.cache_desc
        dtype = desc.data_type.to_numpy()
        count = desc.size // dtype.itemsize
        views = []
        for t, addr in enumerate(entry.addrs):
            if entry.segment is not None:
                off = entry.shm_offsets[t]
                raw = np.frombuffer(
                    memoryview(entry.segment), dtype=np.uint8, count=desc.size, offset=off
                )
            elif entry.buffers is not None:
                raw = np.frombuffer(entry.buffers[t], dtype=np.uint8, count=desc.size)
            else:
                raw = np.ctypeslib.as_array((ctypes.c_ubyte * desc.size).from_address(addr))
            views.append(raw.view(dtype)[:count].reshape(desc.shape))
        return views

    # ------------------------------------------------------------------- freeing

    def free(
        self, cache_id: int, *, allocated: bool | None, blocks: bool | None, bound: float
    ) -> None:
        """Frees a cache; unknown ids (and deallocating a registered one) are a no-op.

        One-sided peers first: the lease is revoked on every link's page, waiting (at
        most ``bound`` seconds, the GIL released) until no peer copy under it is left;
        then our own transfers. Nothing changes unless both are done.

        Raises:
            LLMParamError: ``allocated`` / ``blocks`` do not match the cache.
            LLMLinkError: LLM_LINK_BUSY while a transfer or a peer's copy uses it.
        """
        entry = self.entries.get(cache_id)
        if entry is None:
            return  # upstream: unknown ids are a no-op
        if allocated is not None and (entry.segment is not None) != allocated:
            if allocated:
                return  # upstream: deallocate of a registered cache is a no-op
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID, f"cache {cache_id} was allocated; use deallocate_*"
            )
        if blocks is not None and entry.is_blocks != blocks:
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"cache {cache_id} is {'a' if entry.is_blocks else 'not a'} blocks cache",
            )
        if not self.leases.revoke(entry, bound):
            raise failure(
                LLMStatusCode.LLM_LINK_BUSY,
                f"cache {cache_id} is still being copied by a linked peer after {bound:g} s; "
                "it stays registered",
            )
        try:
            entry.mark_freed()
        except BaseException:
            self.leases.restore(entry)
            # Peers on other hosts lease it per transfer (_engine_lease.py): back-to-back
            # pulls would keep it held at every attempt. No new lease for a moment, so a
            # retried free finds the transfers in flight ended.
            entry.no_leases_until = time.monotonic() + LEASE_PAUSE_S
            raise
        self._engines_deregister(entry)  # the lease is revoked: no peer copy runs under it
        self.leases.release(entry)
        del self.entries[cache_id]
        self.table.remove(cache_id)
        # The mapping goes when the last numpy view of the segment does (nothing is named).
        entry.segment = None
        entry.buffers = None
        if entry.cache is not None:
            entry.cache._views_factory = None
            entry.cache._buffers = None
        self.on_change()

    def remove_key(self, key: CacheKey) -> None:
        """Unbinds a row key (unknown keys are a no-op)."""
        rk = row_key(key)
        hit = self.table.row(rk)
        self.table.remove_row_key(rk)
        if hit is not None:
            # Peers that resolved the key must not keep reading the row under it.
            self.leases.renew(hit[0])
        self.on_change()

    def free_all(self, timeout: float = 1.0) -> None:
        """Finalize: frees every cache. Revoking their leases waits for peer copies at most
        ``timeout`` seconds in all; a cache still copied (by a peer or our own job) is
        leaked with a warning: its memory stays mapped for the life of the process."""
        end = time.monotonic() + timeout
        for entry in list(self.entries.values()):
            revoked = self.leases.revoke(entry, max(0.0, end - time.monotonic()))
            if entry.busy or not revoked:
                if revoked:
                    self.leases.restore(entry)
                log.warning(
                    "finalize: cache %d still in use by a transfer; not freed", entry.cache_id
                )
                # The memory stays (a job may still write into it); segments are nameless,
                # so nothing is left behind in /dev/shm when this process exits.
                _LEAKED.append(entry)
                continue
            entry.freed = True
            self._engines_deregister(entry)
            self.leases.release(entry)
            if entry.cache is not None:
                entry.cache._views_factory = None
            entry.segment = None
            entry.buffers = None
        self.entries.clear()
        self.table.clear()
        self.leases.close()
