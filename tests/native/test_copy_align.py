"""copy_local's kernels under every relative alignment, and shm mappings without page faults.

The kernels (ext/movers.cpp): ``memcpy``; ``stream`` (a head to a 64-byte destination
boundary, then aligned non-temporal stores, then a tail); ``auto`` streams transfers of at
least ``STREAM_THRESHOLD`` bytes. Every source offset 0..63 against every destination
offset 0..63 (relative to a page), exact bytes, and every byte between the segments (the
neighbours) untouched. Shared memory: an allocated segment and a peer's mapping of it are
2 MiB-aligned from 2 MiB on, and a peer's mapping has its page tables filled on a thread
of its own, after which reading any page of it takes no page fault.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator

import numpy as np
import pytest

from aiodatadist import _native as n
from aiodatadist._native import Status
from aiodatadist.testing import host_buffer
from tests.native._helpers import raises, unique_shm_name

MODES = ("memcpy", "stream", "auto")
PAGE = 4096
HUGE = 2 << 20


@pytest.fixture(autouse=True)
def restore_mode() -> Iterator[None]:
    yield
    n.set_copy_mode("auto")


def page_aligned(nbytes: int, seed: int | None) -> np.ndarray:
    """``nbytes`` of page-aligned memory (own mapping): seeded random bytes, or 0xEE."""
    arr = host_buffer(nbytes, np.uint8, huge_pages=False)
    assert arr.ctypes.data % PAGE == 0
    if seed is None:
        arr[:] = 0xEE
    else:
        arr[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return arr


def copy_segments(
    segs: list[tuple[int, int, int]], slot: int, mode: str, threads: int, seed: int
) -> None:
    """Copies ``(src_off, dst_off, nbytes)`` segments between page-aligned buffers with
    ``mode`` and checks every byte of the destination against a numpy reference."""
    total = slot * len(segs)
    src = page_aligned(total, seed)
    dst = page_aligned(total, None)
    want = dst.copy()
    rows = np.array([(0, s, 0, d, k) for s, d, k in segs], dtype=np.uint64)
    geo = n.Geometry(1, total, 1)
    plan = n.Plan.from_segments(geo, geo, rows)
    assert plan.num_segments == len(segs)  # the guards keep them apart (nothing merged)
    for s, d, k in segs:
        want[d : d + k] = src[s : s + k]
    src_before = src.copy()
    n.set_copy_mode(mode)
    ctl = n.Control()
    n.copy_local(plan, [src.ctypes.data], [dst.ctypes.data], ctl, threads)
    assert ctl.bytes_done == plan.total_bytes
    bad = np.flatnonzero(dst != want)
    assert bad.size == 0, (
        f"{mode}: {bad.size} wrong bytes, first at {bad[0]} (slot {bad[0] // slot}, "
        f"byte {bad[0] % slot})"
    )
    assert np.array_equal(src, src_before)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nbytes", [1, 31, 64, 127, 200, 4133])
def test_every_offset_pair_exact_and_neighbours_untouched(mode: str, nbytes: int) -> None:
    # Slot i holds one segment: source offset i % 64, destination offset i // 64 within a
    # 64-byte-aligned slot with >= 64 guard bytes after it on both sides.
    slot = -(-(nbytes + 128) // 64) * 64
    segs = [(i * slot + so, i * slot + do, nbytes) for i, (so, do) in enumerate(_pairs())]
    copy_segments(segs, slot, mode, threads=1, seed=nbytes)


def _pairs() -> list[tuple[int, int]]:
    return [(so, do) for do in range(64) for so in range(64)]


@pytest.mark.parametrize("mode", ["stream", "auto"])
def test_misaligned_large_pieces_split_among_threads(mode: str) -> None:
    # >= STREAM_THRESHOLD in all (auto streams), 2 threads cutting pieces at byte counts
    # that are not multiples of anything; each segment misaligned differently on both sides.
    nbytes = 600_017
    count = max(64, -(-n.STREAM_THRESHOLD // nbytes) + 1)
    slot = -(-(nbytes + 128) // PAGE) * PAGE
    segs = [(i * slot + (i * 7) % 64, i * slot + (i * 13 + 16) % 64, nbytes) for i in range(count)]
    assert sum(k for _, _, k in segs) >= n.STREAM_THRESHOLD
    copy_segments(segs, slot, mode, threads=2, seed=7)


def test_copy_mode_is_settable_and_checked() -> None:
    assert n.copy_mode() == "auto"
    for mode in MODES:
        n.set_copy_mode(mode)
        assert n.copy_mode() == mode
    with raises(Status.PARAM_INVALID, "copy mode"):
        n.set_copy_mode("fast")
    assert n.copy_mode() == "auto"  # unchanged by the refused call
    assert isinstance(n.STREAM_SUPPORTED, bool)
    assert 16 << 20 <= n.STREAM_THRESHOLD <= 32 << 20


# ---------------------------------------------------------------- shared memory


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def wait_populated(seg: n.ShmSegment, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not seg.populated:
        assert time.monotonic() < end, "the mapping was not populated in time"
        time.sleep(0.005)


def test_segments_are_2mib_aligned_and_created_populated() -> None:
    size = 3 * HUGE + 5 * PAGE
    seg = n.ShmSegment.create(unique_shm_name("align"), size)
    try:
        assert seg.addr % HUGE == 0
        assert seg.populated  # the creator's own pages are filled at creation
        before = minor_faults()
        view = np.frombuffer(memoryview(seg), dtype=np.uint8)
        view[::PAGE] = 1  # a write to every page: no fault (populated for writing)
        assert minor_faults() - before < 0.01 * size / PAGE
        small = n.ShmSegment.create(unique_shm_name("align-small"), 5 * PAGE)
        try:
            assert small.addr % PAGE == 0
        finally:
            small.close()
    finally:
        seg.close()


@pytest.mark.parametrize("writable", [False, True], ids=["read", "write"])
def test_a_peer_mapping_is_populated_then_takes_no_faults(writable: bool) -> None:
    size = 64 << 20
    pages = size // PAGE
    seg = n.ShmSegment.create(unique_shm_name("populate"), size)
    try:
        src = np.frombuffer(memoryview(seg), dtype=np.uint8)
        src[::PAGE] = np.arange(pages, dtype=np.uint64).astype(np.uint8)
        peer = n.ShmSegment.from_fd(seg.fd, size, writable, "populate-peer")
        try:
            assert peer.addr % HUGE == 0
            wait_populated(peer)
            # A read of (and, writable, a write to) every page of the mapping: no page of
            # it faults any more (each would otherwise fault once, in 64 KiB steps). numpy
            # touches them: a sanitizer build's copy_local would fault its shadow memory in.
            view = np.frombuffer(memoryview(peer), dtype=np.uint8)
            before = minor_faults()
            seen = view[::PAGE].copy()
            if writable:
                view[::PAGE] = seen + 1
            faults = minor_faults() - before
            assert faults < 0.01 * pages, f"{faults} minor faults over {pages} mapped pages"
            assert np.array_equal(seen, np.arange(pages, dtype=np.uint64).astype(np.uint8))
            del view
            # And the mover copies out of it, byte for byte.
            dst = host_buffer(size, np.uint8)
            geo = n.Geometry(1, pages, PAGE)
            plan = n.Plan.blocks(geo, geo, list(range(pages)), list(range(pages)), 0, 0, 1)
            n.copy_local(plan, [peer.addr], [dst.ctypes.data], n.Control(), 2)
            assert np.array_equal(dst, src)
        finally:
            peer.close()
    finally:
        seg.close()


def test_close_while_populating_stops_it() -> None:
    # close() must not unmap under the populating thread: it stops it and waits (one step).
    size = 512 << 20
    seg = n.ShmSegment.create(unique_shm_name("populate-close"), size)
    try:
        for _ in range(3):
            peer = n.ShmSegment.from_fd(seg.fd, size, False, "populate-close-peer")
            t0 = time.monotonic()
            peer.close()
            assert peer.closed
            assert time.monotonic() - t0 < 10.0  # generous: one step is ~32 MiB
        # A mapping that is dropped, not closed, stops its thread in the destructor.
        peer = n.ShmSegment.from_fd(seg.fd, size, False, "populate-drop-peer")
        del peer
    finally:
        seg.close()


@pytest.mark.parametrize(
    ("tensor_bytes", "align"),
    [(1 << 20, PAGE), (5000, PAGE), (2 << 20, HUGE), ((2 << 20) + PAGE, PAGE), (40 << 20, HUGE)],
)
def test_allocated_tensors_are_page_or_2mib_aligned(tensor_bytes: int, align: int) -> None:
    # allocate_*: every tensor page-aligned; 2 MiB-aligned from 2 MiB on where rounding
    # each tensor up to 2 MiB wastes at most a 16th of it.
    from aiodatadist._registration import CacheRegistry
    from aiodatadist.types import CacheDesc, DataType, Placement

    reg = CacheRegistry(7, lambda: None)
    try:
        desc = CacheDesc(3, [1, tensor_bytes], DataType.DT_UINT8, Placement.HOST)
        cache = reg.allocate(desc, is_blocks=False, model_id=None, row_keys=[])
        addrs = cache.tensor_addrs
        assert all(a % align == 0 for a in addrs), [hex(a) for a in addrs]
        assert addrs[1] - addrs[0] - tensor_bytes < align
        # The bytes are the tensors' own: a pattern written through the views stays put.
        views = cache.tensors()
        for t, v in enumerate(views):
            v[...] = t + 1
        assert all((v == t + 1).all() for t, v in enumerate(views))
    finally:
        reg.free_all()
