"""Plans: block lists + tensor ranges -> merged, bounds-checked segments; rejections."""

from __future__ import annotations

import numpy as np
import pytest

from aiodatadist import _native as n
from aiodatadist._native import NativeError, Status
from tests.native._helpers import expected_block_segments, layer_range_args, raises

BB = 256  # block bytes used by most plans here


def seg_list(plan: n.Plan) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in row) for row in plan.segments()]


# ------------------------------------------------------------------ geometry


def test_geometry_properties() -> None:
    g = n.Geometry(num_tensors=8, num_blocks=16, block_bytes=4096)
    assert (g.num_tensors, g.num_blocks, g.block_bytes, g.tensor_bytes) == (8, 16, 4096, 16 * 4096)
    assert "num_tensors=8" in repr(g)


@pytest.mark.parametrize(
    ("args", "word"),
    [((0, 4, 64), "num_tensors"), ((2, 0, 64), "num_blocks"), ((2, 4, 0), "block_bytes")],
)
def test_geometry_rejects_zero(args: tuple[int, int, int], word: str) -> None:
    with pytest.raises(NativeError) as ei:
        n.Geometry(*args)
    assert ei.value.status == Status.PARAM_INVALID
    assert word in str(ei.value)


def test_geometry_rejects_overflow() -> None:
    with pytest.raises(NativeError) as ei:
        n.Geometry(1, 1 << 40, 1 << 40)
    assert ei.value.status == Status.PARAM_INVALID
    assert "overflow" in str(ei.value)


# ------------------------------------------------------------------ block plans


@pytest.mark.parametrize("tpl", [1, 2, 4])
@pytest.mark.parametrize(
    ("src_layers", "dst_layers"),
    [((0, 4), (0, 4)), ((1, 3), (1, 3)), ((2, 3), (0, 1)), ((0, 1), (3, 4))],
    ids=["all", "middle", "shifted-down", "shifted-up"],
)
def test_block_plan_layer_ranges(
    tpl: int, src_layers: tuple[int, int], dst_layers: tuple[int, int]
) -> None:
    layers = 4
    src = n.Geometry(layers * tpl, 32, BB)
    dst = n.Geometry(layers * tpl, 24, BB)
    src_blocks = [5, 6, 7, 20, 2, 31]
    dst_blocks = [0, 1, 2, 9, 11, 12]
    s0, d0, count = layer_range_args(tpl, src_layers, dst_layers)
    plan = n.Plan.blocks(src, dst, src_blocks, dst_blocks, s0, d0, count)

    want = expected_block_segments(BB, src_blocks, dst_blocks, s0, d0, count)
    assert seg_list(plan) == want
    # 4 runs per tensor: [5,6,7]->[0,1,2], 20->9, 2->11, 31->12 (not merged: src not contiguous)
    assert plan.num_segments == 4 * count
    assert plan.total_bytes == len(src_blocks) * BB * count
    # Only tensors of the requested layers are touched, paired K->K, V->V.
    assert {r[0] for r in want} == set(range(src_layers[0] * tpl, src_layers[1] * tpl))
    assert {r[2] for r in want} == set(range(dst_layers[0] * tpl, dst_layers[1] * tpl))
    assert plan.src.num_blocks == 32 and plan.dst.num_blocks == 24


def test_block_plan_merges_runs_contiguous_on_both_sides() -> None:
    g = n.Geometry(2, 16, BB)
    # 0..3 -> 4..7 is one run; 8 -> 9 and 9 -> 11 are not (dst gap); 12,13 -> 14,15 one run.
    plan = n.Plan.blocks(g, g, [0, 1, 2, 3, 8, 9, 12, 13], [4, 5, 6, 7, 9, 11, 14, 15], 0, 0, 2)
    assert seg_list(plan) == [
        (0, 0, 0, 4 * BB, 4 * BB),
        (0, 8 * BB, 0, 9 * BB, BB),
        (0, 9 * BB, 0, 11 * BB, BB),
        (0, 12 * BB, 0, 14 * BB, 2 * BB),
        (1, 0, 1, 4 * BB, 4 * BB),
        (1, 8 * BB, 1, 9 * BB, BB),
        (1, 9 * BB, 1, 11 * BB, BB),
        (1, 12 * BB, 1, 14 * BB, 2 * BB),
    ]
    assert plan.total_bytes == 8 * BB * 2


def test_block_plan_all_blocks_is_one_segment_per_tensor() -> None:
    g = n.Geometry(4, 64, BB)
    plan = n.Plan.blocks(g, g, list(range(64)), list(range(64)), 0, 0, 4)
    assert seg_list(plan) == [(t, 0, t, 0, 64 * BB) for t in range(4)]


