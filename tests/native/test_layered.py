"""copy_local_layered / cma_read_layered: one job over a whole plan, 1 added to an eventfd
per layer once that layer's bytes have all landed (in layer order), the lease checked
before each signal, and bad layer cuts refused before a byte moves.

Sources are seeded random bytes, unique per test case; every check compares exact bytes.
"""

from __future__ import annotations

import os
import select
import time

import numpy as np
import pytest

from aiodatadist import _native as n
from aiodatadist._native import Status
from aiodatadist.transports.base import LayerCut
from tests.native._helpers import Background, abort_after, bases, geometry_of, pattern, raises

BB = 64 << 10  # block bytes


def _setup(layers: int, tpl: int, blocks: int, seed: int):
    """src/dst of ``layers * tpl`` tensors, a plan of every block (shuffled), its cut."""
    src = pattern(layers * tpl, blocks * BB, seed=seed)
    dst = pattern(layers * tpl, blocks * BB, seed=None)
    rng = np.random.default_rng(seed)
    sb = [int(x) for x in rng.permutation(blocks)]
    db = [int(x) for x in rng.permutation(blocks)]
    plan = n.Plan.blocks(geometry_of(src, BB), geometry_of(dst, BB), sb, db, 0, 0, layers * tpl)
    return src, dst, sb, db, plan


def _want(src: np.ndarray, dst_shape: tuple[int, int], sb: list[int], db: list[int]) -> np.ndarray:
    want = np.zeros(dst_shape, dtype=np.uint8)
    for s, d in zip(sb, db, strict=True):
        want[:, d * BB : (d + 1) * BB] = src[:, s * BB : (s + 1) * BB]
    return want


def _drain(fd: int) -> int:
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


@pytest.fixture
def efd():
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    yield fd
    os.close(fd)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tpl", [1, 2])
def test_every_layer_signalled_once_and_exact(efd: int, threads: int, tpl: int) -> None:
    layers = 8 // tpl
    # 16 blocks x 64 KiB x 8 tensors = 8 MiB: two threads do split it.
    src, dst, sb, db, plan = _setup(layers, tpl, 16, seed=0x5EED_0100 + threads * 10 + tpl)
    cut = LayerCut(efd, 0, tpl, layers)
    bounds = cut.bounds(plan)
    assert len(bounds) == layers and bounds[-1] == plan.num_segments
    ctl = n.Control()
    n.copy_local_layered(plan, bases(src), bases(dst), bounds, ctl, threads, efd)
    assert _drain(efd) == layers
    assert ctl.bytes_done == ctl.total == plan.total_bytes
    assert np.array_equal(dst, _want(src, dst.shape, sb, db))


def test_a_signalled_layer_has_landed_whenever_it_is_read(efd: int) -> None:
    # 64 layers of 2 tensors x 2 MiB (256 MiB, two threads) read while they move: every
    # count read off the eventfd names layers whose bytes are all there already.
    layers, tpl, blocks = 64, 2, 32
    src, dst, sb, db, plan = _setup(layers, tpl, blocks, seed=0x5EED_0200)
    want = _want(src, dst.shape, sb, db)
    bounds = LayerCut(efd, 0, tpl, layers).bounds(plan)
    job = Background(
        n.copy_local_layered, plan, bases(src), bases(dst), bounds, n.Control(), 2, efd
    )
    landed, end = 0, time.monotonic() + 60
    while landed < layers:
        assert time.monotonic() < end, f"only {landed} layers signalled"
        select.select([efd], [], [], 1.0)
        got = _drain(efd)
        for k in range(landed, landed + got):
            rows = slice(k * tpl, (k + 1) * tpl)
            assert np.array_equal(dst[rows], want[rows]), f"layer {k} signalled before it landed"
        landed += got
    job.join()
    assert landed == layers and _drain(efd) == 0
    assert np.array_equal(dst, want)


def test_cma_read_layered_from_this_process(efd: int) -> None:
    src, dst, sb, db, plan = _setup(4, 2, 8, seed=0x5EED_0300)
    bounds = LayerCut(efd, 0, 2, 4).bounds(plan)
    n.cma_read_layered(os.getpid(), plan, bases(src), bases(dst), bounds, n.Control(), 2, efd)
    assert _drain(efd) == 4
    assert np.array_equal(dst, _want(src, dst.shape, sb, db))


@pytest.mark.parametrize("mover", ["local", "cma"])
def test_lease_checked_before_each_signal(efd: int, mover: str) -> None:
    src, dst, _sb, _db, plan = _setup(4, 2, 8, seed=0x5EED_0400)
    bounds = LayerCut(efd, 0, 2, 4).bounds(plan)
    slot = np.zeros(2, dtype=np.uint64)  # {gen, readers|pad}: one lease slot
    slot[0] = 7
    addr = slot.ctypes.data

    def run(gen: int) -> None:
        args = (plan, bases(src), bases(dst), bounds, n.Control(), 1, efd)
        if mover == "local":
            n.copy_local_layered(*args, lease_addr=addr, lease_gen=gen)
        else:
            n.cma_read_layered(os.getpid(), *args, lease_addr=addr, lease_gen=gen)

    run(7)
    assert _drain(efd) == 4
    # The slot holds another generation (the owner revoked it): layer 0 is never signalled.
    with raises(Status.FAILED, "layer 0", "revoked"):
        run(8)
    assert _drain(efd) == 0


