"""The cache manager's argument checks, shared by the facade and its mixins.

Each function checks what one public call was given, in upstream's order, and returns
what the request needs (``TypeError`` for a wrong type, ``LLMParamError`` for a bad
value), before anything is queued. Nothing here does I/O or awaits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._plan import PullRequest, RemoteKey, Segment
from ._validate import (
    INT64_MAX,
    INVALID_ID,
    check_int,
    check_int_list,
    check_layer_range,
    check_timeout,
    check_type,
    check_uint,
    require,
)
from .errors import LLMStatusCode, failure
from .types import BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex

if TYPE_CHECKING:
    from ._caches import CacheEntry
    from ._registration import CacheRegistry
    from ._runtime import Runtime

__all__ = [
    "MISSING",
    "blocks_pull_request",
    "check_cache_key",
    "check_row_keys",
    "check_tensor_num",
    "copy_pairs",
    "pull_block_lists",
    "pull_names",
    "pull_request",
    "push_block_lists",
    "push_layers",
    "row_copy_segments",
]


class _Missing:
    """The default of a parameter that has a second (upstream v1) spelling."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<required>"


MISSING: Any = _Missing()
"""Marks an argument the caller did not pass (so a v1 keyword may stand in for it)."""

# pull_blocks' upstream v1 keyword -> its v2 name (the parameter it stands for).
_PULL_V1 = {
    "prompt_cache_key": "src_cache_key",
    "decoder_kv_cache": "dst_cache",
    "prompt_blocks": "src_blocks",
    "decoder_blocks": "dst_blocks",
}


def pull_names(
    src_cache_key: object,
    dst_cache: object,
    src_blocks: object,
    dst_blocks: object,
    legacy: dict[str, object],
) -> tuple[Any, Any, Any, Any]:
    """``pull_blocks``' four arguments from the v2 names and the v1 keywords in ``legacy``.

    Raises:
        TypeError: an unknown keyword, one parameter passed under both names (or both
            positionally and as a v1 keyword), or a required one missing.
    """
    got = {
        "src_cache_key": src_cache_key,
        "dst_cache": dst_cache,
        "src_blocks": src_blocks,
        "dst_blocks": dst_blocks,
    }
    for old, value in legacy.items():
        new = _PULL_V1.get(old)
        if new is None:
            raise TypeError(f"pull_blocks() got an unexpected keyword argument {old!r}")
        if got[new] is not MISSING:
            raise TypeError(
                f"pull_blocks() got {new!r} and its upstream v1 name {old!r}: pass one of them"
            )
        got[new] = value
    for name in ("src_cache_key", "dst_cache"):
        if got[name] is MISSING:
            raise TypeError(f"pull_blocks() missing required argument: {name!r}")
    return (
        got["src_cache_key"],
        got["dst_cache"],
        () if got["src_blocks"] is MISSING else got["src_blocks"],
        () if got["dst_blocks"] is MISSING else got["dst_blocks"],
    )


def check_tensor_num(value: object) -> int:
    """``tensor_num_per_layer``: a uint32 > 0 (upstream)."""
    t = check_uint("tensor_num_per_layer", value, 32)
    require(t > 0, f"tensor_num_per_layer must be > 0, got {t}")
    return t


def check_cache_key(key: CacheKey) -> None:
    """A ``CacheKey`` sets exactly one of ``req_id`` and ``prefix_id`` (upstream)."""
    require(
        (key.req_id == INVALID_ID) != (key.prefix_id == INVALID_ID),
        f"a CacheKey must set exactly one of req_id and prefix_id, got {key!r}",
    )


def check_row_keys(desc: CacheDesc, cache_keys: object) -> list[CacheKey]:
    """``register_cache`` / ``allocate_cache``'s row keys: at most one per row."""
    check_type("cache_keys", cache_keys, (list, tuple))
    assert isinstance(cache_keys, (list, tuple))
    for i, k in enumerate(cache_keys):
        check_type(f"cache_keys[{i}]", k, CacheKey)
    require(
        len(cache_keys) <= desc.shape[0],
        f"cache_keys has {len(cache_keys)} keys for a batch of {desc.shape[0]} rows",
    )
    return list(cache_keys)


