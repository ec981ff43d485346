"""Cache entries and the cache table an instance serves to its peers.

A :class:`CacheEntry` describes one registered or allocated cache: its
geometry (tensors x blocks x block bytes), tensor addresses, the keys that
name it, for allocated caches the shared-memory (memfd) segment that holds it,
and the lease one-sided peers copy under.
The same class describes a peer's cache seen over a link (then ``local`` is
False and the addresses are in the peer's address space).

Index rules follow upstream (reference section 6.4): a blocks cache is indexed
by ``model_id`` only and the last registration wins; a non-block cache row is
indexed by ``(req_id or prefix_id, model_id)``; every cache by ``cache_id``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from . import _native
from .errors import LLMStatusCode, failure
from .types import CacheDesc, KvCache

__all__ = [
    "CacheEntry",
    "CacheTable",
    "Region",
    "RowKey",
    "require_host_memory",
    "wait_unfenced",
]

RowKey = tuple[int, int]
"""``(req_id or prefix_id, model_id)`` naming one row of a non-block cache."""


class Region:
    """The bytes one side of a plan touches, as address ranges: what an aborted engine
    transfer may still write (a fence, :meth:`CacheEntry.fence`) or what a new one would
    write (checked against the fences, :meth:`CacheEntry.check_no_late_writes`).

    ``Region(None)`` is every byte (a fence whose extent is not known). Otherwise the
    ranges ``[starts[i], ends[i])`` (absolute addresses: a cache's tensors never overlap,
    so two sides' regions compare whatever caches they name), sorted by start, with
    ``reach[i]`` the largest end among the first ``i + 1``.
    """

    __slots__ = ("ends", "reach", "starts")

    def __init__(self, ranges: tuple[np.ndarray, np.ndarray] | None) -> None:
        if ranges is None:
            self.starts = self.ends = self.reach = None
            return
        starts, ends = ranges
        order = np.argsort(starts, kind="stable")
        self.starts, self.ends = starts[order], ends[order]
        self.reach = np.maximum.accumulate(self.ends) if len(self.ends) else self.ends

    @classmethod
    def of(cls, addrs: Sequence[int], plan: _native.Plan, side: Literal["src", "dst"]) -> Region:
        """The bytes ``plan`` reads (``side="src"``) or writes (``"dst"``) in the cache whose
        tensors start at ``addrs`` (the plan was checked against its geometry)."""
        return cls.of_rows(addrs, plan.segments(), side)

    @classmethod
    def of_rows(cls, addrs: Sequence[int], rows: np.ndarray, side: Literal["src", "dst"]) -> Region:
        """:meth:`of` from a plan's segments (``Plan.segments()``: rows of src tensor, src
        offset, dst tensor, dst offset, bytes)."""
        col = 0 if side == "src" else 2
        base = np.asarray(addrs, dtype=np.uint64)[rows[:, col].astype(np.intp)]
        starts = base + rows[:, col + 1]
        return cls((starts, starts + rows[:, 4]))

    @property
    def whole(self) -> bool:
        return self.starts is None

    def overlaps(self, other: Region) -> bool:
        """Whether a byte lies in both."""
        if self.whole or other.whole:
            return True
        assert self.starts is not None and self.reach is not None
        assert other.starts is not None and other.ends is not None
        if not len(self.starts) or not len(other.starts):
            return False
        # For each range of ``other``: the last of ours starting before it ends reaches
        # past its start exactly when one of ours overlaps it.
        last = np.searchsorted(self.starts, other.ends, side="left") - 1
        hit = last >= 0
        return bool(np.any(self.reach[last[hit]] > other.starts[hit]))


@dataclass(eq=False)
class CacheEntry:
    """One cache as the transfer engine sees it."""

    cache_id: int
    num_tensors: int
    num_blocks: int
    block_bytes: int
    is_blocks: bool
    addrs: list[int]
    data_type: int = 0
    placement: int = 0  # upstream's label (CacheDesc.placement): not where the memory lives
    # The CUDA device the tensors live on (registered from device tensors, moved only by an
    # engine that moves device memory); None: host memory our own paths may read and write.
    device_id: int | None = None
    shape: tuple[int, ...] = ()
    model_id: int | None = None
    row_keys: dict[RowKey, int] = field(default_factory=dict)
    shm_name: str | None = None
    shm_size: int = 0
    shm_offsets: list[int] = field(default_factory=list)
    # (slot, generation) of the lease one-sided peers copy under (see _leases.py);
    # None: no lease, so no one-sided access (a peer uses tcp).
    lease: tuple[int, int] | None = None
    local: bool = True
    # Local-only state.
    cache: KvCache | None = None
    buffers: list[Any] | None = None
    segment: _native.ShmSegment | None = None
    freed: bool = False
    # What aborted engine requests may still write into this cache (transports/nixl.py,
    # mooncake.py), one Region per request: while any is out the cache is held (no free)
    # and takes no transfer that touches those bytes.
    _fences: list[Region] = field(default_factory=list, repr=False)
    # A free refused while transfers held it: until then (monotonic), no new control-plane
    # lease is granted on it (_engine_lease.py), so a retried free can succeed.
    no_leases_until: float = 0.0
    # Set by the lease book while the cache has a lease: publishes the fence count on the
    # lease pages after every change (a peer's one-sided push refuses while it is not 0).
    fences_changed: Callable[[], None] | None = field(default=None, repr=False)
    _busy: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def for_cache(cls, cache: KvCache, desc: CacheDesc, addrs: list[int]) -> CacheEntry:
        shape = tuple(desc.shape)
        return cls(
            cache_id=cache.cache_id,
            num_tensors=desc.num_tensors,
            num_blocks=shape[0],
            block_bytes=desc.size // shape[0],
            is_blocks=cache.is_blocks_cache,
            addrs=list(addrs),
            data_type=desc.data_type.value,
            placement=int(desc.placement),
            shape=shape,
            cache=cache,
        )

    @property
    def geometry(self) -> _native.Geometry:
        return _native.Geometry(self.num_tensors, self.num_blocks, self.block_bytes)

    @property
    def tensor_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def busy(self) -> int:
        """Transfers using this cache right now (either side of a link in this process)."""
        return self._busy

    def hold(self, api: str | None = None) -> None:
        """Marks one more transfer as using this cache.

        ``api``: the call's name where no public call runs (serving a peer); by
        default the one :func:`~aiodatadist.errors.api_scope` set.

        Raises:
            LLMCacheNotFoundError: the cache was freed or unregistered.
        """
        with self._lock:
            if self.freed:
                raise failure(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"cache {self.cache_id} was unregistered",
                    api=api,
                )
            self._busy += 1

    def release(self) -> None:
        with self._lock:
            self._busy -= 1

    @property
    def late_writes(self) -> int:
        """Aborted engine transfers that may still write into this cache (its fences)."""
        return len(self._fences)

    def fence(self, region: Region | None = None) -> Region:
        """An aborted transfer may still write ``region`` of this cache (None: anywhere in
        it): hold the cache (no free) and refuse transfers that touch those bytes
        (:meth:`check_no_late_writes`) until :meth:`unfence` with the value returned."""
        token = Region(None) if region is None else region
        with _FENCES, self._lock:
            self._busy += 1
            self._fences.append(token)
        self._publish_fences()
        return token

    def unfence(self, token: Region) -> None:
        with _FENCES, self._lock:
            self._fences.remove(token)  # (by identity: a Region has no __eq__)
            self._busy -= 1
            _FENCES.notify_all()
        self._publish_fences()

    def _publish_fences(self) -> None:
        publish = self.fences_changed
        if publish is not None:
            publish()

    def check_no_late_writes(self, api: str | None = None, *regions: Region) -> None:
        """Refuses a transfer that touches bytes an aborted one may still write: any of
        ``regions`` (none given: anywhere in this cache) overlapping a fence.

        Raises:
            LLMLinkError: LLM_LINK_BUSY.
        """
        fences = self._fences
        if not fences:
            return
        fences = list(fences)  # (a reaper thread may end one meanwhile)
        if regions and not any(f.overlaps(r) for f in fences for r in regions):
            return
        raise failure(
            LLMStatusCode.LLM_LINK_BUSY,
            f"cache {self.cache_id}: an engine transfer that was cancelled or timed out is "
            "still in flight (its peer has not finished it) and may still write into blocks "
            "this call touches, overwriting what lands now; those take transfers again once "
            "it ended (the cache's other blocks take them meanwhile)",
            api=api,
        )

    def mark_freed(self) -> None:
        """Marks the entry unusable; refuses while transfers still use it.

        Raises:
            LLMLinkError: LLM_LINK_BUSY while transfers are in flight.
        """
        with self._lock:
            if self._busy:
                raise failure(
                    LLMStatusCode.LLM_LINK_BUSY,
                    f"cache {self.cache_id} is used by {self._busy} transfer(s) in "
                    "flight; await them before freeing it",
                )
            self.freed = True

    def describe(self) -> dict[str, Any]:
        """The wire description a peer needs (no local-only state)."""
        return {
            "cache_id": self.cache_id,
            "num_tensors": self.num_tensors,
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "is_blocks": self.is_blocks,
            "addrs": list(self.addrs),
            "data_type": self.data_type,
            "placement": self.placement,
            "shape": list(self.shape),
            "model_id": self.model_id,
            "row_keys": [[k[0], k[1], row] for k, row in self.row_keys.items()],
            "shm_name": self.shm_name,
            "shm_size": self.shm_size,
            "shm_offsets": list(self.shm_offsets),
            "lease": None if self.lease is None else list(self.lease),
            "device_id": self.device_id,
        }

    @classmethod
    def from_description(cls, d: dict[str, Any]) -> CacheEntry:
        return cls(
            cache_id=int(d["cache_id"]),
            num_tensors=int(d["num_tensors"]),
            num_blocks=int(d["num_blocks"]),
            block_bytes=int(d["block_bytes"]),
            is_blocks=bool(d["is_blocks"]),
            addrs=[int(a) for a in d["addrs"]],
            data_type=int(d["data_type"]),
            placement=int(d["placement"]),
            shape=tuple(int(s) for s in d["shape"]),
            model_id=None if d["model_id"] is None else int(d["model_id"]),
            row_keys={(int(a), int(b)): int(r) for a, b, r in d["row_keys"]},
            shm_name=d["shm_name"],
            shm_size=int(d["shm_size"]),
            shm_offsets=[int(o) for o in d["shm_offsets"]],
            lease=None if d.get("lease") is None else (int(d["lease"][0]), int(d["lease"][1])),
            device_id=None if d.get("device_id") is None else int(d["device_id"]),
            local=False,
        )


_FENCES = threading.Condition()


def wait_unfenced(entries: list[CacheEntry], timeout: float) -> bool:
    """Blocks until no entry of ``entries`` is fenced (or ``timeout`` s); True when none is."""
    with _FENCES:
        return _FENCES.wait_for(lambda: not any(e.late_writes for e in entries), timeout)


def require_host_memory(what: str, *entries: CacheEntry) -> None:
    """Refuses device memory where this process would read or write it itself.

    Raises:
        LLMParamError: LLM_PARAM_INVALID, one of ``entries`` lives in device memory.
    """
    for e in entries:
        if e.device_id is not None:
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"{what}: cache {e.cache_id} is in device memory (cuda:{e.device_id}); only an "
                "engine path that moves device memory (nixl) transfers it, nothing here reads it",
            )


class CacheTable:
    """The caches one instance registered, with upstream's indices."""

    def __init__(self) -> None:
        self._by_id: dict[int, CacheEntry] = {}
        self._blocks: dict[int, CacheEntry] = {}
        self._rows: dict[RowKey, tuple[CacheEntry, int]] = {}
        self.version = 0  # bumped on every change; peers compare it
        # Called after replace_with (a peer's table update arrived): lets the link let go
        # of what the peer no longer lists (fds of freed segments).
        self.on_replace: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[CacheEntry]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, entry: CacheEntry) -> None:
        self._by_id[entry.cache_id] = entry
        if entry.model_id is not None:
            # Upstream indexes a blocks cache by model_id alone: the last registration wins.
            self._blocks[entry.model_id] = entry
        for key, row in entry.row_keys.items():
            self._rows[key] = (entry, row)
        self.version += 1

    def replace_with(self, other: CacheTable) -> None:
        """Takes ``other``'s contents in place (holders of this table see the change)."""
        self._by_id = other._by_id
        self._blocks = other._blocks
        self._rows = other._rows
        self.version += 1
        if self.on_replace is not None:
            self.on_replace()

    def clear(self) -> None:
        self.replace_with(CacheTable())

    def remove(self, cache_id: int) -> CacheEntry | None:
        entry = self._by_id.pop(cache_id, None)
        if entry is None:
            return None
        if entry.model_id is not None and self._blocks.get(entry.model_id) is entry:
            del self._blocks[entry.model_id]
        for key in list(entry.row_keys):
            if self._rows.get(key, (None, 0))[0] is entry:
                del self._rows[key]
        self.version += 1
        return entry

    def remove_row_key(self, key: RowKey) -> None:
        hit = self._rows.pop(key, None)
        if hit is not None:
            hit[0].row_keys.pop(key, None)
            self.version += 1

    def by_id(self, cache_id: int) -> CacheEntry | None:
        return self._by_id.get(cache_id)

    def blocks(self, model_id: int) -> CacheEntry | None:
        return self._blocks.get(model_id)

    def row(self, key: RowKey) -> tuple[CacheEntry, int] | None:
        return self._rows.get(key)

    def containing(self, addr: int, nbytes: int) -> tuple[CacheEntry, int, int] | None:
        """The (entry, tensor index, offset) whose tensor holds ``[addr, addr + nbytes)``."""
        for entry in self._by_id.values():
            size = entry.tensor_bytes
            for t, base in enumerate(entry.addrs):
                if base <= addr and addr + nbytes <= base + size:
                    return entry, t, addr - base
        return None

    def describe(self) -> list[dict[str, Any]]:
        return [e.describe() for e in self._by_id.values()]

    @classmethod
    def from_description(cls, items: list[dict[str, Any]]) -> CacheTable:
        table = cls()
        for d in items:
            table.add(CacheEntry.from_description(d))
        return table
