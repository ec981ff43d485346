"""The movers' helper threads: a persistent pool (ext/parallel.hpp), not a thread per job.

A threaded copy's helper shares run on pool threads named ``aiodd-mover`` that outlive
the job; the caller runs share 0 and takes back any share no pool thread has started.
Checked here with real bytes (seeded, unique per case): many jobs in a row reuse the
same threads, concurrent jobs each get theirs, an abort while shares are queued or
running, a failure on one share (the caller's or a helper's), and a forked child.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

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
    pattern,
    raises,
)

MIB = 1 << 20
BB = 256 << 10  # block bytes


def pool_threads() -> list[int]:
    """Thread ids of this process's pool threads (by the name they give themselves)."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "aiodd-mover":
                    out.append(int(tid))
        except FileNotFoundError:  # exited meanwhile
            pass
    return out


def shuffled_copy(tensors: int, tensor_bytes: int, seed: int):
    """src (seeded), dst (zeros), a plan of every block shuffled, and the wanted dst."""
    src = pattern(tensors, tensor_bytes, seed=seed)
    dst = pattern(tensors, tensor_bytes, seed=None)
    nblk = tensor_bytes // BB
    rng = np.random.default_rng(seed)
    sb = [int(x) for x in rng.permutation(nblk)]
    db = [int(x) for x in rng.permutation(nblk)]
    g = geometry_of(src, BB)
    plan = n.Plan.blocks(g, g, sb, db, 0, 0, tensors)
    want = np.zeros_like(src)
    for s, d in zip(sb, db, strict=True):
        want[:, d * BB : (d + 1) * BB] = src[:, s * BB : (s + 1) * BB]
    return src, dst, plan, want


def test_many_jobs_in_a_row_reuse_the_same_threads() -> None:
    # 16 MiB copies with 4 threads (each above the size that splits a copy): every job's
    # helpers run on pool threads, and 40 jobs in a row leave no more than one job needs.
    src, dst, plan, want = shuffled_copy(4, 4 * MIB, seed=0x9001)
    n.copy_local(plan, bases(src), bases(dst), n.Control(), threads=4)
    first = set(pool_threads())
    assert first, "a threaded copy ran without pool threads"
    for i in range(40):
        dst[...] = 0
        ctl = n.Control()
        n.copy_local(plan, bases(src), bases(dst), ctl, threads=4)
        assert np.array_equal(dst, want), f"job {i}: {differing(dst, want)}"
        assert ctl.bytes_done == ctl.total == plan.total_bytes
    # The same threads (none exited, none added while nothing else ran copies).
    assert first <= set(pool_threads())
    assert len(pool_threads()) <= len(first) + 3 * 4, pool_threads()


def test_concurrent_jobs_each_get_their_bytes() -> None:
    # Four jobs at once, 4 threads each, distinct sources: exact bytes for every one.
    jobs = [shuffled_copy(2, 8 * MIB, seed=0x9100 + k) for k in range(4)]
    barrier = threading.Barrier(len(jobs))

    def run(k: int) -> None:
        src, dst, plan, _ = jobs[k]
        barrier.wait(timeout=30)
        for _ in range(5):
            dst[...] = 0
            n.copy_local(plan, bases(src), bases(dst), n.Control(), threads=4)

    bg = [Background(run, k) for k in range(len(jobs))]
    for b in bg:
        b.join()
    for k, (_, dst, _, want) in enumerate(jobs):
        assert np.array_equal(dst, want), f"job {k}: {differing(dst, want)}"


def test_abort_before_start_runs_no_share() -> None:
    src, dst, plan, _ = shuffled_copy(2, 16 * MIB, seed=0x9200)
    ctl = n.Control()
    ctl.abort()
    with raises(Status.ABORTED):
        n.copy_local(plan, bases(src), bases(dst), ctl, threads=4)
    assert ctl.bytes_done == 0 and not dst.any()


