"""tcp stream requests in one process: a tiny pull is asked and answered on its data stream.

A real tcp link between two instances of this process (``inproc_pair(data_path="tcp")``):
the prompt listens on loopback, the decoder links to it and pulls. A pull of at most
``LOOP_MAX_BYTES`` sends no control message (no PULL, no DONE); a bigger one does. A
stream carrying anything but the answer to the pull waiting on it (a late answer of an
earlier transfer, a foreign refusal) is refused before a byte lands, retired, and the
next pull lands the right bytes on a new stream; a refusal of the pull itself leaves the
stream in step (it is used again). Every pull's source bytes differ from every other's.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from aiodatadist import LLMException, LLMStatusCode, LLMTimeoutError, _native
from aiodatadist import _wire as w
from aiodatadist.testing import Pair, inproc_pair, make_blocks_cache, pattern_mismatches
from aiodatadist.transports import tcp
from aiodatadist.transports.tcp_streams import LOOP_MAX_BYTES

pytestmark = pytest.mark.asyncio

SEED = 0x5713
NUM_BLOCKS = 80  # 4 KiB per block per tensor: 64 blocks x 4 tensors = 1 MiB (over the limit)
BOUND_S = 10.0  # generous: a deadline was honoured, not a speed claim


@pytest_asyncio.fixture
async def tcp_pair() -> AsyncIterator[Pair]:
    async with inproc_pair(data_path="tcp") as p:
        yield p


def _peers(pair: Pair) -> tuple[Any, Any]:
    """(the decoder's control connection, the prompt's) of the pair's link."""
    link = pair.decoder._rt.links.find(pair.prompt.cluster_id)
    assert link is not None and link.data_path == "tcp", link
    server = pair.prompt._server
    assert server is not None
    (served,) = server.peers.values()
    return link.path.peer, served


def _spy_requests(peer: Any) -> list[Any]:
    """Records (and still sends) every request the decoder sends on its control connection."""
    sent: list[Any] = []
    real = peer.request

    async def request(msg_type: Any, body: Any, binary: bytes) -> Any:
        sent.append(msg_type)
        return await real(msg_type, body, binary)

    peer.request = request
    return sent


async def _pull(pair: Pair, dst: Any, src: list[int], dst_blocks: list[int], **kw: Any) -> None:
    await pair.decoder.cache_manager.pull_blocks(
        pair.key(),
        dst.cache,
        src,
        dst_blocks,
        src_layer_range=range(0, 1),
        dst_layer_range=range(0, 1),
        tensor_num_per_layer=1,
        **kw,
    )


def _seeded(pair: Pair, seed: int) -> Any:
    return pair.prompt_cache(num_blocks=NUM_BLOCKS, seed=seed, pattern=True)


async def test_tiny_pulls_send_no_control_message_and_big_ones_do(tcp_pair: Pair) -> None:
    pair = tcp_pair
    _seeded(pair, SEED)
    dst = pair.decoder_cache(num_blocks=NUM_BLOCKS)
    mine, theirs = _peers(pair)
    sent = _spy_requests(mine)
    for i in range(12):  # a different source block into a different destination each time
        src, to = [i], [(i * 7 + 3) % NUM_BLOCKS]
        await _pull(pair, dst, src, to)
        assert not pattern_mismatches(dst.tensors, src, to, SEED, [(0, 0)])
    assert sent == [] and theirs.serving.stats.served == 12, (sent, theirs.serving.stats)
    # Over the limit: asked on the control connection (and answered with a DONE).
    blocks = list(range(64))
    assert len(blocks) * 4 * 4096 > LOOP_MAX_BYTES
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, blocks, blocks)
    assert not pattern_mismatches(dst.tensors, blocks, blocks, SEED)
    assert len(sent) == 1, sent


