"""``CacheManager.push_blocks`` and ``push_cache``: write local caches into a peer's.

A mixin of :class:`~aiodatadist.cache_manager.CacheManager`. Each call is checked
(upstream's checks, in its order), then becomes one
:class:`~aiodatadist._plan.PushRequest` covering every selected layer, which takes
the one path (:func:`aiodatadist._runner.run`) as a ``transfer_cache_async`` layer
does: the peer's table resolves the key, the link's FIFO slot is taken once, and a
one-sided write into the peer's memory happens only under a lease for that cache's
current registration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import _runner
from ._bridge import public
from ._checks import push_block_lists, push_layers
from ._plan import PushRequest
from ._validate import check_int, check_sint, check_timeout, check_type, require
from .errors import LLMStatusCode, failure
from .types import BlocksCacheKey, CacheKeyByIdAndIndex, KvCache

if TYPE_CHECKING:
    from ._registration import CacheRegistry
    from ._runtime import Runtime

__all__ = ["PushMixin"]


class PushMixin:
    """``push_blocks`` and ``push_cache`` (any role may push: upstream v2)."""

    _rt: Runtime
    _caches: CacheRegistry

    def _push_deadline(self, cluster_id: int, timeout: object) -> float:
        tmo = check_timeout("timeout", timeout)
        if cluster_id == self._rt.cluster_id:
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"cannot push to this instance's own cluster_id {cluster_id}",
            )
        return self._rt.deadline(tmo)

    @public("push_blocks")
    async def push_blocks(
        self,
        dst_cache_key: BlocksCacheKey,
        src_cache: KvCache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        *,
        timeout: float | None = None,
    ) -> None:
        """Writes blocks of a local blocks cache into the peer's blocks cache under
        ``dst_cache_key.model_id`` on cluster ``dst_cache_key.cluster_id``.

        For every selected layer pair and every ``i``, block ``src_blocks[i]`` of each
        tensor of source layer ``src_layer_range[k]`` lands in block ``dst_blocks[i]`` of
        the same tensor of destination layer ``dst_layer_range[k]``.

        Unlike upstream (one native transfer per layer), every selected layer moves in
        one transfer under one acquisition of the link's slot and one deadline. Upstream
        requires ``enable_remote_cache_accessible``; here every registered cache is
        reachable by linked peers, so no option is needed.

        Args:
            dst_cache_key: names the peer and its blocks cache.
            src_cache: a blocks cache of this instance.
            src_blocks: source block ids; empty = ``0 .. len(dst_blocks) - 1`` (contiguous).
            dst_blocks: the peer's block ids, non-empty, no duplicates, checked against
                the peer's cache; as many as ``src_blocks`` when that is given.
            src_layer_range: source layers (step 1); None = every layer of the source
                (``num_tensors // tensor_num_per_layer``).
            dst_layer_range: destination layers (step 1), as many as the source's;
                None = the same default as ``src_layer_range``.
            tensor_num_per_layer: tensors per layer (K,V = 2), a uint32 > 0.
            timeout: seconds for the whole call (every layer, waiting for the link
                included); None = ``sync_kv_timeout``.

        Raises:
            TypeError, LLMParamError (a ValueError): bad arguments, before anything moves;
                LLMParamError also for ids or layers beyond the peer's cache or a block
                size that differs (checked against the peer's table, before any byte).
            LLMLinkError: LLM_NOT_YET_LINK without a link to the key's cluster.
            LLMCacheNotFoundError: the peer has no blocks cache under that model_id.
            LLMTimeoutError: the deadline passed; the job was aborted and has returned.
                A failed, timed-out or cancelled push leaves the named destination blocks
                of the selected layers undefined; the link stays usable.
            asyncio.CancelledError: cancelled; raised once the native job has returned.
        """
        self._rt.require_ready()
        check_type("dst_cache_key", dst_cache_key, BlocksCacheKey)
        local = self._caches.live("src_cache", src_cache)
        require(local.is_blocks, "src_cache must be a blocks cache")
        src, dst = push_block_lists(local, src_blocks, dst_blocks)
        t, src_lr, dst_lr = push_layers(
            local, tensor_num_per_layer, src_layer_range, dst_layer_range
        )
        request = PushRequest(
            local=local,
            cluster_id=dst_cache_key.cluster_id,
            deadline=self._push_deadline(dst_cache_key.cluster_id, timeout),
            key=dst_cache_key,
            src_blocks=src,
            dst_blocks=dst,
            src_layers=src_lr,
            dst_layers=dst_lr,
            tensors_per_layer=t,
        )
        await _runner.run(self._rt, self._rt.links.get(request.cluster_id), request)

    @public("push_cache")
    async def push_cache(
        self,
        dst_cache_key: CacheKeyByIdAndIndex,
        src_cache: KvCache,
        src_batch_index: int = 0,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        size: int = -1,
        tensor_num_per_layer: int = 2,
        *,
        timeout: float | None = None,
    ) -> None:
        """Writes row ``src_batch_index`` of a local non-block cache into row
        ``dst_cache_key.batch_index`` of the peer's cache ``dst_cache_key.cache_id``.

        The whole source row (its stride in bytes, per selected tensor) is written; it
        must fit the remote row. Layers as ``push_blocks``; one transfer for every layer.

        Args:
            dst_cache_key: the peer, its non-block cache and the row.
            src_cache: a non-block cache of this instance.
            src_batch_index: the local row.
            src_layer_range, dst_layer_range, tensor_num_per_layer, timeout: as ``push_blocks``.
            size: must be -1 (upstream supports only the whole row).

        Raises:
            TypeError, LLMParamError (a ValueError): bad arguments, before anything is queued.
            LLMLinkError: LLM_NOT_YET_LINK without a link to the key's cluster.
            LLMCacheNotFoundError: the peer has no cache with that ``cache_id``.
            LLMTimeoutError: the deadline passed; the job was aborted and has returned.
                A failed, timed-out or cancelled push leaves the destination row undefined;
                the link stays usable.
            asyncio.CancelledError: cancelled; raised once the native job has returned.
        """
        self._rt.require_ready()
        check_type("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
        local = self._caches.live("src_cache", src_cache)
        require(not local.is_blocks, "src_cache can not be a blocks cache (use push_blocks)")
        row = check_int(
            "src_batch_index", src_batch_index, min_value=0, max_value=local.num_blocks - 1
        )
        t, src_lr, dst_lr = push_layers(
            local, tensor_num_per_layer, src_layer_range, dst_layer_range
        )
        n = check_sint("size", size, 64)
        require(n == -1, f"size must be -1, got {n}")
        request = PushRequest(
            local=local,
            cluster_id=dst_cache_key.cluster_id,
            deadline=self._push_deadline(dst_cache_key.cluster_id, timeout),
            key=dst_cache_key,
            src_row=row,
            src_layers=src_lr,
            dst_layers=dst_lr,
            tensors_per_layer=t,
        )
        await _runner.run(self._rt, self._rt.links.get(request.cluster_id), request)
