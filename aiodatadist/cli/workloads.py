"""The standard workloads of DESIGN.md ("Standard workloads"), and the random block lists.

The one definition: ``aiodatadist bench`` and the source tree's ``bench/`` scripts
(through ``bench/workloads.py``, which adds the pull shapes) both use it, so the
installed benchmark and the development ones cannot drift apart. Standard library
only (numpy only inside :meth:`Workload.np_dtype`).

A KV cache of a workload is ``num_tensors = num_layers * tensors_per_layer``
tensors, each ``[num_blocks, *block_shape]`` of ``dtype``; a block of one tensor is
``block_bytes`` contiguous bytes.

Random block lists come from :class:`SplitMix64`, a tiny generator that
``bench/c/baselines.c`` implements bit for bit, so the C baselines move exactly the
same segments as the Python side for the same seed (both print :func:`blocks_hash`
to prove it).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_SEED",
    "WORKLOADS",
    "SplitMix64",
    "Workload",
    "blocks_hash",
    "random_blocks",
]

DEFAULT_SEED = 20240601

_ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4, "int8": 1, "uint8": 1}


@dataclass(frozen=True)
class Workload:
    """One standard KV-cache layout."""

    name: str
    num_layers: int
    tensors_per_layer: int  # 2 for K,V; 1 for MLA-style latent caches
    block_shape: tuple[int, ...]  # per-block shape of one tensor: (tokens, heads, head_dim)
    dtype: str  # "fp16" | "bf16" | ...

    @property
    def num_tensors(self) -> int:
        return self.num_layers * self.tensors_per_layer

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def block_elems(self) -> int:
        return math.prod(self.block_shape)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one tensor."""
        return self.block_elems * self.itemsize

    @property
    def block_bytes_all_tensors(self) -> int:
        """Bytes of one block across every tensor of the cache."""
        return self.block_bytes * self.num_tensors

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    def tensor_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_bytes

    def np_dtype(self) -> Any:
        """The numpy dtype used to hold this workload (bf16 is held as raw uint16)."""
        import numpy as np

        return {
            "fp16": np.float16,
            "bf16": np.uint16,
            "fp32": np.float32,
            "int8": np.int8,
            "uint8": np.uint8,
        }[self.dtype]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        # 32 layers x K,V; [num_blocks, 128 tokens, 8 heads, 128 dim] fp16: 256 KiB/block/tensor.
        Workload("llama8b-fp16", 32, 2, (128, 8, 128), "fp16"),
        # 4 layers x K,V; [num_blocks, 16, 2, 64] fp16: 4 KiB / block / tensor (per-call overhead).
        Workload("small", 4, 2, (16, 2, 64), "fp16"),
        # 61 layers, tensor_num_per_layer=1; [num_blocks, 128, 1, 576] bf16: 144 KiB / block.
        Workload("mla-like", 61, 1, (128, 1, 576), "bf16"),
    )
}

_M64 = (1 << 64) - 1


class SplitMix64:
    """splitmix64 (Steele, Lea, Flood 2014); mirrored in ``bench/c/baselines.c``."""

    _MASK = _M64

    def __init__(self, seed: int) -> None:
        self.state = seed & _M64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)


def _pick(rng: SplitMix64, pool: int, count: int) -> list[int]:
    # Partial Fisher-Yates: `count` distinct blocks of [0, pool) in random order.
    a = list(range(pool))
    for i in range(count):
        j = i + rng.next() % (pool - i)
        a[i], a[j] = a[j], a[i]
    return a[:count]


def random_blocks(
    src_pool: int, dst_pool: int, count: int, seed: int = DEFAULT_SEED
) -> tuple[list[int], list[int]]:
    """``count`` distinct random source blocks of ``[0, src_pool)`` and destination
    blocks of ``[0, dst_pool)``, neither list holding two ascending neighbours
    (``b[i+1] == b[i] + 1``), so no two pairs merge into one segment: every block is
    its own segment. Deterministic in ``seed``; bit for bit the C baselines' ``pick``.

    Raises:
        ValueError: ``count`` is not in ``[1, min(src_pool, dst_pool)]``.
    """
    if not 1 <= count <= min(src_pool, dst_pool):
        raise ValueError(f"count must be in [1, {min(src_pool, dst_pool)}], got {count}")
    rng = SplitMix64(seed)
    out = []
    for pool in (src_pool, dst_pool):
        for _ in range(10_000):
            blocks = _pick(rng, pool, count)
            if count == 1 or pool < 3 or not any(b == x + 1 for x, b in itertools.pairwise(blocks)):
                break
        else:  # pragma: no cover - only for pathological (pool, count)
            raise ValueError(f"could not draw {count} non-contiguous blocks of {pool}")
        out.append(blocks)
    return out[0], out[1]


def blocks_hash(src_blocks: list[int], dst_blocks: list[int]) -> str:
    """FNV-1a 64 over the (src, dst) pairs as little-endian uint64s, as the C baselines
    print it."""
    h = 0xCBF29CE484222325
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        for v in (s, d):
            for k in range(8):
                h ^= (v >> (8 * k)) & 0xFF
                h = (h * 0x100000001B3) & _M64
    return f"{h:016x}"
