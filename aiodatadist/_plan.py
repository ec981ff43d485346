"""Transfer requests and their plans: pure functions, no I/O, no awaits.

The facade turns each public call into one immutable request (:class:`PullRequest`,
:class:`PushRequest`, :class:`CopyRequest`); :func:`plan` turns a request and the
peer's :class:`~aiodatadist._caches.CacheTable` into the peer's cache entry and a
validated native :class:`~aiodatadist._native.Plan`. The runner calls it again
whenever the peer's table may have changed (a refresh on a miss, a re-registration
while the call waited for the link, a stale lease), which is why a request holds
what the caller asked for, never what it resolved to.

Everything here is arithmetic on the entries' geometry, so it is tested from tables
of hand-made entries (``tests/test_plan.py``) without a pair. Errors carry upstream's
status codes: ``LLM_KV_CACHE_NOT_EXIST`` for a key the table does not hold (the
runner refreshes once on it), ``LLM_PARAM_INVALID`` for a request that cannot fit
the caches it names, and the native core's own for a plan it refuses
(:func:`~aiodatadist.errors.from_native`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from . import _native
from ._caches import CacheEntry, CacheTable, RowKey
from ._validate import INVALID_ID
from .errors import LLMException, LLMStatusCode, failure, from_native
from .types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex

__all__ = [
    "CopyRequest",
    "LocalCopyRequest",
    "PullRequest",
    "PushRequest",
    "RemoteKey",
    "Request",
    "Segment",
    "copy_plan",
    "local_copy_plan",
    "plan",
    "pull_blocks_plan",
    "pull_row_plan",
    "push_addr_plan",
    "push_key_plan",
    "resolve",
    "row_key",
    "tensor_span",
]

RemoteKey = CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey
"""A key naming a peer's cache (a row of it for ``CacheKey`` / ``CacheKeyByIdAndIndex``)."""

Segment = tuple[int, int, int, int, int]
"""(src tensor, src offset, dst tensor, dst offset, bytes)."""


def _param(info: str) -> LLMException:
    return failure(LLMStatusCode.LLM_PARAM_INVALID, info)


# ------------------------------------------------------------------ requests


class PullRequest(NamedTuple):
    """One ``pull_blocks`` or ``pull_cache`` call, checked.

    Requests are immutable named tuples (a frozen dataclass costs about 1 us per call
    to build, a tenth of a tiny pull's whole overhead).

    Attributes:
        local: the destination cache (this instance's).
        key: names the peer's source cache (and row); its ``cluster_id`` the link.
        deadline: loop time the whole call ends.
        src_blocks: remote block ids (``pull_blocks`` with a ``BlocksCacheKey``).
        dst_blocks: local block ids (``pull_blocks``).
        row: ``pull_cache``'s local row; None for ``pull_blocks``.
        nbytes: ``pull_cache``'s bytes per tensor.
        src_layers, dst_layers, tensors_per_layer: the tensor span (:func:`tensor_span`).
    """

    local: CacheEntry
    key: RemoteKey
    deadline: float
    src_blocks: tuple[int, ...] = ()
    dst_blocks: tuple[int, ...] = ()
    row: int | None = None
    nbytes: int = 0
    src_layers: range | None = None
    dst_layers: range | None = None
    tensors_per_layer: int = 2

    @property
    def cluster_id(self) -> int:
        return self.key.cluster_id


class PushRequest(NamedTuple):
    """One layer of one ``transfer_cache_async`` config (K and V: two tensors), or one
    ``push_blocks`` / ``push_cache`` call (every selected layer: ``src_layers`` set).

    Attributes:
        local: the source cache.
        cluster_id: the peer.
        deadline: loop time this layer's transfer ends.
        layer: the source layer (tensors ``2*layer`` and ``2*layer + 1``).
        src_row: the source row (a non-block source).
        key: ``TransferWithCacheKeyConfig``: the peer's cache; None for raw addresses.
        dst_layer: the destination layer (with ``key``).
        dst_addrs: ``TransferConfig``: this layer's K and V addresses in the peer.
        src_blocks, dst_blocks: block ids (a blocks source), else None.
        src_layers, dst_layers, tensors_per_layer: ``push_blocks`` / ``push_cache``'s
            layers (both set; ``layer`` and ``dst_layer`` unused), see :func:`tensor_span`.
    """

    local: CacheEntry
    cluster_id: int
    deadline: float
    layer: int = 0
    src_row: int = 0
    key: BlocksCacheKey | CacheKeyByIdAndIndex | None = None
    dst_layer: int = 0
    dst_addrs: tuple[int, ...] = ()
    src_blocks: tuple[int, ...] | None = None
    dst_blocks: tuple[int, ...] | None = None
    src_layers: range | None = None
    dst_layers: range | None = None
    tensors_per_layer: int = 2


