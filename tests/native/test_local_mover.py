"""copy_local: exact bytes against a numpy reference, threads, progress, abort, GIL."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from aiodatadist import _native as n
from aiodatadist._native import Status
from tests.native._helpers import (
    Background,
    abort_after,
    as_mover,
    bases,
    differing,
    geometry_of,
    layer_range_args,
    pattern,
    raises,
    reference_blocks,
    reference_segments,
)

CHUNK = n.CHUNK_BYTES
BIG = 256 << 20  # bytes per side for the large copies (abort, GIL, threads)


@pytest.fixture(scope="module")
def big() -> tuple[np.ndarray, np.ndarray]:
    """A 256 MiB source full of a byte pattern and a 256 MiB destination, as one tensor each."""
    src = np.empty((1, BIG), dtype=np.uint8)
    src[0, :] = np.arange(BIG // 8, dtype=np.uint64).view(np.uint8)
    dst = np.zeros((1, BIG), dtype=np.uint8)
    return src, dst


def _only_first_landed(src: np.ndarray, dst: np.ndarray, done: int) -> None:
    """Exactly the first ``done`` bytes of the single-tensor copy landed, nothing after."""
    assert np.array_equal(dst[0, :done], src[0, :done])
    assert not dst[0, done:].any()


def one_segment_plan(nbytes: int) -> n.Plan:
    g = n.Geometry(1, nbytes // (1 << 20), 1 << 20)
    return n.Plan.blocks(g, g, list(range(g.num_blocks)), list(range(g.num_blocks)), 0, 0, 1)


@pytest.mark.parametrize("tpl", [1, 2, 4])
@pytest.mark.parametrize(
    ("src_layers", "dst_layers"), [((0, 3), (0, 3)), ((1, 2), (2, 3))], ids=["all", "one-layer"]
)
def test_copy_matches_numpy_reference(
    tpl: int, src_layers: tuple[int, int], dst_layers: tuple[int, int]
) -> None:
    layers, bb = 3, 512
    src = pattern(layers * tpl, 20 * bb, seed=tpl)
    dst = pattern(layers * tpl, 12 * bb, seed=100 + tpl)
    src_blocks = [4, 5, 6, 0, 19, 7]
    dst_blocks = [1, 2, 3, 11, 0, 5]
    args = layer_range_args(tpl, src_layers, dst_layers)
    plan = n.Plan.blocks(geometry_of(src, bb), geometry_of(dst, bb), src_blocks, dst_blocks, *args)
    want = reference_blocks(src, dst, bb, src_blocks, dst_blocks, *args)
    src_before = src.copy()

    ctl = n.Control()
    n.copy_local(plan, bases(src), bases(dst), ctl)

    assert np.array_equal(dst, want), differing(dst, want)
    assert np.array_equal(src, src_before)
    assert ctl.bytes_done == ctl.total == plan.total_bytes == len(src_blocks) * bb * args[2]
    assert not ctl.aborted


def test_copy_unaligned_segments_from_separate_arrays() -> None:
    # Tensors need not be one array: each base is its own allocation.
    srcs = [pattern(1, 1000, seed=s)[0] for s in range(3)]
    dsts = [np.zeros(700, dtype=np.uint8) for _ in range(2)]
    rows = [(0, 1, 1, 3, 17), (2, 500, 0, 0, 333), (1, 999, 0, 333, 1), (0, 18, 1, 20, 600)]
    plan = n.Plan.from_segments(
        n.Geometry(3, 10, 100), n.Geometry(2, 7, 100), np.array(rows, np.uint64)
    )
    want = reference_segments(np.stack(srcs), np.stack(dsts), np.array(rows))

    ctl = n.Control()
    n.copy_local(plan, [a.ctypes.data for a in srcs], [a.ctypes.data for a in dsts], ctl)

    got = np.stack(dsts)
    assert np.array_equal(got, want), differing(got, want)
    assert ctl.bytes_done == 951


@pytest.mark.parametrize("threads", [2, 4])
def test_threaded_copy_of_many_segments(threads: int) -> None:
    # 24 MiB over 2 tensors, non-contiguous blocks: the parallel path cuts segments.
    bb = 64 << 10
    src = pattern(2, 256 * bb, seed=7)
    dst = np.zeros((2, 256 * bb), dtype=np.uint8)
    rng = np.random.default_rng(3)
    src_blocks = rng.permutation(256)[:192].tolist()
    dst_blocks = rng.permutation(256)[:192].tolist()
    plan = n.Plan.blocks(
        geometry_of(src, bb), geometry_of(dst, bb), src_blocks, dst_blocks, 0, 0, 2
    )
    assert plan.total_bytes == 24 << 20
    want = reference_blocks(src, dst, bb, src_blocks, dst_blocks, 0, 0, 2)

    ctl = n.Control()
    n.copy_local(plan, bases(src), bases(dst), ctl, threads=threads)

    assert np.array_equal(dst, want), differing(dst, want)
    assert ctl.bytes_done == ctl.total == plan.total_bytes


def test_more_threads_than_work_is_fine() -> None:
    src = pattern(1, 4096, seed=1)
    dst = np.zeros_like(src)
    g = geometry_of(src, 4096)
    plan = n.Plan.blocks(g, g, [0], [0], 0, 0, 1)
    ctl = n.Control()
    n.copy_local(plan, bases(src), bases(dst), ctl, threads=64)
    assert np.array_equal(src, dst)


# ------------------------------------------------------------------ bad input touches nothing


def small_case() -> tuple[np.ndarray, np.ndarray, n.Plan]:
    src = pattern(2, 8 * 64, seed=1)
    dst = pattern(2, 8 * 64, seed=2)
    g = geometry_of(src, 64)
    return src, dst, n.Plan.blocks(g, g, [0, 1], [2, 3], 0, 0, 2)


@pytest.mark.parametrize(
    ("which", "words"),
    [
        ("src-count", ("expected 2 source addresses, got 1",)),
        ("dst-count", ("expected 2 destination",)),
        ("src-null", ("null",)),
        ("dst-null", ("null",)),
        ("src-empty", ("both",)),
    ],
)
def test_bad_address_lists_touch_nothing(which: str, words: tuple[str, ...]) -> None:
    src, dst, plan = small_case()
    before = dst.copy()
    s, d = bases(src), bases(dst)
    if which == "src-count":
        s = s[:1]
    elif which == "dst-count":
        d = [*d, d[0]]
    elif which == "src-null":
        s[1] = 0
    elif which == "dst-null":
        d[0] = 0
    else:
        s = []
    ctl = n.Control()
    with raises(Status.PARAM_INVALID, *words):
        n.copy_local(plan, s, d, ctl)
    assert np.array_equal(dst, before)
    assert ctl.bytes_done == 0


def test_abort_before_start_moves_nothing() -> None:
    src, dst, plan = small_case()
    before = dst.copy()
    ctl = n.Control()
    ctl.abort()
    assert ctl.aborted
    with raises(Status.ABORTED, "aborted"):
        n.copy_local(plan, bases(src), bases(dst), ctl)
    assert ctl.bytes_done == 0
    assert np.array_equal(dst, before)


def test_control_reset_makes_it_reusable() -> None:
    src, dst, plan = small_case()
    ctl = n.Control()
    ctl.abort()
    with raises(Status.ABORTED):
        n.copy_local(plan, bases(src), bases(dst), ctl)
    ctl.reset()
    assert not ctl.aborted and ctl.bytes_done == 0 and ctl.total == 0
    n.copy_local(plan, bases(src), bases(dst), ctl)
    assert ctl.bytes_done == ctl.total == plan.total_bytes
    assert "bytes_done=" in repr(ctl)


# ------------------------------------------------------------------ abort, progress, GIL


@pytest.mark.parametrize("threads", [1, 2])
def test_a_job_ends_at_its_own_deadline_with_nobody_aborting_it(
    big: tuple[np.ndarray, np.ndarray], threads: int
) -> None:
    # No event loop, no abort(): the 256 MiB copy (tens of ms) is cut short by the
    # deadline the control carries, between chunks.
    src, dst = big
    dst[:] = 0
    plan = one_segment_plan(BIG)
    ctl = n.Control()
    ctl.expire_in(0.002)
    t0 = time.monotonic()
    with raises(Status.ABORTED, "deadline passed"):
        n.copy_local(plan, bases(src), bases(dst), ctl, threads)
    assert time.monotonic() - t0 < 0.5  # generous: within a chunk per thread, not the copy
    assert ctl.expired and ctl.aborted
    done = ctl.bytes_done
    assert done < BIG and done % CHUNK == 0
    if threads == 1:
        _only_first_landed(src, dst, done)


def test_a_deadline_already_due_moves_nothing_and_reset_clears_it() -> None:
    src, dst, plan = small_case()
    before = dst.copy()
    ctl = n.Control()
    for due in (0.0, -1.0, float("nan")):
        ctl.reset()
        ctl.expire_in(due)
        with raises(Status.ABORTED, "deadline passed"):
            n.copy_local(plan, bases(src), bases(dst), ctl)
        assert ctl.expired and ctl.bytes_done == 0
        assert np.array_equal(dst, before)
    ctl.reset()
    assert not ctl.expired and not ctl.aborted
    n.copy_local(plan, bases(src), bases(dst), ctl)  # reset: no deadline any more
    ctl.reset()
    ctl.expire_in(0.0)
    ctl.expire_in(float("inf"))  # none: clears the one set before
    n.copy_local(plan, bases(src), bases(dst), ctl)
    assert not ctl.expired and ctl.bytes_done == plan.total_bytes


def test_aborted_says_stop_once_the_deadline_passed() -> None:
    # For pollers that are not movers (engine jobs): reading ``aborted`` past the
    # deadline aborts the job and marks it expired, as a mover's check would.
    ctl = n.Control()
    assert not ctl.aborted  # no deadline: never due
    ctl.expire_in(0.05)
    assert not ctl.aborted and not ctl.expired
    time.sleep(0.06)
    assert ctl.aborted and ctl.expired
    src, dst, plan = small_case()
    with raises(Status.ABORTED, "deadline passed"):
        n.copy_local(plan, bases(src), bases(dst), ctl)  # the movers see it too
    ctl.reset()
    ctl.expire_in(float("inf"))
    assert not ctl.aborted and not ctl.expired
    ctl.abort()
    assert ctl.aborted and not ctl.expired  # an abort is not a deadline


@pytest.mark.parametrize("threads", [1, 2])
def test_abort_mid_copy_stops_within_one_chunk(
    big: tuple[np.ndarray, np.ndarray], threads: int
) -> None:
    src, dst = big
    dst[:] = 0
    plan = one_segment_plan(BIG)
    ctl = n.Control()
    job = Background(as_mover(n.copy_local), plan, bases(src), bases(dst), ctl, threads)
    at_abort = abort_after(ctl, 2 * CHUNK)
    err = job.join_error()

    assert isinstance(err, n.NativeError) and err.status == Status.ABORTED, err
    done = ctl.bytes_done
    assert ctl.total == BIG
    # After the abort, each thread finishes at most the chunk it was in.
    assert at_abort <= done <= at_abort + threads * CHUNK, (at_abort, done)
    assert done < BIG
    if threads == 1:
        # One thread copies in order: exactly the first `done` bytes landed, nothing after.
        assert done % CHUNK == 0
        _only_first_landed(src, dst, done)
    time.sleep(0.05)
    assert ctl.bytes_done == done, "progress grew after the mover returned"


def test_progress_is_readable_during_a_copy_and_the_gil_is_released(
    big: tuple[np.ndarray, np.ndarray],
) -> None:
    """A Python thread keeps counting and reading ``bytes_done`` while this thread copies:
    a value strictly between 0 and the total can only be read mid-copy, which a mover
    holding the GIL (or blocking the counter) would make impossible."""
    src, dst = big
    plan = one_segment_plan(BIG)
    current = [n.Control()]
    mid: list[int] = []  # bytes_done values read while a copy was running
    count = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal count
        while not stop.is_set():
            count += 1
            done = current[0].bytes_done
            if 0 < done < BIG:
                mid.append(done)

    t = threading.Thread(target=spin)
    t.start()
    try:
        # A loaded machine may not schedule the counter during one copy: allow a few.
        for _ in range(5):
            ctl = n.Control()
            current[0] = ctl
            dst[:] = 0
            before = count
            n.copy_local(plan, bases(src), bases(dst), ctl)  # on this thread, single-threaded
            assert ctl.bytes_done == ctl.total == BIG
            if mid:
                break
        during = count - before
    finally:
        stop.set()
        t.join(10)
    assert mid, "bytes_done never seen strictly inside a copy"
    assert during > 0
    assert mid == sorted(mid), "progress went backwards"
    assert all(s % CHUNK == 0 for s in mid), mid[:10]
    assert np.array_equal(dst, src)