def pull_request(
    rt: Runtime,
    key: RemoteKey,
    local: CacheEntry,
    tensor_num_per_layer: object,
    src_layer_range: object,
    dst_layer_range: object,
    timeout: object,
    **what: Any,
) -> PullRequest:
    """The checks every pull shares, in upstream's order, then its one request
    (the deadline fixed here: waiting for the link counts against it). Any role
    may pull (upstream v2: the role is a label)."""
    t = check_tensor_num(tensor_num_per_layer)
    src_lr = check_layer_range("src_layer_range", src_layer_range, allow_none=True)
    dst_lr = check_layer_range("dst_layer_range", dst_layer_range, allow_none=True)
    tmo = check_timeout("timeout", timeout)
    if key.cluster_id == rt.cluster_id:
        raise failure(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"cannot pull from this instance's own cluster_id {rt.cluster_id}",
        )
    return PullRequest(
        local=local,
        key=key,
        deadline=rt.deadline(tmo),
        src_layers=src_lr,
        dst_layers=dst_lr,
        tensors_per_layer=t,
        **what,
    )


def pull_block_lists(
    key: RemoteKey, local: CacheEntry, src_blocks: object, dst_blocks: object
) -> tuple[list[int], list[int]]:
    """``pull_blocks``'s block lists, checked against the key's kind and the destination."""
    # Bounded by the destination: no list can name more blocks than it holds, and no
    # id beyond int64 may reach native code (the source's size is known only later).
    most = local.num_blocks
    src = check_int_list("src_blocks", src_blocks, max_len=most, max_value=INT64_MAX)
    dst = check_int_list(
        "dst_blocks", dst_blocks, allow_empty=False, max_len=most, max_value=most - 1
    )
    if isinstance(key, BlocksCacheKey):
        require(len(src) > 0, "src_blocks must not be empty with a BlocksCacheKey")
        require(
            len(src) == len(dst),
            f"src_blocks and dst_blocks differ in length ({len(src)} != {len(dst)})",
        )
    else:
        require(
            not src,
            "src_blocks must be empty unless the key is a BlocksCacheKey "
            "(the remote row is cut into dst blocks)",
        )
        if isinstance(key, CacheKey):
            check_cache_key(key)
    return src, dst


def copy_pairs(entry: CacheEntry, copy_block_info: object) -> list[tuple[int, int]]:
    """``copy_blocks``'s ``{src: [dst, ...]}`` as (src, dst) pairs, checked against ``entry``."""
    require(entry.is_blocks, "cache must be a blocks cache")
    check_type("copy_block_info", copy_block_info, Mapping)
    assert isinstance(copy_block_info, Mapping)
    require(len(copy_block_info) > 0, "copy_block_info must not be empty")
    # Every block is named at most once as a destination: no list (and no total)
    # can be longer than the cache, and no id beyond it reaches native code.
    nb = entry.num_blocks
    require(
        len(copy_block_info) <= nb,
        f"copy_block_info has {len(copy_block_info)} sources, more than the cache's {nb} blocks",
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
            f"copy_block_info names {len(pairs)}+ destinations, more than the cache's {nb} blocks",
        )
    sources = {s for s, _ in pairs}
    for _, d in pairs:
        require(d not in sources, f"block {d} is both a source and a destination")
    return pairs


