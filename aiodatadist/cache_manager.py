"""``CacheManager``: the facade of registration, allocation and every transfer.

Each public method checks its arguments (``TypeError`` / ``LLMParamError`` before
anything is queued), fixes the call's one deadline, and hands one immutable request
on: registration to :class:`~aiodatadist._registration.CacheRegistry`, a pull or a
copy to the one path (:mod:`aiodatadist._runner`, planned by :mod:`aiodatadist._plan`),
``transfer_cache_async`` to its pipeline (:mod:`aiodatadist._pipeline`). The API
name every error carries comes from ``@public``; nothing below it is told.

Timeout and cancel, for every transfer: the native job is aborted and awaited, then
``LLMException(LLM_TIMEOUT)`` (also a ``TimeoutError``) or ``CancelledError``; the
link stays usable.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import _runner
from ._bridge import public
from ._caches import require_host_memory
from ._checks import (
    MISSING,
    blocks_pull_request,
    check_cache_key,
    check_row_keys,
    copy_pairs,
    pull_names,
    pull_request,
)
from ._cm_layerwise import LayerwiseMixin
from ._cm_local import LocalMixin
from ._cm_push import PushMixin
from ._lanes import FastPulls
from ._pipeline import (
    CacheTask,
    PipelineRequest,
    Pipelines,
    check_push_blocks,
    check_push_span,
    stop_abandoned,
)
from ._plan import CopyRequest
from ._validate import check_int, check_sint, check_timeout, check_type, require
from .types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    KvCache,
    LayerSynchronizer,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ["CacheManager", "CacheTask"]

# Public here, as before the pipeline got its own module (reprs, pickling, docs).
CacheTask.__module__ = __name__


class CacheManager(PushMixin, LocalMixin, LayerwiseMixin):
    """Registers caches and moves blocks between this instance and its linked peers.

    Obtained as ``LLMDataDist.cache_manager`` (alias ``kv_cache_manager``).
    Registration calls are synchronous, like upstream; every transfer is a coroutine.
    The role is a label (upstream v2): any role may pull, push and copy. ``push_blocks``
    and ``push_cache`` come from :class:`~aiodatadist._cm_push.PushMixin`, ``copy_cache``
    and ``swap_blocks`` from :class:`~aiodatadist._cm_local.LocalMixin`.

    Attributes:
        table: the caches this instance serves to its peers.
        leases: the leases one-sided peers copy those caches under.
    """

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._caches = rt.caches
        self._lanes = FastPulls(rt)
        self._pipelines = Pipelines(rt)
        self.table = rt.caches.table
        self.leases = rt.caches.leases

    def _home_loop(self) -> asyncio.AbstractEventLoop | None:
        return self._rt.loop

    async def _shutdown(self, timeout: float | None = None) -> None:
        """Finalize: cancels the running pipelines and waits for them (at most ``timeout``)."""
        await self._pipelines.shutdown(timeout)
        self._lanes.clear()  # (no lane outlives the instance: links, caches, mappings)

    # ------------------------------------------------------------ registration

    @public("register_blocks_cache")
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
        self._rt.require_ready()
        check_type("cache_desc", cache_desc, CacheDesc)
        if blocks_cache_key is not None:
            check_type("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        if remote_accessible is not None:
            check_type("remote_accessible", remote_accessible, bool)
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        return self._caches.register(
            cache_desc, addrs, is_blocks=True, model_id=model_id, row_keys=()
        )

    @public("register_cache")
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
        self._rt.require_ready()
        check_type("cache_desc", cache_desc, CacheDesc)
        keys = check_row_keys(cache_desc, cache_keys)
        if remote_accessible is not None:
            check_type("remote_accessible", remote_accessible, bool)
        return self._caches.register(
            cache_desc, addrs, is_blocks=False, model_id=None, row_keys=keys
        )

    @public("allocate_blocks_cache")
    def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> KvCache:
        """Allocates a blocks cache in shared memory (zero-filled); see ``register_blocks_cache``.

        Shared memory lets a decoder on the same host map the cache once and copy
        from it one-sidedly (the ``shm`` data path).
        """
        self._rt.require_ready()
        check_type("cache_desc", cache_desc, CacheDesc)
        if blocks_cache_key is not None:
            check_type("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        return self._caches.allocate(cache_desc, is_blocks=True, model_id=model_id, row_keys=())

    @public("allocate_cache")
    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> KvCache:
        """Allocates a non-block cache in shared memory; ``cache_keys[i]`` names row ``i``."""
        self._rt.require_ready()
        check_type("cache_desc", cache_desc, CacheDesc)
        keys = check_row_keys(cache_desc, cache_keys)
        return self._caches.allocate(cache_desc, is_blocks=False, model_id=None, row_keys=keys)

    def _free(self, cache_id: int, *, allocated: bool | None, blocks: bool | None) -> None:
        bound = self._rt.options.sync_kv_timeout_ms / 1000
        self._caches.free(cache_id, allocated=allocated, blocks=blocks, bound=bound)

    @public("unregister_cache")
    def unregister_cache(self, cache_id: int) -> None:
        """Removes a registered cache and its index entries; unknown ids are a no-op.

        Revokes the cache's lease first: waits (blocking, the GIL released) until no
        linked peer's one-sided copy under it is left, at most ``sync_kv_timeout``; after
        a successful return no peer reads or writes the memory any more.

        Raises:
            LLMLinkError: LLM_LINK_BUSY while a transfer of this process uses the cache,
                or a peer's copy still held the lease at the bound; nothing changed.
        """
        self._rt.require_ready()
        cid = check_sint("cache_id", cache_id, 64)
        self._free(cid, allocated=False, blocks=None)

    @public("deallocate_cache")
    def deallocate_cache(self, cache: KvCache) -> None:
        """Frees a non-block cache made by ``allocate_cache`` (no-op for registered ones).

        Waits for peers' one-sided copies as ``unregister_cache`` does.

        Raises:
            LLMLinkError: LLM_LINK_BUSY as ``unregister_cache``; nothing changed.
        """
        self._rt.require_ready()
        check_type("cache", cache, KvCache)
        self._free(cache.cache_id, allocated=True, blocks=False)

    @public("deallocate_blocks_cache")
    def deallocate_blocks_cache(self, cache: KvCache) -> None:
        """Frees a blocks cache made by ``allocate_blocks_cache`` (no-op for registered ones).

        Waits for peers' one-sided copies as ``unregister_cache`` does.

        Raises:
            LLMLinkError: LLM_LINK_BUSY as ``unregister_cache``; nothing changed.
        """
        self._rt.require_ready()
        check_type("cache", cache, KvCache)
        self._free(cache.cache_id, allocated=True, blocks=True)

    @public("remove_cache_key")
    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbinds a row key: peers can no longer pull that row. Unknown keys are a no-op."""
        self._rt.require_ready()
        check_type("cache_key", cache_key, CacheKey)
        self._caches.remove_key(cache_key)

    # --------------------------------------------------------------- transfers

    async def pull_blocks(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey = MISSING,
        dst_cache: KvCache = MISSING,
        src_blocks: Sequence[int] = MISSING,
        dst_blocks: Sequence[int] = MISSING,
        *,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        timeout: float | None = None,
        **v1_names: Any,
    ) -> None:
        """Pulls blocks of a linked peer's cache into ``dst_cache``.

        For every selected tensor ``t`` and every ``i``, block ``src_blocks[i]`` of the
        remote tensor lands in block ``dst_blocks[i]`` of the local one. With a
        ``CacheKey`` / ``CacheKeyByIdAndIndex`` the remote row is cut into local-block-sized
        chunks and chunk ``i`` lands in ``dst_blocks[i]`` (``src_blocks`` empty).

        The parameter names are upstream v2's; upstream v1's are accepted as keywords:
        ``prompt_cache_key``, ``decoder_kv_cache``, ``prompt_blocks``, ``decoder_blocks``
        (passing one parameter under both names is a ``TypeError``).

        Args:
            src_cache_key: names the remote cache; its ``cluster_id`` selects the link.
            dst_cache: a blocks cache of this instance.
            src_blocks: remote block ids (required with ``BlocksCacheKey``).
            dst_blocks: local block ids, non-empty, no duplicates.
            src_layer_range: remote layers (step 1); None = all.
            dst_layer_range: local layers (step 1); None = all.
            tensor_num_per_layer: tensors per layer (K,V = 2); must divide the tensor counts.
            timeout: seconds for the whole call (waiting for the link included);
                None = ``sync_kv_timeout``.

        Raises:
            TypeError, LLMParamError (a ValueError): bad arguments, before anything is queued
                (LLMParamError also for the instance's own ``cluster_id``).
            LLMLinkError: LLM_NOT_YET_LINK without a link to the key's cluster.
            LLMCacheNotFoundError: the peer has no cache under that key.
            LLMTimeoutError: the deadline passed; the native job was aborted and has returned,
                the named destination blocks are undefined, the link stays usable.
            asyncio.CancelledError: cancelled; raised once the native job has returned.
        """
        lanes = self._lanes
        if lanes and not v1_names:  # a small repeated pull: its kept lane (aiodatadist._lanes)
            taken = lanes.pull(
                src_cache_key,
                dst_cache,
                src_blocks,
                dst_blocks,
                src_layer_range,
                dst_layer_range,
                tensor_num_per_layer,
                timeout,
            )
            if taken is not True and taken is not False:
                taken = await taken  # (tcp: its answer, awaited holding the link's slot)
            if taken:
                # Lane pulls never suspend: once a ms, one yields, *after* its bytes landed
                # (a yield before would let a later call's lane pull run first: FIFO).
                if time.monotonic() >= lanes.yield_due:
                    await lanes.pause()
                return
        await _pull_blocks(
            self,
            src_cache_key,
            dst_cache,
            src_blocks,
            dst_blocks,
            src_layer_range,
            dst_layer_range,
            tensor_num_per_layer,
            timeout,
            v1_names,
        )

    @public("pull_cache")
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
        self._rt.require_ready()
        check_type("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex))
        local = self._caches.live("cache", cache)
        require(not local.is_blocks, "cache must be a non-block cache (use pull_blocks for blocks)")
        if isinstance(cache_key, CacheKey):
            check_cache_key(cache_key)
        bi = check_int("batch_index", batch_index, min_value=0, max_value=local.num_blocks - 1)
        nbytes = check_int("size", size, min_value=-1)
        require(nbytes != 0, "size must be -1 or > 0, got 0")
        if nbytes == -1:
            nbytes = local.block_bytes
        require(
            nbytes <= local.block_bytes,
            f"size {nbytes} exceeds the local row stride of {local.block_bytes} bytes",
        )
        request = pull_request(
            self._rt,
            cache_key,
            local,
            tensor_num_per_layer,
            src_layer_range,
            dst_layer_range,
            timeout,
            row=bi,
            nbytes=nbytes,
        )
        await _runner.run(self._rt, self._rt.links.get(request.cluster_id), request)

    @public("copy_blocks")
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
        self._rt.require_ready()
        entry = self._caches.live("cache", cache)
        pairs = copy_pairs(entry, copy_block_info)
        tmo = check_timeout("timeout", timeout)
        require_host_memory("copy_blocks", entry)
        request = CopyRequest(entry=entry, pairs=tuple(pairs), deadline=self._rt.deadline(tmo))
        await _runner.copy(self._rt, request)

    # ------------------------------------------------------ transfer_cache_async

    @public("transfer_cache_async", on_abandoned=stop_abandoned)
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

        A blocks ``src_cache`` with both block index lists None (upstream's empty lists)
        sends the whole layer: block ``i`` -> block ``i`` for every source block; a
        destination with fewer blocks (or another block size) fails that config with
        ``LLM_PARAM_INVALID`` before a byte of it is written. Any role may push.

        Raises (synchronously, before anything is sent):
            TypeError, LLMParamError: bad arguments.
            asyncio.CancelledError: awaited from another thread's loop and cancelled there;
                a pipeline the call had already started is cancelled and awaited first,
                so a started ``CacheTask`` is never left running without an owner.
        """
        self._rt.require_ready()
        local = self._caches.live("src_cache", src_cache)
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
        configs = tuple(copy.copy(c) for c in transfer_configs)
        require(
            local.num_tensors % 2 == 0,
            f"src_cache must hold K,V pairs (an even tensor count), has {local.num_tensors}",
        )
        num_layers = local.num_tensors // 2
        src_blocks, dst_blocks = check_push_blocks(
            local, src_block_indices, dst_block_indices, dst_block_memory_size
        )
        spans = tuple(
            check_push_span(i, c, num_layers, src_blocks is not None) for i, c in enumerate(configs)
        )
        request = PipelineRequest(
            local, layer_synchronizer, configs, spans, src_blocks, dst_blocks, num_layers
        )
        return self._pipelines.start(request)


def _show_signature(fn: Any, required: tuple[str, ...], defaults: dict[str, object]) -> None:
    """What ``help()`` / ``inspect`` show: ``required`` without a default, ``defaults``
    as given (the real defaults only tell a v1 keyword apart from a missing argument)."""
    sig = inspect.signature(fn)
    params = [
        p.replace(default=inspect.Parameter.empty)
        if p.name in required
        else p.replace(default=defaults[p.name])
        if p.name in defaults
        else p
        for p in sig.parameters.values()
    ]
    fn.__signature__ = sig.replace(parameters=params)


_show_signature(
    CacheManager.pull_blocks, ("src_cache_key", "dst_cache"), {"src_blocks": (), "dst_blocks": ()}
)


@public("pull_blocks")
async def _pull_blocks(
    cm: CacheManager,
    src_cache_key: object,
    dst_cache: object,
    src_blocks: object,
    dst_blocks: object,
    src_layer_range: object,
    dst_layer_range: object,
    tensor_num_per_layer: object,
    timeout: object,
    v1_names: dict[str, Any],
) -> None:
    """``pull_blocks`` the whole way (:mod:`aiodatadist._runner`); keeps a lane after it."""
    # All four given (v2 or positional): four identity checks.
    if (
        v1_names
        or dst_blocks is MISSING
        or src_blocks is MISSING
        or dst_cache is MISSING
        or src_cache_key is MISSING
    ):
        src_cache_key, dst_cache, src_blocks, dst_blocks = pull_names(
            src_cache_key, dst_cache, src_blocks, dst_blocks, v1_names
        )
    rt = cm._rt
    request = blocks_pull_request(
        rt,
        cm._caches,
        src_cache_key,
        dst_cache,
        src_blocks,
        dst_blocks,
        tensor_num_per_layer,
        src_layer_range,
        dst_layer_range,
        timeout,
    )
    link = rt.links.get(request.cluster_id)
    remote = await _runner.run(rt, link, request)
    cm._lanes.learn(dst_cache, request, link, remote)