def test_block_plan_accepts_numpy_block_arrays() -> None:
    g = n.Geometry(2, 16, BB)
    a = n.Plan.blocks(
        g, g, np.array([3, 1, 2], dtype=np.int64), np.array([0, 5, 6], dtype=np.int32), 0, 0, 2
    )
    b = n.Plan.blocks(g, g, [3, 1, 2], [0, 5, 6], 0, 0, 2)
    assert seg_list(a) == seg_list(b)


def test_block_plan_keeps_caller_order() -> None:
    g = n.Geometry(1, 16, BB)
    plan = n.Plan.blocks(g, g, [9, 2, 5], [1, 7, 3], 0, 0, 1)
    assert seg_list(plan) == [
        (0, 9 * BB, 0, BB, BB),
        (0, 2 * BB, 0, 7 * BB, BB),
        (0, 5 * BB, 0, 3 * BB, BB),
    ]


def test_segments_returns_a_copy() -> None:
    g = n.Geometry(1, 8, BB)
    plan = n.Plan.blocks(g, g, [1], [2], 0, 0, 1)
    segs = plan.segments()
    assert segs.dtype == np.uint64 and segs.shape == (1, 5)
    segs[0, 4] = 1
    assert int(plan.segments()[0, 4]) == BB
    assert "segments=1" in repr(plan)


# ------------------------------------------------------------------ block plan rejections


G = n.Geometry(8, 16, BB)
G_SMALL = n.Geometry(4, 10, BB)


def test_rejects_mismatched_lengths() -> None:
    with raises(Status.PARAM_INVALID, "differ in length", "3 != 2"):
        n.Plan.blocks(G, G, [1, 2, 3], [1, 2], 0, 0, 1)


def test_rejects_empty_block_lists() -> None:
    with raises(Status.PARAM_INVALID, "empty"):
        n.Plan.blocks(G, G, [], [], 0, 0, 1)


def test_rejects_block_size_mismatch() -> None:
    with raises(Status.PARAM_INVALID, "block size", "256", "512"):
        n.Plan.blocks(G, n.Geometry(8, 16, 512), [1], [1], 0, 0, 1)


def test_rejects_zero_tensor_count() -> None:
    with raises(Status.PARAM_INVALID, "tensor_count"):
        n.Plan.blocks(G, G, [1], [1], 0, 0, 0)


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "words"),
    [
        ([0, 16], [0, 1], ("src_blocks[1] = 16", "[0, 16)")),
        ([0, -1], [0, 1], ("src_blocks[1] = -1",)),
        ([3], [10], ("dst_blocks[0] = 10", "[0, 10)")),
        ([3, 4], [2, -7], ("dst_blocks[1] = -7",)),
        ([1 << 40], [0], (f"src_blocks[0] = {1 << 40}",)),
    ],
)
def test_rejects_block_out_of_range(
    src_blocks: list[int], dst_blocks: list[int], words: tuple[str, ...]
) -> None:
    with raises(Status.OUT_OF_RANGE, *words):
        n.Plan.blocks(G, G_SMALL, src_blocks, dst_blocks, 0, 0, 1)


@pytest.mark.parametrize(
    ("s0", "d0", "count", "words"),
    [
        (6, 0, 3, ("source tensors [6, 9)", "8 tensors")),
        (8, 0, 1, ("source tensors [8, 9)",)),
        (0, 2, 3, ("destination tensors [2, 5)", "4 tensors")),
        (0, 0, 9, ("source tensors [0, 9)",)),
    ],
)
def test_rejects_tensor_range_out_of_range(
    s0: int, d0: int, count: int, words: tuple[str, ...]
) -> None:
    with raises(Status.OUT_OF_RANGE, *words):
        n.Plan.blocks(G, G_SMALL, [1], [1], s0, d0, count)


def test_layer_range_past_the_last_layer_is_rejected() -> None:
    # 4 layers x K,V: layers [3, 5) do not exist.
    g = n.Geometry(8, 16, BB)
    s0, d0, count = layer_range_args(2, (3, 5), (0, 2))
    with raises(Status.OUT_OF_RANGE, "source tensors [6, 10)"):
        n.Plan.blocks(g, g, [1], [1], s0, d0, count)


def test_rejects_duplicate_destination_block() -> None:
    with raises(Status.OVERLAP, "overlap", "written twice"):
        n.Plan.blocks(G, G, [1, 2, 3], [4, 5, 4], 0, 0, 2)


