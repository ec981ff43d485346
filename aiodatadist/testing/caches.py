"""Caches for tests: registered on real instances, with real bytes, and the spec of a peer's.

* :func:`make_blocks_cache` registers (or allocates in shared memory) a blocks cache,
  zeroed, random or filled with :func:`~aiodatadist.testing.patterns.fill_pattern`'s
  pattern; :class:`FilledCache` holds it with numpy views of its tensors.
* :func:`host_buffer`: host memory as a serving process registers it (anonymous,
  2 MiB-aligned, ``MADV_HUGEPAGE``, touched); ``make_blocks_cache(huge_pages=True)``
  registers a cache on it (otherwise on page-aligned tensors, one mapping each).
* :class:`PromptSpec`: the blocks cache a peer process serves, as JSON on its command
  line, so both processes know its geometry and seed.
* :func:`cluster_info`: the ``LLMClusterInfo`` of a link.
"""

from __future__ import annotations

import contextlib
import json
import mmap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..types import BlocksCacheKey, CacheDesc, DataType, KvCache, LLMClusterInfo, Placement
from .patterns import fill_pattern

if TYPE_CHECKING:
    from ..datadist import LLMDataDist

__all__ = [
    "HUGE_PAGE_BYTES",
    "FilledCache",
    "PromptSpec",
    "cluster_info",
    "host_buffer",
    "make_blocks_cache",
]


@dataclass
class FilledCache:
    """A registered cache and numpy views of its tensors."""

    cache: KvCache
    tensors: list[Any]

    def block(self, tensor: int, block: int) -> Any:
        return self.tensors[tensor][block]


def cluster_info(
    remote_cluster_id: int, host: str | None = None, port: int | None = None
) -> LLMClusterInfo:
    """An ``LLMClusterInfo`` for ``remote_cluster_id`` (with its address when it is remote)."""
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    if host is not None and port is not None:
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(host, port)
    return info


HUGE_PAGE_BYTES = 2 << 20
"""The transparent huge page size :func:`host_buffer` aligns to (x86-64, arm64 4K)."""


