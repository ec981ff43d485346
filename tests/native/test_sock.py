"""Socket movers: segments sent straight from source memory and received straight into
destination segments, over socketpairs (threads) and TCP loopback (two processes)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import signal
import socket
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
    abort_after,
    accept_streams,
    bases,
    differing,
    geometry_of,
    layer_range_args,
    pattern,
    plan_to_json,
    raises,
    reference_blocks,
    tcp_listener,
)

CHUNK = n.CHUNK_BYTES
BB = 2048
PROMPT = 2.0  # generous bound for "returns promptly"
TAG = 7  # the transfer tag both ends of these tests use (the worker's default too)
HDR = n.SOCK_HEADER_BYTES


def send(fds: list[int], plan: n.Plan, src: list[int], ctl: n.Control, tag: int = TAG) -> None:
    n.sock_send(fds, plan, src, ctl, tag=tag)


def recv(fds: list[int], plan: n.Plan, dst: list[int], ctl: n.Control, tag: int = TAG) -> None:
    n.sock_recv(fds, plan, dst, ctl, tag=tag)


@contextlib.contextmanager
def socketpairs(count: int) -> Iterator[tuple[list[socket.socket], list[socket.socket]]]:
    pairs = [socket.socketpair() for _ in range(count)]
    try:
        yield [a for a, _ in pairs], [b for _, b in pairs]
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def fds(socks: list[socket.socket]) -> list[int]:
    return [s.fileno() for s in socks]


def block_case(
    tpl: int, seed: int, nblk: int = 24, bb: int = BB
) -> tuple[np.ndarray, np.ndarray, n.Plan, np.ndarray]:
    """src/dst tensors (3 layers x tpl), a plan of layers [1, 3) -> [0, 2), and the expected dst."""
    src = pattern(3 * tpl, nblk * bb, seed=seed)
    dst = pattern(3 * tpl, 16 * bb, seed=seed + 1)
    src_blocks = [nblk - 1, 0, 1, 2, 9, 5]
    dst_blocks = [4, 7, 8, 9, 15, 0]
    args = layer_range_args(tpl, (1, 3), (0, 2))
    plan = n.Plan.blocks(geometry_of(src, bb), geometry_of(dst, bb), src_blocks, dst_blocks, *args)
    return src, dst, plan, reference_blocks(src, dst, bb, src_blocks, dst_blocks, *args)


def transfer_in_process(
    plan: n.Plan, src: np.ndarray, dst: np.ndarray, streams: int
) -> tuple[int, int]:
    with socketpairs(streams) as (tx, rx):
        send_ctl, recv_ctl = n.Control(), n.Control()
        sender = Background(send, fds(tx), plan, bases(src), send_ctl)
        recv(fds(rx), plan, bases(dst), recv_ctl)
        sender.join()
    assert send_ctl.total == recv_ctl.total == plan.total_bytes
    return send_ctl.bytes_done, recv_ctl.bytes_done


# ------------------------------------------------------------------ in-process (socketpair)


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("tpl", [1, 2, 4])
def test_socketpair_matches_numpy_reference(tpl: int, streams: int) -> None:
    src, dst, plan, want = block_case(tpl, seed=tpl)
    sent, received = transfer_in_process(plan, src, dst, streams)
    assert np.array_equal(dst, want), differing(dst, want)
    assert sent == received == plan.total_bytes


@pytest.mark.parametrize("streams", [1, 2, 3])
def test_large_transfer_with_partial_writes(streams: int) -> None:
    # 24 MiB, far more than a socket buffer: every sendmsg/readv is partial at times,
    # and the stream split cuts segments in the middle.
    bb, nblk = 96 << 10, 256
    src = pattern(1, nblk * bb, seed=9)
    dst = np.zeros_like(src)
    perm = np.random.default_rng(1).permutation(nblk).tolist()
    g = geometry_of(src, bb)
    plan = n.Plan.blocks(g, g, list(range(nblk)), perm, 0, 0, 1)
    want = reference_blocks(src, dst, bb, list(range(nblk)), perm, 0, 0, 1)
    sent, received = transfer_in_process(plan, src, dst, streams)
    assert np.array_equal(dst, want), differing(dst, want)
    assert sent == received == plan.total_bytes


def test_more_segments_than_iov_max() -> None:
    bb, nblk = 32, 4000
    src = pattern(2, nblk * bb, seed=3)
    dst = pattern(2, nblk * bb, seed=4)
    src_blocks = list(range(0, nblk, 2))
    dst_blocks = list(range(1, nblk, 2))
    g = geometry_of(src, bb)
    plan = n.Plan.blocks(g, g, src_blocks, dst_blocks, 0, 0, 2)
    assert plan.num_segments == 2 * len(src_blocks) > 2 * n.IOV_MAX
    want = reference_blocks(src, dst, bb, src_blocks, dst_blocks, 0, 0, 2)
    sent, received = transfer_in_process(plan, src, dst, 1)
    assert np.array_equal(dst, want), differing(dst, want)
    assert sent == received == plan.total_bytes


def test_blocking_mode_of_the_fds_is_restored() -> None:
    src, dst, plan, _ = block_case(1, seed=5)
    with socketpairs(1) as (tx, rx):
        rx[0].setblocking(False)
        send_ctl = n.Control()
        sender = Background(send, fds(tx), plan, bases(src), send_ctl)
        recv(fds(rx), plan, bases(dst), n.Control())
        sender.join()
        assert not fcntl.fcntl(tx[0].fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
        assert fcntl.fcntl(rx[0].fileno(), fcntl.F_GETFL) & os.O_NONBLOCK


def test_signals_during_a_blocked_recv_are_survived() -> None:
    # Signals interrupt poll() with EINTR; the mover must carry on and finish.
    src, dst, plan, want = block_case(2, seed=6)
    hits: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    main = threading.get_ident()

    def late_sender(tx: list[socket.socket]) -> None:
        for _ in range(5):
            time.sleep(0.02)
            signal.pthread_kill(main, signal.SIGUSR1)
        send(fds(tx), plan, bases(src), n.Control())

    try:
        with socketpairs(1) as (tx, rx):
            sender = Background(late_sender, tx)
            ctl = n.Control()
            recv(fds(rx), plan, bases(dst), ctl)
            sender.join()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert np.array_equal(dst, want), differing(dst, want)
    assert ctl.bytes_done == plan.total_bytes
    assert hits, "the signal handler never ran"


# ------------------------------------------------------------------ peer close, abort


def test_peer_close_mid_recv_is_peer_closed() -> None:
    _, dst, plan, _ = block_case(4, seed=7)
    part = plan.total_bytes // 3
    with socketpairs(1) as (tx, rx):
        tx[0].sendall(n.sock_header(TAG, plan.total_bytes) + b"x" * part)
        tx[0].close()
        ctl = n.Control()
        start = time.monotonic()
        with raises(Status.PEER_CLOSED, f"after {part} of {plan.total_bytes} bytes"):
            recv(fds(rx), plan, bases(dst), ctl)
    assert time.monotonic() - start < PROMPT
    assert ctl.bytes_done == part


def test_peer_close_mid_send_is_peer_closed() -> None:
    size = 64 << 20
    src = np.zeros((1, size), dtype=np.uint8)
    g = n.Geometry(1, size >> 20, 1 << 20)
    plan = n.Plan.blocks(g, g, list(range(g.num_blocks)), list(range(g.num_blocks)), 0, 0, 1)
    with socketpairs(1) as (tx, rx):
        ctl = n.Control()
        sender = Background(send, fds(tx), plan, bases(src), ctl)
        got = 0
        while got < HDR + 1000:  # the header and some payload: the sender is mid-transfer
            chunk = rx[0].recv(HDR + 1000 - got)
            assert chunk, "the sender closed early"
            got += len(chunk)
        rx[0].close()
        err = sender.join_error(PROMPT * 5)
    assert isinstance(err, n.NativeError) and err.status == Status.PEER_CLOSED, err
    assert "peer closed" in str(err)
    assert 0 < ctl.bytes_done < size


def test_abort_during_blocked_recv_returns_promptly() -> None:
    _, dst, plan, _ = block_case(1, seed=8)
    before = dst.copy()
    with socketpairs(2) as (_tx, rx):
        ctl = n.Control()
        timer = threading.Timer(0.2, ctl.abort)
        start = time.monotonic()
        timer.start()
        try:
            with raises(Status.ABORTED):
                recv(fds(rx), plan, bases(dst), ctl)  # the peer sends nothing
        finally:
            timer.cancel()
            timer.join()
        elapsed = time.monotonic() - start
    assert 0.1 <= elapsed < PROMPT, elapsed  # it blocked: half the 0.2 s at least
    assert ctl.bytes_done == 0
    assert np.array_equal(dst, before)


def test_abort_during_blocked_send_returns_promptly() -> None:
    size = 32 << 20
    src = np.zeros((1, size), dtype=np.uint8)
    g = n.Geometry(1, size >> 20, 1 << 20)
    plan = n.Plan.blocks(g, g, list(range(g.num_blocks)), list(range(g.num_blocks)), 0, 0, 1)
    with socketpairs(1) as (tx, _rx):
        ctl = n.Control()
        timer = threading.Timer(0.2, ctl.abort)
        start = time.monotonic()
        timer.start()
        try:
            with raises(Status.ABORTED):
                send(fds(tx), plan, bases(src), ctl)  # nobody reads
        finally:
            timer.cancel()
            timer.join()
        elapsed = time.monotonic() - start
    assert 0.1 <= elapsed < PROMPT, elapsed  # it blocked: half the 0.2 s at least
    assert 0 < ctl.bytes_done < size


def test_abort_mid_transfer_stops_within_one_chunk() -> None:
    size = 128 << 20
    src = np.zeros((1, size), dtype=np.uint8)
    dst = np.ones((1, size), dtype=np.uint8)
    g = n.Geometry(1, size >> 20, 1 << 20)
    plan = n.Plan.blocks(g, g, list(range(g.num_blocks)), list(range(g.num_blocks)), 0, 0, 1)
    with socketpairs(1) as (tx, rx):
        send_ctl, recv_ctl = n.Control(), n.Control()
        sender = Background(send, fds(tx), plan, bases(src), send_ctl)
        receiver = Background(recv, fds(rx), plan, bases(dst), recv_ctl)
        at_abort = abort_after(recv_ctl, 2 * CHUNK)
        err = receiver.join_error()
        send_ctl.abort()
        sender.join_error()
    assert isinstance(err, n.NativeError) and err.status == Status.ABORTED, err
    done = recv_ctl.bytes_done
    assert at_abort <= done <= at_abort + CHUNK and done < size, (at_abort, done)
    assert not dst[0, :done].any() and dst[0, done:].all()


def test_abort_before_start_sends_nothing() -> None:
    src, _, plan, _ = block_case(1, seed=9)
    with socketpairs(1) as (tx, rx):
        ctl = n.Control()
        ctl.abort()
        with raises(Status.ABORTED):
            send(fds(tx), plan, bases(src), ctl)
        rx[0].setblocking(False)
        with pytest.raises(BlockingIOError):
            rx[0].recv(1)
    assert ctl.bytes_done == 0


# ------------------------------------------------------------------ transfer identity


def test_stream_header_layout() -> None:
    # magic, tag (u64 LE), the stream's payload bytes (u64 LE): both ends build it natively.
    h = n.sock_header(0x0102030405060708, 4096)
    assert len(h) == HDR == 24
    assert h[:8] == b"AIODDST1"
    assert int.from_bytes(h[8:16], "little") == 0x0102030405060708
    assert int.from_bytes(h[16:24], "little") == 4096


def test_recv_refuses_another_transfers_stream_and_writes_nothing() -> None:
    # The sender sends transfer 41's bytes (a full, valid stream); the receiver waits for
    # transfer 42 on that stream: it must fail before writing a byte of 41's payload.
    src, dst, plan, _ = block_case(1, seed=21)
    before = dst.copy()
    with socketpairs(1) as (tx, rx):
        sender = Background(send, fds(tx), plan, bases(src), n.Control(), 41)
        ctl = n.Control()
        with raises(Status.STALE, "carries transfer 41, not transfer 42"):
            recv(fds(rx), plan, bases(dst), ctl, tag=42)
        rx[0].close()  # the sender may still be writing 41's payload
        sender.join_error()
    assert ctl.bytes_done == 0
    assert np.array_equal(dst, before), differing(dst, before)


def test_recv_refuses_a_header_with_another_byte_count() -> None:
    _, dst, plan, _ = block_case(1, seed=22)
    before = dst.copy()
    with socketpairs(1) as (tx, rx):
        tx[0].sendall(n.sock_header(TAG, plan.total_bytes - 1) + b"\xee" * plan.total_bytes)
        with raises(Status.STALE, f"announces {plan.total_bytes - 1} bytes"):
            recv(fds(rx), plan, bases(dst), n.Control())
    assert np.array_equal(dst, before), differing(dst, before)


def test_recv_refuses_a_stream_out_of_step() -> None:
    # Payload bytes where a header should start (a stream that lost its place).
    _, dst, plan, _ = block_case(1, seed=23)
    before = dst.copy()
    with socketpairs(2) as (tx, rx):
        for t in tx:
            t.sendall(b"\xee" * (HDR + 1000))
        with raises(Status.STALE, "out of step"):
            recv(fds(rx), plan, bases(dst), n.Control())
    assert np.array_equal(dst, before), differing(dst, before)


def test_stale_bytes_ahead_of_the_awaited_transfer_are_never_delivered() -> None:
    # The tcp failure mode this guards against: transfer 5 was given up by the receiver,
    # but its sender still wrote it on the stream; the receiver's next transfer (6) must
    # not take 5's bytes as its own.
    src, dst, plan, _ = block_case(2, seed=24)
    other = pattern(src.shape[0], src.shape[1], seed=99)
    before = dst.copy()
    with socketpairs(2) as (tx, rx):
        old = Background(send, fds(tx), plan, bases(other), n.Control(), 5)
        with raises(Status.STALE, "carries transfer 5, not transfer 6"):
            recv(fds(rx), plan, bases(dst), n.Control(), tag=6)
        for r in rx:
            r.close()
        old.join_error()
    assert np.array_equal(dst, before), differing(dst, before)


def test_header_then_close_is_peer_closed() -> None:
    _, dst, plan, _ = block_case(1, seed=25)
    with socketpairs(1) as (tx, rx):
        tx[0].sendall(n.sock_header(TAG, plan.total_bytes)[:10])
        tx[0].close()
        with raises(Status.PEER_CLOSED, "before the transfer's stream header"):
            recv(fds(rx), plan, bases(dst), n.Control())


# ------------------------------------------------------------------ bad arguments


def test_bad_arguments() -> None:
    src, dst, plan, _ = block_case(1, seed=10)
    with raises(Status.PARAM_INVALID, "no socket fds"):
        send([], plan, bases(src), n.Control())
    with raises(Status.PARAM_INVALID, "negative"):
        recv([-1], plan, bases(dst), n.Control())
    with raises(Status.PARAM_INVALID, "source addresses"):
        send([0], plan, [], n.Control())
    with raises(Status.PARAM_INVALID, "destination addresses"):
        recv([0], plan, [], n.Control())
    with raises(Status.PARAM_INVALID, "expected 3 destination addresses, got 2"):
        recv([0], plan, bases(dst)[:2], n.Control())
    # Not a just-closed fd: its number could be handed out again before the call
    # (to the very eventfd of a Control), and the mover would wait on that.
    closed_fd = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 1
    with pytest.raises(OSError):
        os.fstat(closed_fd)
    ctl = n.Control()
    with raises(Status.PARAM_INVALID, "not a connected stream socket"):
        recv([closed_fd], plan, bases(dst), ctl)
    # A descriptor that is open but not a socket (here an eventfd-like pipe end)
    # is refused up front instead of being waited on forever.
    r, w = os.pipe()
    try:
        with raises(Status.PARAM_INVALID, "not a connected stream socket"):
            recv([r], plan, bases(dst), n.Control())
    finally:
        os.close(r)
        os.close(w)


# ------------------------------------------------------------------ two processes (TCP loopback)


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_tcp_between_processes(
    shared_worker: Worker, tmp_path: Path, streams: int, direction: str
) -> None:
    tpl, bb, nblk = 2, 16 << 10, 64
    rows = 3 * tpl
    # pull: the worker holds the source and sends; push: this process sends to the worker.
    src_seed, dst_seed = 100 + streams, 200 + streams
    src = pattern(rows, nblk * bb, seed=src_seed)
    dst = pattern(rows, nblk * bb, seed=dst_seed)
    rng = np.random.default_rng(streams)
    src_blocks = rng.permutation(nblk)[:40].tolist()
    dst_blocks = sorted(rng.permutation(nblk)[:40].tolist())
    args = layer_range_args(tpl, (0, 2), (1, 3))
    g = geometry_of(src, bb)
    plan = n.Plan.blocks(g, g, src_blocks, dst_blocks, *args)
    want = reference_blocks(src, dst, bb, src_blocks, dst_blocks, *args)
    name = f"tcp-{direction}-{streams}"
    shared_worker.call(
        op="alloc",
        name=name,
        rows=rows,
        cols=nblk * bb,
        seed=src_seed if direction == "pull" else dst_seed,
    )

    with contextlib.closing(tcp_listener()) as lst:
        port = lst.getsockname()[1]
        shared_worker.send(
            op="sock",
            dir="send" if direction == "pull" else "recv",
            port=port,
            streams=streams,
            plan=plan_to_json(plan),
            name=name,
        )
        conns = accept_streams(lst, streams)
        try:
            ctl = n.Control()
            if direction == "pull":
                recv(fds(conns), plan, bases(dst), ctl)
            else:
                send(fds(conns), plan, bases(src), ctl)
        finally:
            for c in conns:
                c.close()
    reply = shared_worker.recv()
    assert reply["ok"], reply
    assert reply["bytes_done"] == reply["total"] == ctl.bytes_done == plan.total_bytes

    if direction == "pull":
        got = dst
    else:
        shared_worker.call(op="dump", name=name, path=str(tmp_path / "d.npy"))
        got = np.load(tmp_path / "d.npy")
    assert np.array_equal(got, want), differing(got, want)


def test_tcp_more_segments_than_iov_max(shared_worker: Worker) -> None:
    bb, nblk = 16, 5000
    src = pattern(1, nblk * bb, seed=300)
    dst = np.zeros_like(src)
    src_blocks = list(range(0, nblk, 2))
    dst_blocks = list(range(nblk - 1, 0, -2))
    g = geometry_of(src, bb)
    plan = n.Plan.blocks(g, g, src_blocks, dst_blocks, 0, 0, 1)
    assert plan.num_segments > 2 * n.IOV_MAX
    shared_worker.call(op="alloc", name="tcp-iov", rows=1, cols=nblk * bb, seed=300)
    with contextlib.closing(tcp_listener()) as lst:
        shared_worker.send(
            op="sock",
            dir="send",
            port=lst.getsockname()[1],
            streams=2,
            plan=plan_to_json(plan),
            name="tcp-iov",
        )
        conns = accept_streams(lst, 2)
        try:
            recv(fds(conns), plan, bases(dst), n.Control())
        finally:
            for c in conns:
                c.close()
    assert shared_worker.recv()["ok"]
    want = reference_blocks(src, np.zeros_like(src), bb, src_blocks, dst_blocks, 0, 0, 1)
    assert np.array_equal(dst, want), differing(dst, want)


def test_tcp_peer_killed_mid_recv_is_peer_closed(worker: Worker) -> None:
    _, dst, plan, _ = block_case(2, seed=11)
    part = plan.total_bytes // 2
    worker.call(op="alloc", name="s", rows=1, cols=part, seed=1)
    with contextlib.closing(tcp_listener()) as lst:
        worker.send(
            op="send_raw",
            port=lst.getsockname()[1],
            name="s",
            nbytes=part,
            header=[TAG, plan.total_bytes],
        )
        (conn,) = accept_streams(lst, 1)
        with conn:
            assert worker.recv()["ok"]
            killer = threading.Timer(0.2, worker.kill)
            killer.start()
            ctl = n.Control()
            start = time.monotonic()
            try:
                with raises(Status.PEER_CLOSED, f"after {part} of"):
                    recv([conn.fileno()], plan, bases(dst), ctl)
            finally:
                killer.cancel()
                killer.join()
            assert time.monotonic() - start < PROMPT + 5
    assert ctl.bytes_done == part


def test_tcp_peer_killed_mid_send_is_peer_closed(worker: Worker) -> None:
    size = 64 << 20
    src = np.zeros((1, size), dtype=np.uint8)
    g = n.Geometry(1, size >> 20, 1 << 20)
    plan = n.Plan.blocks(g, g, list(range(g.num_blocks)), list(range(g.num_blocks)), 0, 0, 1)
    with contextlib.closing(tcp_listener()) as lst:
        worker.send(op="connect_idle", port=lst.getsockname()[1])
        (conn,) = accept_streams(lst, 1)
        with conn:
            assert worker.recv()["ok"]
            ctl = n.Control()
            sender = Background(send, [conn.fileno()], plan, bases(src), ctl)
            abort_after_fill = time.monotonic() + 10
            while ctl.bytes_done == 0 and time.monotonic() < abort_after_fill:
                time.sleep(0.01)
            worker.kill()
            err = sender.join_error(PROMPT + 5)
    assert isinstance(err, n.NativeError) and err.status == Status.PEER_CLOSED, err
    assert 0 < ctl.bytes_done < size
