"""tcp stream requests in one process: a small pull is asked and answered on the request stream.

A real tcp link between two instances of this process (``inproc_pair(data_path="tcp")``):
the prompt listens on loopback, the decoder links to it and pulls. A pull of at most
``STREAM_MAX_BYTES`` sends no control message (no PULL, no DONE): it is asked on the
decoder's request stream and answered there by the prompt's native serving thread (the
decoder's loop takes an answer of at most ``STREAM_POLL_MAX_BYTES``, a worker thread a
bigger one); a bigger pull is asked on the control connection. A stream carrying anything
but the answer to the pull waiting on it (a late answer of an earlier transfer, a foreign
refusal) is refused before a byte lands, retired, and the next pull lands the right bytes on a new
stream; a refusal of the pull itself leaves the stream in step (it is used again). Every
pull's source bytes differ from every other's. (A prompt that answers late, or not at
all: ``tests/xproc/test_xproc_tcp_stream_requests.py``, with a stopped prompt process.)
"""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from aiodatadist import BlocksCacheKey, LLMException, LLMStatusCode, _native
from aiodatadist.testing import Pair, inproc_pair, make_blocks_cache, pattern_mismatches
from aiodatadist.transports.tcp_lane import STREAM_POLL_MAX_BYTES
from aiodatadist.transports.tcp_requests import STREAM_MAX_BYTES
from aiodatadist.transports.tcp_streams import LOOP_MAX_BYTES
from tests._procs import named_threads
from tests.engine._util import wait_until

pytestmark = pytest.mark.asyncio

SEED = 0x5713
NUM_BLOCKS = 160  # 4 KiB per block per tensor, 4 tensors: 16 KiB per block of all four
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


async def _served(theirs: Any, n: int) -> None:
    """The prompt's serving thread counted ``n`` answers (it counts one once its last byte
    is sent, which may be just after the decoder has them all)."""
    await wait_until(lambda: theirs.serving.stats.served >= n, what=f"{n} answers counted")
    assert theirs.serving.stats.served == n, theirs.serving.stats


def _seeded(pair: Pair, seed: int) -> Any:
    return pair.prompt_cache(num_blocks=NUM_BLOCKS, seed=seed, pattern=True)


async def test_small_pulls_send_no_control_message_and_big_ones_do(
    tcp_pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = tcp_pair
    _seeded(pair, SEED)
    dst = pair.decoder_cache(num_blocks=NUM_BLOCKS)
    mine, theirs = _peers(pair)
    sent = _spy_requests(mine)
    takers = _spy_takers(monkeypatch)
    for i in range(12):  # a different source block into a different destination each time
        src, to = [i], [(i * 7 + 3) % NUM_BLOCKS]
        await _pull(pair, dst, src, to)
        assert not pattern_mismatches(dst.tensors, src, to, SEED, [(0, 0)])
    assert sent == [] and takers == [], (sent, takers)  # (answers the loop took)
    await _served(theirs, 12)
    # Up to STREAM_POLL_MAX_BYTES (1 MiB): asked on the request stream, taken by the loop.
    blocks = list(range(64))
    assert LOOP_MAX_BYTES < len(blocks) * 4 * 4096 <= STREAM_POLL_MAX_BYTES
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, blocks, blocks[::-1])
    assert not pattern_mismatches(dst.tensors, blocks, blocks[::-1], SEED)
    assert sent == [] and takers == [], (sent, takers)
    await _served(theirs, 13)
    # Over it (1.1 MiB): still asked on the request stream, and its answer is taken by a
    # worker thread of the executor (the loop copies no megabytes).
    blocks = list(range(72, 144))
    assert STREAM_POLL_MAX_BYTES < len(blocks) * 4 * 4096 <= STREAM_MAX_BYTES
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, blocks, blocks[::-1])
    assert not pattern_mismatches(dst.tensors, blocks, blocks[::-1], SEED)
    assert sent == [], sent
    assert len(takers) == 1 and takers[0].startswith("aiodatadist-"), takers
    await _served(theirs, 14)
    # Over the stream requests' limit: asked on the control connection (and answered with
    # a DONE). 80 blocks of 16 KiB x 4 tensors: 5 MiB.
    make_blocks_cache(
        pair.prompt, num_blocks=80, block_shape=(8192,), model_id=1, seed=SEED + 9, pattern=True
    )
    big = make_blocks_cache(pair.decoder, num_blocks=80, block_shape=(8192,))
    key = BlocksCacheKey(pair.prompt.cluster_id, 1)
    blocks = list(range(80))
    assert len(blocks) * 4 * 16384 > STREAM_MAX_BYTES
    await pair.decoder.cache_manager.pull_blocks(key, big.cache, blocks, blocks[::-1])
    assert not pattern_mismatches(big.tensors, blocks, blocks[::-1], SEED + 9)
    assert len(sent) == 1 and len(takers) == 1, (sent, takers)
    await _served(theirs, 15)  # (the control-plane request counted too)