class CopyRequest(NamedTuple):
    """One ``copy_blocks`` call: ``(src block, dst block)`` pairs within ``entry``."""

    entry: CacheEntry
    pairs: tuple[tuple[int, int], ...]
    deadline: float


class LocalCopyRequest(NamedTuple):
    """``copy_cache`` / ``swap_blocks``: segments from ``src`` to ``dst``, both local.

    Attributes:
        src, dst: the two sides (``dst`` may be ``src``).
        segments: (src tensor, src offset, dst tensor, dst offset, bytes).
        deadline: loop time the call ends.
        holds: the registered caches the two sides live in (held while bytes move).
    """

    src: CacheEntry
    dst: CacheEntry
    segments: tuple[Segment, ...]
    deadline: float
    holds: tuple[CacheEntry, ...]


Request = PullRequest | PushRequest
"""A request over a link (what the runner takes)."""


# ---------------------------------------------------------------- the rules


def row_key(key: CacheKey) -> RowKey:
    """The one row-key rule: ``(req_id if set else prefix_id, model_id)`` (upstream 6.4)."""
    return (key.req_id if key.req_id != INVALID_ID else key.prefix_id, key.model_id)


def resolve(table: CacheTable, key: RemoteKey) -> tuple[CacheEntry, int]:
    """The cache ``key`` names in ``table``, and the row (0 for a blocks key).

    Raises:
        LLMCacheNotFoundError: the table holds no such cache or row.
        LLMParamError: a ``CacheKeyByIdAndIndex`` row beyond the cache.
    """
    missing = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    if isinstance(key, BlocksCacheKey):
        entry = table.blocks(key.model_id)
        if entry is None:
            raise failure(
                missing, f"cluster {key.cluster_id} has no blocks cache for model_id {key.model_id}"
            )
        return entry, 0
    if isinstance(key, CacheKeyByIdAndIndex):
        entry = table.by_id(key.cache_id)
        if entry is None:
            raise failure(
                missing, f"cluster {key.cluster_id} has no cache with cache_id {key.cache_id}"
            )
        if key.batch_index >= entry.num_blocks:
            raise _param(
                f"batch_index {key.batch_index} out of range for remote cache "
                f"{key.cache_id} with {entry.num_blocks} rows"
            )
        return entry, key.batch_index
    hit = table.row(row_key(key))
    if hit is None:
        raise failure(missing, f"cluster {key.cluster_id} has no cache row for {key!r}")
    return hit


def tensor_span(
    src_tensors: int,
    dst_tensors: int,
    src_layers: range | None,
    dst_layers: range | None,
    per_layer: int,
) -> tuple[int, int, int]:
    """Layer ranges -> (src tensor start, dst tensor start, tensor count), as upstream.

    Layer ``l`` is tensors ``[l*T, (l+1)*T)``. A missing range means every tensor of
    that side; the two sides must then select the same count. ``T`` need divide the
    tensor counts only when a range is given (an MLA cache of 61 tensors pulled whole
    with the default ``T=2`` works upstream).

    Raises:
        LLMParamError: a range beyond its cache, ``T`` not dividing, counts that differ.
    """
    t = per_layer
    if src_layers is not None or dst_layers is not None:
        for side, n in (("source", src_tensors), ("destination", dst_tensors)):
            if n % t:
                raise _param(
                    f"tensor_num_per_layer={t} does not divide the {side} cache's {n} tensors"
                )
    if src_layers is not None:
        src_start, src_count = src_layers.start * t, len(src_layers) * t
        if src_start + src_count > src_tensors:
            raise _param(
                f"src_layer_range={src_layers!r} selects tensors "
                f"[{src_start}, {src_start + src_count}) of a source cache with {src_tensors}"
            )
    else:
        src_start, src_count = 0, src_tensors
    if dst_layers is not None:
        dst_start, dst_count = dst_layers.start * t, len(dst_layers) * t
        if dst_start + dst_count > dst_tensors:
            raise _param(
                f"dst_layer_range={dst_layers!r} selects tensors "
                f"[{dst_start}, {dst_start + dst_count}) of a destination cache with "
                f"{dst_tensors}"
            )
    else:
        dst_start, dst_count = 0, dst_tensors
    if src_count != dst_count:
        raise _param(
            f"source and destination select different tensor counts ({src_count} != "
            f"{dst_count}; src_layer_range={src_layers!r}, "
            f"dst_layer_range={dst_layers!r}, tensor_num_per_layer={t})"
        )
    return src_start, dst_start, src_count


