"""Upstream ``llm_datadist`` data types: enums, cache descriptions, keys, configs.

Names, fields, defaults and integer values follow upstream (reference §3.1,
§5.1, §6).  Differences are deliberate and listed where they occur; the main
ones: out-of-range integers raise :class:`~aiodatadist.errors.LLMParamError`
(a ``ValueError``, as upstream, and an ``LLMException``), ``bool`` is never
accepted as an ``int``, and keys are hashable value objects.

Nothing here imports numpy or the native core at import time.
"""

from __future__ import annotations

import abc
import enum
import ipaddress
import math
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._validate import (
    INT64_MAX,
    INVALID_ID,
    UINT32_MAX,
    check_bool,
    check_int,
    check_int_list,
    check_layer_range,
    check_sint,
    check_type,
    check_uint,
    raise_param_error,
    require,
)
from .errors import LLMException, LLMStatusCode

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

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
_TENSORS_PER_LAYER = 2  # TransferConfig.dst_addrs: K and V of each layer


class LLMRole(enum.IntEnum):
    """Role of an ``LLMDataDist``: ``PROMPT`` (prefill), ``DECODER`` or ``MIX`` (both).

    Unlike upstream's cache-manager mode, the role restricts two calls: ``pull_blocks``
    and ``pull_cache`` need ``DECODER`` or ``MIX``, ``transfer_cache_async`` needs
    ``PROMPT`` or ``MIX`` (otherwise ``LLMException(LLM_FAILED)``).
    """

    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class Placement(enum.IntEnum):
    """Where a cache lives."""

    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class RegisterMemStatus(enum.Enum):
    """State of the memory exchange after a two-sided ``link``.

    Looking up an unknown integer gives ``FAILED``, as upstream maps unknown
    native values.
    """

    OK = 0
    PREPARING = 1
    FAILED = 2

    @classmethod
    def _missing_(cls, value: object) -> RegisterMemStatus | None:
        if isinstance(value, int) and not isinstance(value, bool):
            return cls.FAILED
        return None


class Memtype(enum.Enum):
    """Memory kind of a :class:`MemInfo`."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


# Per-member facts kept outside the Enum body so they do not become members.
_ITEMSIZE: dict[str, int] = {
    "DT_FLOAT": 4,
    "DT_FLOAT16": 2,
    "DT_INT8": 1,
    "DT_INT32": 4,
    "DT_UINT8": 1,
    "DT_INT16": 2,
    "DT_UINT16": 2,
    "DT_UINT32": 4,
    "DT_INT64": 8,
    "DT_UINT64": 8,
    "DT_DOUBLE": 8,
    "DT_BOOL": 1,
    "DT_BF16": 2,
}
_NUMPY_NAME: dict[str, str] = {
    "DT_FLOAT": "float32",
    "DT_FLOAT16": "float16",
    "DT_INT8": "int8",
    "DT_INT32": "int32",
    "DT_UINT8": "uint8",
    "DT_INT16": "int16",
    "DT_UINT16": "uint16",
    "DT_UINT32": "uint32",
    "DT_INT64": "int64",
    "DT_UINT64": "uint64",
    "DT_DOUBLE": "float64",
    "DT_BOOL": "bool",
    "DT_BF16": "uint16",  # numpy has no bfloat16: a 2-byte stand-in with the same size
}
_FROM_NUMPY_NAME: dict[str, str] = {
    np_name: dt for dt, np_name in _NUMPY_NAME.items() if dt != "DT_BF16"
} | {"bfloat16": "DT_BF16"}


class DataType(enum.Enum):
    """Element type of a cache tensor; values are GE ``ge::DataType`` ids."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27

    @property
    def itemsize(self) -> int:
        """Bytes per element.

        Raises:
            LLMParamError: for ``DT_STRING``, which has no fixed size.
        """
        size = _ITEMSIZE.get(self.name)
        if size is None:
            raise LLMException(
                f"{self} has no fixed item size", status_code=LLMStatusCode.LLM_PARAM_INVALID
            )
        return size

    def to_numpy(self) -> np.dtype[Any]:
        """Return the numpy dtype for this type.

        ``DT_BF16`` maps to ``uint16``: numpy has no bfloat16, and the byte
        layout is what matters for moving data.  Reinterpret the array (for
        example with ``ml_dtypes.bfloat16``) to compute with it.

        Raises:
            LLMParamError: for ``DT_STRING``.
        """
        import numpy as np

        name = _NUMPY_NAME.get(self.name)
        if name is None:
            raise LLMException(
                f"{self} has no numpy equivalent", status_code=LLMStatusCode.LLM_PARAM_INVALID
            )
        return np.dtype(name)

    @classmethod
    def from_numpy(cls, dtype: npt.DTypeLike) -> DataType:
        """Return the :class:`DataType` for a numpy dtype (or anything ``np.dtype()`` accepts).

        ``uint16`` gives ``DT_UINT16``; a registered ``bfloat16`` dtype (such
        as ``ml_dtypes.bfloat16``) gives ``DT_BF16``.

        Raises:
            TypeError: ``dtype`` is not understood by numpy.
            LLMParamError: the dtype has no :class:`DataType` (e.g. ``complex64``)
                or is not in native byte order.
        """
        import numpy as np

        try:
            dt = np.dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"dtype must be a numpy dtype, got {dtype!r}") from exc
        name = _FROM_NUMPY_NAME.get(dt.name)
        if name is None or not dt.isnative:
            raise_param_error(f"dtype {dt!r} has no DataType equivalent")
        return cls[name]


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