@pytest.mark.parametrize("threads", [2, 4])
def test_abort_mid_copy_then_the_pool_still_works(threads: int) -> None:
    # 256 MiB, aborted after 8 MiB: every share stops within its chunk, the job returns
    # ABORTED, and the next job on the same pool copies every byte.
    g = n.Geometry(1, 256, MIB)
    src = np.empty((1, 256 * MIB), dtype=np.uint8)
    src[0, :] = np.arange(256 * MIB // 8, dtype=np.uint64).view(np.uint8)
    dst = np.zeros_like(src)
    plan = n.Plan.blocks(g, g, list(range(256)), list(range(256)), 0, 0, 1)
    ctl = n.Control()
    job = Background(as_mover(n.copy_local), plan, bases(src), bases(dst), ctl, threads)
    at_abort = abort_after(ctl, 8 * MIB)
    err = job.join_error()
    assert isinstance(err, n.NativeError) and err.status == Status.ABORTED, err
    assert at_abort <= ctl.bytes_done <= at_abort + threads * n.CHUNK_BYTES
    assert ctl.bytes_done < 256 * MIB

    src2, dst2, plan2, want2 = shuffled_copy(2, 16 * MIB, seed=0x9300 + threads)
    n.copy_local(plan2, bases(src2), bases(dst2), n.Control(), threads=threads)
    assert np.array_equal(dst2, want2), differing(dst2, want2)


@pytest.fixture
def inaccessible() -> int:
    """The address of 16 MiB mapped PROT_NONE (any access faults), unmapped afterwards."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    prot_none = 0  # PROT_NONE (the mmap module does not name it)
    addr = libc.mmap(None, 16 * MIB, prot_none, flags, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    yield addr
    libc.munmap(addr, 16 * MIB)


@pytest.mark.parametrize("bad", [0, 1], ids=["caller-share", "helper-share"])
def test_a_failure_on_one_share_is_the_error_raised(inaccessible: int, bad: int) -> None:
    # process_vm_readv from this very process, 2 tensors x 16 MiB on 2 threads: share 0
    # reads tensor 0, share 1 tensor 1. The tensor read from an inaccessible address
    # fails with EFAULT: that error is raised (not the ABORTED of the other share), and
    # the pool runs the next job in full.
    src = pattern(2, 16 * MIB, seed=0x9400 + bad)
    dst = pattern(2, 16 * MIB, seed=None)
    g = geometry_of(src, MIB)
    plan = n.Plan.blocks(g, g, list(range(16)), list(range(16)), 0, 0, 2)
    remote = bases(src)
    remote[bad] = inaccessible
    with raises(Status.OUT_OF_RANGE, "process_vm_readv"):
        n.cma_read(os.getpid(), plan, remote, bases(dst), n.Control(), threads=2)

    ctl = n.Control()
    n.cma_read(os.getpid(), plan, bases(src), bases(dst), ctl, threads=2)
    assert np.array_equal(dst, src), differing(dst, src)
    assert ctl.bytes_done == ctl.total == plan.total_bytes


def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    # The parent's pool threads do not exist in a child: the child starts its own (and
    # copies every byte), whatever state the parent's pool was in at the fork.
    src, dst, plan, want = shuffled_copy(2, 16 * MIB, seed=0x9500)
    n.copy_local(plan, bases(src), bases(dst), n.Control(), threads=4)  # the parent's pool
    assert pool_threads()
    dst[...] = 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: native calls only, then _exit
        code = 1
        try:
            os.close(r)
            fresh = not pool_threads()
            n.copy_local(plan, bases(src), bases(dst), n.Control(), threads=4)
            ok = bool(np.array_equal(dst, want))
            os.write(w, f"{int(fresh)} {int(ok)} {len(pool_threads())}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        fresh, ok, count = (int(x) for x in f.read().split())
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fresh == 1, "the child saw its parent's pool threads"
    assert ok == 1, "the child's copy was wrong"
    assert count >= 1, "the child's copy ran without pool threads of its own"
    assert not dst.any()  # the child's copy-on-write pages, not ours
