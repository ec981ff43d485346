"""pull_blocks semantics against a numpy reference.

Block lists (random, non-contiguous, merged runs, repeated sources), layer ranges with
1, 2 and 4 tensors per layer, source-only and destination-only ranges, dtypes and block
sizes on both sides of the inline/executor threshold, and the contiguous -> blocks form
(``CacheKey`` / ``CacheKeyByIdAndIndex``). Every destination is prefilled with random
bytes, so "every other block is byte-identical" is part of every comparison.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiodatadist import CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, Placement
from aiodatadist.testing import Pair
from tests.engine._util import assert_bytes, blocks_of, reference_pull, snapshot

pytestmark = pytest.mark.asyncio

NUM_BLOCKS = 16
SMALL = (4, 2, 8)  # 128 B blocks in fp16: plans small enough to run inline on the loop
LARGE = (64, 8, 16)  # 16 KiB blocks: plans of hundreds of KiB run on the executor


def _caches(
    pair: Pair,
    *,
    src_tensors: int = 8,
    dst_tensors: int = 8,
    src_blocks: int = NUM_BLOCKS,
    dst_blocks: int = NUM_BLOCKS,
    block_shape: tuple[int, ...] = SMALL,
    data_type: DataType = DataType.DT_FLOAT16,
    model_id: int = 0,
):
    src = pair.prompt_cache(
        model_id=model_id,
        seed=11,
        num_tensors=src_tensors,
        num_blocks=src_blocks,
        block_shape=block_shape,
        data_type=data_type,
    )
    dst = pair.decoder_cache(
        seed=22,
        num_tensors=dst_tensors,
        num_blocks=dst_blocks,
        block_shape=block_shape,
        data_type=data_type,
    )
    return src, dst


@pytest.mark.parametrize("block_shape", [SMALL, LARGE], ids=["inline", "executor"])
@pytest.mark.parametrize("seed", range(4))
async def test_random_block_lists(pair: Pair, block_shape: tuple[int, ...], seed: int) -> None:
    src, dst = _caches(pair, block_shape=block_shape)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, NUM_BLOCKS + 1))
    src_blocks = [int(b) for b in rng.choice(NUM_BLOCKS, n, replace=False)]
    dst_blocks = [int(b) for b in rng.choice(NUM_BLOCKS, n, replace=False)]
    want = reference_pull(snapshot(src), snapshot(dst), src_blocks, dst_blocks, 0, 0, 8)

    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, src_blocks, dst_blocks)

    assert_bytes(dst, want)


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks"),
    [
        ([2, 3, 4, 9, 10], [5, 6, 7, 0, 1]),  # two runs that merge on both sides
        ([4, 3, 2], [5, 6, 7]),  # descending source: nothing merges
        ([0, 1, 2, 3], [3, 2, 1, 0]),  # reversed destination
        ([1, 1, 1], [2, 9, 15]),  # one source block fanned out
        ([15], [0]),  # the last block
        (list(range(16)), list(range(16))),  # everything, one run per tensor
        ([0, 2, 4, 6], [1, 3, 5, 7]),  # strided, non-contiguous
    ],
    ids=["merged-runs", "descending", "reversed", "fan-out", "last", "all", "strided"],
)
async def test_block_list_shapes(
    pair: Pair, src_blocks: list[int], dst_blocks: list[int]
) -> None:
    src, dst = _caches(pair, block_shape=LARGE)
    want = reference_pull(snapshot(src), snapshot(dst), src_blocks, dst_blocks, 0, 0, 8)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_blocks]
    before = snapshot(dst)

    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, src_blocks, dst_blocks)

    assert_bytes(dst, want)
    for t, tensor in enumerate(dst.tensors):
        assert np.array_equal(blocks_of(tensor)[untouched], before[t][untouched])


async def test_blocks_from_a_bigger_remote_cache(pair: Pair) -> None:
    src, dst = _caches(pair, src_blocks=40, dst_blocks=6, block_shape=LARGE)
    src_blocks, dst_blocks = [39, 20, 21, 0], [5, 0, 1, 3]
    want = reference_pull(snapshot(src), snapshot(dst), src_blocks, dst_blocks, 0, 0, 8)
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, src_blocks, dst_blocks)
    assert_bytes(dst, want)


# (tensor_num_per_layer, src_layer_range, dst_layer_range) on 8-tensor caches.
LAYER_CASES = [
    (1, range(5, 8), range(0, 3)),
    (1, range(0, 8), range(0, 8)),
    (1, range(3, 4), range(6, 7)),
    (2, range(1, 3), range(2, 4)),
    (2, range(0, 1), range(3, 4)),
    (2, range(0, 4), range(0, 4)),
    (4, range(1, 2), range(0, 1)),
    (4, range(0, 2), range(0, 2)),
    (4, range(0, 1), range(1, 2)),
]


@pytest.mark.parametrize(("t", "src_lr", "dst_lr"), LAYER_CASES)
async def test_layer_ranges(pair: Pair, t: int, src_lr: range, dst_lr: range) -> None:
    src, dst = _caches(pair, block_shape=LARGE)
    blocks_src, blocks_dst = [3, 4, 7], [0, 1, 12]
    want = reference_pull(
        snapshot(src),
        snapshot(dst),
        blocks_src,
        blocks_dst,
        src_lr.start * t,
        dst_lr.start * t,
        len(src_lr) * t,
    )

    await pair.decoder.cache_manager.pull_blocks(
        pair.key(),
        dst.cache,
        blocks_src,
        blocks_dst,
        src_layer_range=src_lr,
        dst_layer_range=dst_lr,
        tensor_num_per_layer=t,
    )

    # Tensors outside dst_layer_range are part of the reference, hence unchanged.
    assert_bytes(dst, want)


@pytest.mark.parametrize(
    ("t", "src_lr"),
    [(1, range(3, 7)), (2, range(2, 4)), (2, range(0, 2)), (4, range(1, 2))],
)
async def test_source_range_only(pair: Pair, t: int, src_lr: range) -> None:
    # 8 remote tensors into a 4-tensor local cache: the source range selects them all.
    src, dst = _caches(pair, src_tensors=8, dst_tensors=4)
    want = reference_pull(snapshot(src), snapshot(dst), [1, 2], [6, 5], src_lr.start * t, 0, 4)
    await pair.decoder.cache_manager.pull_blocks(
        pair.key(), dst.cache, [1, 2], [6, 5], src_layer_range=src_lr, tensor_num_per_layer=t
    )
    assert_bytes(dst, want)


@pytest.mark.parametrize(
    ("t", "dst_lr"),
    [(1, range(4, 8)), (2, range(1, 3)), (2, range(2, 4)), (4, range(0, 1))],
)
async def test_destination_range_only(pair: Pair, t: int, dst_lr: range) -> None:
    src, dst = _caches(pair, src_tensors=4, dst_tensors=8)
    want = reference_pull(snapshot(src), snapshot(dst), [0, 9], [9, 0], 0, dst_lr.start * t, 4)
    await pair.decoder.cache_manager.pull_blocks(
        pair.key(), dst.cache, [0, 9], [9, 0], dst_layer_range=dst_lr, tensor_num_per_layer=t
    )
    assert_bytes(dst, want)


@pytest.mark.parametrize("t", [1, 2, 4])
async def test_no_range_means_all_layers(pair: Pair, t: int) -> None:
    src, dst = _caches(pair)
    want = reference_pull(snapshot(src), snapshot(dst), [5], [6], 0, 0, 8)
    await pair.decoder.cache_manager.pull_blocks(
        pair.key(), dst.cache, [5], [6], tensor_num_per_layer=t
    )
    assert_bytes(dst, want)


@pytest.mark.parametrize(
    ("data_type", "block_shape"),
    [
        (DataType.DT_FLOAT16, (16, 2, 64)),
        (DataType.DT_BF16, (8, 1, 576)),
        (DataType.DT_FLOAT, (3, 5)),
        (DataType.DT_DOUBLE, (7,)),
        (DataType.DT_INT8, (128, 3)),
        (DataType.DT_UINT8, (1,)),
        (DataType.DT_INT64, (2, 2, 2)),
        (DataType.DT_BOOL, (33,)),
        (DataType.DT_INT32, (1024, 4)),
    ],
    ids=lambda v: v.name if isinstance(v, DataType) else "x".join(map(str, v)),
)
async def test_dtypes_and_block_sizes(
    pair: Pair, data_type: DataType, block_shape: tuple[int, ...]
) -> None:
    src, dst = _caches(pair, src_tensors=4, dst_tensors=4, block_shape=block_shape,
                       data_type=data_type)
    assert src.tensors[0].dtype == data_type.to_numpy()
    want = reference_pull(snapshot(src), snapshot(dst), [2, 3, 11], [14, 15, 0], 0, 0, 4)
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [2, 3, 11], [14, 15, 0])
    assert_bytes(dst, want)
    # The typed views agree too (a dtype-level check, not only bytes).
    for t in range(4):
        assert np.array_equal(
            dst.tensors[t][14].view(np.uint8), src.tensors[t][2].view(np.uint8)
        )


async def test_model_ids_select_the_remote_cache(pair: Pair) -> None:
    a = pair.prompt_cache(model_id=0, seed=1, num_tensors=2, num_blocks=4, block_shape=LARGE)
    b = pair.prompt_cache(model_id=7, seed=2, num_tensors=2, num_blocks=4, block_shape=LARGE)
    dst = pair.decoder_cache(seed=3, num_tensors=2, num_blocks=4, block_shape=LARGE)
    cm = pair.decoder.cache_manager
    await cm.pull_blocks(pair.key(7), dst.cache, [1], [0])
    await cm.pull_blocks(pair.key(0), dst.cache, [1], [1])
    for t in range(2):
        assert np.array_equal(blocks_of(dst.tensors[t])[0], blocks_of(b.tensors[t])[1])
        assert np.array_equal(blocks_of(dst.tensors[t])[1], blocks_of(a.tensors[t])[1])


# ------------------------------------------------------ contiguous -> blocks


def _row_cache(pair: Pair, *, rows: int, row_elems: int, keys: list[CacheKey]):
    """A non-block fp16 cache of 4 tensors x ``rows`` rows on the prompt, filled randomly."""
    desc = CacheDesc(4, [rows, row_elems], DataType.DT_FLOAT16, Placement.HOST)
    arrays = [np.empty((rows, row_elems), dtype=np.float16) for _ in range(4)]
    rng = np.random.default_rng(5)
    for a in arrays:
        a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, dtype=np.uint8)
    cache = pair.prompt.cache_manager.register_cache(desc, arrays, keys)
    return cache, arrays


@pytest.mark.parametrize("by", ["req_id", "prefix_id", "cache_id"])
async def test_row_cut_into_blocks(pair: Pair, by: str) -> None:
    # A remote row of 4 local blocks: chunk i lands in decoder_blocks[i].
    block_elems = 16 * 2 * 64
    keys = [CacheKey(1, 100), CacheKey(1, 2**64 - 1, prefix_id=7)]
    cache, arrays = _row_cache(pair, rows=3, row_elems=4 * block_elems, keys=keys)
    dst = pair.decoder_cache(seed=9, num_tensors=4, num_blocks=8)
    before = snapshot(dst)
    if by == "req_id":
        key, row = CacheKey(1, 100), 0
    elif by == "prefix_id":
        key, row = CacheKey(1, 2**64 - 1, prefix_id=7), 1
    else:
        key, row = CacheKeyByIdAndIndex(1, cache.cache_id, 2), 2
    dst_blocks = [6, 1, 2]  # the first 3 chunks of the row

    await pair.decoder.cache_manager.pull_blocks(key, dst.cache, (), dst_blocks)

    for t in range(4):
        chunks = arrays[t][row].view(np.uint8).reshape(4, -1)
        want = before[t].copy()
        want[dst_blocks] = chunks[:3]
        assert np.array_equal(blocks_of(dst.tensors[t]), want)
