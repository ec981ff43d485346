"""Shared-memory segments: create / map / unmap, mapped by name from another process,
with copy_local moving planned blocks in and out of them."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from _helpers import (
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

from aiodatadist import _native as n
from aiodatadist._native import Status


def shm_path(name: str) -> Path:
    return Path("/dev/shm") / name.lstrip("/")


def test_create_open_close() -> None:
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
        assert seg.addr != 0 and shm_path(name).exists()
        view = np.frombuffer(seg, dtype=np.uint8)
        assert view.flags.writeable and view.size == seg.size and not view.any()
        data = pattern(1, seg.size, seed=1)[0]
        view[:] = data

        other = n.ShmSegment.open(name, seg.size)  # read-only by default
        assert (other.owner, other.writable) == (False, False) and other.addr != seg.addr
        oview = np.frombuffer(other, dtype=np.uint8)
        assert not oview.flags.writeable
        assert np.array_equal(oview, data)
        del oview
        other.close()
        other.unlink()  # a non-owner never unlinks
        assert other.closed and shm_path(name).exists()
        del view
    finally:
        seg.close()
    assert seg.closed and not shm_path(name).exists()
    seg.close()  # idempotent
    assert "closed" in repr(seg)
    with pytest.raises(BufferError):
        np.frombuffer(seg, dtype=np.uint8)


def test_unlink_keeps_the_mapping() -> None:
    name = unique_shm_name("unlink")
    seg = n.ShmSegment.create(name, 4096)
    try:
        seg.unlink()
        assert not shm_path(name).exists() and not seg.closed
        view = np.frombuffer(seg, dtype=np.uint8)
        view[:] = 7
        assert view.sum() == 7 * 4096
        del view
        with raises(Status.PARAM_INVALID, name) as info:
            n.ShmSegment.open(name, 4096)
        assert info.value.errno == errno.ENOENT
    finally:
        seg.close()


@pytest.mark.parametrize("bad", ["noslash", "/", "/a/b", "/" + "x" * 251, ""])
def test_rejects_bad_names(bad: str) -> None:
    with raises(Status.PARAM_INVALID, "shm name", f"'{bad}'"):
        n.ShmSegment.create(bad, 4096)
    with raises(Status.PARAM_INVALID, "shm name"):
        n.ShmSegment.open(bad, 4096)


def test_rejects_zero_size() -> None:
    with raises(Status.PARAM_INVALID, "size"):
        n.ShmSegment.create(unique_shm_name("zero"), 0)


def test_rejects_existing_name() -> None:
    name = unique_shm_name("dup")
    seg = n.ShmSegment.create(name, 4096)
    try:
        with raises(Status.IO_ERROR, name, "exists") as info:
            n.ShmSegment.create(name, 4096)
        assert info.value.errno == errno.EEXIST
        assert not seg.closed and shm_path(name).exists()  # the first one is untouched
    finally:
        seg.close()


def test_open_rejects_missing_and_short_segments() -> None:
    name = unique_shm_name("short")
    with raises(Status.PARAM_INVALID, name, "No such file"):
        n.ShmSegment.open(name, 4096)
    seg = n.ShmSegment.create(name, 4096)
    try:
        with raises(Status.OUT_OF_RANGE, "holds 4096 bytes", "8192 expected"):
            n.ShmSegment.open(name, 8192)
        with raises(Status.OUT_OF_RANGE, "0 expected"):
            n.ShmSegment.open(name, 0)
        smaller = n.ShmSegment.open(name, 100)
        assert smaller.size == 100
        smaller.close()
    finally:
        seg.close()


# ------------------------------------------------------------------ two processes


@pytest.mark.parametrize("tpl", [1, 2, 4])
def test_another_process_reads_and_writes_by_name(worker: Worker, tmp_path: Path, tpl: int) -> None:
    """The prompt side creates a pool segment holding its tensors end to end; the decoder
    side maps it by name and copies planned blocks out of it (and back into it)."""
    layers, bb, nblk = 3, 4096, 16
    rows, tb = layers * tpl, nblk * bb
    name = unique_shm_name(f"xproc{tpl}")
    seg = n.ShmSegment.create(name, rows * tb)
    try:
        pool = np.frombuffer(seg, dtype=np.uint8).reshape(rows, tb)
        pool[:] = pattern(rows, tb, seed=tpl)
        local0 = pattern(rows, 8 * bb, seed=50 + tpl)
        worker.call(op="alloc", name="local", rows=rows, cols=8 * bb, seed=50 + tpl)
        opened = worker.call(op="shm_open", shm=name, size=seg.size, writable=False)
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
        assert worker.call(op="shm_open", shm=name, size=seg.size, writable=True)["ok"]
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
    reply = worker.call(op="shm_open", shm=name, size=4096, writable=False)
    assert (
        not reply["ok"]
        and reply["status"] == Status.PARAM_INVALID
        and reply["errno"] == errno.ENOENT
    )


def test_segment_outlives_its_creator_only_while_mapped(worker: Worker) -> None:
    # The worker creates, the parent maps, the worker dies: the parent's mapping stays valid.
    name = unique_shm_name("orphan")
    try:
        reply = worker.call(op="shm_create", shm=name, size=8192, fill=3)
        assert reply["ok"], reply
        seg = n.ShmSegment.open(name, 8192, writable=False)
        worker.kill()
        view = np.frombuffer(seg, dtype=np.uint8)
        assert (view == 3).all()
        del view
        seg.close()
    finally:
        if shm_path(name).exists():  # the creator was killed before it could unlink
            os.unlink(shm_path(name))
