"""Tiny pulls across processes: no thread handoff, exact bytes, deadlines honoured.

A one-sided pull (``shm``, ``cma``) of at most ``ONE_SIDED_INLINE_MAX_BYTES`` runs inline
on the loop thread, and a ``tcp`` pull of at most ``LOOP_MAX_BYTES`` is moved by the
loop in non-blocking steps (on both sides): none of them hands a job to the decoder's
transfer executor. Over the limit, the executor moves it (``tcp``: over
``STREAM_POLL_MAX_BYTES``; up to it the loop takes an answer that comes within its short
poll, whole, and hands what does not to a worker thread). A stalled
peer never blocks the loop during a tiny tcp pull: the deadline ends it, and the link
works again afterwards.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

import pytest

from aiodatadist import LLMStatusCode, LLMTimeoutError
from aiodatadist._executor import ONE_SIDED_INLINE_MAX_BYTES
from aiodatadist.testing import PromptSpec, RemotePair, remote_pair
from aiodatadist.transports.tcp_lane import STREAM_POLL_MAX_BYTES
from aiodatadist.transports.tcp_streams import LOOP_MAX_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]  # peer processes

PATHS = ["shm", "cma", "tcp"]
BLOCK_SHAPE = (128, 8, 64)  # 128 KiB blocks in fp16: 2 blocks are exactly the limit
BOUND_S = 10.0  # generous: the deadline was honoured, not a speed claim
_seeds = itertools.count(0x71_4E_0001)


def _spec(path: str) -> PromptSpec:
    return PromptSpec(
        num_tensors=2,
        num_blocks=8,
        block_shape=BLOCK_SHAPE,
        dtype="fp16",
        seed=next(_seeds),
        allocate=(path == "shm"),
    )


def _spy_submits(pair: RemotePair) -> list[str]:
    """Records (and still runs) every job the decoder's transfer executor is handed."""
    ex: Any = pair.decoder._rt.executor
    submitted: list[str] = []
    real = ex._post  # (what run() and submit() both queue through)

    def post(job: Any, control: Any, **kw: Any) -> Any:
        submitted.append(threading.current_thread().name)
        return real(job, control, **kw)

    ex._post = post
    return submitted


async def _skip_unless(pair: RemotePair, path: str) -> None:
    link = pair.decoder._rt.links.find(pair.prompt_id)
    assert link is not None
    if link.data_path != path:
        pytest.skip(f"{path} is not available here (the link uses {link.data_path})")


@pytest.mark.parametrize("path", PATHS)
async def test_tiny_pulls_take_no_thread_and_bigger_ones_do(path: str) -> None:
    assert ONE_SIDED_INLINE_MAX_BYTES == LOOP_MAX_BYTES == 2 * 128 * 8 * 64 * 2
    async with remote_pair(_spec(path), data_path=path) as pair:
        await _skip_unless(pair, path)
        dst = pair.decoder_cache()
        cm = pair.decoder.cache_manager
        submitted = _spy_submits(pair)
        # At the limit: 1 tensor x 2 blocks, then 2 tensors x 1 block (one layer).
        await cm.pull_blocks(
            pair.key(),
            dst.cache,
            [5, 2],
            [0, 7],
            src_layer_range=range(0, 1),
            dst_layer_range=range(0, 1),
            tensor_num_per_layer=1,
        )
        assert not pair.mismatches(dst, [5, 2], [0, 7], [(0, 0)])
        await cm.pull_blocks(pair.key(), dst.cache, [6], [3])
        assert not pair.mismatches(dst, [6], [3])
        for i in range(20):  # repeated: the same path every time, bytes exact every time
            await cm.pull_blocks(pair.key(), dst.cache, [i % 8], [(i + 1) % 8])
            assert not pair.mismatches(dst, [i % 8], [(i + 1) % 8])
        assert submitted == [], submitted
        # Over the limit (2 tensors x 2 blocks): the executor moves it. (A tcp pull of up
        # to STREAM_POLL_MAX_BYTES may be taken by the loop when its answer comes within
        # the poll: all 8 blocks, 2 MiB, are over that too.)
        src, to = ([1, 4], [5, 6]) if path != "tcp" else (list(range(8)), [3, 1, 7, 0, 6, 2, 5, 4])
        assert (len(src) * 2 * 128 * 8 * 64 * 2 > STREAM_POLL_MAX_BYTES) == (path == "tcp")
        await cm.pull_blocks(pair.key(), dst.cache, src, to)
        assert not pair.mismatches(dst, src, to)
        assert len(submitted) == 1, submitted


async def test_a_stalled_peer_never_blocks_the_loop_in_a_tiny_tcp_pull() -> None:
    async with remote_pair(_spec("tcp"), data_path="tcp", faults=True) as pair:
        assert pair.faults is not None
        dst = pair.decoder_cache()
        cm = pair.decoder.cache_manager
        await cm.pull_blocks(pair.key(), dst.cache, [3], [4])
        assert not pair.mismatches(dst, [3], [4])
        before = [t.view("uint8").copy() for t in dst.tensors]

        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                await asyncio.sleep(0.005)
                ticks += 1

        tick_task = asyncio.get_running_loop().create_task(ticker())
        pair.faults.pause()
        t0 = time.monotonic()
        try:
            with pytest.raises(LLMTimeoutError) as info:
                await cm.pull_blocks(pair.key(), dst.cache, [1], [2], timeout=0.4)
        finally:
            elapsed = time.monotonic() - t0
            stop.set()
            await tick_task
            pair.faults.resume()
        assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert elapsed < BOUND_S
        # The loop ran all along (a blocking wait would have starved the ticker).
        assert ticks >= 10, ticks
        # Nothing landed in the blocks the failed pull named, or elsewhere.
        assert all((t.view("uint8") == b).all() for t, b in zip(dst.tensors, before, strict=True))
        # The given-up pull's bytes (the peer may still send them once resumed) never land
        # in the next pull into the same block: only that pull's own bytes do.
        await cm.pull_blocks(pair.key(), dst.cache, [5], [2])
        assert not pair.mismatches(dst, [5], [2])
        # The link works again: fresh streams, exact bytes.
        for i in range(3):
            await cm.pull_blocks(pair.key(), dst.cache, [i], [7 - i])
            assert not pair.mismatches(dst, [i], [7 - i])
