"""The standard workloads and pull shapes of DESIGN.md ("Standard workloads"), as data.

Benchmarks import this module. The block-list generator (:class:`SplitMix64`,
:func:`random_blocks`, :func:`blocks_hash`, :data:`DEFAULT_SEED`) is the one of
``aiodatadist._cli_bench`` (``aiodatadist bench``), re-exported here so that the
package and these scripts cannot drift apart (the package cannot import ``bench/``);
the rest needs nothing but the standard library (numpy only for
:meth:`Workload.np_dtype`, imported lazily).

A KV cache of a workload is ``num_tensors = num_layers * tensors_per_layer``
tensors, each ``[num_blocks, *block_shape]`` of ``dtype``; a block of one tensor
is ``block_bytes`` contiguous bytes.  A pull names ``src_blocks`` / ``dst_blocks``
(pairwise) and a contiguous range of tensors (layers x tensors per layer).

Random block lists come from :class:`SplitMix64`, a tiny generator that
``bench/c/baselines.c`` implements bit for bit, so the C baselines move exactly
the same segments as the Python benchmarks for the same ``seed`` (both print
:func:`blocks_hash` to prove it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from aiodatadist._cli_bench import DEFAULT_SEED, SplitMix64, blocks_hash, random_blocks

__all__ = [
    "DEFAULT_SEED",
    "PULL_SHAPES",
    "WORKLOADS",
    "Pull",
    "PullShape",
    "SplitMix64",
    "Workload",
    "blocks_hash",
    "make_pull",
    "random_blocks",
]

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


@dataclass(frozen=True)
class PullShape:
    """A standard pull: how many blocks, whether they are random, and which tensors."""

    name: str
    num_blocks: int
    random: bool  # random non-contiguous blocks (else block 0 -> block 0 ...)
    layers: int | None  # None: all layers
    single_tensor: bool = False  # one tensor only (overrides tensors_per_layer)


PULL_SHAPES: dict[str, PullShape] = {
    s.name: s
    for s in (
        PullShape("1-block-all-layers", 1, False, None),
        PullShape("64-random-blocks-all-layers", 64, True, None),
        PullShape("1-block-1-layer", 1, False, 1),
        PullShape("1-block-1-tensor", 1, False, 1, single_tensor=True),
    )
}


@dataclass(frozen=True)
class Pull:
    """A concrete pull of a workload: block lists and tensor range, ready for ``Plan.blocks``."""

    workload: Workload
    shape: PullShape
    src_pool: int  # num_blocks of each source tensor
    dst_pool: int  # num_blocks of each destination tensor
    src_blocks: list[int]
    dst_blocks: list[int]
    tensor_start: int  # same on both sides
    tensor_count: int
    seed: int

    @property
    def layer_range(self) -> tuple[int, int]:
        """Inclusive-exclusive layer range of the pull (upstream's ``*_layer_range``)."""
        tpl = self.workload.tensors_per_layer
        return self.tensor_start // tpl, -(-(self.tensor_start + self.tensor_count) // tpl)

    @property
    def num_segments(self) -> int:
        return len(self.src_blocks) * self.tensor_count

    @property
    def total_bytes(self) -> int:
        return self.num_segments * self.workload.block_bytes

    def hash(self) -> str:
        return blocks_hash(self.src_blocks, self.dst_blocks)


def make_pull(
    workload: Workload | str,
    shape: PullShape | str,
    *,
    num_blocks: int | None = None,
    src_pool: int | None = None,
    dst_pool: int | None = None,
    seed: int = DEFAULT_SEED,
) -> Pull:
    """A pull of ``shape`` on ``workload``.

    ``num_blocks`` overrides the shape's block count (e.g. 16 for a quick run);
    the pools (blocks per tensor on each side) default to that count, so a
    64-random-blocks pull of ``llama8b-fp16`` needs 1 GiB on each side.
    """
    w = WORKLOADS[workload] if isinstance(workload, str) else workload
    s = PULL_SHAPES[shape] if isinstance(shape, str) else shape
    n = s.num_blocks if num_blocks is None else num_blocks
    sp = n if src_pool is None else src_pool
    dp = n if dst_pool is None else dst_pool
    if s.random:
        src_blocks, dst_blocks = random_blocks(sp, dp, n, seed)
    else:
        if n > min(sp, dp):
            raise ValueError("num_blocks exceeds a pool")
        src_blocks, dst_blocks = list(range(n)), list(range(n))
    if s.single_tensor:
        count = 1
    elif s.layers is None:
        count = w.num_tensors
    else:
        count = s.layers * w.tensors_per_layer
    return Pull(w, s, sp, dp, src_blocks, dst_blocks, 0, count, seed)