def _pick_cluster_id(owner: str, prompt_cluster_id: int | None, cluster_id: int | None) -> int:
    if prompt_cluster_id is not None and cluster_id is not None:
        raise TypeError(f"{owner}() got both prompt_cluster_id and cluster_id; pass one")
    value = cluster_id if cluster_id is not None else prompt_cluster_id
    if value is None:
        raise TypeError(
            f"{owner}() missing required argument 'cluster_id' (or 'prompt_cluster_id')"
        )
    name = "cluster_id" if cluster_id is not None else "prompt_cluster_id"
    return check_uint(name, value, 64)


class _ValueKey:
    """Keys are immutable values: equal when of one type with equal fields, hashable."""

    __slots__ = ()

    def _key(self) -> tuple[int, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _ValueKey)
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self), *self._key()))


class CacheKey(_ValueKey):
    """Key of one batch row of a non-block cache, by request id (or prefix id).

    Args:
        prompt_cluster_id: Cluster id of the side that holds the cache (uint64);
            also accepted as ``cluster_id=``.  Ignored on registration.
        req_id: Request id (uint64; ``2**64 - 1`` means none).
        model_id: Model id (uint64).
        prefix_id: Prefix id (uint64; ``2**64 - 1``, the default, means none).
        cluster_id: Keyword alias of ``prompt_cluster_id``.

    Raises:
        TypeError: an argument is missing or not an ``int``.
        LLMParamError: a value is not a uint64.
    """

    __slots__ = ("_cluster_id", "_model_id", "_prefix_id", "_req_id")

    def __init__(
        self,
        prompt_cluster_id: int | None = None,
        req_id: int | None = None,
        model_id: int = 0,
        prefix_id: int = INVALID_ID,
        *,
        cluster_id: int | None = None,
    ) -> None:
        self._cluster_id = _pick_cluster_id("CacheKey", prompt_cluster_id, cluster_id)
        if req_id is None:
            raise TypeError("CacheKey() missing required argument 'req_id'")
        self._req_id = check_uint("req_id", req_id, 64)
        self._model_id = check_uint("model_id", model_id, 64)
        self._prefix_id = check_uint("prefix_id", prefix_id, 64)

    @property
    def cluster_id(self) -> int:
        """Cluster id of the side that holds the cache."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same as :attr:`cluster_id` (upstream's older name)."""
        return self._cluster_id

    @property
    def req_id(self) -> int:
        """Request id (``2**64 - 1`` when unset)."""
        return self._req_id

    @property
    def model_id(self) -> int:
        """Model id."""
        return self._model_id

    @property
    def prefix_id(self) -> int:
        """Prefix id (``2**64 - 1`` when unset)."""
        return self._prefix_id

    def _key(self) -> tuple[int, int, int, int]:
        return (self._cluster_id, self._req_id, self._model_id, self._prefix_id)

    def __repr__(self) -> str:
        return (
            f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
            f"model_id={self._model_id}, prefix_id={self._prefix_id})"
        )