def _native_plan(build: Callable[..., _native.Plan], *args: Any) -> _native.Plan:
    try:
        return build(*args)
    except _native.NativeError as e:
        raise from_native(e) from e


def _from_segments(src: CacheEntry, dst: CacheEntry, rows: Sequence[Segment]) -> _native.Plan:
    import numpy as np

    segments = np.asarray(rows, dtype=np.uint64).reshape(-1, 5)
    return _native_plan(_native.Plan.from_segments, src.geometry, dst.geometry, segments)


# --------------------------------------------------------------------- plans


def plan(request: Request, table: CacheTable) -> tuple[CacheEntry, _native.Plan]:
    """The peer's cache a request names in ``table``, and the plan that moves its bytes.

    Raises:
        LLMCacheNotFoundError, LLMParamError, LLMException: as the plan functions.
    """
    if isinstance(request, PushRequest):
        if request.key is not None:
            return push_key_plan(request, table)
        return push_addr_plan(request, table)
    if request.row is None:
        return pull_blocks_plan(request, table)
    return pull_row_plan(request, table)


def pull_blocks_plan(req: PullRequest, table: CacheTable) -> tuple[CacheEntry, _native.Plan]:
    """``pull_blocks``: remote blocks -> local blocks, or a remote row cut into local blocks.

    With a ``BlocksCacheKey`` block ``src_blocks[i]`` of every selected remote tensor
    lands in block ``dst_blocks[i]``; with a row key chunk ``i`` of the row (local
    block-sized) lands in ``dst_blocks[i]``.
    """
    local = req.local
    remote, row = resolve(table, req.key)
    s0, d0, n = tensor_span(
        remote.num_tensors, local.num_tensors, req.src_layers, req.dst_layers, req.tensors_per_layer
    )
    if isinstance(req.key, BlocksCacheKey):
        if not remote.is_blocks:
            raise _param(f"remote cache {remote.cache_id} is not a blocks cache")
        return remote, _native_plan(
            _native.Plan.blocks,
            remote.geometry,
            local.geometry,
            req.src_blocks,
            req.dst_blocks,
            s0,
            d0,
            n,
        )
    bb = local.block_bytes
    base = row * remote.block_bytes
    if len(req.dst_blocks) * bb > remote.block_bytes:
        raise _param(
            f"{len(req.dst_blocks)} decoder blocks of {bb} bytes exceed the remote row of "
            f"{remote.block_bytes} bytes"
        )
    rows = [
        (s0 + k, base + i * bb, d0 + k, d * bb, bb)
        for k in range(n)
        for i, d in enumerate(req.dst_blocks)
    ]
    return remote, _from_segments(remote, local, rows)


def pull_row_plan(req: PullRequest, table: CacheTable) -> tuple[CacheEntry, _native.Plan]:
    """``pull_cache``: one remote row -> local row ``req.row``, ``req.nbytes`` per tensor."""
    local = req.local
    assert req.row is not None
    remote, row = resolve(table, req.key)
    if req.nbytes > remote.block_bytes:
        raise _param(f"size {req.nbytes} exceeds the remote row of {remote.block_bytes} bytes")
    s0, d0, n = tensor_span(
        remote.num_tensors, local.num_tensors, req.src_layers, req.dst_layers, req.tensors_per_layer
    )
    rows = [
        (s0 + k, row * remote.block_bytes, d0 + k, req.row * local.block_bytes, req.nbytes)
        for k in range(n)
    ]
    return remote, _from_segments(remote, local, rows)


