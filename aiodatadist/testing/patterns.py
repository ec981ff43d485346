"""What bytes a cache holds, and what bytes a pull must leave where: pure numpy.

Two halves, both free of any ``LLMDataDist``, so a test (or the other process of a
cross-process test) can compute in numpy what it cannot see:

* The **pattern**: :func:`pattern_blocks` gives the deterministic bytes of any block of
  any tensor from a seed; :func:`fill_pattern` writes them into a cache and
  :func:`pattern_mismatches` checks pulled blocks against them.
* The **reference model of a pull**, the one every suite checks real bytes against:
  a pull of blocks ``src_blocks -> dst_blocks`` over a tensor span ``(src_start,
  dst_start, count)`` copies, for every ``k < count`` and every ``i``, block
  ``src_blocks[i]`` of source tensor ``src_start + k`` into block ``dst_blocks[i]`` of
  destination tensor ``dst_start + k`` (in that order: a later pair wins), and leaves
  every other byte of the destination as it was. :func:`block_segments` writes that as
  the byte segments a native plan must hold (one per maximal run contiguous on both
  sides, per tensor), :func:`apply_segments` applies segments to numpy copies, and
  :func:`reference_pull` is the two together. :func:`layer_span` turns layer ranges into
  a tensor span.

Caches in the model are ``(num_tensors, tensor_bytes)`` uint8 matrices (:func:`as_matrix`
makes one from a cache's tensors); comparisons are on raw bytes, since random bytes read
as floats contain NaNs, which never compare equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "Mismatch",
    "Segment",
    "TensorSpan",
    "apply_segments",
    "as_matrix",
    "block_segments",
    "fill_pattern",
    "layer_span",
    "pattern_blocks",
    "pattern_mismatches",
    "reference_pull",
]

Bytes = npt.NDArray[np.uint8]

Segment = tuple[int, int, int, int, int]
"""``(src_tensor, src_offset, dst_tensor, dst_offset, nbytes)``: one copied byte run."""

TensorSpan = tuple[int, int, int]
"""``(src_tensor_start, dst_tensor_start, tensor_count)``: the tensors a pull covers."""


# --------------------------------------------------------------------------- the pattern

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_WORD_STEP = 0xBF58476D1CE4E5B9


def _mix64(x: int) -> int:
    x = (x + _GOLDEN) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def pattern_blocks(
    seed: int, tensor: int, blocks: Sequence[int] | npt.NDArray[Any], block_bytes: int
) -> Bytes:
    """The pattern bytes of ``blocks`` of tensor ``tensor`` for ``seed``.

    Every (seed, tensor, block) gives a different sequence and every 8-byte word of a
    block differs from its neighbours, so a lost, misplaced, shifted or flipped byte
    shows. Cheap: a few vector operations per block.

    Returns:
        A ``(len(blocks), block_bytes)`` uint8 array.
    """
    ids = np.asarray(blocks, dtype=np.uint64).reshape(-1)
    nwords = -(-block_bytes // 8)
    key = np.uint64(_mix64((seed & _M64) ^ _mix64(tensor + 1)))
    bases = (ids * np.uint64(_GOLDEN)) ^ key
    words = bases[:, None] + np.arange(nwords, dtype=np.uint64)[None, :] * np.uint64(_WORD_STEP)
    words ^= words >> np.uint64(31)
    out: Bytes = words.view(np.uint8)[:, :block_bytes]
    return out


def _raw_blocks(tensor: Any) -> Bytes:
    raw: Bytes = tensor.view("uint8").reshape(tensor.shape[0], -1)
    return raw


_CHUNK_BYTES = 32 << 20


def fill_pattern(
    tensors: Sequence[Any],
    seed: int,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Fills every block of ``tensors`` (each ``[num_blocks, ...]``) with :func:`pattern_blocks`.

    ``progress(done, total)`` is called after each tensor.
    """
    for t, tensor in enumerate(tensors):
        raw = _raw_blocks(tensor)
        n, bb = raw.shape
        step = max(1, _CHUNK_BYTES // max(1, bb))
        for b0 in range(0, n, step):
            ids = np.arange(b0, min(n, b0 + step))
            raw[b0 : b0 + len(ids)] = pattern_blocks(seed, t, ids, bb)
        if progress is not None:
            progress(t + 1, len(tensors))


@dataclass(frozen=True)
class Mismatch:
    """A destination block whose bytes are not the pattern of the source block it should hold."""

    src_tensor: int
    dst_tensor: int
    src_block: int
    dst_block: int
    offset: int  # first differing byte within the block
    count: int  # differing bytes within the block

    def __str__(self) -> str:
        return (
            f"tensor {self.src_tensor} block {self.src_block} -> tensor {self.dst_tensor} "
            f"block {self.dst_block}: {self.count} byte(s) differ, first at offset {self.offset}"
        )


def pattern_mismatches(
    dst_tensors: Sequence[Any],
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    seed: int,
    tensors: Sequence[tuple[int, int]] | None = None,
    *,
    limit: int = 100,
) -> list[Mismatch]:
    """Checks pulled blocks against :func:`pattern_blocks`; returns at most ``limit`` mismatches.

    Args:
        dst_tensors: the destination cache's tensors (``[num_blocks, ...]`` each).
        src_blocks, dst_blocks: the pull's block lists (pairwise).
        seed: the seed the source was filled with.
        tensors: ``(src_tensor, dst_tensor)`` pairs to check; default: every tensor to itself.
    """
    pairs = [(t, t) for t in range(len(dst_tensors))] if tensors is None else list(tensors)
    src = list(src_blocks)
    dst = list(dst_blocks)
    out: list[Mismatch] = []
    for st, dt in pairs:
        raw = _raw_blocks(dst_tensors[dt])
        bb = raw.shape[1]
        step = max(1, _CHUNK_BYTES // max(1, bb))
        for i0 in range(0, len(src), step):
            s_ids, d_ids = src[i0 : i0 + step], dst[i0 : i0 + step]
            want = pattern_blocks(seed, st, s_ids, bb)
            got = raw[np.asarray(d_ids, dtype=np.intp)]
            if np.array_equal(got, want):
                continue
            for k in np.flatnonzero((got != want).any(axis=1)).tolist():
                diff = np.flatnonzero(got[k] != want[k])
                out.append(Mismatch(st, dt, s_ids[k], d_ids[k], int(diff[0]), int(diff.size)))
                if len(out) >= limit:
                    return out
    return out


# --------------------------------------------------------------------------- the model of a pull


def as_matrix(tensors: Sequence[Any]) -> Bytes:
    """A ``(num_tensors, tensor_bytes)`` uint8 copy of a cache's tensors (any shape each)."""
    return np.stack([np.ascontiguousarray(t).reshape(-1).view(np.uint8).copy() for t in tensors])


def layer_span(
    num_tensors: int,
    src_layers: Sequence[int] | None,
    dst_layers: Sequence[int] | None,
    tensors_per_layer: int,
) -> TensorSpan:
    """The tensor span of a pull with layer ranges ``[a, b)`` (None: every tensor).

    Layer ``l`` is tensors ``[l * T, (l + 1) * T)`` (K, V, ..., K, V order). Without a
    source range the destination range gives the count, without either every tensor.
    """
    t = tensors_per_layer
    s0 = 0 if src_layers is None else src_layers[0] * t
    d0 = 0 if dst_layers is None else dst_layers[0] * t
    if src_layers is not None:
        n = (src_layers[1] - src_layers[0]) * t
    elif dst_layers is not None:
        n = (dst_layers[1] - dst_layers[0]) * t
    else:
        n = num_tensors
    return s0, d0, n


def block_segments(
    block_bytes: int,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    span: TensorSpan,
    *,
    nbytes: int | None = None,
) -> list[Segment]:
    """The segments a pull of ``src_blocks -> dst_blocks`` on ``span`` copies, in order.

    Per tensor, one segment per maximal run of pairs contiguous on both sides (what a
    native block plan holds, so a test can compare a plan with it). ``nbytes``: bytes
    copied from the start of each block (a row pull of part of a row); then no two
    blocks merge.

    Raises:
        ValueError: the block lists differ in length.
    """
    size = block_bytes if nbytes is None else nbytes
    runs: list[list[int]] = []
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        if (
            size == block_bytes
            and runs
            and runs[-1][0] + runs[-1][2] == s
            and runs[-1][1] + runs[-1][2] == d
        ):
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    s0, d0, count = span
    return [
        (s0 + k, s * block_bytes, d0 + k, d * block_bytes, (c - 1) * block_bytes + size)
        for k in range(count)
        for s, d, c in runs
    ]


def apply_segments(src: Bytes, dst: Bytes, segments: Sequence[Segment] | npt.NDArray[Any]) -> Bytes:
    """A copy of ``dst`` after copying ``segments`` out of ``src`` (both uint8 matrices).

    Reads come from ``src`` as it is (a copy within one cache reads the old bytes).
    """
    out = dst.copy()
    for st, so, dt, do, nb in np.asarray(segments, dtype=np.int64).reshape(-1, 5).tolist():
        out[dt, do : do + nb] = src[st, so : so + nb]
    return out


def reference_pull(
    src: Bytes,
    dst: Bytes,
    block_bytes: int,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    span: TensorSpan | None = None,
    *,
    nbytes: int | None = None,
) -> Bytes:
    """What ``dst`` must hold after pulling ``src_blocks -> dst_blocks`` out of ``src``.

    Args:
        src, dst: ``(num_tensors, tensor_bytes)`` uint8 matrices (:func:`as_matrix`);
            ``dst`` is what the destination held before the pull.
        block_bytes: bytes of one block (or row) of one tensor.
        src_blocks, dst_blocks: the pull's block lists (pairwise; a later pair wins).
        span: the tensors covered (:func:`layer_span`); default every tensor of ``src``.
        nbytes: bytes copied per block (default the whole block).

    Returns:
        A new matrix; ``dst`` is not changed.
    """
    if span is None:
        span = (0, 0, int(src.shape[0]))
    return apply_segments(
        src, dst, block_segments(block_bytes, src_blocks, dst_blocks, span, nbytes=nbytes)
    )