class CacheKeyByIdAndIndex(_ValueKey):
    """Key of one batch row of a remote cache, by the remote cache id.

    Args:
        cluster_id: Cluster id of the side that holds the cache (uint64).
        cache_id: The remote cache's id (int64).
        batch_index: Row within that cache (uint32).

    Raises:
        TypeError: an argument is not an ``int``.
        LLMParamError: a value is out of range.
    """

    __slots__ = ("_batch_index", "_cache_id", "_cluster_id")

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        self._cluster_id = check_uint("cluster_id", cluster_id, 64)
        self._cache_id = check_sint("cache_id", cache_id, 64)
        self._batch_index = check_uint("batch_index", batch_index, 32)

    @property
    def cluster_id(self) -> int:
        """Cluster id of the side that holds the cache."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same as :attr:`cluster_id`."""
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        """The remote cache's id."""
        return self._cache_id

    @property
    def batch_index(self) -> int:
        """Row within the remote cache."""
        return self._batch_index

    def _key(self) -> tuple[int, int, int]:
        return (self._cluster_id, self._cache_id, self._batch_index)

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
            f"batch_index={self._batch_index})"
        )


class BlocksCacheKey(_ValueKey):
    """Key of a whole blocks cache on a cluster, by model id.

    One blocks cache per ``model_id`` per process can be registered under a
    key; registering another with the same ``model_id`` replaces the index
    entry (upstream: last wins).

    Args:
        prompt_cluster_id: Cluster id of the side that holds the cache (uint64);
            also accepted as ``cluster_id=``.  Ignored on registration.
        model_id: Model id (uint64).
        cluster_id: Keyword alias of ``prompt_cluster_id``.

    Raises:
        TypeError: an argument is missing or not an ``int``.
        LLMParamError: a value is not a uint64.
    """

    __slots__ = ("_cluster_id", "_model_id")

    def __init__(
        self,
        prompt_cluster_id: int | None = None,
        model_id: int = 0,
        *,
        cluster_id: int | None = None,
    ) -> None:
        self._cluster_id = _pick_cluster_id("BlocksCacheKey", prompt_cluster_id, cluster_id)
        self._model_id = check_uint("model_id", model_id, 64)

    @property
    def cluster_id(self) -> int:
        """Cluster id of the side that holds the cache."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same as :attr:`cluster_id` (upstream's older name)."""
        return self._cluster_id

    @property
    def model_id(self) -> int:
        """Model id."""
        return self._model_id

    def _key(self) -> tuple[int, int]:
        return (self._cluster_id, self._model_id)

    def __repr__(self) -> str:
        return f"BlocksCacheKey(cluster_id={self._cluster_id}, model_id={self._model_id})"


def ip_to_int(name: str, ip: str | int) -> int:
    """Convert an IPv4 address to upstream's integer form.

    Args:
        name: Argument name for messages.
        ip: Dotted IPv4 string, or an int already in upstream's form.

    Returns:
        ``int.from_bytes(socket.inet_aton(ip), "little")`` for a string; the
        int itself (checked to be a uint32) otherwise.

    Raises:
        TypeError: ``ip`` is neither ``str`` nor ``int``.
        LLMParamError: ``ip`` is not a dotted IPv4 address or not a uint32.
    """
    if isinstance(ip, str):
        try:
            packed = ipaddress.IPv4Address(ip).packed
        except ValueError:
            packed = b""
        if not packed:
            raise_param_error(f"{name} must be a dotted IPv4 address, got {ip!r}")
        return int.from_bytes(packed, "little")
    check_type(name, ip, (str, int))
    return check_uint(name, ip, 32)


def ip_to_str(ip: int) -> str:
    """Convert upstream's integer IPv4 form back to a dotted string."""
    return socket.inet_ntoa(check_uint("ip", ip, 32).to_bytes(4, "little"))


