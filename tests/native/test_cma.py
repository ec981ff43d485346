"""CMA movers (process_vm_readv / process_vm_writev) between two real processes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from aiodatadist import _native as n
from aiodatadist._native import Status
from tests.native._helpers import (
    Background,
    Worker,
    abort_after,
    bases,
    dead_pid,
    differing,
    geometry_of,
    layer_range_args,
    pattern,
    plan_to_json,
    raises,
    reference_blocks,
)

CHUNK = n.CHUNK_BYTES
BB = 1024
LAYERS = 3
NBLK = 32


def remote_array(
    w: Worker, name: str, rows: int, cols: int, seed: int | None
) -> tuple[np.ndarray, list[int]]:
    """Allocates `name` in the worker; returns its local twin (same seed) and remote bases."""
    reply = w.call(op="alloc", name=name, rows=rows, cols=cols, seed=seed)
    return pattern(rows, cols, seed), reply["bases"]


def fetch(w: Worker, name: str, tmp_path: Path) -> np.ndarray:
    path = tmp_path / f"{name}.npy"
    w.call(op="dump", name=name, path=str(path))
    return np.load(path)


@pytest.fixture(scope="module", autouse=True)
def _cma_allowed(shared_worker: Worker) -> None:
    allowed, err = n.cma_probe(shared_worker.pid)
    if not allowed:
        pytest.skip(
            f"this kernel refuses process_vm_readv on a child process ({errno.errorcode[err]}: "
            "ptrace policy or a seccomp profile); CMA cannot be exercised here"
        )


def test_probe(shared_worker: Worker) -> None:
    assert n.cma_probe(shared_worker.pid) == (True, 0)
    assert n.cma_probe(os.getpid()) == (True, 0)
    assert n.cma_probe(dead_pid()) == (False, errno.ESRCH)


@pytest.mark.parametrize("tpl", [1, 2, 4])
@pytest.mark.parametrize(
    ("src_layers", "dst_layers"), [((0, 3), (0, 3)), ((2, 3), (0, 1))], ids=["all", "one-layer"]
)
def test_read_matches_numpy_reference(
    shared_worker: Worker, tpl: int, src_layers: tuple[int, int], dst_layers: tuple[int, int]
) -> None:
    src, remote = remote_array(shared_worker, f"src{tpl}", LAYERS * tpl, NBLK * BB, seed=10 + tpl)
    dst = pattern(LAYERS * tpl, 16 * BB, seed=20 + tpl)
    src_blocks = [3, 4, 5, 31, 0, 17]
    dst_blocks = [0, 1, 2, 7, 15, 9]
    args = layer_range_args(tpl, src_layers, dst_layers)
    plan = n.Plan.blocks(geometry_of(src, BB), geometry_of(dst, BB), src_blocks, dst_blocks, *args)
    want = reference_blocks(src, dst, BB, src_blocks, dst_blocks, *args)

    ctl = n.Control()
    n.cma_read(shared_worker.pid, plan, remote, bases(dst), ctl)

    assert np.array_equal(dst, want), differing(dst, want)
    assert ctl.bytes_done == ctl.total == plan.total_bytes


@pytest.mark.parametrize("tpl", [1, 2, 4])
def test_write_matches_numpy_reference(shared_worker: Worker, tmp_path: Path, tpl: int) -> None:
    src = pattern(LAYERS * tpl, 16 * BB, seed=30 + tpl)
    dst0, remote = remote_array(shared_worker, f"wdst{tpl}", LAYERS * tpl, NBLK * BB, seed=40 + tpl)
    src_blocks = [15, 0, 1, 2, 8]
    dst_blocks = [31, 10, 11, 12, 0]
    args = layer_range_args(tpl, (1, 3), (0, 2))
    plan = n.Plan.blocks(geometry_of(src, BB), geometry_of(dst0, BB), src_blocks, dst_blocks, *args)
    want = reference_blocks(src, dst0, BB, src_blocks, dst_blocks, *args)

    ctl = n.Control()
    n.cma_write(shared_worker.pid, plan, bases(src), remote, ctl)

    got = fetch(shared_worker, f"wdst{tpl}", tmp_path)
    assert np.array_equal(got, want), differing(got, want)
    assert ctl.bytes_done == ctl.total == plan.total_bytes


@pytest.mark.parametrize("mover", ["read", "write"])
def test_more_segments_than_iov_max(shared_worker: Worker, tmp_path: Path, mover: str) -> None:
    # Every other block of 3000: 1500 non-contiguous segments, more than one batch of IOV_MAX.
    bb, nblk = 64, 3000
    src_blocks = list(range(0, nblk, 2))
    dst_blocks = list(range(nblk - 1, 0, -2))
    local = pattern(1, nblk * bb, seed=51)
    remote_twin, remote = remote_array(shared_worker, f"iov-{mover}", 1, nblk * bb, seed=52)
    g = geometry_of(local, bb)
    plan = n.Plan.blocks(g, g, src_blocks, dst_blocks, 0, 0, 1)
    assert plan.num_segments == len(src_blocks) > n.IOV_MAX

    ctl = n.Control()
    if mover == "read":
        want = reference_blocks(remote_twin, local, bb, src_blocks, dst_blocks, 0, 0, 1)
        n.cma_read(shared_worker.pid, plan, remote, bases(local), ctl)
        got = local
    else:
        want = reference_blocks(local, remote_twin, bb, src_blocks, dst_blocks, 0, 0, 1)
        n.cma_write(shared_worker.pid, plan, bases(local), remote, ctl)
        got = fetch(shared_worker, f"iov-{mover}", tmp_path)
    assert np.array_equal(got, want), differing(got, want)
    assert ctl.bytes_done == ctl.total == plan.total_bytes


@pytest.mark.parametrize("threads", [1, 3])
def test_large_read_with_threads(shared_worker: Worker, threads: int) -> None:
    # 24 MiB in 256 KiB blocks, shuffled: several 4 MiB batches, split over threads.
    bb, nblk = 256 << 10, 96
    src, remote = remote_array(shared_worker, "large", 1, nblk * bb, seed=61)
    dst = np.zeros_like(src)
    perm = np.random.default_rng(5).permutation(nblk).tolist()
    g = geometry_of(src, bb)
    plan = n.Plan.blocks(g, g, list(range(nblk)), perm, 0, 0, 1)
    want = reference_blocks(src, dst, bb, list(range(nblk)), perm, 0, 0, 1)

    ctl = n.Control()
    n.cma_read(shared_worker.pid, plan, remote, bases(dst), ctl, threads=threads)

    assert np.array_equal(dst, want), differing(dst, want)
    assert ctl.bytes_done == ctl.total == nblk * bb


def test_abort_mid_read_stops_within_one_chunk(shared_worker: Worker) -> None:
    size = 256 << 20
    _, remote = remote_array(shared_worker, "huge", 1, size, seed=None)
    dst = np.ones((1, size), dtype=np.uint8)
    g = n.Geometry(1, size // (1 << 20), 1 << 20)
    plan = n.Plan.blocks(g, g, list(range(g.num_blocks)), list(range(g.num_blocks)), 0, 0, 1)
    ctl = n.Control()
    job = Background(n.cma_read, shared_worker.pid, plan, remote, bases(dst), ctl)
    at_abort = abort_after(ctl, CHUNK)
    err = job.join_error()
    assert isinstance(err, n.NativeError) and err.status == Status.ABORTED, err
    done = ctl.bytes_done
    assert at_abort <= done <= at_abort + CHUNK and done < size, (at_abort, done)
    # Exactly the first `done` bytes landed (the worker's array is zeros).
    assert not dst[0, :done].any() and dst[0, done:].all()


def test_abort_before_start_moves_nothing(shared_worker: Worker) -> None:
    src, remote = remote_array(shared_worker, "abort0", 1, 4 * BB, seed=71)
    dst = np.zeros_like(src)
    g = geometry_of(src, BB)
    plan = n.Plan.blocks(g, g, [0, 1], [2, 3], 0, 0, 1)
    ctl = n.Control()
    ctl.abort()
    with raises(Status.ABORTED):
        n.cma_read(shared_worker.pid, plan, remote, bases(dst), ctl)
    assert ctl.bytes_done == 0 and not dst.any()


# ------------------------------------------------------------------ errors


def test_dead_process_is_no_such_process() -> None:
    pid = dead_pid()
    local = pattern(1, 4 * BB, seed=1)
    g = geometry_of(local, BB)
    plan = n.Plan.blocks(g, g, [0], [1], 0, 0, 1)
    for call in (n.cma_read, n.cma_write):
        ctl = n.Control()
        with raises(Status.NO_SUCH_PROCESS, f"pid {pid}", "gone") as info:
            call(pid, plan, bases(local), bases(local), ctl)
        assert info.value.errno == errno.ESRCH
        assert ctl.bytes_done == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a worker under another uid")
def test_permission_denied_is_reported(worker: Worker) -> None:
    # A worker running as `nobody` may not read this root process's memory: EPERM.
    src = pattern(1, 4 * BB, seed=91)
    g = geometry_of(src, BB)
    plan = n.Plan.blocks(g, g, [0, 1], [2, 3], 0, 0, 1)
    assert worker.call(op="alloc", name="dst", rows=1, cols=4 * BB, seed=None)["ok"]
    assert worker.call(op="drop_privileges", uid=65534)["uid"] == 65534
    probe = worker.call(op="cma_probe", pid=os.getpid())
    assert (probe["allowed"], probe["errno"]) == (False, errno.EPERM)
    reply = worker.call(
        op="cma_read", pid=os.getpid(), plan=plan_to_json(plan), remote=bases(src), name="dst"
    )
    assert not reply["ok"], reply
    assert reply["status"] == Status.PERMISSION_DENIED and reply["errno"] == errno.EPERM
    assert f"pid {os.getpid()}" in reply["message"] and "ptrace" in reply["message"]


def test_bad_pid_is_param_invalid() -> None:
    local = pattern(1, 4 * BB, seed=1)
    g = geometry_of(local, BB)
    plan = n.Plan.blocks(g, g, [0], [1], 0, 0, 1)
    with raises(Status.PARAM_INVALID, "pid"):
        n.cma_read(0, plan, bases(local), bases(local), n.Control())


def test_unmapped_remote_address_is_out_of_range(shared_worker: Worker) -> None:
    # Address 16 lies in page 0, which no process can map (vm.mmap_min_addr).
    dst = np.zeros((1, 4 * BB), dtype=np.uint8)
    g = geometry_of(dst, BB)
    plan = n.Plan.blocks(g, g, [0], [1], 0, 0, 1)
    ctl = n.Control()
    with raises(Status.OUT_OF_RANGE, "process_vm_readv", "not mapped") as info:
        n.cma_read(shared_worker.pid, plan, [16], bases(dst), ctl)
    assert info.value.errno == errno.EFAULT
    assert ctl.bytes_done == 0 and not dst.any()
    with raises(Status.OUT_OF_RANGE, "process_vm_writev"):
        n.cma_write(shared_worker.pid, plan, bases(dst), [16], n.Control())


def test_partial_transfer_reports_what_landed(shared_worker: Worker) -> None:
    # Tensor 0 is mapped in the worker, tensor 1 is not: the batch stops part way and
    # the mover reports EFAULT after exactly tensor 0's bytes.
    src, remote = remote_array(shared_worker, "partial", 1, 8 * BB, seed=81)
    dst = np.zeros((2, 8 * BB), dtype=np.uint8)
    g = n.Geometry(2, 8, BB)
    plan = n.Plan.blocks(g, g, [1, 2, 3], [4, 5, 6], 0, 0, 2)
    ctl = n.Control()
    with raises(Status.OUT_OF_RANGE):
        n.cma_read(shared_worker.pid, plan, [remote[0], 16], bases(dst), ctl)
    assert ctl.bytes_done == 3 * BB
    assert np.array_equal(dst[0, 4 * BB : 7 * BB], src[0, BB : 4 * BB])
    assert not dst[1].any()


def test_worker_still_usable_after_errors(shared_worker: Worker) -> None:
    assert shared_worker.call(op="alloc", name="alive", rows=1, cols=8, seed=1)["ok"]
