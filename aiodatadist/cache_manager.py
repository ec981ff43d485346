"""``CacheManager``: registration, allocation and every transfer of one instance.

Every coroutine here follows the one path of DESIGN.md: validate (TypeError /
ValueError before anything is queued), one deadline for the whole call, find
the link, build the plan, take the link's FIFO slot, run the native job on the
dedicated executor. On timeout the native job is aborted, the call raises
``LLMException(LLM_TIMEOUT)`` (also a ``TimeoutError``) once the job has
returned, and the link stays usable. On cancel the same quiescence rule holds
and ``CancelledError`` propagates.
"""

from __future__ import annotations

import asyncio
import copy
import ctypes
import inspect
import itertools
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import _native
from ._bridge import bridged
from ._caches import CacheEntry, CacheTable
from ._leases import LeaseBook, LeaseStale
from ._validate import (
    INT32_MAX,
    INT64_MAX,
    INVALID_ID,
    check_int,
    check_int_list,
    check_layer_range,
    check_sint,
    check_timeout,
    check_type,
    check_uint,
    require,
)
from .errors import LLMException, LLMStatusCode, format_error, from_native
from .transports.base import Call
from .types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    KvCache,
    LayerSynchronizer,
    LLMRole,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

if TYPE_CHECKING:
    from .datadist import LLMDataDist
    from .links import Link

__all__ = ["CacheManager", "CacheTask"]

log = logging.getLogger("aiodatadist.cache_manager")

_cache_ids = itertools.count(1)  # upstream: int64 ids starting at 1, per process
_shm_ids = itertools.count(1)
# Caches finalize could not free (a copy still ran): kept alive, never unmapped under it.
_LEAKED: list[CacheEntry] = []
_TENSOR_ALIGN = 4096


def _err(api: str, code: LLMStatusCode, info: str) -> LLMException:
    return LLMException(format_error(api, code, info), status_code=code)


def _param(api: str, info: str) -> LLMException:
    return _err(api, LLMStatusCode.LLM_PARAM_INVALID, info)


def _tensor_span(
    api: str,
    src_tensors: int,
    dst_tensors: int,
    src_layer_range: range | None,
    dst_layer_range: range | None,
    tensor_num_per_layer: int,
) -> tuple[int, int, int]:
    """Layer ranges -> (src tensor start, dst tensor start, tensor count), as upstream.

    Layer ``l`` is tensors ``[l*T, (l+1)*T)``. A missing range means every
    tensor of that side; the two sides must then select the same count.
    """
    t = tensor_num_per_layer
    if src_layer_range is not None or dst_layer_range is not None:
        for side, n in (("source", src_tensors), ("destination", dst_tensors)):
            if n % t:
                raise _param(
                    api,
                    f"tensor_num_per_layer={t} does not divide the {side} cache's {n} tensors",
                )
    if src_layer_range is not None:
        src_start, src_count = src_layer_range.start * t, len(src_layer_range) * t
        if src_start + src_count > src_tensors:
            raise _param(
                api,
                f"src_layer_range={src_layer_range!r} selects tensors "
                f"[{src_start}, {src_start + src_count}) of a source cache with {src_tensors}",
            )
    else:
        src_start, src_count = 0, src_tensors
    if dst_layer_range is not None:
        dst_start, dst_count = dst_layer_range.start * t, len(dst_layer_range) * t
        if dst_start + dst_count > dst_tensors:
            raise _param(
                api,
                f"dst_layer_range={dst_layer_range!r} selects tensors "
                f"[{dst_start}, {dst_start + dst_count}) of a destination cache with "
                f"{dst_tensors}",
            )
    else:
        dst_start, dst_count = 0, dst_tensors
    if src_count != dst_count:
        raise _param(
            api,
            f"source and destination select different tensor counts ({src_count} != "
            f"{dst_count}; src_layer_range={src_layer_range!r}, "
            f"dst_layer_range={dst_layer_range!r}, tensor_num_per_layer={t})",
        )
    return src_start, dst_start, src_count


def _check_tensor_num(value: object) -> int:
    t = check_uint("tensor_num_per_layer", value, 32)
    require(t > 0, f"tensor_num_per_layer must be > 0, got {t}")
    return t


def _check_timeout(value: object) -> float | None:
    # Finite and bounded: an inf/NaN deadline reaches timers and the wire as garbage.
    return check_timeout("timeout", value)


def _plan(api: str, build: Any, *args: Any) -> _native.Plan:
    try:
        plan: _native.Plan = build(*args)
    except _native.NativeError as e:
        raise from_native(e, api) from e
    return plan


def _segments(rows: list[tuple[int, int, int, int, int]]) -> Any:
    import numpy as np

    return np.asarray(rows, dtype=np.uint64).reshape(-1, 5)