class LLMClusterInfo:
    """Where and what to link to, for ``link_clusters`` / ``unlink_clusters``.

    IPs are stored as upstream does: ``(ip_int, port)`` with
    ``ip_int = int.from_bytes(socket.inet_aton(ip), "little")``.  Only IPv4.
    """

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int | None = None
        self._local_ip_info_list: list[tuple[int, int]] = []
        self._remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """Cluster id of the peer (uint64); ``None`` until set."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = check_uint("remote_cluster_id", value, 64)

    @property
    def remote_role_type(self) -> LLMRole | int | None:
        """Role of the peer (stored only; not used in cache-manager mode)."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: LLMRole | int) -> None:
        check_type("remote_role_type", value, (LLMRole, int))
        self._remote_role_type = value

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        """``(ip_int, port)`` entries for this side."""
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        """``(ip_int, port)`` entries for the peer (its listen address)."""
        return self._remote_ip_info_list

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add a local host IP (the port is unused in practice; samples pass 0).

        Raises:
            TypeError: ``ip`` or ``port`` has the wrong type.
            LLMParamError: ``ip`` is not IPv4 or ``port`` is not a uint16.
        """
        entry = (ip_to_int("ip", ip), check_uint("port", port, 16))
        self._local_ip_info_list.append(entry)

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add the peer's host IP and the port of its ``listen_ip_info``.

        Raises:
            TypeError: ``ip`` or ``port`` has the wrong type.
            LLMParamError: ``ip`` is not IPv4 or ``port`` is not a uint16.
        """
        entry = (ip_to_int("ip", ip), check_uint("port", port, 16))
        self._remote_ip_info_list.append(entry)

    def local_ip_info_strs(self) -> list[tuple[str, int]]:
        """Return :attr:`local_ip_info_list` with dotted IP strings."""
        return [(ip_to_str(ip), port) for ip, port in self._local_ip_info_list]

    def remote_ip_info_strs(self) -> list[tuple[str, int]]:
        """Return :attr:`remote_ip_info_list` with dotted IP strings."""
        return [(ip_to_str(ip), port) for ip, port in self._remote_ip_info_list]

    def remote_address(self) -> tuple[str, int]:
        """Return the first remote ``(dotted_ip, port)``: where to connect.

        Raises:
            LLMParamError: no remote IP info was appended.
        """
        require(
            bool(self._remote_ip_info_list),
            f"remote_ip_info_list is empty for remote_cluster_id={self._remote_cluster_id}",
        )
        ip, port = self._remote_ip_info_list[0]
        return ip_to_str(ip), port

    def remote_ip_str(self) -> str:
        """Return the first remote IP as a dotted string.

        Raises:
            LLMParamError: no remote IP info was appended.
        """
        return self.remote_address()[0]

    def __repr__(self) -> str:
        return (
            f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
            f"remote_role_type={self._remote_role_type}, "
            f"local_ip_info={self.local_ip_info_strs()}, "
            f"remote_ip_info={self.remote_ip_info_strs()})"
        )


class LayerSynchronizer(abc.ABC):
    """User hook called by ``transfer_cache_async`` before sending each layer.

    Implement :meth:`synchronize_layer` as a plain method or as an
    ``async def``; the engine awaits the result when it is awaitable.
    """

    @abc.abstractmethod
    def synchronize_layer(
        self, layer_index: int, timeout_in_millis: int | None
    ) -> bool | Awaitable[bool]:
        """Wait until layer ``layer_index`` has been computed.

        Args:
            layer_index: Source layer about to be sent.
            timeout_in_millis: Time limit in ms, or ``None`` for no limit
                (upstream always passes ``None``).

        Returns:
            ``True`` to send the layer; ``False`` aborts the transfer.
        """


class TransferConfig:
    """Target of ``transfer_cache_async`` by raw destination addresses.

    Used when remote-cache-accessible is off.

    Args:
        dst_cluster_id: Cluster id of the destination (uint64).
        dst_addrs: Destination tensor addresses (uint64), 2 per layer (K, V).
        src_layer_range: Source layers to send (step 1, ``0 <= start < stop``),
            or ``None`` for all layers.  When given, ``len(dst_addrs)`` must
            be ``2 * len(src_layer_range)``.
        src_batch_index: Source batch row (uint32).

    The attribute ``dst_layer_range`` exists and is ``None`` (as upstream).

    Raises:
        TypeError: an argument has the wrong type.
        LLMParamError: a value is out of range or the counts do not match.
    """

    def __init__(
        self,
        dst_cluster_id: int,
        dst_addrs: Sequence[int],
        src_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        self._dst_cluster_id = check_uint("dst_cluster_id", dst_cluster_id, 64)
        self._dst_addrs = check_int_list("dst_addrs", dst_addrs)
        self._src_layer_range = check_layer_range(
            "src_layer_range", src_layer_range, allow_none=True
        )
        self._src_batch_index = check_uint("src_batch_index", src_batch_index, 32)
        self.dst_layer_range: range | None = None
        if self._src_layer_range is not None:
            expected = _TENSORS_PER_LAYER * len(self._src_layer_range)
            require(
                len(self._dst_addrs) == expected,
                f"dst_addrs must have {expected} entries (2 per layer of src_layer_range="
                f"{self._src_layer_range!r}), got {len(self._dst_addrs)}",
            )

    @property
    def dst_cluster_id(self) -> int:
        """Cluster id of the destination."""
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, value: int) -> None:
        self._dst_cluster_id = check_uint("dst_cluster_id", value, 64)

    @property
    def dst_addrs(self) -> list[int]:
        """Destination tensor addresses, 2 per layer."""
        return list(self._dst_addrs)

    @dst_addrs.setter
    def dst_addrs(self, value: Sequence[int]) -> None:
        self._dst_addrs = check_int_list("dst_addrs", value)

    @property
    def src_layer_range(self) -> range | None:
        """Source layers to send, or ``None`` for all."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: range | None) -> None:
        self._src_layer_range = check_layer_range("src_layer_range", value, allow_none=True)

    @property
    def src_batch_index(self) -> int:
        """Source batch row."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        self._src_batch_index = check_uint("src_batch_index", value, 32)

    def __repr__(self) -> str:
        return (
            f"TransferConfig(dst_cluster_id={self._dst_cluster_id}, dst_addrs={self._dst_addrs}, "
            f"src_layer_range={self._src_layer_range!r}, src_batch_index={self._src_batch_index})"
        )


