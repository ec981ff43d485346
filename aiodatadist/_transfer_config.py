"""Targets of ``transfer_cache_async`` and the per-layer hook it calls.

Public through :mod:`aiodatadist.types`, which re-exports every name and gives
each class its public ``__module__``.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Sequence

from ._keys import BlocksCacheKey, CacheKeyByIdAndIndex
from ._validate import check_int_list, check_layer_range, check_type, check_uint, require

__all__ = ["LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig"]

_TENSORS_PER_LAYER = 2  # TransferConfig.dst_addrs: K and V of each layer


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