class CacheTask:
    """The handle ``transfer_cache_async`` returns: one background layer pipeline.

    Awaiting the task itself is ``await task.synchronize()``. Like the instance's own
    coroutines, its coroutines awaited on another thread's loop run on the loop that
    runs the pipeline (the instance's loop).
    """

    def __init__(self, num_configs: int) -> None:
        self._results: list[LLMStatusCode | None] = [None] * num_configs
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _start(self, task: asyncio.Task[None]) -> None:
        self._task = task
        self._loop = task.get_loop()

    def _home_loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def done(self) -> bool:
        return self._task is not None and self._task.done()

    async def _wait(self, timeout_in_millis: int | None) -> bool:
        assert self._task is not None
        timeout = None
        if timeout_in_millis is not None:
            # int32 ms, as upstream: a larger one would overflow the loop's timer.
            ms = check_int("timeout_in_millis", timeout_in_millis, min_value=0, max_value=INT32_MAX)
            timeout = ms / 1000
        # asyncio.wait never cancels the pipeline: a timed-out synchronize leaves it running.
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        return bool(done)

    @bridged
    async def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Waits for the pipeline; the first failure, else ``LLM_SUCCESS``.

        ``LLM_FAILED`` when the pipeline was stopped (``cancel``, ``finalize``) before
        every config completed: success means every layer of every config landed.
        On timeout returns ``LLM_TIMEOUT`` and the pipeline keeps running (as upstream).
        A cancel of the awaiting task does not cancel the pipeline either.

        Raises:
            TypeError, LLMParamError: a bad ``timeout_in_millis``.
        """
        if not await self._wait(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        for r in self._results:
            if r is not None and r != LLMStatusCode.LLM_SUCCESS:
                return r
        if any(r is None for r in self._results):
            return LLMStatusCode.LLM_FAILED  # stopped without a recorded failure: cancelled
        return LLMStatusCode.LLM_SUCCESS

    @bridged
    async def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """One status per transfer config.

        ``LLM_SUCCESS`` once a config's last layer was sent; the failing config's status
        for the failure that stopped the job; ``None`` for a config that did not complete
        (never started, or stopped part-way by another config's failure, a False from
        ``synchronize_layer`` or a cancel). If the pipeline is still running after the
        timeout, every entry is ``LLM_TIMEOUT``.

        Raises:
            TypeError, LLMParamError: a bad ``timeout_in_millis``.
        """
        if not await self._wait(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._results)
        return list(self._results)

    @bridged
    async def cancel(self) -> None:
        """Stops the pipeline after the layer in flight (that layer is aborted and awaited)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})

    def __await__(self) -> Any:
        return self.synchronize().__await__()


async def _stop_abandoned(task: CacheTask) -> None:
    """A CacheTask whose caller was cancelled before it got the task: stop its pipeline."""
    await task.cancel()


