"""Shared-memory segments (nameless, size-sealed memfds) and lease slots.

Segments: create / map from an fd / unmap, mapped by another process, with copy_local
moving planned blocks in and out of them; nothing ever appears in /dev/shm; a segment
that could shrink is refused; the creator cannot shrink a segment its peer maps.
Leases: enter / exit / publish / revoke on a slot, revoke waiting (futex) for a reader
on another thread and in another process, and restoring the generation on timeout.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from aiodatadist import _native as n
from aiodatadist._native import Status
from tests.native._helpers import (
    Background,
    Worker,
    differing,
    geometry_of,
    layer_range_args,
    pattern,
    plan_to_json,
    raises,
    reference_blocks,
    unique_shm_name,
)

REVOKED = 1 << 63


def dev_shm_entries() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").is_dir() else set()


def test_create_map_close_leaves_nothing_named() -> None:
    before = dev_shm_entries()
    name = unique_shm_name("basic")
    seg = n.ShmSegment.create(name, 3 * 4096 + 5)
    try:
        assert (seg.name, seg.size, seg.owner, seg.closed, seg.writable) == (
            name,
            3 * 4096 + 5,
            True,
            False,
            True,
        )
        assert seg.addr != 0 and seg.fd >= 0
        assert dev_shm_entries() == before  # nameless: nothing a killed process could leave
        assert os.readlink(f"/proc/self/fd/{seg.fd}").startswith(f"/memfd:{name}")
        seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals & want == want and not seals & fcntl.F_SEAL_WRITE
        view = np.frombuffer(seg, dtype=np.uint8)
        assert view.flags.writeable and view.size == seg.size and not view.any()
        data = pattern(1, seg.size, seed=1)[0]
        view[:] = data

        other = n.ShmSegment.from_fd(seg.fd, seg.size, name="peer")  # read-only by default
        assert (other.owner, other.writable, other.name) == (False, False, "peer")
        assert other.addr != seg.addr and other.fd not in (-1, seg.fd)  # its own dup
        oview = np.frombuffer(other, dtype=np.uint8)
        assert not oview.flags.writeable
        assert np.array_equal(oview, data)
        del oview
        dup = other.fd
        other.close()
        assert other.closed and other.fd == -1
        with pytest.raises(OSError):
            os.fstat(dup)  # close() closed its dup, and only that
        os.fstat(seg.fd)
        del view
    finally:
        seg.close()
    assert seg.closed and seg.fd == -1
    seg.close()  # idempotent
    assert "closed" in repr(seg)
    with pytest.raises(BufferError):
        np.frombuffer(seg, dtype=np.uint8)


def test_from_fd_keeps_mapping_after_the_senders_fd_closes() -> None:
    seg = n.ShmSegment.create(unique_shm_name("dup"), 8192)
    fd = os.dup(seg.fd)
    peer = n.ShmSegment.from_fd(fd, 8192, writable=True)
    os.close(fd)
    seg.close()  # the creator is gone too: the memory lives while mapped
    try:
        view = np.frombuffer(peer, dtype=np.uint8)
        view[:] = 9
        assert int(view.sum()) == 9 * 8192
        del view
    finally:
        peer.close()


@pytest.mark.parametrize("bad", ["noslash", "/", "/a/b", "/" + "x" * 241, ""])
def test_rejects_bad_labels(bad: str) -> None:
    with raises(Status.PARAM_INVALID, "shm label", f"'{bad}'"):
        n.ShmSegment.create(bad, 4096)


def test_rejects_zero_size_and_bad_fds() -> None:
    with raises(Status.PARAM_INVALID, "size"):
        n.ShmSegment.create(unique_shm_name("zero"), 0)
    seg = n.ShmSegment.create(unique_shm_name("z"), 4096)
    try:
        with raises(Status.PARAM_INVALID, "size"):
            n.ShmSegment.from_fd(seg.fd, 0)
        with raises(Status.PARAM_INVALID, "fd"):
            n.ShmSegment.from_fd(-1, 4096)
    finally:
        seg.close()
    r, w = os.pipe()
    try:
        with raises(Status.PERMISSION_DENIED, "not a memfd"):
            n.ShmSegment.from_fd(r, 4096)
    finally:
        os.close(r)
        os.close(w)


def test_from_fd_refuses_segments_that_could_shrink(tmp_path: Path) -> None:
    """A file whose size the sender could still cut would make our copies fault: refused."""
    plain = os.memfd_create("aiodd-test-unsealable", os.MFD_CLOEXEC)
    sealable = os.memfd_create("aiodd-test-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    regular = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for fd in (plain, sealable, regular):
            os.ftruncate(fd, 8192)
            with raises(Status.PERMISSION_DENIED, "not sealed against shrinking"):
                n.ShmSegment.from_fd(fd, 4096, writable=True)
        # Sealed against growing only: still refused.
        fcntl.fcntl(sealable, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
        with raises(Status.PERMISSION_DENIED, "not sealed against shrinking"):
            n.ShmSegment.from_fd(sealable, 4096)
        # Sealed against shrinking: accepted.
        fcntl.fcntl(sealable, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        n.ShmSegment.from_fd(sealable, 4096).close()
    finally:
        for fd in (plain, sealable, regular):
            os.close(fd)


def test_from_fd_refuses_a_short_segment() -> None:
    seg = n.ShmSegment.create(unique_shm_name("short"), 4096)
    try:
        with raises(Status.OUT_OF_RANGE, "holds 4096 bytes", "8192 expected"):
            n.ShmSegment.from_fd(seg.fd, 8192)
        smaller = n.ShmSegment.from_fd(seg.fd, 100)
        assert smaller.size == 100
        smaller.close()
    finally:
        seg.close()


def test_sealed_size_cannot_change_and_the_mapping_stays_readable() -> None:
    seg = n.ShmSegment.create(unique_shm_name("seal"), 4 * 4096)
    peer = n.ShmSegment.from_fd(seg.fd, seg.size)
    try:
        np.frombuffer(seg, dtype=np.uint8)[:] = 0x42
        for size in (0, 4096, 8 * 4096):
            with pytest.raises(OSError) as info:
                os.ftruncate(seg.fd, size)
            assert info.value.errno == errno.EPERM
        with pytest.raises(OSError) as info:  # F_SEAL_SEAL: no seal can be added or changed
            fcntl.fcntl(seg.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert info.value.errno == errno.EPERM
        view = np.frombuffer(peer, dtype=np.uint8)
        assert (view == 0x42).all()  # the last page too: no SIGBUS
        del view
    finally:
        peer.close()
        seg.close()


# ------------------------------------------------------------------ two processes


@pytest.mark.parametrize("tpl", [1, 2, 4])
@pytest.mark.slow  # worker processes, big segments
def test_another_process_reads_and_writes(worker: Worker, tmp_path: Path, tpl: int) -> None:
    """The prompt side creates a pool segment holding its tensors end to end; the decoder
    side maps it from its fd and copies planned blocks out of it (and back into it)."""
    layers, bb, nblk = 3, 4096, 16
    rows, tb = layers * tpl, nblk * bb
    name = unique_shm_name(f"xproc{tpl}")
    seg = n.ShmSegment.create(name, rows * tb)
    fd_path = f"/proc/{os.getpid()}/fd/{seg.fd}"
    try:
        pool = np.frombuffer(seg, dtype=np.uint8).reshape(rows, tb)
        pool[:] = pattern(rows, tb, seed=tpl)
        local0 = pattern(rows, 8 * bb, seed=50 + tpl)
        worker.call(op="alloc", name="local", rows=rows, cols=8 * bb, seed=50 + tpl)
        opened = worker.call(
            op="shm_open", shm=name, fd_path=fd_path, size=seg.size, writable=False
        )
        assert opened["ok"] and not opened["owner"]

        # pull: shm blocks -> the worker's own tensors
        src_blocks, dst_blocks = [15, 0, 1, 2, 9], [0, 4, 5, 6, 7]
        args = layer_range_args(tpl, (1, 3), (0, 2))
        plan = n.Plan.blocks(
            geometry_of(pool, bb), geometry_of(local0, bb), src_blocks, dst_blocks, *args
        )
        reply = worker.call(
            op="shm_copy",
            shm=name,
            shm_tensors=rows,
            tensor_bytes=tb,
            name="local",
            dir="from_shm",
            plan=plan_to_json(plan),
        )
        assert reply["ok"] and reply["bytes_done"] == plan.total_bytes, reply
        worker.call(op="dump", name="local", path=str(tmp_path / "local.npy"))
        got = np.load(tmp_path / "local.npy")
        want = reference_blocks(pool, local0, bb, src_blocks, dst_blocks, *args)
        assert np.array_equal(got, want), differing(got, want)

        # push: the worker's tensors -> shm blocks, seen through this process's mapping
        worker.call(op="shm_close", shm=name)
        opened = worker.call(op="shm_open", shm=name, fd_path=fd_path, size=seg.size, writable=True)
        assert opened["ok"]
        back = n.Plan.blocks(
            geometry_of(local0, bb), geometry_of(pool, bb), [0, 1, 2], [12, 13, 3], 0, 0, rows
        )
        want = reference_blocks(got, pool, bb, [0, 1, 2], [12, 13, 3], 0, 0, rows)
        reply = worker.call(
            op="shm_copy",
            shm=name,
            shm_tensors=rows,
            tensor_bytes=tb,
            name="local",
            dir="to_shm",
            plan=plan_to_json(back),
        )
        assert reply["ok"] and reply["bytes_done"] == back.total_bytes, reply
        assert np.array_equal(pool, want), differing(pool, want)
        del pool
        worker.call(op="shm_close", shm=name)
    finally:
        seg.close()


def test_segment_outlives_its_killed_creator_only_while_mapped(worker: Worker) -> None:
    # The worker creates, the parent maps, the worker dies: the parent's mapping stays
    # valid, and nothing of the worker's is left in /dev/shm.
    before = dev_shm_entries()
    name = unique_shm_name("orphan")
    reply = worker.call(op="shm_create", shm=name, size=8192, fill=3)
    assert reply["ok"], reply
    fd = os.open(f"/proc/{worker.pid}/fd/{reply['fd']}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        seg = n.ShmSegment.from_fd(fd, 8192, writable=False)
    finally:
        os.close(fd)
    worker.kill()
    view = np.frombuffer(seg, dtype=np.uint8)
    assert (view == 3).all()
    del view
    seg.close()
    assert not {e for e in dev_shm_entries() - before if "aiodd" in e}


def test_a_hostile_creator_cannot_shrink_what_we_map(worker: Worker) -> None:
    """The peer that owns a segment we map tries to truncate it: EPERM, and our reads of
    every page keep working (before the seals, this was a SIGBUS that killed us)."""
    name = unique_shm_name("hostile")
    size = 16 * 4096
    reply = worker.call(op="shm_create", shm=name, size=size, fill=0x77)
    assert reply["ok"], reply
    fd = os.open(f"/proc/{worker.pid}/fd/{reply['fd']}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        seg = n.ShmSegment.from_fd(fd, size, writable=False)
    finally:
        os.close(fd)
    try:
        for cut in (0, 4096, size - 1):
            r = worker.call(op="shm_truncate", shm=name, size=cut)
            assert not r["ok"] and r["errno"] == errno.EPERM, r
        dst = np.zeros((1, size), dtype=np.uint8)
        plan = n.Plan.blocks(n.Geometry(1, 16, 4096), n.Geometry(1, 16, 4096), list(range(16)),
                             list(range(16)), 0, 0, 1)
        n.copy_local(plan, [seg.addr], [dst.ctypes.data], n.Control())
        assert (dst == 0x77).all()
    finally:
        seg.close()


# ------------------------------------------------------------------ leases


@pytest.fixture
def page() -> Iterator[n.ShmSegment]:
    seg = n.ShmSegment.create(unique_shm_name("lease"), 64 * n.LEASE_SLOT_BYTES)
    yield seg
    seg.close()


def test_lease_constants() -> None:
    assert n.LEASE_SLOT_BYTES == 16 and n.LEASE_REVOKED == REVOKED


def test_lease_enter_exit_publish(page: n.ShmSegment) -> None:
    a = page.addr + 3 * 16
    assert n.lease_gen(a) == 0 and n.lease_readers(a) == 0
    assert not n.lease_enter(a, 5)  # empty slot: nothing to enter
    assert n.lease_readers(a) == 0  # a refused enter leaves no reader behind
    n.lease_publish(a, 5)
    assert n.lease_enter(a, 5) and n.lease_enter(a, 5)
    assert n.lease_readers(a) == 2
    assert not n.lease_enter(a, 4) and n.lease_readers(a) == 2
    n.lease_exit(a)
    n.lease_exit(a)
    assert n.lease_readers(a) == 0
    # Neighbouring slots are untouched.
    assert n.lease_gen(a - 16) == 0 and n.lease_gen(a + 16) == 0
    assert n.lease_revoke(a, 0.0)  # no reader: at once
    assert n.lease_gen(a) == 5 | REVOKED
    assert not n.lease_enter(a, 5)
    with raises(Status.PARAM_INVALID, "misaligned"):
        n.lease_enter(a + 1, 5)
    with raises(Status.PARAM_INVALID, "timeout"):
        n.lease_revoke(a, -1.0)


def test_revoke_waits_for_a_reader_on_another_thread(page: n.ShmSegment) -> None:
    a = page.addr
    n.lease_publish(a, 7)
    assert n.lease_enter(a, 7)
    started = time.monotonic()
    revoke = Background(n.lease_revoke, a, 20.0)
    deadline = time.monotonic() + 10
    while n.lease_gen(a) != 7 | REVOKED:  # the revoker marked it and now sleeps
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert not n.lease_enter(a, 7)  # a new reader is refused while it waits
    time.sleep(0.2)
    assert revoke.finished_at is None  # still waiting for our reader
    n.lease_exit(a)  # wakes it through the futex
    assert revoke.join(10) is True
    assert revoke.finished_at is not None and revoke.finished_at - started < 15
    assert n.lease_readers(a) == 0 and n.lease_gen(a) == 7 | REVOKED


def test_revoke_times_out_and_restores(page: n.ShmSegment) -> None:
    a = page.addr + 16
    n.lease_publish(a, 11)
    assert n.lease_enter(a, 11)
    t0 = time.monotonic()
    assert n.lease_revoke(a, 0.2) is False
    assert time.monotonic() - t0 >= 0.1  # it did wait for the bound (half of it at least)
    assert n.lease_gen(a) == 11  # restored: the lease stands
    assert n.lease_enter(a, 11)
    n.lease_exit(a)
    n.lease_exit(a)
    assert n.lease_readers(a) == 0


def test_revoke_releases_the_gil(page: n.ShmSegment) -> None:
    a = page.addr
    n.lease_publish(a, 1)
    assert n.lease_enter(a, 1)
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        assert n.lease_revoke(a, 0.3) is False
    finally:
        stop.set()
        t.join(5)
        n.lease_exit(a)
    assert ticks > 10


def test_revoke_is_woken_by_a_reader_in_another_process(page: n.ShmSegment) -> None:
    """The slot is shared (MAP_SHARED memfd): a forked reader's exit wakes our revoke
    (a shared futex, not a private one)."""
    a = page.addr + 5 * 16
    n.lease_publish(a, 21)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: enter, tell the parent, hold the lease a while, exit
        try:
            ok = n.lease_enter(a, 21)
            os.write(w, b"1" if ok else b"0")
            time.sleep(0.5)
            n.lease_exit(a)
        finally:
            os._exit(0)
    try:
        os.close(w)
        assert os.read(r, 1) == b"1"
        assert n.lease_readers(a) == 1
        t0 = time.monotonic()
        assert n.lease_revoke(a, 20.0) is True
        assert time.monotonic() - t0 < 15
        assert n.lease_readers(a) == 0
    finally:
        os.close(r)
        _reap(pid)


def _reap(pid: int, timeout: float = 10.0) -> None:
    """Waits (bounded) for a forked child, killing it at the bound."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