def test_rejects_negative_arguments_before_native_code() -> None:
    with pytest.raises(TypeError):
        n.Plan.blocks(G, G, [1], [1], -1, 0, 1)


# ------------------------------------------------------------------ from_segments


def segs(*rows: tuple[int, int, int, int, int]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, 5)


def test_from_segments_merges_adjacent_and_keeps_the_rest() -> None:
    src = n.Geometry(2, 4, 100)
    dst = n.Geometry(2, 8, 50)
    plan = n.Plan.from_segments(
        src,
        dst,
        segs(
            (0, 0, 1, 10, 7),
            (0, 7, 1, 17, 13),  # contiguous on both sides with the previous: merged
            (0, 20, 1, 31, 5),  # src contiguous, dst not: kept
            (1, 25, 0, 0, 5),  # other tensors: kept
            (1, 30, 0, 5, 70),  # contiguous with the previous: merged
        ),
    )
    assert seg_list(plan) == [(0, 0, 1, 10, 20), (0, 20, 1, 31, 5), (1, 25, 0, 0, 75)]
    assert plan.total_bytes == 100


def test_from_segments_does_not_merge_across_tensors() -> None:
    g = n.Geometry(2, 1, 64)
    plan = n.Plan.from_segments(g, g, segs((0, 0, 0, 0, 64), (1, 0, 1, 0, 64)))
    assert plan.num_segments == 2


def test_from_segments_end_exactly_at_tensor_end_is_accepted() -> None:
    g = n.Geometry(1, 4, 100)
    plan = n.Plan.from_segments(g, g, segs((0, 399, 0, 0, 1), (0, 0, 0, 1, 399)))
    assert plan.total_bytes == 400


@pytest.mark.parametrize(
    ("row", "status", "words"),
    [
        (
            (0, 350, 0, 0, 51),
            Status.OUT_OF_RANGE,
            ("segment 1", "reads outside the source", "offset 350"),
        ),
        ((2, 0, 0, 0, 1), Status.OUT_OF_RANGE, ("segment 1", "reads outside", "tensor 2")),
        (
            (0, 0, 0, 399, 2),
            Status.OUT_OF_RANGE,
            ("segment 1", "writes outside the destination", "offset 399"),
        ),
        ((0, 0, 5, 0, 1), Status.OUT_OF_RANGE, ("segment 1", "writes outside", "tensor 5")),
        ((0, 0, 0, 1 << 63, 1), Status.OUT_OF_RANGE, ("segment 1", f"offset {1 << 63}")),
        ((0, 0, 0, 1, (1 << 64) - 1), Status.OUT_OF_RANGE, ("segment 1",)),
        ((0, 0, 0, 0, 0), Status.PARAM_INVALID, ("segment 1 has 0 bytes",)),
    ],
)
def test_from_segments_rejections(
    row: tuple[int, ...], status: Status, words: tuple[str, ...]
) -> None:
    g = n.Geometry(2, 4, 100)
    with raises(status, *words):
        n.Plan.from_segments(g, g, segs((0, 0, 1, 0, 10), row))  # type: ignore[arg-type]


def test_from_segments_rejects_overlapping_destinations() -> None:
    g = n.Geometry(2, 4, 100)
    with raises(Status.OVERLAP, "tensor 1 offset 50", "written twice"):
        n.Plan.from_segments(g, g, segs((0, 0, 1, 40, 20), (1, 0, 0, 0, 10), (0, 100, 1, 50, 30)))


def test_from_segments_allows_overlapping_sources() -> None:
    g = n.Geometry(1, 4, 100)
    plan = n.Plan.from_segments(g, g, segs((0, 0, 0, 200, 50), (0, 10, 0, 300, 50)))
    assert plan.total_bytes == 100


@pytest.mark.parametrize("shape", [(0, 5), (3, 4), (5,)])
def test_from_segments_rejects_bad_arrays(shape: tuple[int, ...]) -> None:
    g = n.Geometry(1, 4, 100)
    with pytest.raises(NativeError) as ei:
        n.Plan.from_segments(g, g, np.zeros(shape, dtype=np.uint64))
    assert ei.value.status == Status.PARAM_INVALID


def test_native_error_shape() -> None:
    e = NativeError(Status.OVERLAP, "boom", 17)
    assert (e.status, str(e), e.errno) == (Status.OVERLAP, "boom", 17)
    assert n.CHUNK_BYTES == 4 << 20
    assert n.IOV_MAX >= 16
