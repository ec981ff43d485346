"""The standard workloads and pull shapes of DESIGN.md ("Standard workloads"), as data.

Benchmarks import this module. The workloads (:class:`Workload`, :data:`WORKLOADS`)
and the block-list generator (:class:`SplitMix64`, :func:`random_blocks`,
:func:`blocks_hash`, :data:`DEFAULT_SEED`) are the one definition in
``aiodatadist.cli.workloads`` (``aiodatadist bench`` uses it), re-exported here so that
the package and these scripts cannot drift apart (the package cannot import
``bench/``); this module adds the pull shapes, standard library only.

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

from dataclasses import dataclass

from aiodatadist.cli.workloads import (
    DEFAULT_SEED,
    WORKLOADS,
    SplitMix64,
    Workload,
    blocks_hash,
    random_blocks,
)

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