class TransferWithCacheKeyConfig:
    """Target of ``transfer_cache_async`` by remote key.

    Required when remote-cache-accessible is on.

    Args:
        cache_key: The destination cache on the peer.
        src_layer_range: Source layers (step 1, ``0 <= start < stop``).
        dst_layer_range: Destination layers, same length as ``src_layer_range``.
        src_batch_index: Source batch row (uint32); must be 0 with a
            :class:`BlocksCacheKey`.

    Raises:
        TypeError: an argument has the wrong type (both ranges are required).
        LLMParamError: a value is out of range, the range lengths differ, or
            ``src_batch_index`` is non-zero with a :class:`BlocksCacheKey`.
    """

    def __init__(
        self,
        cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
        src_layer_range: range,
        dst_layer_range: range,
        src_batch_index: int = 0,
    ) -> None:
        check_type("cache_key", cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex))
        self._cache_key = cache_key
        self._src_layer_range = check_layer_range("src_layer_range", src_layer_range)
        self._dst_layer_range = check_layer_range("dst_layer_range", dst_layer_range)
        require(
            len(self._src_layer_range) == len(self._dst_layer_range),
            f"src_layer_range and dst_layer_range must have the same length, got "
            f"{self._src_layer_range!r} and {self._dst_layer_range!r}",
        )
        self._src_batch_index = self._check_batch_index(cache_key, src_batch_index)

    @staticmethod
    def _check_batch_index(cache_key: object, value: int) -> int:
        index = check_uint("src_batch_index", value, 32)
        require(
            index == 0 or not isinstance(cache_key, BlocksCacheKey),
            f"src_batch_index must be 0 when cache_key is a BlocksCacheKey, got {index}",
        )
        return index

    @property
    def cache_key(self) -> BlocksCacheKey | CacheKeyByIdAndIndex:
        """The destination cache on the peer."""
        return self._cache_key

    @cache_key.setter
    def cache_key(self, value: BlocksCacheKey | CacheKeyByIdAndIndex) -> None:
        check_type("cache_key", value, (BlocksCacheKey, CacheKeyByIdAndIndex))
        self._check_batch_index(value, self._src_batch_index)
        self._cache_key = value

    @property
    def dst_cluster_id(self) -> int:
        """``cache_key.cluster_id``."""
        return self._cache_key.cluster_id

    @property
    def src_layer_range(self) -> range:
        """Source layers."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: range) -> None:
        self._src_layer_range = check_layer_range("src_layer_range", value)

    @property
    def dst_layer_range(self) -> range:
        """Destination layers."""
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, value: range) -> None:
        self._dst_layer_range = check_layer_range("dst_layer_range", value)

    @property
    def src_batch_index(self) -> int:
        """Source batch row."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        self._src_batch_index = self._check_batch_index(self._cache_key, value)

    def __repr__(self) -> str:
        return (
            f"TransferWithCacheKeyConfig(cache_key={self._cache_key!r}, "
            f"src_layer_range={self._src_layer_range!r}, "
            f"dst_layer_range={self._dst_layer_range!r}, src_batch_index={self._src_batch_index})"
        )


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