def _spy_takers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the thread of every answer taken by ``SockStep.run`` (a worker's)."""
    names: list[str] = []
    real = _native.SockStep.run

    def run(self: _native.SockStep, control: _native.Control) -> None:
        names.append(threading.current_thread().name)
        real(self, control)

    monkeypatch.setattr(_native.SockStep, "run", run)
    return names


# A pull of one block of one tensor (4 KiB), of 24 blocks of all 4 tensors (384 KiB: the
# loop takes both answers) or of 72 (1.1 MiB: a worker thread takes it).
SIZES = {"tiny": (1, 1), "small": (24, 4), "large": (72, 4)}


def _sized(size: str, first: int, to: int) -> tuple[list[int], list[int], dict[str, Any]]:
    """(source blocks from ``first``, destination blocks from ``to``, the pull's keywords)."""
    n, tensors = SIZES[size]
    kw: dict[str, Any] = {"src_layer_range": range(0, 1), "dst_layer_range": range(0, 1)}
    kw["tensor_num_per_layer"] = tensors
    return list(range(first, first + n)), list(range(to, to + n)), kw


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("junk", ["late answer", "foreign refusal", "not a header"])
async def test_a_stream_carrying_anything_else_is_refused_and_replaced(
    tcp_pair: Pair, junk: str, size: str
) -> None:
    pair = tcp_pair
    _seeded(pair, SEED + 1)
    dst = pair.decoder_cache(num_blocks=NUM_BLOCKS)
    mine, theirs = _peers(pair)
    await _pull(pair, dst, [1], [2])  # the streams are up
    epoch = mine.streams.epoch[0]
    stream = theirs.streams.req[0]
    assert stream is not None
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
    cm = pair.decoder.cache_manager
    src, to, kw = _sized(size, 5, 40)
    with pytest.raises(LLMException) as info:
        await cm.pull_blocks(pair.key(), dst.cache, src, to, timeout=BOUND_S, **kw)
    assert info.value.status_code != LLMStatusCode.LLM_SUCCESS
    for t, b in zip(dst.tensors, before, strict=True):
        assert np.array_equal(t.view(np.uint8), b)  # not a byte landed
    # The stream was retired; the next pull runs on a new one and lands its own bytes.
    src, to, kw = _sized(size, 33, 40)
    await cm.pull_blocks(pair.key(), dst.cache, src, to, **kw)
    tensors = [(t, t) for t in range(kw["tensor_num_per_layer"])]
    assert not pattern_mismatches(dst.tensors, src, to, SEED + 1, tensors)
    assert mine.streams.epoch[0] > epoch


@pytest.mark.parametrize("size", sorted(SIZES))
async def test_a_refusal_leaves_the_stream_in_step(tcp_pair: Pair, size: str) -> None:
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
    cm = pair.decoder.cache_manager
    src, to, kw = _sized(size, 3, 4)
    with pytest.raises(LLMException) as info:
        await cm.pull_blocks(pair.key(), dst.cache, src, to, timeout=BOUND_S, **kw)
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, info.value
    assert theirs.serving.stats.failed == failed + 1  # refused on the stream
    make_blocks_cache(pair.prompt, num_blocks=NUM_BLOCKS, model_id=0, seed=SEED + 3, pattern=True)
    src, to, kw = _sized(size, 9, 4)
    await cm.pull_blocks(pair.key(), dst.cache, src, to, **kw)
    tensors = [(t, t) for t in range(kw["tensor_num_per_layer"])]
    assert not pattern_mismatches(dst.tensors, src, to, SEED + 3, tensors)
    assert mine.streams.epoch[0] == epoch  # the same stream all along


async def test_an_answer_too_big_for_the_socket_goes_out_in_parts(tcp_pair: Pair) -> None:
    """The serving thread waits for the socket to drain (the decoder's loop for it to
    fill): small socket buffers on both ends, exact bytes, and the stream stays in step."""
    pair = tcp_pair
    _seeded(pair, SEED + 6)
    dst = pair.decoder_cache(num_blocks=NUM_BLOCKS)
    mine, theirs = _peers(pair)
    await _pull(pair, dst, [1], [2])
    served, epoch = theirs.serving.stats.served, mine.streams.epoch[0]
    for s in (theirs.streams.req[0], mine.streams.req[0]):
        assert s is not None
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    for blocks in ([40, 41, 42, 43], [50, 51, 52, 53]):  # 64 KiB each, both tensors
        # (buffers this small stall on TCP's persist timer, ~0.2 s: a generous timeout)
        await pair.decoder.cache_manager.pull_blocks(
            pair.key(), dst.cache, blocks, blocks[::-1], timeout=BOUND_S
        )
        assert not pattern_mismatches(dst.tensors, blocks, blocks[::-1], SEED + 6)
    await _served(theirs, served + 2)
    assert mine.streams.epoch[0] == epoch


def _serving_threads() -> int:
    return named_threads("aiodd-serve")


async def test_the_serving_thread_ends_with_the_link() -> None:
    """Each link's serving threads are joined when the link goes (none outlives it)."""
    before = _serving_threads()  # (every other test's links are gone)
    async with inproc_pair(prompt_id=11, decoder_id=12, data_path="tcp") as pair:
        pair.prompt_cache(num_blocks=NUM_BLOCKS, seed=SEED + 8, pattern=True)
        dst = pair.decoder_cache(num_blocks=NUM_BLOCKS)
        await _pull(pair, dst, [3], [4])
        assert not pattern_mismatches(dst.tensors, [3], [4], SEED + 8, [(0, 0)])
        # (the prompt's for the decoder's request stream, and, once the prompt's own is
        # connected, the decoder's: both ends are in this process)
        assert _serving_threads() > before
    assert _serving_threads() == before  # joined when the link closed


def _one_block_plan() -> _native.Plan:
    g = _native.Geometry(4, NUM_BLOCKS, 4096)
    return _native.Plan.blocks(g, g, [0], [1], 0, 0, 1)
