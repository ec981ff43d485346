"""``sock_recv_layered``: a tcp layered pull's receiver, and ``plan_striped``, its plan.

A layered tcp pull is one transfer on every stream: the plan is reordered
(``plan_striped``) so that each stream's share (as ``sock_send`` splits a plan) carries
its part of every layer in layer order; the receiver adds 1 to an eventfd for each layer
once every stream's part of it (and of every layer before) has landed, never earlier.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from aiodatadist import _native as n
from aiodatadist._native import Status
from tests.native._helpers import Background, bases, differing, geometry_of, pattern, raises

BB = 4096
TAG = 21
LAYERS, TPL, BLOCKS = 3, 2, 8  # 3 layers of 2 tensors (K, V), 8 blocks each


def _setup(seed: int) -> tuple[np.ndarray, np.ndarray, n.Plan, list[int]]:
    src = pattern(LAYERS * TPL, BLOCKS * BB, seed=seed)
    dst = pattern(LAYERS * TPL, BLOCKS * BB, seed=None)
    g = geometry_of(src, BB)
    plan = n.Plan.blocks(g, g, [1, 4, 6], [0, 7, 2], 0, 0, LAYERS * TPL)
    return src, dst, plan, plan.layer_bounds(0, TPL, LAYERS)


def _payload(src: np.ndarray, plan: n.Plan) -> bytes:
    """The plan's source bytes in its order (what a sender streams)."""
    return b"".join(
        src[st, so : so + nb].tobytes() for st, so, _, _, nb in plan.segments().tolist()
    )


def _count(efd: int) -> int:
    try:
        return int.from_bytes(os.read(efd, 8), "little")
    except BlockingIOError:
        return 0


def test_plan_striped_gives_each_stream_its_part_of_every_layer() -> None:
    _, _, plan, bounds = _setup(1)
    layer_bytes = plan.total_bytes // LAYERS
    got = n.plan_striped(plan, bounds, 2)
    assert got is not None
    striped, ends = got
    assert ends == [layer_bytes // 2 * (k + 1) for k in range(LAYERS)]
    assert striped.total_bytes == plan.total_bytes
    # Stream 0's share (the first half) holds the first half of each layer's tensors.
    half = 0
    for st, _, dt, _, nb in striped.segments().tolist():
        if half < plan.total_bytes // 2:
            assert st == dt and st % TPL == 0, (st, dt)  # (each layer: K first, then V)
        half += nb
    assert n.plan_striped(plan, bounds, 7) is None  # a layer's bytes do not divide by 7


def test_layers_are_signalled_once_every_stream_delivered_them() -> None:
    src, dst, plan, bounds = _setup(2)
    got = n.plan_striped(plan, bounds, 2)
    assert got is not None
    striped, ends = got
    data = _payload(src, striped)
    share = len(data) // 2
    parts = [data[:share], data[share:]]
    pairs = [socket.socketpair() for _ in range(2)]
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        fds = [b.fileno() for _, b in pairs]
        rx = Background(
            lambda: n.sock_recv_layered(
                fds, striped, bases(dst), n.Control(), tag=TAG, ends=ends, efd=efd
            )
        )
        head = [n.sock_header(TAG, share)] * 2
        # Stream 0 delivers all its layers, stream 1 only layer 0's part: one layer.
        pairs[0][0].sendall(head[0] + parts[0])
        pairs[1][0].sendall(head[1] + parts[1][: ends[0]])
        deadline = time.monotonic() + 10
        landed = 0
        while landed < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
            landed += _count(efd)
        time.sleep(0.05)  # (no more may come)
        landed += _count(efd)
        assert landed == 1, landed
        pairs[1][0].sendall(parts[1][ends[0] :])
        rx.join()
        assert landed + _count(efd) == LAYERS
    finally:
        os.close(efd)
        for a, b in pairs:
            a.close()
            b.close()
    want = dst.copy()
    for st, so, dt, do, nb in plan.segments().tolist():
        want[dt, do : do + nb] = src[st, so : so + nb]
    assert np.array_equal(dst, want), differing(dst, want)


def test_the_threaded_sender_feeds_the_layered_receiver() -> None:
    src, dst, plan, bounds = _setup(3)
    got = n.plan_striped(plan, bounds, 2)
    assert got is not None
    striped, ends = got
    pairs = [socket.socketpair() for _ in range(2)]
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        fds = [a.fileno() for a, _ in pairs]
        tx = Background(lambda: n.sock_send(fds, striped, bases(src), n.Control(), tag=TAG))
        n.sock_recv_layered(
            [b.fileno() for _, b in pairs],
            striped,
            bases(dst),
            n.Control(),
            tag=TAG,
            ends=ends,
            efd=efd,
        )
        tx.join()
        assert _count(efd) == LAYERS
    finally:
        os.close(efd)
        for a, b in pairs:
            a.close()
            b.close()
    want = np.zeros_like(dst)
    for st, so, dt, do, nb in plan.segments().tolist():
        want[dt, do : do + nb] = src[st, so : so + nb]
    assert np.array_equal(dst, want), differing(dst, want)


def test_ends_that_do_not_match_the_shares_are_refused() -> None:
    _, dst, plan, bounds = _setup(4)
    got = n.plan_striped(plan, bounds, 2)
    assert got is not None
    striped, ends = got
    a, b = socket.socketpair()
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        with raises(Status.PARAM_INVALID, "each stream's layers must end at its share"):
            n.sock_recv_layered(  # one stream: its share is the whole plan, not ends[-1]
                [b.fileno()], striped, bases(dst), n.Control(), tag=TAG, ends=ends, efd=efd
            )
        with raises(Status.PARAM_INVALID, "must ascend"):
            n.sock_recv_layered(
                [b.fileno()],
                striped,
                bases(dst),
                n.Control(),
                tag=TAG,
                ends=[ends[1], ends[0], ends[2] * 2],
                efd=efd,
            )
    finally:
        os.close(efd)
        a.close()
        b.close()
