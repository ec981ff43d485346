"""What the cross-process tests and their peer process (``peer_main.py``) share.

Both sides build caches from the same names, geometries and seeds, so the test
can recompute in numpy what any cache of the other process holds, and compare
it with what landed (byte equality, or sha256 digests of what a subprocess
decoder holds).

Every peer registers these caches (a prompt fills them from its seed, a decoder
leaves them zeroed):

========== ============================= ========= ====================================
name       how                           model_id  keys
========== ============================= ========= ====================================
alloc      ``allocate_blocks_cache``     0         ``BlocksCacheKey(cluster, 0)`` (shm)
reg        ``register_blocks_cache``     1         ``BlocksCacheKey(cluster, 1)``
rows_reg   ``register_cache``            -         ``CacheKey(req_id=100 + row)``
rows_alloc ``allocate_cache``            -         ``CacheKey(req_id=200 + row)`` (shm)
big        ``register_blocks_cache``     9         only with ``--big-mib``; filled with 0x5A
========== ============================= ========= ====================================
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiodatadist import CacheDesc, DataType, Placement
from aiodatadist.testing import layer_span, reference_pull

NUM_TENSORS = 4  # 2 layers x (K, V)
NUM_BLOCKS = 8
BLOCK_SHAPE = (16, 2, 64)  # fp16: 4 KiB per block per tensor
BATCH = 4
ROW_SHAPE = (2048,)  # fp16: 4 KiB per row per tensor
BIG_BLOCK_SHAPE = (512 * 1024,)  # fp16: 1 MiB per block
BIG_TENSORS = 2
BIG_FILL = 0x5A

MODEL_ALLOC = 0
MODEL_REG = 1
MODEL_BIG = 9
ROWS_REG_REQ = 100
ROWS_ALLOC_REQ = 200

SEED_OFFSETS = {"alloc": 0, "reg": 1, "rows_reg": 2, "rows_alloc": 3}


@dataclass(frozen=True)
class Spec:
    name: str
    blocks: bool
    allocate: bool
    shape: tuple[int, ...]
    num_tensors: int = NUM_TENSORS
    model_id: int | None = None
    req_base: int | None = None

    def desc(self) -> CacheDesc:
        return CacheDesc(self.num_tensors, list(self.shape), DataType.DT_FLOAT16, Placement.HOST)

    @property
    def nbytes(self) -> int:
        """Bytes per tensor."""
        return int(np.prod(self.shape)) * 2

    @property
    def unit(self) -> int:
        """Bytes per block (or row) per tensor."""
        return self.nbytes // self.shape[0]


SPECS: dict[str, Spec] = {
    "alloc": Spec("alloc", True, True, (NUM_BLOCKS, *BLOCK_SHAPE), model_id=MODEL_ALLOC),
    "reg": Spec("reg", True, False, (NUM_BLOCKS, *BLOCK_SHAPE), model_id=MODEL_REG),
    "rows_reg": Spec("rows_reg", False, False, (BATCH, *ROW_SHAPE), req_base=ROWS_REG_REQ),
    "rows_alloc": Spec("rows_alloc", False, True, (BATCH, *ROW_SHAPE), req_base=ROWS_ALLOC_REQ),
}


def big_spec(mib: int) -> Spec:
    return Spec(
        "big",
        True,
        False,
        (max(1, mib // BIG_TENSORS), *BIG_BLOCK_SHAPE),
        num_tensors=BIG_TENSORS,
        model_id=MODEL_BIG,
    )


def pattern(seed: int | None, spec: Spec) -> np.ndarray:
    """``(num_tensors, nbytes)`` uint8: what a cache filled from ``seed`` holds (zeros for None)."""
    if seed is None:
        return np.zeros((spec.num_tensors, spec.nbytes), dtype=np.uint8)
    return np.stack(
        [
            np.random.default_rng([seed, t]).integers(0, 256, spec.nbytes, dtype=np.uint8)
            for t in range(spec.num_tensors)
        ]
    )


def cache_seed(base: int, name: str) -> int:
    return base * 16 + SEED_OFFSETS.get(name, 15)


def raw_views(tensors: Sequence[Any]) -> list[np.ndarray]:
    """The tensors of a cache as flat uint8 arrays (views, not copies)."""
    return [np.asarray(t).reshape(-1).view(np.uint8) for t in tensors]


def as_matrix(tensors: Sequence[Any]) -> np.ndarray:
    """A ``(num_tensors, nbytes)`` uint8 copy of a cache's tensors."""
    return np.stack([v.copy() for v in raw_views(tensors)])