def test_bad_cuts_refused_before_a_byte_moves(efd: int) -> None:
    src, dst, _sb, _db, plan = _setup(4, 2, 8, seed=0x5EED_0500)
    good = LayerCut(efd, 0, 2, 4).bounds(plan)
    segs = plan.num_segments
    for bounds in ([], [segs - 1], [0, segs], [good[1], good[0], segs], [*good[:-1], segs + 1]):
        with raises(Status.PARAM_INVALID, "layer"):
            n.copy_local_layered(plan, bases(src), bases(dst), bounds, n.Control(), 1, efd)
    with raises(Status.PARAM_INVALID, "signal fd"):
        n.copy_local_layered(plan, bases(src), bases(dst), good, n.Control(), 1, -1)
    with raises(Status.PARAM_INVALID, "pid"):
        n.cma_read_layered(0, plan, bases(src), bases(dst), good, n.Control(), 1, efd)
    assert not dst.any() and _drain(efd) == 0
    # A cut that does not match the plan's tensors is refused in Python, before the job.
    with pytest.raises(Exception, match="do not cut into"):
        LayerCut(efd, 0, 3, 4).bounds(plan)


def test_abort_before_start_signals_nothing(efd: int) -> None:
    src, dst, _sb, _db, plan = _setup(4, 2, 8, seed=0x5EED_0600)
    ctl = n.Control()
    ctl.abort()
    with raises(Status.ABORTED):
        n.copy_local_layered(
            plan, bases(src), bases(dst), LayerCut(efd, 0, 2, 4).bounds(plan), ctl, 2, efd
        )
    assert _drain(efd) == 0 and not dst.any()


# ------------------------------------------------------------------ start_layered


@pytest.mark.parametrize("mover", ["local", "cma"])
def test_started_job_moves_every_layer_and_waits(efd: int, mover: str) -> None:
    # Started on a mover pool thread: it moves while this thread does nothing; wait()
    # returns once it has, and every layer was signalled, in full.
    src, dst, sb, db, plan = _setup(8, 2, 16, seed=0x5EED_0700 + (mover == "cma"))
    bounds = LayerCut(efd, 0, 2, 8).bounds(plan)
    ctl = n.Control()
    pid = 0 if mover == "local" else os.getpid()
    job = n.start_layered(pid, plan, bases(src), bases(dst), bounds, ctl, 2, efd, 0, 0, 0)
    landed, end = 0, time.monotonic() + 30
    while landed < 8:  # the layers land without anyone calling into the job
        assert time.monotonic() < end, f"only {landed} layers signalled before wait()"
        select.select([efd], [], [], 1.0)
        landed += _drain(efd)
    job.wait()
    assert job.done and landed == 8 and _drain(efd) == 0
    assert ctl.bytes_done == ctl.total == plan.total_bytes
    assert np.array_equal(dst, _want(src, dst.shape, sb, db))
    job.wait()  # again: returns (the error, had there been one, is raised once)


def test_started_job_enters_and_leaves_the_lease(efd: int) -> None:
    src, dst, sb, db, plan = _setup(4, 2, 8, seed=0x5EED_0800)
    bounds = LayerCut(efd, 0, 2, 4).bounds(plan)
    slot = np.zeros(2, dtype=np.uint64)  # {gen, readers|pad}: one lease slot
    slot[0] = 9
    addr = slot.ctypes.data
    # Not current: STALE, nothing moved, nothing signalled, no reader left behind.
    job = n.start_layered(0, plan, bases(src), bases(dst), bounds, n.Control(), 1, efd, addr, 8, 0)
    with raises(Status.STALE, "lease", "nothing moved"):
        job.wait()
    assert not dst.any() and _drain(efd) == 0 and n.lease_readers(addr) == 0
    # Current: every layer lands and is signalled, and the job left the lease at the end.
    job = n.start_layered(0, plan, bases(src), bases(dst), bounds, n.Control(), 1, efd, addr, 9, 0)
    job.wait()
    assert n.lease_readers(addr) == 0
    assert _drain(efd) == 4 and np.array_equal(dst, _want(src, dst.shape, sb, db))


def test_started_job_aborted_and_dropped_handle_waits(efd: int) -> None:
    # 64 layers of 4 MiB (256 MiB): aborted after some bytes, wait() raises ABORTED once the
    # job has returned; a handle dropped mid-job waits for it (nothing moves afterwards).
    layers, tpl, blocks = 64, 2, 32
    src, dst, _sb, _db, plan = _setup(layers, tpl, blocks, seed=0x5EED_0900)
    bounds = LayerCut(efd, 0, tpl, layers).bounds(plan)
    ctl = n.Control()
    # (nice 5, as in the engine: the movers never starve this thread's abort_after)
    job = n.start_layered(0, plan, bases(src), bases(dst), bounds, ctl, 2, efd, 0, 0, 5)
    abort_after(ctl, 8 << 20)
    with raises(Status.ABORTED):
        job.wait()
    assert job.done and ctl.bytes_done < plan.total_bytes

    ctl2 = n.Control()
    job = n.start_layered(0, plan, bases(src), bases(dst), bounds, ctl2, 2, efd, 0, 0, 5)
    abort_after(ctl2, 8 << 20)
    del job  # waits for the job (its error dropped)
    done = ctl2.bytes_done
    time.sleep(0.05)
    assert ctl2.bytes_done == done < plan.total_bytes


def test_started_job_bad_arguments(efd: int) -> None:
    src, dst, _sb, _db, plan = _setup(4, 2, 8, seed=0x5EED_0A00)
    good = LayerCut(efd, 0, 2, 4).bounds(plan)
    with raises(Status.PARAM_INVALID, "pid"):
        n.start_layered(-1, plan, bases(src), bases(dst), good, n.Control(), 1, efd, 0, 0, 0)
    # The job's own checks are raised by wait(), before a byte moved.
    job = n.start_layered(0, plan, bases(src), bases(dst), good[:-1], n.Control(), 1, efd, 0, 0, 0)
    with raises(Status.PARAM_INVALID, "layer"):
        job.wait()
    assert not dst.any() and _drain(efd) == 0
