"""``CacheManager.copy_cache``, ``swap_blocks`` (copies between this instance's caches) and
``remap_registered_memory``.

A mixin of :class:`~aiodatadist.cache_manager.CacheManager`. Each call is checked,
then becomes one :class:`~aiodatadist._plan.LocalCopyRequest` that
:func:`aiodatadist._runner.copy` runs on the executor (the GIL released) under the
call's deadline, holding the registered caches it touches.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from . import _runner
from ._bridge import public
from ._caches import CacheEntry, require_host_memory
from ._checks import row_copy_segments
from ._plan import LocalCopyRequest
from ._validate import check_int, check_timeout, check_type, check_uint, require
from .errors import LLMStatusCode, failure
from .types import KvCache, MemInfo, Memtype, Placement

if TYPE_CHECKING:
    from ._registration import CacheRegistry
    from ._runtime import Runtime

__all__ = ["LocalMixin"]

log = logging.getLogger("aiodatadist.cache_manager")

_SWAPS = {(Placement.HOST, Placement.DEVICE), (Placement.DEVICE, Placement.HOST)}


class LocalMixin:
    """``copy_cache``, ``swap_blocks`` and ``remap_registered_memory``."""

    _rt: Runtime
    _caches: CacheRegistry

    @public("copy_cache")
    async def copy_cache(
        self,
        dst: KvCache,
        src: KvCache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: int | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Copies ``size`` bytes at ``offset`` of row ``src_batch_index`` of every tensor of
        ``src`` into the same offset of row ``dst_batch_index`` of the same tensor of ``dst``.

        Args:
            dst, src: non-block caches of this instance with the same tensor count
                (the same cache is fine for two different rows).
            dst_batch_index, src_batch_index: the rows.
            offset: bytes into each row.
            size: bytes per tensor, > 0; -1 = the rest of the source row after ``offset``.
                ``offset + size`` must fit both rows.
            req_id: a uint64 for the logs only.
            timeout: seconds for the copy; None = ``sync_kv_timeout``.

        Raises:
            TypeError, LLMParamError: bad arguments, before anything is copied.
            LLMTimeoutError: the deadline passed (the copy was aborted and has returned;
                the named bytes of ``dst`` are undefined).
        """
        self._rt.require_ready()
        d = self._caches.live("dst", dst)
        s = self._caches.live("src", src)
        segments = row_copy_segments(d, s, dst_batch_index, src_batch_index, offset, size)
        if req_id is not None:
            check_uint("req_id", req_id, 64)
        tmo = check_timeout("timeout", timeout)
        log.debug("copy_cache req_id=%s: %d segments", req_id, len(segments))
        holds = (s,) if s is d else (s, d)
        require_host_memory("copy_cache", *holds)
        request = LocalCopyRequest(s, d, segments, self._rt.deadline(tmo), holds)
        await _runner.copy(self._rt, request)

    def _swap_side(self, name: str, cache: object) -> tuple[CacheEntry, tuple[CacheEntry, ...]]:
        """The entry of one side of ``swap_blocks`` and the registered caches it lives in.

        A ``KvCache.create_cpu_cache`` handle (``cache_id`` -1, not registered) is
        accepted only when every one of its tensors lies inside one tensor of a cache this
        instance registered or allocated: the copy never touches other memory.
        """
        check_type(name, cache, KvCache)
        assert isinstance(cache, KvCache)
        if cache.cache_id != -1:
            entry = self._caches.live(name, cache)
            return entry, (entry,)
        desc = cache.cache_desc
        entry = CacheEntry.for_cache(cache, desc, cache.tensor_addrs)
        holds: list[CacheEntry] = []
        for t, addr in enumerate(entry.addrs):
            home = self._registered_home(addr, entry.tensor_bytes)
            require(
                home is not None,
                f"{name}.tensor_addrs[{t}] ({addr:#x}, {entry.tensor_bytes} bytes) is not "
                "inside memory this instance registered or allocated",
            )
            assert home is not None
            if home not in holds:
                holds.append(home)
        return entry, tuple(holds)

    def _registered_home(self, addr: int, nbytes: int) -> CacheEntry | None:
        for e in list(self._caches.entries.values()):
            if e.freed:
                continue
            size = e.tensor_bytes
            for base in e.addrs:
                if base <= addr and addr + nbytes <= base + size:
                    return e
        return None

    @public("swap_blocks")
    async def swap_blocks(
        self,
        src_cache: KvCache,
        dst_cache: KvCache,
        src_to_dst: Mapping[int, int],
        *,
        timeout: float | None = None,
    ) -> None:
        """Copies block ``s`` of every tensor of ``src_cache`` to block ``src_to_dst[s]``
        of the same tensor of ``dst_cache`` (upstream's swap in / swap out).

        Both are blocks caches with the same block size and tensor count, one placed
        ``HOST`` and the other ``DEVICE`` (upstream's rule; here the placement is a label,
        every cache is host memory). The host side may be a ``KvCache.create_cpu_cache``
        handle: it is not registered, so it is accepted only when each of its tensors
        lies inside a tensor of a cache this instance registered or allocated
        (``LLMParamError`` otherwise), and its memory must not overlap the other side's.

        Raises:
            TypeError, LLMParamError: bad arguments, before anything is copied.
            LLMTimeoutError: the deadline passed (the copy was aborted and has returned).
        """
        self._rt.require_ready()
        src, src_holds = self._swap_side("src_cache", src_cache)
        dst, dst_holds = self._swap_side("dst_cache", dst_cache)
        require(src.is_blocks, "src_cache must be a blocks cache")
        require(dst.is_blocks, "dst_cache must be a blocks cache")
        check_type("src_to_dst", src_to_dst, Mapping)
        require(
            src.block_bytes == dst.block_bytes,
            f"src block size {src.block_bytes} and dst block size {dst.block_bytes} must be equal",
        )
        require(
            src.num_tensors == dst.num_tensors,
            f"src num_tensors {src.num_tensors} and dst num_tensors {dst.num_tensors} must "
            "be equal",
        )
        # A destination block is named at most once: no dict may be longer than it.
        require(
            len(src_to_dst) <= dst.num_blocks,
            f"src_to_dst names {len(src_to_dst)} blocks; dst_cache holds {dst.num_blocks}",
        )
        pairs = [
            (
                check_int("src_to_dst key", s, min_value=0, max_value=src.num_blocks - 1),
                check_int(f"src_to_dst[{s}]", d, min_value=0, max_value=dst.num_blocks - 1),
            )
            for s, d in src_to_dst.items()
        ]
        placements = (Placement(src.placement), Placement(dst.placement))
        require(
            placements in _SWAPS,
            f"swap from placement {placements[0]} to {placements[1]} is not supported "
            "(HOST -> DEVICE or DEVICE -> HOST)",
        )
        if src_cache.cache_id == -1 or dst_cache.cache_id == -1:
            _require_apart(src, dst)
        tmo = check_timeout("timeout", timeout)
        if not pairs:
            return
        bb = src.block_bytes
        segments = tuple(
            (t, s * bb, t, d * bb, bb) for t in range(src.num_tensors) for s, d in pairs
        )
        holds = tuple(dict.fromkeys(src_holds + dst_holds))
        require_host_memory("swap_blocks", *holds)
        request = LocalCopyRequest(src, dst, segments, self._rt.deadline(tmo), holds)
        await _runner.copy(self._rt, request)

    @public("remap_registered_memory")
    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """Upstream's recovery call after a device-memory fault (HBM UCE): re-maps the
        physical pages behind registered device memory. Reserved upstream too.

        The arguments are checked as upstream (``MemInfo`` or a list of them, device
        type, non-null address, size > 0). Every region must then lie inside device
        memory registered with this instance. The host data paths register host memory
        only (a ``Placement.DEVICE`` cache here is a label on host memory), which has no
        fault remapping, so every call is refused with ``LLM_PARAM_INVALID`` after the
        checks: it never reports a remap that did not happen. Device memory comes with
        the fabric data paths.

        Raises:
            LLMParamError: a check failed, or a region is not registered device memory.
        """
        self._rt.require_ready()
        infos = mem_infos if isinstance(mem_infos, list) else [mem_infos]
        require(
            isinstance(mem_infos, (list, MemInfo)),
            f"mem_infos must be a MemInfo or a list of MemInfo, got {type(mem_infos).__name__}",
        )
        for i, info in enumerate(infos):
            require(
                isinstance(info, MemInfo),
                f"mem_infos[{i}] must be a MemInfo, got {type(info).__name__}",
            )
            require(
                info.mem_type == Memtype.MEM_TYPE_DEVICE,
                f"mem_infos[{i}].mem_type must be Memtype.MEM_TYPE_DEVICE",
            )
            require(info.addr != 0, f"mem_infos[{i}].addr must not be zero")
            require(info.size > 0, f"mem_infos[{i}].size must be > 0")
        for i, info in enumerate(infos):
            found = self._caches.table.containing(info.addr, info.size)
            where = (
                "is not registered memory of this instance"
                if found is None
                else f"is host memory (cache {found[0].cache_id}), which has no fault remapping"
            )
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"mem_infos[{i}] [{info.addr:#x}, +{info.size}) {where}; remapping needs device "
                "memory registered through a fabric data path",
            )


def _require_apart(a: CacheEntry, b: CacheEntry) -> None:
    """No tensor of ``a`` shares a byte with a tensor of ``b`` (a CPU handle may wrap any
    registered memory, including the other side's)."""
    for x in a.addrs:
        for y in b.addrs:
            require(
                not (x < y + b.tensor_bytes and y < x + a.tensor_bytes),
                "src_cache and dst_cache share memory: a swap needs two distinct memories",
            )