def push_layers(
    local: CacheEntry,
    tensor_num_per_layer: object,
    src_layer_range: object,
    dst_layer_range: object,
) -> tuple[int, range, range]:
    """``push_blocks`` / ``push_cache``'s tensors per layer and layer ranges (upstream):
    a missing range is every layer of the source (``num_tensors // tensor_num_per_layer``);
    both ranges select the same number of layers."""
    t = check_tensor_num(tensor_num_per_layer)
    src_lr = check_layer_range("src_layer_range", src_layer_range, allow_none=True)
    dst_lr = check_layer_range("dst_layer_range", dst_layer_range, allow_none=True)
    every = range(local.num_tensors // t)
    src_lr = every if src_lr is None else src_lr
    dst_lr = every if dst_lr is None else dst_lr
    require(
        len(src_lr) == len(dst_lr),
        f"src_layer_range {src_lr!r} and dst_layer_range {dst_lr!r} differ in length",
    )
    require(len(src_lr) > 0, f"no layer selected (tensor_num_per_layer={t})")
    return t, src_lr, dst_lr


def push_block_lists(
    local: CacheEntry, src_blocks: object, dst_blocks: object
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``push_blocks``'s block lists: ``dst_blocks`` non-empty; an empty ``src_blocks``
    means source blocks ``0 .. len(dst_blocks) - 1``; source ids checked here, the
    destination's against the peer's table in the plan."""
    nb = local.num_blocks
    dst = check_int_list(
        "dst_blocks", dst_blocks, allow_empty=False, max_len=nb, max_value=INT64_MAX
    )
    src = check_int_list("src_blocks", src_blocks, max_len=nb, max_value=nb - 1)
    if not src:
        require(
            len(dst) <= nb,
            f"dst_blocks names {len(dst)} blocks; the source holds {nb}",
        )
        src = list(range(len(dst)))
    require(
        len(src) == len(dst),
        f"src_blocks and dst_blocks differ in length ({len(src)} != {len(dst)})",
    )
    return tuple(src), tuple(dst)


def row_copy_segments(
    dst: CacheEntry,
    src: CacheEntry,
    dst_batch_index: object,
    src_batch_index: object,
    offset: object,
    size: object,
) -> tuple[Segment, ...]:
    """``copy_cache``'s segments: ``size`` bytes at ``offset`` of row ``src_batch_index``
    of every source tensor into the same place of row ``dst_batch_index`` of ``dst``."""
    require(not src.is_blocks, "src cache can not be a blocks cache")
    require(not dst.is_blocks, "dst cache can not be a blocks cache")
    db = check_int("dst_batch_index", dst_batch_index, min_value=0, max_value=dst.num_blocks - 1)
    sb = check_int("src_batch_index", src_batch_index, min_value=0, max_value=src.num_blocks - 1)
    off = check_uint("offset", offset, 64)
    n = check_int("size", size, min_value=-1, max_value=INT64_MAX)
    require(n == -1 or n > 0, f"size must be -1 or > 0, got {n}")
    require(
        src.num_tensors == dst.num_tensors,
        f"src has {src.num_tensors} tensors, dst {dst.num_tensors}: they must be equal",
    )
    stride = min(src.block_bytes, dst.block_bytes)
    require(off < stride, f"offset {off} is not inside a row of {stride} bytes")
    if n == -1:
        n = src.block_bytes - off
    require(
        off + n <= stride,
        f"offset {off} + size {n} exceeds a row (src {src.block_bytes}, dst "
        f"{dst.block_bytes} bytes)",
    )
    require(
        src is not dst or sb != db,
        f"src and dst are the same cache and row {sb}: the byte ranges overlap",
    )
    so, do = sb * src.block_bytes + off, db * dst.block_bytes + off
    return tuple((t, so, t, do, n) for t in range(src.num_tensors))


def blocks_pull_request(
    rt: Runtime,
    caches: CacheRegistry,
    src_cache_key: object,
    dst_cache: object,
    src_blocks: object,
    dst_blocks: object,
    tensor_num_per_layer: object,
    src_layer_range: object,
    dst_layer_range: object,
    timeout: object,
) -> PullRequest:
    """``pull_blocks``'s checks, in upstream's order, and its one request (shared with
    ``pull_blocks_layerwise``)."""
    rt.require_ready()
    check_type("src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey))
    assert isinstance(src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey))
    local = caches.live("dst_cache", dst_cache)
    require(local.is_blocks, "dst_cache must be a blocks cache")
    src, dst = pull_block_lists(src_cache_key, local, src_blocks, dst_blocks)
    return pull_request(
        rt,
        src_cache_key,
        local,
        tensor_num_per_layer,
        src_layer_range,
        dst_layer_range,
        timeout,
        src_blocks=tuple(src),
        dst_blocks=tuple(dst),
    )