@pytest.mark.parametrize("junk", ["late answer", "foreign refusal", "not a header"])
async def test_a_stream_carrying_anything_else_is_refused_and_replaced(
    tcp_pair: Pair, junk: str
) -> None:
    pair = tcp_pair
    _seeded(pair, SEED + 1)
    dst = pair.decoder_cache(num_blocks=NUM_BLOCKS)
    mine, theirs = _peers(pair)
    await _pull(pair, dst, [1], [2])  # the streams are up
    epoch = mine.streams.epoch[0]
    stream = theirs.streams.sockets[0][0]
    unit = 4096
    stray = {
        "late answer": _native.sock_header(1 << 39, unit) + b"\xee" * unit,
        "foreign refusal": _native.SOCK_REFUSAL_MAGIC
        + (1 << 39).to_bytes(8, "little")
        + (2).to_bytes(8, "little")
        + b"{}",
        "not a header": b"\xee" * 64,
    }[junk]
    stream.send(stray)  # the prompt's end writes it before the answer to the next pull
    before = [t.view(np.uint8).copy() for t in dst.tensors]
    with pytest.raises(LLMException) as info:
        await _pull(pair, dst, [5], [6], timeout=BOUND_S)
    assert info.value.status_code != LLMStatusCode.LLM_SUCCESS
    for t, b in zip(dst.tensors, before, strict=True):
        assert np.array_equal(t.view(np.uint8), b)  # not a byte landed
    # The stream was retired; the next pull runs on a new one and lands its own bytes.
    await _pull(pair, dst, [7], [6])
    assert not pattern_mismatches(dst.tensors, [7], [6], SEED + 1, [(0, 0)])
    assert mine.streams.epoch[0] > epoch


async def test_a_refusal_leaves_the_stream_in_step(tcp_pair: Pair) -> None:
    """The prompt refuses a pull of a cache it just unregistered (the decoder's table is
    older): the decoder fails with the prompt's reason, and the same stream serves the
    next pull."""
    pair = tcp_pair
    first = _seeded(pair, SEED + 2)
    dst = pair.decoder_cache(num_blocks=NUM_BLOCKS)
    mine, theirs = _peers(pair)
    await _pull(pair, dst, [1], [2])
    epoch, failed = mine.streams.epoch[0], theirs.serving.stats.failed
    pair.prompt.cache_manager.unregister_cache(first.cache.cache_id)
    with pytest.raises(LLMException) as info:
        await _pull(pair, dst, [3], [4], timeout=BOUND_S)
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, info.value
    assert theirs.serving.stats.failed == failed + 1  # refused on the stream
    make_blocks_cache(pair.prompt, num_blocks=NUM_BLOCKS, model_id=0, seed=SEED + 3, pattern=True)
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [9], [4])
    assert not pattern_mismatches(dst.tensors, [9], [4], SEED + 3)
    assert mine.streams.epoch[0] == epoch  # the same stream all along


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_an_abandoned_tiny_pull_never_lands_in_the_next_one(tcp_pair: Pair, how: str) -> None:
    """The prompt does not answer (its end of the stream is not read): the pull ends by
    its deadline or a cancel, and the prompt then answers it late. The next pulls, into
    the same destination, get their own bytes."""
    pair = tcp_pair
    _seeded(pair, SEED + 4)
    dst = pair.decoder_cache(num_blocks=NUM_BLOCKS)
    _, theirs = _peers(pair)
    await _pull(pair, dst, [1], [2])
    stream = theirs.streams.sockets[0][0]
    theirs.streams.unwatch(stream)  # the prompt stalls: the request waits in its buffer
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    if how == "timeout":
        with pytest.raises(LLMTimeoutError):
            await _pull(pair, dst, [10], [3], timeout=0.2)
    else:
        task = loop.create_task(_pull(pair, dst, [10], [3], timeout=BOUND_S))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # The late answer, before the decoder's CANCEL reaches the prompt: it serves what it
    # finds on that stream now (the decoder retired its end: the bytes go nowhere).
    theirs.serving._readable(stream)
    assert loop.time() - t0 < BOUND_S
    for i, to in zip(range(11, 15), itertools.cycle([3, 5]), strict=False):
        await _pull(pair, dst, [i], [to])
        assert not pattern_mismatches(dst.tensors, [i], [to], SEED + 4, [(0, 0)])