def digests(matrix: np.ndarray) -> list[str]:
    """sha256 per tensor: what a subprocess reports instead of its bytes."""
    return [hashlib.sha256(np.ascontiguousarray(row).tobytes()).hexdigest() for row in matrix]


# The model of a pull is aiodatadist.testing's (one for every suite); these adapt its
# argument order to the calls of these tests.


def tensor_span(
    num_tensors: int,
    src_layers: tuple[int, int] | None,
    dst_layers: tuple[int, int] | None,
    tpl: int,
) -> tuple[int, int, int]:
    """(src tensor start, dst tensor start, tensor count) of a pull with layer ranges."""
    return layer_span(num_tensors, src_layers, dst_layers, tpl)


def expect_blocks(
    dst: np.ndarray,
    src: np.ndarray,
    unit: int,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    span: tuple[int, int, int],
) -> np.ndarray:
    """What ``dst`` holds after copying blocks ``src_blocks`` -> ``dst_blocks`` on ``span``."""
    return reference_pull(src, dst, unit, src_blocks, dst_blocks, span)


def expect_row(
    dst: np.ndarray,
    src: np.ndarray,
    unit: int,
    src_row: int,
    dst_row: int,
    span: tuple[int, int, int],
    size: int | None = None,
) -> np.ndarray:
    """What ``dst`` holds after copying row ``src_row`` (first ``size`` bytes) to ``dst_row``."""
    return reference_pull(src, dst, unit, [src_row], [dst_row], span, nbytes=size)


def layer_range(pair: Sequence[int] | None) -> range | None:
    return None if pair is None else range(int(pair[0]), int(pair[1]))


@dataclass
class Local:
    """One cache of this process: the cache object, its spec and uint8 views of its tensors."""

    spec: Spec
    cache: Any
    views: list[np.ndarray]
    keep: list[np.ndarray]

    def matrix(self) -> np.ndarray:
        return np.stack([v.copy() for v in self.views])


def make_cache(dd: Any, spec: Spec, seed: int | None, cluster_id: int) -> Local:
    """Registers (or allocates) ``spec`` on ``dd`` and fills it from ``seed``."""
    from aiodatadist import BlocksCacheKey, CacheKey

    cm = dd.cache_manager
    desc = spec.desc()
    keep: list[np.ndarray] = []
    if spec.blocks:
        key = None if spec.model_id is None else BlocksCacheKey(cluster_id, spec.model_id)
        if spec.allocate:
            cache = cm.allocate_blocks_cache(desc, key)
        else:
            keep = [np.zeros(spec.shape, dtype=np.float16) for _ in range(spec.num_tensors)]
            cache = cm.register_blocks_cache(desc, keep, key)
    else:
        assert spec.req_base is not None
        keys = [CacheKey(cluster_id, req_id=spec.req_base + r) for r in range(spec.shape[0])]
        if spec.allocate:
            cache = cm.allocate_cache(desc, keys)
        else:
            keep = [np.zeros(spec.shape, dtype=np.float16) for _ in range(spec.num_tensors)]
            cache = cm.register_cache(desc, keep, keys)
    views = raw_views(keep if keep else cache.tensors())
    if spec.name == "big":
        if seed is not None:
            for v in views:
                v.fill(BIG_FILL)
    elif seed is not None:
        ref = pattern(seed, spec)
        for t, v in enumerate(views):
            v[...] = ref[t]
    return Local(spec, cache, views, keep)


def make_caches(
    dd: Any, seed_base: int | None, cluster_id: int, big_mib: int = 0
) -> dict[str, Local]:
    out = {
        name: make_cache(
            dd, spec, None if seed_base is None else cache_seed(seed_base, name), cluster_id
        )
        for name, spec in SPECS.items()
    }
    if big_mib:
        out["big"] = make_cache(
            dd, big_spec(big_mib), 0 if seed_base is not None else None, cluster_id
        )
    return out


def reference(seed_base: int | None, name: str) -> np.ndarray:
    """What a peer's cache ``name`` holds right after start (seeded prompt, zeroed decoder)."""
    spec = SPECS[name]
    return pattern(None if seed_base is None else cache_seed(seed_base, name), spec)