def push_key_plan(req: PushRequest, table: CacheTable) -> tuple[CacheEntry, _native.Plan]:
    """A push to a keyed cache of the peer.

    ``TransferWithCacheKeyConfig``: layer ``req.layer`` -> the keyed cache's ``dst_layer``
    (2 tensors); ``push_blocks`` / ``push_cache``: the layer ranges (:func:`tensor_span`).
    Blocks (``src_blocks[i]`` -> ``dst_blocks[i]``, ids checked against the peer's
    cache) from a blocks source, else the source row into the key's row.
    """
    local = req.local
    assert req.key is not None
    remote, row = resolve(table, req.key)
    span = req.src_layers is not None
    if span:
        s0, d0, n = tensor_span(
            local.num_tensors,
            remote.num_tensors,
            req.src_layers,
            req.dst_layers,
            req.tensors_per_layer,
        )
    else:
        s0, d0, n = 2 * req.layer, 2 * req.dst_layer, 2
        if d0 + 2 > remote.num_tensors:
            raise _param(
                f"dst layer {req.dst_layer} is outside the remote cache's "
                f"{remote.num_tensors // 2} layers"
            )
    if req.src_blocks is not None:
        assert req.dst_blocks is not None
        if isinstance(req.key, BlocksCacheKey) and not remote.is_blocks:
            raise _param(f"remote cache {remote.cache_id} is not a blocks cache")
        top = max(req.dst_blocks)
        if top >= remote.num_blocks:
            raise _param(
                f"dst block {top} out of range for remote cache {remote.cache_id} with "
                f"{remote.num_blocks} blocks"
            )
        return remote, _native_plan(
            _native.Plan.blocks,
            local.geometry,
            remote.geometry,
            req.src_blocks,
            req.dst_blocks,
            s0,
            d0,
            n,
        )
    if span:
        # push_cache: the whole source row; it must fit the remote row.
        if remote.is_blocks:
            raise _param(f"remote cache {remote.cache_id} is a blocks cache (use push_blocks)")
        nbytes = local.block_bytes
        if nbytes > remote.block_bytes:
            raise _param(
                f"the source row of {nbytes} bytes exceeds the remote row of "
                f"{remote.block_bytes} bytes"
            )
    else:
        nbytes = min(local.block_bytes, remote.block_bytes)
    rows = [
        (s0 + k, req.src_row * local.block_bytes, d0 + k, row * remote.block_bytes, nbytes)
        for k in range(n)
    ]
    return remote, _from_segments(local, remote, rows)


def push_addr_plan(req: PushRequest, table: CacheTable) -> tuple[CacheEntry, _native.Plan]:
    """``TransferConfig``: layer ``req.layer`` -> raw peer addresses (K, V).

    Each address (with the bytes written there) must lie inside one tensor the peer
    registered, and both inside the same cache.
    """
    local = req.local
    bb = local.block_bytes
    need = (max(req.dst_blocks) + 1) * bb if req.dst_blocks else bb
    found = []
    for addr in req.dst_addrs:
        hit = table.containing(addr, need)
        if hit is None:
            raise _param(
                f"dst address {addr:#x} (+{need} bytes) is not inside memory "
                f"registered by cluster {req.cluster_id}"
            )
        found.append(hit)
    remote = found[0][0]
    if found[1][0] is not remote:
        raise _param("the K and V addresses of one layer lie in different remote caches")
    s0 = 2 * req.layer
    rows: list[Segment] = []
    for j, (_, tensor, off) in enumerate(found):
        if req.src_blocks is not None:
            assert req.dst_blocks is not None
            rows += [
                (s0 + j, s * bb, tensor, off + d * bb, bb)
                for s, d in zip(req.src_blocks, req.dst_blocks, strict=True)
            ]
        else:
            rows.append((s0 + j, req.src_row * bb, tensor, off, bb))
    return remote, _from_segments(local, remote, rows)


def copy_plan(req: CopyRequest) -> _native.Plan:
    """``copy_blocks``: every tensor's block ``s`` -> block ``d`` for each pair."""
    entry = req.entry
    bb = entry.block_bytes
    rows = [(t, s * bb, t, d * bb, bb) for t in range(entry.num_tensors) for s, d in req.pairs]
    return _from_segments(entry, entry, rows)


def local_copy_plan(req: LocalCopyRequest) -> _native.Plan:
    """``copy_cache`` / ``swap_blocks``: the request's segments, checked against both sides."""
    return _from_segments(req.src, req.dst, req.segments)