class CacheManager:
    """Registers caches and moves blocks between this instance and its linked peers.

    Obtained as ``LLMDataDist.cache_manager`` (alias ``kv_cache_manager``).
    Registration calls are synchronous, like upstream; every transfer is a coroutine.
    """

    def __init__(self, owner: LLMDataDist) -> None:
        self._dd = owner
        self.table = CacheTable()
        self._entries: dict[int, CacheEntry] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Leases of our caches for one-sided peers (aiodatadist._leases).
        self.leases = LeaseBook(f"/aiodd-{os.getpid()}-{owner.cluster_id}")
        self.leases.set_segments(self._live_segments)

    def _live_segments(self) -> list[tuple[str, int, int]]:
        return [
            (e.segment.name, e.segment.size, e.segment.fd)
            for e in list(self._entries.values())
            if e.segment is not None and not e.freed
        ]

    # ------------------------------------------------------------------ helpers

    def _home_loop(self) -> asyncio.AbstractEventLoop | None:
        return self._dd._loop

    def _require_ready(self) -> None:
        self._dd._require_initialized()

    def _deadline(self, timeout: float | None) -> float:
        loop = asyncio.get_running_loop()
        if timeout is None:
            timeout = self._dd._options.sync_kv_timeout_ms / 1000
        return loop.time() + timeout

    def _call(self, api: str, deadline: float | None) -> Call:
        return Call(
            api=api,
            deadline=deadline,
            executor=self._dd._executor_or_raise(),
            mover_threads=self._dd._options.mover_threads,
        )

    def _entry_of(self, api: str, name: str, cache: object) -> CacheEntry:
        check_type(name, cache, KvCache)
        assert isinstance(cache, KvCache)
        entry = self._entries.get(cache.cache_id)
        if entry is None or entry.cache is not cache or entry.freed:
            raise _param(
                api, f"{name} (cache_id {cache.cache_id}) is not a live cache of this instance"
            )
        return entry

    def _require_role(self, api: str, *roles: LLMRole) -> None:
        if self._dd.role not in roles:
            allowed = " or ".join(r.name for r in roles)
            raise _err(
                api,
                LLMStatusCode.LLM_FAILED,
                f"{api} may only be called on a {allowed} instance; this one is "
                f"{self._dd.role.name}",
            )

    # ------------------------------------------------------------ registration

    def _buffers_to_addrs(
        self, desc: CacheDesc, addrs: object
    ) -> tuple[list[int], list[Any] | None]:
        check_type("addrs", addrs, (list, tuple))
        assert isinstance(addrs, (list, tuple))
        require(len(addrs) > 0, "addrs must not be empty")
        require(
            len(addrs) == desc.num_tensors,
            f"addrs must have cache_desc.num_tensors ({desc.num_tensors}) entries, "
            f"got {len(addrs)}",
        )
        if all(isinstance(a, int) and not isinstance(a, bool) for a in addrs):
            out = check_int_list("addrs", addrs)
            for i, a in enumerate(out):
                require(a != 0, f"addrs[{i}] is a null address")
            return out, None
        result: list[int] = []
        keep: list[Any] = []
        for i, obj in enumerate(addrs):
            if isinstance(obj, int) and not isinstance(obj, bool):
                raise TypeError(
                    "addrs must be all int addresses or all buffer objects, "
                    f"got a mix (addrs[{i}] is int)"
                )
            try:
                view = memoryview(obj)
            except TypeError:
                raise TypeError(
                    f"addrs[{i}] must be an int address or a buffer (numpy array, bytearray, ...), "
                    f"got {type(obj).__name__}"
                ) from None
            require(view.c_contiguous, f"addrs[{i}] is not C-contiguous")
            require(not view.readonly, f"addrs[{i}] is read-only; a cache must be writable")
            require(
                view.nbytes >= desc.size,
                f"addrs[{i}] holds {view.nbytes} bytes, cache_desc needs {desc.size} per tensor",
            )
            flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            addr = ctypes.addressof(ctypes.c_char.from_buffer(flat))
            result.append(addr)
            keep.append(flat)
        return result, keep

    def _check_no_overlap(self, addrs: list[int], size: int) -> None:
        spans = sorted((a, a + size) for a in addrs)
        for (_, end), (start, _) in itertools.pairwise(spans):
            require(start >= end, "the tensors of one cache overlap each other")
        for entry in self._entries.values():
            other = entry.tensor_bytes
            for b in entry.addrs:
                for a in addrs:
                    if a < b + other and b < a + size:
                        raise _param(
                            "register",
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
    ) -> KvCache:
        cache = KvCache(next(_cache_ids), desc, addrs, is_blocks_cache=is_blocks)
        entry = CacheEntry.for_cache(cache, desc, addrs)
        entry.model_id = model_id
        for row, key in enumerate(row_keys):
            key_id = key.req_id if key.req_id != INVALID_ID else key.prefix_id
            if key_id == INVALID_ID:
                continue  # upstream's placeholder for an unused row
            rk = (key_id, key.model_id)
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
        cache._views_factory = lambda: self._views(entry)
        # The lease is granted before the table lists the cache: no peer can see the
        # cache without a current lease for it.
        self.leases.grant(entry)
        displaced = self.table.blocks(model_id) if model_id is not None else None
        self._entries[cache.cache_id] = entry
        self.table.add(entry)
        if displaced is not None and displaced is not entry:
            # It lost its model_id binding (last registration wins): peers that resolved
            # the key to it must not keep reading it under the key's old meaning.
            self.leases.renew(displaced)
        if segment is not None:
            # Same-host peers get the segment's fd before the table update that lists it
            # (and only once nothing can fail: an fd never listed would pin the memory).
            self.leases.push_segment(segment.name, segment.size, segment.fd)
        self._dd._table_changed()
        return cache

    def _views(self, entry: CacheEntry) -> list[Any]:
        import numpy as np

        if entry.freed:
            raise _err(
                "tensors", LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {entry.cache_id} was freed"
            )
        assert entry.cache is not None
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

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Sequence[int] | Sequence[Any],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> KvCache:
        """Registers user memory as a blocks (paged) cache.

        Args:
            cache_desc: ``num_tensors`` tensors of ``shape``; ``shape[0]`` is the block count.
            addrs: one address per tensor (ints, as upstream), or one buffer per tensor
                (numpy arrays, bytearrays, ...: then contiguity, writability and size are
                checked and a reference is kept until the cache is unregistered).
            blocks_cache_key: makes the cache pullable by peers under its ``model_id``.
                Upstream keeps one blocks cache per ``model_id``: a later registration with
                the same ``model_id`` replaces the earlier one in the index (last wins).
            remote_accessible: accepted for compatibility; every cache is reachable by
                linked peers here.

        Raises:
            TypeError: an argument has the wrong type.
            LLMParamError: sizes, counts or overlapping addresses are wrong.
        """
        self._require_ready()
        check_type("cache_desc", cache_desc, CacheDesc)
        if blocks_cache_key is not None:
            check_type("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        if remote_accessible is not None:
            check_type("remote_accessible", remote_accessible, bool)
        addr_list, buffers = self._buffers_to_addrs(cache_desc, addrs)
        self._check_no_overlap(addr_list, cache_desc.size)
        return self._add(
            cache_desc,
            addr_list,
            True,
            model_id=None if blocks_cache_key is None else blocks_cache_key.model_id,
            row_keys=(),
            buffers=buffers,
        )

    def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Sequence[int] | Sequence[Any],
        cache_keys: Sequence[CacheKey] = (),
        remote_accessible: bool | None = None,
    ) -> KvCache:
        """Registers user memory as a non-block cache; ``cache_keys[i]`` names batch row ``i``.

        Raises:
            TypeError: an argument has the wrong type.
            LLMParamError: sizes, counts, duplicate keys or overlapping addresses.
        """
        self._require_ready()
        check_type("cache_desc", cache_desc, CacheDesc)
        keys = self._check_row_keys(cache_desc, cache_keys)
        if remote_accessible is not None:
            check_type("remote_accessible", remote_accessible, bool)
        addr_list, buffers = self._buffers_to_addrs(cache_desc, addrs)
        self._check_no_overlap(addr_list, cache_desc.size)
        return self._add(
            cache_desc, addr_list, False, model_id=None, row_keys=keys, buffers=buffers
        )

    @staticmethod
    def _check_row_keys(desc: CacheDesc, cache_keys: object) -> list[CacheKey]:
        check_type("cache_keys", cache_keys, (list, tuple))
        assert isinstance(cache_keys, (list, tuple))
        for i, k in enumerate(cache_keys):
            check_type(f"cache_keys[{i}]", k, CacheKey)
        require(
            len(cache_keys) <= desc.shape[0],
            f"cache_keys has {len(cache_keys)} keys for a batch of {desc.shape[0]} rows",
        )
        return list(cache_keys)

    def _allocate(
        self, desc: CacheDesc, is_blocks: bool, model_id: int | None, keys: Sequence[CacheKey]
    ) -> KvCache:
        stride = -(-desc.size // _TENSOR_ALIGN) * _TENSOR_ALIGN
        total = stride * desc.num_tensors
        name = f"/aiodd-{os.getpid()}-{self._dd.cluster_id}-{next(_shm_ids)}"
        try:
            segment = _native.ShmSegment.create(name, total)
        except _native.NativeError as e:
            raise from_native(e, "allocate_cache") from e
        offsets = [t * stride for t in range(desc.num_tensors)]
        addrs = [segment.addr + o for o in offsets]
        try:
            return self._add(
                desc,
                addrs,
                is_blocks,
                model_id=model_id,
                row_keys=keys,
                segment=segment,
                shm_offsets=offsets,
            )
        except BaseException:
            segment.close()
            raise

    def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> KvCache:
        """Allocates a blocks cache in shared memory (zero-filled); see ``register_blocks_cache``.

        Shared memory lets a decoder on the same host map the cache once and copy
        from it one-sidedly (the ``shm`` data path).
        """
        self._require_ready()
        check_type("cache_desc", cache_desc, CacheDesc)
        if blocks_cache_key is not None:
            check_type("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        return self._allocate(cache_desc, True, model_id, ())

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> KvCache:
        """Allocates a non-block cache in shared memory; ``cache_keys[i]`` names row ``i``."""
        self._require_ready()
        check_type("cache_desc", cache_desc, CacheDesc)
        keys = self._check_row_keys(cache_desc, cache_keys)
        return self._allocate(cache_desc, False, None, keys)

    def _free(
        self, api: str, cache_id: int, *, allocated: bool | None, blocks: bool | None
    ) -> None:
        entry = self._entries.get(cache_id)
        if entry is None:
            return  # upstream: unknown ids are a no-op
        if allocated is not None and (entry.segment is not None) != allocated:
            if allocated:
                return  # upstream: deallocate of a registered cache is a no-op
            raise _param(api, f"cache {cache_id} was allocated; use deallocate_*")
        if blocks is not None and entry.is_blocks != blocks:
            raise _param(
                api,
                f"cache {cache_id} is {'a' if entry.is_blocks else 'not a'} blocks cache",
            )
        # One-sided peers first: revoke the lease on every link's page and wait (bounded,
        # GIL released) until no peer copy under it is left; then our own transfers.
        bound = self._dd._options.sync_kv_timeout_ms / 1000
        if not self.leases.revoke(entry, bound):
            raise _err(
                api,
                LLMStatusCode.LLM_LINK_BUSY,
                f"cache {cache_id} is still being copied by a linked peer after {bound:g} s; "
                "it stays registered",
            )
        try:
            entry.mark_freed(api)
        except BaseException:
            self.leases.restore(entry)
            raise
        self.leases.release(entry)
        del self._entries[cache_id]
        self.table.remove(cache_id)
        # The mapping goes when the last numpy view of the segment does (nothing is named).
        entry.segment = None
        entry.buffers = None
        if entry.cache is not None:
            entry.cache._views_factory = None
            entry.cache._buffers = None
        self._dd._table_changed()

    def unregister_cache(self, cache_id: int) -> None:
        """Removes a registered cache and its index entries; unknown ids are a no-op.

        Revokes the cache's lease first: waits (blocking, the GIL released) until no
        linked peer's one-sided copy under it is left, at most ``sync_kv_timeout``; after
        a successful return no peer reads or writes the memory any more.

        Raises:
            LLMLinkError: LLM_LINK_BUSY while a transfer of this process uses the cache,
                or a peer's copy still held the lease at the bound; nothing changed.
        """
        self._require_ready()
        cid = check_sint("cache_id", cache_id, 64)
        self._free("unregister_cache", cid, allocated=False, blocks=None)

    def deallocate_cache(self, cache: KvCache) -> None:
        """Frees a non-block cache made by ``allocate_cache`` (no-op for registered ones).

        Waits for peers' one-sided copies as ``unregister_cache`` does.

        Raises:
            LLMLinkError: LLM_LINK_BUSY as ``unregister_cache``; nothing changed.
        """
        self._require_ready()
        check_type("cache", cache, KvCache)
        self._free("deallocate_cache", cache.cache_id, allocated=True, blocks=False)

    def deallocate_blocks_cache(self, cache: KvCache) -> None:
        """Frees a blocks cache made by ``allocate_blocks_cache`` (no-op for registered ones).

        Waits for peers' one-sided copies as ``unregister_cache`` does.

        Raises:
            LLMLinkError: LLM_LINK_BUSY as ``unregister_cache``; nothing changed.
        """
        self._require_ready()
        check_type("cache", cache, KvCache)
        self._free("deallocate_blocks_cache", cache.cache_id, allocated=True, blocks=True)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbinds a row key: peers can no longer pull that row. Unknown keys are a no-op."""
        self._require_ready()
        check_type("cache_key", cache_key, CacheKey)
        key_id = cache_key.req_id if cache_key.req_id != INVALID_ID else cache_key.prefix_id
        hit = self.table.row((key_id, cache_key.model_id))
        self.table.remove_row_key((key_id, cache_key.model_id))
        if hit is not None:
            # Peers that resolved the key must not keep reading the row under it.
            self.leases.renew(hit[0])
        self._dd._table_changed()

    # --------------------------------------------------------------- transfers

    def _remote_source(
        self, api: str, link: Link, key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey
    ) -> tuple[CacheEntry, int]:
        """The peer's cache a key names, and the row (0 for a blocks key)."""
        table = link.channel.remote_table
        if isinstance(key, BlocksCacheKey):
            entry = table.blocks(key.model_id)
            if entry is None:
                raise _err(
                    api,
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"cluster {key.cluster_id} has no blocks cache for model_id {key.model_id}",
                )
            return entry, 0
        if isinstance(key, CacheKeyByIdAndIndex):
            entry = table.by_id(key.cache_id)
            if entry is None:
                raise _err(
                    api,
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"cluster {key.cluster_id} has no cache with cache_id {key.cache_id}",
                )
            if key.batch_index >= entry.num_blocks:
                raise _param(
                    api,
                    f"batch_index {key.batch_index} out of range for remote cache "
                    f"{key.cache_id} with {entry.num_blocks} rows",
                )
            return entry, key.batch_index
        key_id = key.req_id if key.req_id != INVALID_ID else key.prefix_id
        hit = table.row((key_id, key.model_id))
        if hit is None:
            raise _err(
                api,
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"cluster {key.cluster_id} has no cache row for {key!r}",
            )
        return hit

    @staticmethod
    def _check_cache_key(key: CacheKey) -> None:
        require(
            (key.req_id == INVALID_ID) != (key.prefix_id == INVALID_ID),
            f"a CacheKey must set exactly one of req_id and prefix_id, got {key!r}",
        )

    def _pull_prologue(
        self,
        api: str,
        key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        tensor_num_per_layer: object,
        src_layer_range: object,
        dst_layer_range: object,
        timeout: object,
    ) -> tuple[int, range | None, range | None, float, Link]:
        """The checks and lookups every pull shares, in upstream's order; then the
        call's one deadline and its link (LLM_NOT_YET_LINK when there is none)."""
        t = _check_tensor_num(tensor_num_per_layer)
        src_lr = check_layer_range("src_layer_range", src_layer_range, allow_none=True)
        dst_lr = check_layer_range("dst_layer_range", dst_layer_range, allow_none=True)
        tmo = _check_timeout(timeout)
        self._require_role(api, LLMRole.DECODER, LLMRole.MIX)
        if key.cluster_id == self._dd.cluster_id:
            raise _param(
                api, f"cannot pull from this instance's own cluster_id {self._dd.cluster_id}"
            )
        deadline = self._deadline(tmo)
        return t, src_lr, dst_lr, deadline, self._dd._registry.get(key.cluster_id, api)

    async def _transfer(
        self,
        api: str,
        link: Link,
        build: Any,
        local: CacheEntry,
        deadline: float,
        push: bool,
    ) -> None:
        """Steps 4-7 of the one path: plan, slot, native job, under one deadline."""
        version = link.channel.remote_table.version
        try:
            remote, plan = build()
        except LLMException as e:
            # A registration the peer made just now may still be on its way: one
            # round trip on the link brings every earlier table update in.
            if e.status_code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                raise
            if not await link.channel.refresh(deadline):
                raise
            version = link.channel.remote_table.version
            remote, plan = build()
        async with link.exclusive(deadline, api):
            if link.channel.remote_table.version != version:
                remote, plan = build()  # the peer re-registered while we queued
            local.hold(api)
            try:
                for retry in (False, True):
                    held = remote
                    held.hold(api)
                    try:
                        call = self._call(api, deadline)
                        if push:
                            await link.channel.push(plan, local, held, call)
                        else:
                            await link.channel.pull(plan, held, local, call)
                        link.transfers += 1
                        break
                    except LeaseStale:
                        # A one-sided path found the lease gone before moving a byte: the
                        # peer re-registered or freed the cache. One table refresh and one
                        # retry; stale again: LLM_KV_CACHE_NOT_EXIST (this exception).
                        if retry:
                            raise
                        await link.channel.refresh(deadline)
                        remote, plan = build()
                    finally:
                        held.release()
            finally:
                local.release()

    @bridged
    async def pull_blocks(
        self,
        prompt_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        decoder_kv_cache: KvCache,
        prompt_blocks: Sequence[int] = (),
        decoder_blocks: Sequence[int] = (),
        *,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        timeout: float | None = None,
    ) -> None:
        """Pulls blocks of a linked prompt's cache into ``decoder_kv_cache``.

        For every selected tensor ``t`` and every ``i``, block ``prompt_blocks[i]`` of the
        remote tensor lands in block ``decoder_blocks[i]`` of the local one. With a
        ``CacheKey`` / ``CacheKeyByIdAndIndex`` the remote row is cut into local-block-sized
        chunks and chunk ``i`` lands in ``decoder_blocks[i]`` (``prompt_blocks`` empty).

        Args:
            prompt_cache_key: names the remote cache; its ``cluster_id`` selects the link.
            decoder_kv_cache: a blocks cache of this instance.
            prompt_blocks: remote block ids (required with ``BlocksCacheKey``).
            decoder_blocks: local block ids, non-empty, no duplicates.
            src_layer_range: remote layers (step 1); None = all.
            dst_layer_range: local layers (step 1); None = all.
            tensor_num_per_layer: tensors per layer (K,V = 2); must divide the tensor counts.
            timeout: seconds for the whole call (waiting for the link included);
                None = ``sync_kv_timeout``.

        Raises:
            TypeError, LLMParamError (a ValueError): bad arguments, before anything is queued.
            LLMException: LLM_FAILED on a PROMPT instance.
            LLMLinkError: LLM_NOT_YET_LINK without a link to the key's cluster.
            LLMCacheNotFoundError: the peer has no cache under that key.
            LLMTimeoutError: the deadline passed; the native job was aborted and has returned,
                the named destination blocks are undefined, the link stays usable.
            asyncio.CancelledError: cancelled; raised once the native job has returned.
        """
        api = "pull_blocks"
        self._require_ready()
        check_type(
            "prompt_cache_key", prompt_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey)
        )
        local = self._entry_of(api, "decoder_kv_cache", decoder_kv_cache)
        require(local.is_blocks, "decoder_kv_cache must be a blocks cache")
        # Bounded by the destination: no list can name more blocks than it holds, and no
        # id beyond int64 may reach native code (the source's size is known only later).
        most = local.num_blocks
        src_blocks = check_int_list(
            "prompt_blocks", prompt_blocks, max_len=most, max_value=INT64_MAX
        )
        dst_blocks = check_int_list(
            "decoder_blocks", decoder_blocks, allow_empty=False, max_len=most, max_value=most - 1
        )
        if isinstance(prompt_cache_key, BlocksCacheKey):
            require(len(src_blocks) > 0, "prompt_blocks must not be empty with a BlocksCacheKey")
            require(
                len(src_blocks) == len(dst_blocks),
                f"prompt_blocks and decoder_blocks differ in length "
                f"({len(src_blocks)} != {len(dst_blocks)})",
            )
        else:
            require(
                not src_blocks,
                "prompt_blocks must be empty unless the key is a BlocksCacheKey "
                "(the remote row is cut into decoder blocks)",
            )
            if isinstance(prompt_cache_key, CacheKey):
                self._check_cache_key(prompt_cache_key)
        t, src_lr, dst_lr, deadline, link = self._pull_prologue(
            api, prompt_cache_key, tensor_num_per_layer, src_layer_range, dst_layer_range, timeout
        )

        def build() -> tuple[CacheEntry, _native.Plan]:
            remote, row = self._remote_source(api, link, prompt_cache_key)
            s0, d0, n = _tensor_span(api, remote.num_tensors, local.num_tensors, src_lr, dst_lr, t)
            if isinstance(prompt_cache_key, BlocksCacheKey):
                if not remote.is_blocks:
                    raise _param(api, f"remote cache {remote.cache_id} is not a blocks cache")
                return remote, _plan(
                    api,
                    _native.Plan.blocks,
                    remote.geometry,
                    local.geometry,
                    src_blocks,
                    dst_blocks,
                    s0,
                    d0,
                    n,
                )
            bb = local.block_bytes
            base = row * remote.block_bytes
            if len(dst_blocks) * bb > remote.block_bytes:
                raise _param(
                    api,
                    f"{len(dst_blocks)} decoder blocks of {bb} bytes exceed the remote row of "
                    f"{remote.block_bytes} bytes",
                )
            rows = [
                (s0 + k, base + i * bb, d0 + k, d * bb, bb)
                for k in range(n)
                for i, d in enumerate(dst_blocks)
            ]
            return remote, _plan(
                api, _native.Plan.from_segments, remote.geometry, local.geometry, _segments(rows)
            )

        await self._transfer(api, link, build, local, deadline, push=False)

    @bridged
    async def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        cache: KvCache,
        batch_index: int = 0,
        size: int = -1,
        *,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        timeout: float | None = None,
    ) -> None:
        """Pulls one remote row into row ``batch_index`` of a local non-block cache.

        Args:
            cache_key: ``CacheKey`` (by request or prefix id) or ``CacheKeyByIdAndIndex``.
            cache: a non-block cache of this instance.
            batch_index: the local row.
            size: bytes per tensor; -1 = the local row stride.
            src_layer_range: remote layers (step 1); None = all, as ``pull_blocks``.
            dst_layer_range: local layers (step 1); None = all, as ``pull_blocks``.
            tensor_num_per_layer: tensors per layer (K,V = 2), as ``pull_blocks``.
            timeout: seconds for the whole call; None = ``sync_kv_timeout``, as ``pull_blocks``.

        Raises:
            LLMException: as ``pull_blocks`` (``TypeError`` for a wrong argument type).
        """
        api = "pull_cache"
        self._require_ready()
        check_type("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex))
        local = self._entry_of(api, "cache", cache)
        require(not local.is_blocks, "cache must be a non-block cache (use pull_blocks for blocks)")
        if isinstance(cache_key, CacheKey):
            self._check_cache_key(cache_key)
        bi = check_int("batch_index", batch_index, min_value=0, max_value=local.num_blocks - 1)
        nbytes = check_int("size", size, min_value=-1)
        require(nbytes != 0, "size must be -1 or > 0, got 0")
        if nbytes == -1:
            nbytes = local.block_bytes
        require(
            nbytes <= local.block_bytes,
            f"size {nbytes} exceeds the local row stride of {local.block_bytes} bytes",
        )
        t, src_lr, dst_lr, deadline, link = self._pull_prologue(
            api, cache_key, tensor_num_per_layer, src_layer_range, dst_layer_range, timeout
        )

        def build() -> tuple[CacheEntry, _native.Plan]:
            remote, row = self._remote_source(api, link, cache_key)
            if nbytes > remote.block_bytes:
                raise _param(
                    api, f"size {nbytes} exceeds the remote row of {remote.block_bytes} bytes"
                )
            s0, d0, n = _tensor_span(api, remote.num_tensors, local.num_tensors, src_lr, dst_lr, t)
            rows = [
                (s0 + k, row * remote.block_bytes, d0 + k, bi * local.block_bytes, nbytes)
                for k in range(n)
            ]
            return remote, _plan(
                api, _native.Plan.from_segments, remote.geometry, local.geometry, _segments(rows)
            )

        await self._transfer(api, link, build, local, deadline, push=False)

    @bridged
    async def copy_blocks(
        self,
        cache: KvCache,
        copy_block_info: Mapping[int, Sequence[int]],
        *,
        timeout: float | None = None,
    ) -> None:
        """Copies blocks within one local blocks cache: ``{src_block: [dst_block, ...]}``.

        Raises:
            TypeError, LLMParamError: bad arguments (including a block that is both a
                source and a destination, or a destination named twice).
            LLMTimeoutError: the deadline passed (the native copy was aborted and returned).
        """
        api = "copy_blocks"
        self._require_ready()
        entry = self._entry_of(api, "cache", cache)
        require(entry.is_blocks, "cache must be a blocks cache")
        check_type("copy_block_info", copy_block_info, Mapping)
        require(len(copy_block_info) > 0, "copy_block_info must not be empty")
        # Every block is named at most once as a destination: no list (and no total)
        # can be longer than the cache, and no id beyond it reaches native code.
        nb = entry.num_blocks
        require(
            len(copy_block_info) <= nb,
            f"copy_block_info has {len(copy_block_info)} sources, more than the cache's "
            f"{nb} blocks",
        )
        pairs: list[tuple[int, int]] = []
        for src, dsts in copy_block_info.items():
            s = check_int("copy_block_info key", src, min_value=0, max_value=nb - 1)
            for d in check_int_list(
                f"copy_block_info[{s}]", dsts, allow_empty=False, max_len=nb, max_value=nb - 1
            ):
                pairs.append((s, d))
            require(
                len(pairs) <= nb,
                f"copy_block_info names {len(pairs)}+ destinations, more than the cache's "
                f"{nb} blocks",
            )
        sources = {s for s, _ in pairs}
        for _, d in pairs:
            require(d not in sources, f"block {d} is both a source and a destination")
        tmo = _check_timeout(timeout)
        bb = entry.block_bytes
        rows = [(t, s * bb, t, d * bb, bb) for t in range(entry.num_tensors) for s, d in pairs]
        plan = _plan(
            api, _native.Plan.from_segments, entry.geometry, entry.geometry, _segments(rows)
        )
        deadline = self._deadline(tmo)
        entry.hold(api)
        try:
            addrs = entry.addrs
            threads = self._dd._options.mover_threads
            await self._call(api, deadline).run(
                lambda ctl: _native.copy_local(plan, addrs, addrs, ctl, threads)
            )
        finally:
            entry.release()

    # ------------------------------------------------------ transfer_cache_async

    @bridged(on_abandoned=_stop_abandoned)
    async def transfer_cache_async(
        self,
        src_cache: KvCache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
        src_block_indices: Sequence[int] | None = None,
        dst_block_indices: Sequence[int] | None = None,
        dst_block_memory_size: int | None = None,
    ) -> CacheTask:
        """Starts a layer-pipelined push of ``src_cache`` to linked peers; returns a ``CacheTask``.

        For each source layer in order: ``layer_synchronizer.synchronize_layer(layer, None)``
        (sync or ``async def``) must return True, then that layer (2 tensors, K and V) is
        sent to every config covering it, each under the link's FIFO slot and a
        ``sync_kv_timeout`` deadline. ``False`` marks the configs covering that layer
        ``LLM_PARAM_INVALID`` and stops; the first transfer failure records that
        config's status and stops the whole job (later layers are not sent). A config
        stopped part-way reports ``None`` in ``get_results``; see ``CacheTask``.

        Raises (synchronously, before anything is sent):
            TypeError, LLMParamError: bad arguments.
            LLMException: LLM_FAILED on a DECODER instance.
            asyncio.CancelledError: awaited from another thread's loop and cancelled there;
                a pipeline the call had already started is cancelled and awaited first,
                so a started ``CacheTask`` is never left running without an owner.
        """
        api = "transfer_cache_async"
        self._require_ready()
        local = self._entry_of(api, "src_cache", src_cache)
        sync_fn: object = getattr(layer_synchronizer, "synchronize_layer", None)
        if not callable(sync_fn):
            raise TypeError(
                "layer_synchronizer must be a LayerSynchronizer, got "
                f"{type(layer_synchronizer).__name__}"
            )
        check_type("transfer_configs", transfer_configs, (list, tuple))
        require(len(transfer_configs) > 0, "transfer_configs must not be empty")
        for i, c in enumerate(transfer_configs):
            check_type(f"transfer_configs[{i}]", c, (TransferConfig, TransferWithCacheKeyConfig))
        # The pipeline reads the configs layer by layer, later: it gets copies, so a config
        # the caller changes after this call cannot undo the checks below.
        configs = [copy.copy(c) for c in transfer_configs]
        require(
            local.num_tensors % 2 == 0,
            f"src_cache must hold K,V pairs (an even tensor count), has {local.num_tensors}",
        )
        num_layers = local.num_tensors // 2
        src_blocks: list[int] | None = None
        dst_blocks: list[int] | None = None
        if src_block_indices is not None or dst_block_indices is not None:
            require(
                src_block_indices is not None,
                "dst_block_indices without src_block_indices (contiguous -> blocks) "
                "is not supported",
            )
            require(
                dst_block_indices is not None,
                "src_block_indices needs dst_block_indices (blocks -> contiguous is not supported)",
            )
            # The source's size is known here, the destination's only per layer: ids
            # beyond int64 never reach native code, lists are bounded before reading.
            src_blocks = check_int_list(
                "src_block_indices",
                src_block_indices,
                allow_empty=False,
                max_value=max(0, local.num_blocks - 1) if local.is_blocks else INT64_MAX,
            )
            dst_blocks = check_int_list(
                "dst_block_indices",
                dst_block_indices,
                allow_empty=False,
                max_value=INT64_MAX,
            )
            require(
                len(src_blocks) == len(dst_blocks),
                f"src_block_indices and dst_block_indices differ in length "
                f"({len(src_blocks)} != {len(dst_blocks)})",
            )
            require(local.is_blocks, "src_block_indices needs a blocks src_cache")
        else:
            require(
                not local.is_blocks,
                "a blocks src_cache needs src_block_indices and dst_block_indices",
            )
        if dst_block_memory_size is not None:
            check_int("dst_block_memory_size", dst_block_memory_size, min_value=0)
            require(
                dst_block_memory_size in (0, local.block_bytes),
                f"dst_block_memory_size {dst_block_memory_size} must equal the source block "
                f"size {local.block_bytes}",
            )
        spans: list[range] = []
        for i, c in enumerate(configs):
            lr = c.src_layer_range if c.src_layer_range is not None else range(num_layers)
            require(
                lr.stop <= num_layers,
                f"transfer_configs[{i}].src_layer_range {lr!r} exceeds the {num_layers} "
                "layers of src_cache",
            )
            if isinstance(c, TransferWithCacheKeyConfig):
                # The constructor checks this; the setters cannot (one range at a time).
                require(
                    len(c.dst_layer_range) == len(lr),
                    f"transfer_configs[{i}]: src_layer_range {lr!r} and dst_layer_range "
                    f"{c.dst_layer_range!r} differ in length",
                )
            if isinstance(c, TransferConfig):
                require(
                    len(c.dst_addrs) == 2 * len(lr),
                    f"transfer_configs[{i}].dst_addrs must have {2 * len(lr)} addresses "
                    f"(2 per layer of {lr!r}), got {len(c.dst_addrs)}",
                )
            elif isinstance(c.cache_key, BlocksCacheKey):
                require(
                    src_blocks is not None,
                    f"transfer_configs[{i}] targets a blocks cache: src_block_indices needed",
                )
            spans.append(lr)
        self._require_role(api, LLMRole.PROMPT, LLMRole.MIX)
        task = CacheTask(len(transfer_configs))
        coro = self._pipeline(
            task,
            local,
            layer_synchronizer,
            configs,
            spans,
            src_blocks,
            dst_blocks,
            num_layers,
        )
        t = asyncio.get_running_loop().create_task(
            coro, name=f"aiodatadist-transfer-{local.cache_id}"
        )
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        task._start(t)
        return task

    async def _sync_layer(self, sync: LayerSynchronizer, layer: int) -> bool:
        fn = sync.synchronize_layer
        if inspect.iscoroutinefunction(fn):
            return bool(await fn(layer, None))
        # A sync synchronizer may block (waiting on compute): it runs on the
        # instance's callback thread, never on the loop or a transfer thread.
        result = await self._dd._callbacks_or_raise().run(
            lambda _ctl: fn(layer, None), deadline=None, api="synchronize_layer"
        )
        if inspect.isawaitable(result):
            result = await result
        return bool(result)

    def _push_build(
        self,
        api: str,
        link: Link,
        cfg: TransferConfig | TransferWithCacheKeyConfig,
        local: CacheEntry,
        layer: int,
        dst_layer: int,
        src_blocks: list[int] | None,
        dst_blocks: list[int] | None,
    ) -> Any:
        src_row = cfg.src_batch_index

        def build() -> tuple[CacheEntry, _native.Plan]:
            s0 = 2 * layer
            if isinstance(cfg, TransferWithCacheKeyConfig):
                key = cfg.cache_key
                remote, row = self._remote_source(api, link, key)
                d0 = 2 * dst_layer
                if d0 + 2 > remote.num_tensors:
                    raise _param(
                        api,
                        f"dst layer {dst_layer} is outside the remote cache's "
                        f"{remote.num_tensors // 2} layers",
                    )
                if src_blocks is not None:
                    assert dst_blocks is not None
                    return remote, _plan(
                        api,
                        _native.Plan.blocks,
                        local.geometry,
                        remote.geometry,
                        src_blocks,
                        dst_blocks,
                        s0,
                        d0,
                        2,
                    )
                nbytes = min(local.block_bytes, remote.block_bytes)
                rows = [
                    (s0 + k, src_row * local.block_bytes, d0 + k, row * remote.block_bytes, nbytes)
                    for k in range(2)
                ]
                return remote, _plan(
                    api,
                    _native.Plan.from_segments,
                    local.geometry,
                    remote.geometry,
                    _segments(rows),
                )
            # TransferConfig: raw peer addresses, which must lie in the peer's registered memory.
            lr = cfg.src_layer_range
            k = layer - (lr.start if lr is not None else 0)
            targets = cfg.dst_addrs[2 * k : 2 * k + 2]
            table = link.channel.remote_table
            found = []
            for addr in targets:
                need = (
                    (max(dst_blocks) + 1) * local.block_bytes if dst_blocks else local.block_bytes
                )
                hit = table.containing(addr, need)
                if hit is None:
                    raise _param(
                        api,
                        f"dst address {addr:#x} (+{need} bytes) is not inside memory "
                        f"registered by cluster {cfg.dst_cluster_id}",
                    )
                found.append(hit)
            remote = found[0][0]
            if found[1][0] is not remote:
                raise _param(
                    api, "the K and V addresses of one layer lie in different remote caches"
                )
            rows = []
            for j, (_, tensor, off) in enumerate(found):
                if src_blocks is not None:
                    assert dst_blocks is not None
                    bb = local.block_bytes
                    rows += [
                        (s0 + j, s * bb, tensor, off + d * bb, bb)
                        for s, d in zip(src_blocks, dst_blocks, strict=True)
                    ]
                else:
                    rows.append(
                        (s0 + j, src_row * local.block_bytes, tensor, off, local.block_bytes)
                    )
            return remote, _plan(
                api, _native.Plan.from_segments, local.geometry, remote.geometry, _segments(rows)
            )

        return build

    async def _pipeline(
        self,
        task: CacheTask,
        local: CacheEntry,
        sync: LayerSynchronizer,
        configs: list[TransferConfig | TransferWithCacheKeyConfig],
        spans: list[range],
        src_blocks: list[int] | None,
        dst_blocks: list[int] | None,
        num_layers: int,
    ) -> None:
        api = "transfer_cache_async"
        results = task._results
        for layer in range(num_layers):
            covering = [i for i, lr in enumerate(spans) if layer in lr]
            if not covering:
                continue
            try:
                ok = await self._sync_layer(sync, layer)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("synchronize_layer(%d) raised", layer)
                for i in covering:
                    results[i] = LLMStatusCode.LLM_FAILED
                return
            if not ok:
                for i in covering:
                    results[i] = LLMStatusCode.LLM_PARAM_INVALID
                return
            for i in covering:
                cfg = configs[i]
                # results[i] stays None until this config's last layer is sent (or it is the
                # one that fails): a config stopped part-way, by another config's failure,
                # a False from synchronize_layer or a cancel, reports None, as upstream.
                try:
                    link = self._dd._registry.get(cfg.dst_cluster_id, api)
                    if isinstance(cfg, TransferWithCacheKeyConfig):
                        dst_layer = cfg.dst_layer_range.start + (layer - spans[i].start)
                    else:
                        dst_layer = layer
                    build = self._push_build(
                        api, link, cfg, local, layer, dst_layer, src_blocks, dst_blocks
                    )
                    deadline = self._deadline(None)
                    await self._transfer(api, link, build, local, deadline, push=True)
                except LLMException as e:
                    log.warning(
                        "transfer_cache_async: layer %d to cluster %d failed: %s",
                        layer,
                        cfg.dst_cluster_id,
                        e,
                    )
                    results[i] = e.status_code
                    return
                except Exception:
                    # Not an engine error (an OS error from a data path, a bug): still this
                    # config's failure, never a silent stop that synchronize reads as success.
                    log.exception(
                        "transfer_cache_async: layer %d to cluster %d failed",
                        layer,
                        cfg.dst_cluster_id,
                    )
                    results[i] = LLMStatusCode.LLM_FAILED
                    return
                if layer == spans[i].stop - 1:
                    results[i] = LLMStatusCode.LLM_SUCCESS

    async def _shutdown(self, timeout: float | None = None) -> None:
        """Cancels running transfer_cache_async pipelines and waits for them, at most
        ``timeout`` seconds: a pipeline blocked in a plain (sync) ``synchronize_layer``
        ends only when that call returns, and finalize must not wait on user code forever.
        """
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def _free_all(self, timeout: float = 1.0) -> None:
        """Finalize: frees every cache. Revoking their leases waits for peer copies at most
        ``timeout`` seconds in all; a cache still copied (by a peer or our own job) is
        leaked with a warning: its memory stays mapped for the life of the process."""
        end = time.monotonic() + timeout
        for entry in list(self._entries.values()):
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
            self.leases.release(entry)
            entry.freed = True
            if entry.cache is not None:
                entry.cache._views_factory = None
            entry.segment = None
            entry.buffers = None
        self._entries.clear()
        self.table.clear()
        self.leases.close()