def host_buffer(shape: int | Sequence[int], dtype: Any, *, huge_pages: bool | None = True) -> Any:
    """A zeroed numpy array on its own anonymous mapping, every page touched.

    What a serving process does with host memory it registers: the mapping is
    aligned to 2 MiB and ``madvise(MADV_HUGEPAGE)``'d, so with transparent huge
    pages in ``always`` or ``madvise`` mode (``/sys/kernel/mm/transparent_hugepage/
    enabled``) the kernel backs it with 2 MiB pages when it can. Copies, and above
    all ``process_vm_readv`` (the ``cma`` path), which pins the peer's pages one
    page at a time, are then much faster than on 4 KiB pages. Whether the kernel
    did is visible in ``/proc/PID/smaps`` (``AnonHugePages``); it is a hint.

    Args:
        shape: the array's shape.
        dtype: a numpy dtype.
        huge_pages: True: ``MADV_HUGEPAGE``; False: ``MADV_NOHUGEPAGE`` (4 KiB pages
            for certain, e.g. for a benchmark that compares both); None: no advice (the
            kernel's default), page-aligned.

    The memory is unmapped when the array (and every view of it) is gone.
    """
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    nbytes = dt.itemsize
    for d in dims:
        nbytes *= d
    if nbytes == 0:
        return np.zeros(dims, dtype=dt)
    # From 2 MiB on, over-map by one huge page and start the array on a 2 MiB
    # boundary, so that every whole 2 MiB of it can be one huge page (the untouched
    # slack costs no memory). A smaller array could only get one by wasting one.
    slack = HUGE_PAGE_BYTES if huge_pages and nbytes >= HUGE_PAGE_BYTES else 0
    mm = mmap.mmap(-1, nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(mm, dtype=np.uint8)
    offset = -raw.ctypes.data % HUGE_PAGE_BYTES if slack else 0
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
    if advice is not None and huge_pages is not None:
        with contextlib.suppress(OSError):  # THP compiled out, or a kernel without it
            mm.madvise(advice)
    raw = raw[offset : offset + nbytes]
    raw.fill(0)  # touch: every page is resident before the first transfer
    return raw.view(dt).reshape(dims)


def make_blocks_cache(
    dd: LLMDataDist,
    *,
    num_tensors: int = 4,
    num_blocks: int = 8,
    block_shape: Sequence[int] = (16, 2, 64),
    data_type: DataType = DataType.DT_FLOAT16,
    model_id: int | None = None,
    seed: int | None = None,
    allocate: bool = False,
    pattern: bool = False,
    huge_pages: bool = False,
) -> FilledCache:
    """Registers (or allocates in shared memory) a blocks cache on ``dd``.

    ``seed`` fills it with reproducible random bytes (or, with ``pattern=True``, with
    :func:`fill_pattern`'s pattern, which a peer can check without seeing this cache);
    None leaves it zeroed.

    ``huge_pages=True`` puts the registered tensors, one after the other, on one
    :func:`host_buffer` (2 MiB-aligned, ``MADV_HUGEPAGE``), as a serving process
    would; it has no effect
    with ``allocate=True`` (POSIX shared memory gets huge pages only when
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` says so).
    """
    desc = CacheDesc(num_tensors, [num_blocks, *block_shape], data_type, Placement.HOST)
    key = None if model_id is None else BlocksCacheKey(dd.cluster_id, model_id)
    cm = dd.cache_manager
    if allocate:
        cache = cm.allocate_blocks_cache(desc, key)
        tensors = cache.tensors()
    else:
        dtype = data_type.to_numpy()
        if huge_pages:
            # One mapping for every tensor (as a serving process allocates its cache):
            # huge pages then cover tensors smaller than one, too.
            tensors = list(host_buffer((num_tensors, *desc.shape), dtype))
        else:
            # Page-aligned (numpy's own allocations start 16 bytes into a page), every
            # page touched, so the first transfer does not pay for page faults (a
            # serving cache is resident too).
            tensors = [host_buffer(desc.shape, dtype, huge_pages=None) for _ in range(num_tensors)]
        cache = cm.register_blocks_cache(desc, tensors, key)
    if seed is not None:
        if pattern:
            fill_pattern(tensors, seed)
        else:
            rng = np.random.default_rng(seed)
            for t in tensors:
                raw = t.view(np.uint8)
                raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    return FilledCache(cache, tensors)


_DTYPES = {
    "fp16": DataType.DT_FLOAT16,
    "bf16": DataType.DT_BF16,
    "fp32": DataType.DT_FLOAT,
    "int8": DataType.DT_INT8,
    "uint8": DataType.DT_UINT8,
}


@dataclass(frozen=True)
class PromptSpec:
    """The blocks cache a peer process serves (see :class:`~.peer.PeerProcess`).

    Attributes:
        num_tensors: tensors of the cache (layers x tensors per layer).
        num_blocks: blocks per tensor.
        block_shape: shape of one block of one tensor, e.g. ``(128, 8, 128)``.
        dtype: ``fp16``, ``bf16``, ``fp32``, ``int8`` or ``uint8``.
        model_id: the cache's ``BlocksCacheKey`` model id.
        seed: the :func:`fill_pattern` seed.
        allocate: allocate in shared memory (``shm`` applies) instead of registering
            numpy memory (only ``cma`` / ``tcp`` apply).
        corrupt: ``(tensor, block, offset)`` of one byte to flip after filling, or None
            (to prove that a check of the pulled bytes really checks).
    """

    num_tensors: int = 8
    num_blocks: int = 16
    block_shape: tuple[int, ...] = (16, 2, 64)
    dtype: str = "fp16"
    model_id: int = 0
    seed: int = 1
    allocate: bool = True
    corrupt: tuple[int, int, int] | None = None

    @property
    def data_type(self) -> DataType:
        return _DTYPES[self.dtype]

    @property
    def block_bytes(self) -> int:
        n = self.data_type.itemsize
        for d in self.block_shape:
            n *= d
        return n

    @property
    def cache_bytes(self) -> int:
        return self.num_tensors * self.num_blocks * self.block_bytes

    def desc(self, num_blocks: int | None = None) -> CacheDesc:
        """The cache's ``CacheDesc`` (with another block count for a decoder cache)."""
        n = self.num_blocks if num_blocks is None else num_blocks
        return CacheDesc(self.num_tensors, [n, *self.block_shape], self.data_type, Placement.HOST)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PromptSpec:
        d = json.loads(text)
        d["block_shape"] = tuple(int(x) for x in d["block_shape"])
        if d.get("corrupt") is not None:
            t, b, o = (int(x) for x in d["corrupt"])
            d["corrupt"] = (t, b, o)
        spec = cls(**d)
        if spec.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {spec.dtype!r}")
        return spec
