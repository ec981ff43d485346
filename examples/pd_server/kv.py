"""The KV layout both servers agree on, and the deterministic "model" that fills it.

A real prefill worker computes K and V with the model; this one fills block ``i`` of a
prompt with bytes derived from ``(prompt_id, i)``, so the decode side can recompute
what it should have received and check every byte.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from aiodatadist import CacheDesc, DataType, Placement

LAYERS = 4
TENSORS_PER_LAYER = 2  # K and V: tensors K0, V0, K1, V1, ...
NUM_TENSORS = LAYERS * TENSORS_PER_LAYER
NUM_BLOCKS = 64
BLOCK_SHAPE = (16, 8, 128)  # tokens x heads x head dim, fp16: 32 KiB per block per tensor
MODEL_ID = 0  # the prefill cache is pullable as BlocksCacheKey(prefill_cluster_id, MODEL_ID)


def cache_desc() -> CacheDesc:
    """``NUM_TENSORS`` tensors of ``NUM_BLOCKS`` blocks each."""
    return CacheDesc(NUM_TENSORS, [NUM_BLOCKS, *BLOCK_SHAPE], DataType.DT_FLOAT16, Placement.HOST)


def block_bytes() -> int:
    """Bytes of one block of one tensor."""
    return cache_desc().size // NUM_BLOCKS


def prompt_block(prompt_id: int, position: int) -> npt.NDArray[np.uint8]:
    """The KV of block ``position`` of a prompt: ``[NUM_TENSORS, block_bytes]`` bytes."""
    rng = np.random.default_rng([prompt_id, position])
    raw = np.frombuffer(rng.bytes(NUM_TENSORS * block_bytes()), dtype=np.uint8)
    return raw.reshape(NUM_TENSORS, block_bytes())
