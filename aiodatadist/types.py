"""Upstream ``llm_datadist`` data types: enums, cache descriptions, keys, configs.

This module is the public home of every type; the cache descriptions and handles
(:class:`CacheDesc`, :class:`KvCache`, :class:`MemInfo`) live here, the rest in one
private module per concern (``_enums``, ``_keys``, ``_cluster``,
``_transfer_config``), re-exported here with ``__module__`` set to this module.

Names, fields, defaults and integer values follow upstream (reference §3.1,
§5.1, §6).  Differences are deliberate and listed where they occur; the main
ones: out-of-range integers raise :class:`~aiodatadist.errors.LLMParamError`
(a ``ValueError``, as upstream, and an ``LLMException``), ``bool`` is never
accepted as an ``int``, and keys are hashable value objects.

Nothing here imports numpy or the native core at import time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ._cluster import LLMClusterInfo, ip_to_int, ip_to_str
from ._enums import DataType, LLMRole, Memtype, Placement, RegisterMemStatus
from ._keys import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from ._transfer_config import LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig
from ._validate import (
    INT64_MAX,
    UINT32_MAX,
    check_bool,
    check_int,
    check_int_list,
    check_sint,
    check_type,
    check_uint,
    require,
)
from .errors import LLMException, LLMStatusCode

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "DataType",
    "KvCache",
    "LLMClusterInfo",
    "LLMRole",
    "LayerSynchronizer",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "ip_to_int",
    "ip_to_str",
]

_MAX_DIMS = 32


class CacheDesc:
    """Description of ``num_tensors`` identically shaped tensors (one address each).

    For a KV cache the tensors are ordered K0, V0, K1, V1, ...  For a blocks
    (paged) cache ``shape[0]`` is the number of blocks.

    Args:
        num_tensors: Number of tensors, a uint32 > 0.
        shape: Per-tensor shape: 1 to 32 dims, each an int >= 1.
        data_type: Element type.
        placement: Where the tensors live.
        batch_dim_index: Index of the batch dim, in ``[0, len(shape))``.
        seq_len_dim_index: ``-1`` or an index in ``[0, len(shape))``.
        kv_tensor_format: Free-form format label, or ``None``.

    Raises:
        TypeError: an argument has the wrong type.
        LLMParamError: a value is out of range (``LLM_PARAM_INVALID``).
    """

    def __init__(
        self,
        num_tensors: int,
        shape: Sequence[int],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        self._num_tensors = check_int("num_tensors", num_tensors, min_value=1, max_value=UINT32_MAX)
        check_type("shape", shape, (list, tuple))
        require(
            1 <= len(shape) <= _MAX_DIMS,
            f"shape must have 1 to {_MAX_DIMS} dims, got {len(shape)}: {list(shape)}",
        )
        self._shape = [self._check_dim(f"shape[{i}]", d, shape) for i, d in enumerate(shape)]
        check_type("data_type", data_type, DataType)
        check_type("placement", placement, Placement)
        self._data_type = data_type
        self._placement = placement
        self._batch_dim_index = check_int(
            "batch_dim_index", batch_dim_index, min_value=0, max_value=len(shape) - 1
        )
        check_sint("seq_len_dim_index", seq_len_dim_index, 32)
        require(
            seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
            f"seq_len_dim_index must be -1 or in [0, {len(shape) - 1}], got {seq_len_dim_index}",
        )
        self._seq_len_dim_index = seq_len_dim_index
        if kv_tensor_format is not None:
            check_type("kv_tensor_format", kv_tensor_format, str)
        self._kv_tensor_format = kv_tensor_format

    @staticmethod
    def _check_dim(name: str, value: object, shape: Sequence[object]) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be int, got {type(value).__name__}")
        require(
            1 <= value <= INT64_MAX,
            f"{name} must be >= 1 (empty dims are not supported), got {value}: shape={list(shape)}",
        )
        return int(value)

    @property
    def num_tensors(self) -> int:
        """Number of tensors."""
        return self._num_tensors

    @property
    def shape(self) -> tuple[int, ...]:
        """Per-tensor shape (a tuple; change a dim with :meth:`update_dim`)."""
        return tuple(self._shape)

    @property
    def data_type(self) -> DataType:
        """Element type."""
        return self._data_type

    @property
    def placement(self) -> Placement:
        """Where the tensors live."""
        return self._placement

    @property
    def batch_dim_index(self) -> int:
        """Index of the batch dim."""
        return self._batch_dim_index

    @property
    def batch_dim(self) -> int:
        """Same as :attr:`batch_dim_index` (upstream's property name)."""
        return self._batch_dim_index

    @property
    def batch_size(self) -> int:
        """``shape[batch_dim_index]``."""
        return self._shape[self._batch_dim_index]

    @property
    def seq_len_dim_index(self) -> int:
        """Index of the sequence-length dim, or ``-1``."""
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> str | None:
        """Format label given at construction."""
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes per tensor: ``prod(shape) * data_type.itemsize``.

        Raises:
            LLMParamError: the data type has no fixed size (``DT_STRING``).
        """
        return math.prod(self._shape) * self._data_type.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes per block (``size // shape[0]``): ``shape[0]`` is the block count, always."""
        return self.size // self._shape[0]

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Set ``shape[dim_index]`` to ``dim_value``.

        Raises:
            TypeError: an argument is not an ``int``.
            LLMParamError: ``dim_index`` is out of range or ``dim_value < 1``.
        """
        check_int("dim_index", dim_index, min_value=0, max_value=len(self._shape) - 1)
        self._shape[dim_index] = self._check_dim("dim_value", dim_value, self._shape)

    def _key(self) -> tuple[object, ...]:
        return (
            self._num_tensors,
            tuple(self._shape),
            self._data_type,
            self._placement,
            self._batch_dim_index,
            self._seq_len_dim_index,
            self._kv_tensor_format,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheDesc):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # mutable through update_dim

    def __repr__(self) -> str:
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={self.shape}, "
            f"data_type={self._data_type}, placement={self._placement}, "
            f"batch_dim_index={self._batch_dim_index}, "
            f"seq_len_dim_index={self._seq_len_dim_index}, "
            f"kv_tensor_format={self._kv_tensor_format!r})"
        )


class KvCache:
    """Handle of a registered or allocated cache (upstream's ``Cache``; ``Cache`` is this class).

    Users get these from the cache manager, or from :meth:`create_cpu_cache`
    for the host side of ``swap_blocks``; they should not construct them.

    Args:
        cache_id: Process-unique id (int64; ``-1`` for :meth:`create_cpu_cache`).
        cache_desc: Shape and type of the tensors.
        tensor_addrs: One address (uint64) per tensor, ``num_tensors`` of them.
        is_blocks_cache: Whether ``shape[0]`` counts blocks (paged cache).

    The cache manager attaches its private state to ``_owner`` (the manager),
    ``_buffers`` (whatever keeps the memory alive) and ``_views_factory``
    (returns the tensors as arrays, see :meth:`tensors`); all start as ``None``.

    Raises:
        TypeError: an argument has the wrong type.
        LLMParamError: a value is out of range or ``len(tensor_addrs)`` is
            not ``num_tensors``.
    """

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        tensor_addrs: Sequence[int],
        is_blocks_cache: bool = False,
    ) -> None:
        self._cache_id = check_sint("cache_id", cache_id, 64)
        check_type("cache_desc", cache_desc, CacheDesc)
        self._cache_desc = cache_desc
        self._tensor_addrs = check_int_list("tensor_addrs", tensor_addrs)
        require(
            len(self._tensor_addrs) == cache_desc.num_tensors,
            f"tensor_addrs must have cache_desc.num_tensors ({cache_desc.num_tensors}) entries, "
            f"got {len(self._tensor_addrs)}",
        )
        self._is_blocks_cache = check_bool("is_blocks_cache", is_blocks_cache)
        self._owner: Any = None
        self._buffers: Any = None
        self._views_factory: Callable[[], list[Any]] | None = None

    @classmethod
    def create_cpu_cache(
        cls, cache_desc: CacheDesc, addrs: Sequence[int] | Sequence[Sequence[int]]
    ) -> KvCache:
        """Wrap host memory as a blocks cache, for the host side of ``swap_blocks``.

        Args:
            cache_desc: Description with ``placement == Placement.HOST``.
            addrs: ``num_tensors`` addresses, or upstream v1's one-device
                form ``[addrs]``.

        Returns:
            A cache with ``cache_id == -1`` and ``is_blocks_cache`` true (as upstream).

        Raises:
            TypeError: an argument has the wrong type.
            LLMParamError: placement is not HOST or the address count is wrong.
        """
        check_type("cache_desc", cache_desc, CacheDesc)
        require(
            cache_desc.placement == Placement.HOST,
            f"cache_desc.placement must be Placement.HOST, got {cache_desc.placement}",
        )
        check_type("addrs", addrs, (list, tuple))
        flat: object = addrs
        if len(addrs) == 1 and isinstance(addrs[0], (list, tuple)):
            flat = addrs[0]
        flat_addrs = check_int_list("addrs", flat)
        require(
            len(flat_addrs) == cache_desc.num_tensors,
            f"addrs must have cache_desc.num_tensors ({cache_desc.num_tensors}) entries, "
            f"got {len(flat_addrs)}",
        )
        return cls(-1, cache_desc, flat_addrs, is_blocks_cache=True)

    @property
    def cache_id(self) -> int:
        """Process-unique id (``-1`` for a CPU cache)."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """Shape and type of the tensors."""
        return self._cache_desc

    @property
    def tensor_addrs(self) -> list[int]:
        """One address per tensor."""
        return list(self._tensor_addrs)

    @property
    def per_device_tensor_addrs(self) -> list[list[int]]:
        """Upstream v1's form: ``[tensor_addrs]`` (this library has one device per process)."""
        return [list(self._tensor_addrs)]

    @property
    def is_blocks_cache(self) -> bool:
        """Whether ``shape[0]`` counts blocks."""
        return self._is_blocks_cache

    def tensors(self) -> list[Any]:
        """Return the tensors as arrays (views of the cache memory).

        Raises:
            LLMException: ``LLM_FEATURE_NOT_ENABLED`` when this cache's memory
                cannot be viewed from Python (e.g. it was not created by this
                process's cache manager).
        """
        if self._views_factory is None:
            raise LLMException(
                f"tensors() is not available for cache {self._cache_id}",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        return self._views_factory()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(cache_id={self._cache_id}, "
            f"num_tensors={self._cache_desc.num_tensors}, "
            f"is_blocks_cache={self._is_blocks_cache})"
        )


Cache = KvCache


class MemInfo:
    """A memory region for ``remap_registered_memory`` (reserved upstream).

    Args:
        mem_type: Device or host.
        addr: Start address (uint64).
        size: Size in bytes (uint64).

    Raises:
        TypeError: an argument has the wrong type.
        LLMParamError: ``addr`` or ``size`` is not a uint64.
    """

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_type("mem_type", mem_type, Memtype)
        self._mem_type = mem_type
        self._addr = check_uint("addr", addr, 64)
        self._size = check_uint("size", size, 64)

    @property
    def mem_type(self) -> Memtype:
        """Device or host."""
        return self._mem_type

    @property
    def addr(self) -> int:
        """Start address."""
        return self._addr

    @property
    def size(self) -> int:
        """Size in bytes."""
        return self._size

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type}, addr={self._addr}, size={self._size})"


# The public home of the types defined in the private modules (reprs, pickles, docs).
for _public in (
    BlocksCacheKey,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMRole,
    LayerSynchronizer,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
    ip_to_int,
    ip_to_str,
):
    _public.__module__ = __name__
del _public
