"""Cache keys: immutable, hashable values naming a row or a whole cache on a cluster.

Public through :mod:`aiodatadist.types`, which re-exports every name and gives
each class its public ``__module__``.
"""

from __future__ import annotations

from ._validate import INVALID_ID, check_sint, check_uint

__all__ = ["BlocksCacheKey", "CacheKey", "CacheKeyByIdAndIndex"]


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