async def test_the_wait_on_the_loops_thread_is_bounded(tcp_pair: Pair) -> None:
    """The decoder's wait for the answer on its own thread is bounded (then the loop
    waits): a pull the prompt answers 50 ms late (from the loop) completes long before
    its deadline. (A peer in this process is never waited for so; here it is made to.)"""
    pair = tcp_pair
    _seeded(pair, SEED + 5)
    dst = pair.decoder_cache(num_blocks=NUM_BLOCKS)
    link = pair.decoder._rt.links.find(pair.prompt.cluster_id)
    assert link is not None
    path = link.path.tcp
    assert path is not None and path._spin is False  # (the peer is this process)
    path._spin = True
    _, theirs = _peers(pair)
    await _pull(pair, dst, [1], [2])
    stream = theirs.streams.sockets[0][0]
    theirs.streams.unwatch(stream)
    loop = asyncio.get_running_loop()
    ran = asyncio.Event()
    loop.call_soon(ran.set)
    loop.call_later(0.05, theirs.serving._readable, stream)  # answered 50 ms later
    t0 = loop.time()
    await _pull(pair, dst, [20], [21], timeout=BOUND_S)
    assert ran.is_set() and loop.time() - t0 < BOUND_S / 2
    assert tcp.STREAM_SPIN_US < 50_000
    assert not pattern_mismatches(dst.tensors, [20], [21], SEED + 5, [(0, 0)])


async def test_a_request_behind_another_or_too_big_for_the_socket_is_served_in_turn(
    tcp_pair: Pair,
) -> None:
    """A stream request that comes while the prompt serves something else waits its turn
    (the serve loop takes it); one whose answer does not fit the socket at once is
    finished by the serve loop as the socket drains. Exact bytes either way."""
    pair = tcp_pair
    _seeded(pair, SEED + 6)
    dst = pair.decoder_cache(num_blocks=NUM_BLOCKS)
    mine, theirs = _peers(pair)
    await _pull(pair, dst, [1], [2])
    serving = theirs.serving
    served, failed = serving.stats.served, serving.stats.failed
    # The serve loop is held by a PULL (on the control connection) naming streams of an
    # epoch that never comes: it waits for them for its 300 ms, then is refused.
    remote = next(iter(mine.table))
    body = {
        "req": 1 << 50,
        "cache_id": remote.cache_id,
        "dst_geometry": [4, NUM_BLOCKS, 4096],
        "deadline_ms": 300,
        "streams": 1,
        "epoch": mine.streams.epoch[0] + 5,
    }
    await mine.send(w.MsgType.PULL, body, _native.plan_segment_bytes(_one_block_plan()))
    await asyncio.sleep(0.02)
    task = asyncio.get_running_loop().create_task(_pull(pair, dst, [30], [31]))
    await asyncio.sleep(0.1)
    assert not task.done() and serving.stats.served == served  # queued behind it
    await asyncio.wait_for(task, BOUND_S)
    assert serving.stats.failed == failed + 1  # (the PULL that held the loop)
    assert not pattern_mismatches(dst.tensors, [30], [31], SEED + 6, [(0, 0)])
    # Small socket buffers on both ends: the answer (4 tensors x 4 KiB) goes out in parts.
    for s in (theirs.streams.sockets[0][0], mine.streams.sockets[0][0]):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    blocks = [40, 41, 42, 43]
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, blocks, blocks[::-1])
    assert not pattern_mismatches(dst.tensors, blocks, blocks[::-1], SEED + 6)
    assert serving.stats.served == served + 2 and serving.stats.failed == failed + 1


def _one_block_plan() -> _native.Plan:
    g = _native.Geometry(4, NUM_BLOCKS, 4096)
    return _native.Plan.blocks(g, g, [0], [1], 0, 0, 1)
