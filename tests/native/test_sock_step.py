"""``SockStep``: one stream of a small socket transfer, moved in non-blocking steps.

The loop-driven tcp path (``transports.tcp_streams.LoopMove``) moves tiny transfers
with it on both sides. It must speak exactly the stream format of ``sock_send`` /
``sock_recv`` (either end may be the threaded mover), check the header before a payload
byte lands, never wait, and fail like the threaded movers. ``run`` (a worker thread
taking a stream request's bigger answer) waits between steps, and ends at its control's
abort.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from collections.abc import Iterator

import numpy as np

from aiodatadist import _native as n
from aiodatadist._native import Status
from tests.native._helpers import (
    Background,
    bases,
    differing,
    geometry_of,
    pattern,
    raises,
    reference_blocks,
)

BB = 4096
TAG = 11


@contextlib.contextmanager
def pair(buf: int | None = None) -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        if buf is not None:  # small buffers: every step is partial
            for s in (a, b):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf)
        yield a, b
    finally:
        a.close()
        b.close()


def case(seed: int, nblk: int = 32) -> tuple[np.ndarray, np.ndarray, n.Plan, np.ndarray]:
    """Two tensors of ``nblk`` blocks; a scattered plan of 6 blocks of both; the expected dst."""
    src = pattern(2, nblk * BB, seed=seed)
    dst = pattern(2, nblk * BB, seed=seed + 100)
    src_blocks, dst_blocks = [3, 0, 31, 7, 8, 9], [30, 1, 2, 5, 6, 20]
    g = geometry_of(src, BB)
    plan = n.Plan.blocks(g, g, src_blocks, dst_blocks, 0, 0, 2)
    return src, dst, plan, reference_blocks(src, dst, BB, src_blocks, dst_blocks, 0, 0, 2)


def send(fds: list[int], plan: n.Plan, src: list[int]) -> None:
    n.sock_send(fds, plan, src, n.Control(), tag=TAG)


def recv(fds: list[int], plan: n.Plan, dst: list[int]) -> None:
    n.sock_recv(fds, plan, dst, n.Control(), tag=TAG)


def drive(*steps: n.SockStep, bound: float = 10.0) -> int:
    """Steps every mover whenever its socket is ready (one thread, like the event loop),
    until all finish; returns how many steps it took."""
    end = time.monotonic() + bound
    calls = 0
    pending = list(steps)
    while pending:
        assert time.monotonic() < end, "the steps never finished"
        r = [s.fd for s in pending if not s.sending]
        w = [s.fd for s in pending if s.sending]
        select.select(r, w, [], 1.0)
        for s in list(pending):
            calls += 1
            if s.step():
                pending.remove(s)
    return calls


def test_both_ends_stepped_match_the_reference() -> None:
    src, dst, plan, want = case(1)
    with pair() as (a, b):
        tx = n.SockStep(a.fileno(), plan, bases(src), True, tag=TAG)
        rx = n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)
        drive(tx, rx)
    assert np.array_equal(dst, want), differing(dst, want)
    assert tx.finished and rx.finished
    assert tx.bytes_done == rx.bytes_done == tx.total == plan.total_bytes


def test_small_socket_buffers_make_every_step_partial() -> None:
    src, dst, plan, want = case(2)
    with pair(buf=4096) as (a, b):
        tx = n.SockStep(a.fileno(), plan, bases(src), True, tag=TAG)
        rx = n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)
        assert not tx.step()  # the buffer takes a part, and the step returns: no wait
        assert 0 < tx.bytes_done < plan.total_bytes
        calls = drive(tx, rx)
    assert calls > 4
    assert np.array_equal(dst, want), differing(dst, want)


def test_a_stepped_sender_feeds_the_threaded_receiver() -> None:
    src, dst, plan, want = case(3)
    with pair() as (a, b):
        receiver = Background(recv, [b.fileno()], plan, bases(dst))
        drive(n.SockStep(a.fileno(), plan, bases(src), True, tag=TAG))
        receiver.join()
    assert np.array_equal(dst, want), differing(dst, want)


def test_the_threaded_sender_feeds_a_stepped_receiver() -> None:
    src, dst, plan, want = case(4)
    with pair() as (a, b):
        sender = Background(send, [a.fileno()], plan, bases(src))
        drive(n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG))
        sender.join()
    assert np.array_equal(dst, want), differing(dst, want)


def test_a_step_never_waits() -> None:
    _, dst, plan, _ = case(5)
    with pair() as (_a, b):
        rx = n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)
        t0 = time.monotonic()
        assert not rx.step()  # nothing to read: returns at once
        assert time.monotonic() - t0 < 1.0
        assert rx.bytes_done == 0 and not rx.finished


def test_another_transfers_stream_is_refused_before_a_byte_lands() -> None:
    src, dst, plan, _ = case(6)
    before = dst.copy()
    with pair() as (a, b):
        a.sendall(n.sock_header(TAG + 1, plan.total_bytes) + src.tobytes()[: plan.total_bytes])
        rx = n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)
        with raises(Status.STALE, f"carries transfer {TAG + 1}, not transfer {TAG}"):
            drive(rx)
    assert rx.bytes_done == 0
    assert np.array_equal(dst, before), differing(dst, before)


def test_a_header_announcing_other_bytes_is_refused() -> None:
    _, dst, plan, _ = case(7)
    before = dst.copy()
    with pair() as (a, b):
        a.sendall(n.sock_header(TAG, plan.total_bytes + 8) + b"\xee" * 64)
        with raises(Status.STALE, f"announces {plan.total_bytes + 8} bytes"):
            drive(n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG))
    assert np.array_equal(dst, before), differing(dst, before)


def test_peer_closed_mid_stream() -> None:
    _, dst, plan, _ = case(8)
    with pair() as (a, b):
        a.sendall(n.sock_header(TAG, plan.total_bytes) + b"\x01" * 1000)
        a.close()
        rx = n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)
        with raises(Status.PEER_CLOSED, f"after 1000 of {plan.total_bytes} bytes"):
            drive(rx)


def test_sending_to_a_closed_peer_is_peer_closed() -> None:
    src, _, plan, _ = case(9)
    with pair() as (a, b):
        b.close()
        with raises(Status.PEER_CLOSED):
            drive(n.SockStep(a.fileno(), plan, bases(src), True, tag=TAG))


def test_a_descriptor_that_is_not_a_stream_socket_is_refused() -> None:
    src, _, plan, _ = case(10)
    r, w = os.pipe()
    try:
        with raises(Status.PARAM_INVALID, "not a connected stream socket"):
            n.SockStep(w, plan, bases(src), True, tag=TAG)
    finally:
        os.close(r)
        os.close(w)
    with raises(Status.PARAM_INVALID, "negative socket fd"):
        n.SockStep(-1, plan, bases(src), True, tag=TAG)


# ------------------------------------------------------------------ stream requests' answers


def refusal(tag: int, body: bytes) -> bytes:
    return n.SOCK_REFUSAL_MAGIC + tag.to_bytes(8, "little") + len(body).to_bytes(8, "little") + body


def test_a_refusal_of_this_transfer_ends_it_and_writes_nothing() -> None:
    _, dst, plan, _ = case(11)
    before = dst.copy()
    body = b'{"status": 1, "info": "no", "stale": false}'
    with pair(buf=4096) as (a, b):
        # The body comes in two parts: the step waits for all of it, and reads no further.
        a.sendall(refusal(TAG, body)[:30])
        rx = n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)
        assert not rx.step() and not rx.finished
        a.sendall(refusal(TAG, body)[30:] + b"next")
        drive(rx)
        assert rx.refused and rx.refusal == body and rx.bytes_done == 0
        assert b.recv(16) == b"next"  # the stream is still in step after it
    assert np.array_equal(dst, before), differing(dst, before)


def test_a_refusal_of_another_transfer_or_oversized_is_stale() -> None:
    _, dst, plan, _ = case(12)
    before = dst.copy()
    with pair() as (a, b):
        a.sendall(refusal(TAG + 1, b"{}"))
        with raises(Status.STALE, f"refusal of transfer {TAG + 1}, not of transfer {TAG}"):
            drive(n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG))
    with pair() as (a, b):
        big = n.SOCK_MAX_REFUSAL_BYTES + 1
        a.sendall(n.SOCK_REFUSAL_MAGIC + TAG.to_bytes(8, "little") + big.to_bytes(8, "little"))
        with raises(Status.STALE, f"refusal of {big} bytes"):
            drive(n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG))
    assert np.array_equal(dst, before), differing(dst, before)


def test_step_for_waits_at_most_its_bound_then_takes_what_comes() -> None:
    src, dst, plan, want = case(13)
    with pair() as (a, b):
        rx = n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)
        t0 = time.monotonic()
        assert not rx.step_for(20_000)  # nothing comes: False after about 20 ms
        assert 0.015 < time.monotonic() - t0 < 5.0
        sender = Background(send, [a.fileno()], plan, bases(src))
        assert rx.step_for(10_000_000)  # returns as soon as every byte is in
        sender.join()
    assert np.array_equal(dst, want), differing(dst, want)


def test_run_waits_for_every_byte_and_counts_them() -> None:
    """``run`` (a worker thread's whole exchange): sleeps until the bytes come, in parts
    through small buffers, and reports them to its control."""
    src, dst, plan, want = case(14)
    with pair(buf=4096) as (a, b):
        rx = n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)
        ctl = n.Control()
        receiver = Background(rx.run, ctl)
        time.sleep(0.05)  # (nothing sent yet: it waits)
        assert receiver.finished_at is None
        send([a.fileno()], plan, bases(src))
        receiver.join()
    assert np.array_equal(dst, want), differing(dst, want)
    assert rx.finished and ctl.bytes_done == ctl.total == plan.total_bytes


def test_run_takes_over_where_the_steps_left_off() -> None:
    """The loop polls an answer (taking what came), then a worker thread runs the rest."""
    src, dst, plan, want = case(16)
    with pair(buf=4096) as (a, b):
        tx = n.SockStep(a.fileno(), plan, bases(src), True, tag=TAG)
        rx = n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)
        assert not tx.step()  # (buffers this small: a part only)
        assert not rx.step_for(100_000)
        assert 0 < rx.bytes_done < plan.total_bytes
        receiver = Background(rx.run, n.Control())
        drive(tx)
        receiver.join()
    assert np.array_equal(dst, want), differing(dst, want)


def test_run_returns_on_a_refusal_and_ends_aborted_when_its_control_is() -> None:
    _, dst, plan, _ = case(15)
    before = dst.copy()
    with pair() as (a, b):
        rx = n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)
        a.sendall(refusal(TAG, b"{}"))
        rx.run(n.Control())
        assert rx.refused and rx.refusal == b"{}"
    with pair() as (a, b):
        half = plan.total_bytes // 2
        a.sendall(n.sock_header(TAG, plan.total_bytes) + b"\x5a" * half)
        rx = n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)
        ctl = n.Control()
        receiver = Background(rx.run, ctl)
        time.sleep(0.05)  # it took the half that came and waits for the rest
        t0 = time.monotonic()
        ctl.abort()
        with raises(Status.ABORTED):
            receiver.join()
        assert receiver.finished_at is not None and receiver.finished_at - t0 < 1.0
        assert rx.bytes_done == half and not rx.finished
    assert not np.array_equal(dst, before)  # (the half that came landed: out of step now)


def test_plan_segment_bytes_round_trip_and_checks() -> None:
    _, _, plan, _ = case(14)
    raw = n.plan_segment_bytes(plan)
    assert raw == np.ascontiguousarray(plan.segments(), dtype="<u8").tobytes()
    g = plan.src
    again = n.plan_from_segment_bytes(g, plan.dst, b"x" * 8 + raw, 8)
    assert np.array_equal(again.segments(), plan.segments())
    with raises(Status.PARAM_INVALID, "whole number of 40-byte rows"):
        n.plan_from_segment_bytes(g, plan.dst, raw[:-1])
    outside = np.array([[0, g.tensor_bytes, 0, 0, 8]], dtype="<u8").tobytes()
    with raises(Status.OUT_OF_RANGE, "reads outside the source"):
        n.plan_from_segment_bytes(g, plan.dst, outside)
    with raises(Status.PARAM_INVALID, "no segments"):
        n.plan_from_segment_bytes(g, plan.dst, b"")
