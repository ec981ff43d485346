"""tcp stream requests against a prompt process: its native serving thread.

A small pull is asked on the requester's request stream (``tcp_requests``) and answered
on it by the prompt's serving thread (``ext/serve.cpp``): the stream header of the
request's tag and the bytes, or a refusal after which the stream is still in step.

* A hand-driven requester: every request is checked against what the prompt registered,
  whatever it says: outside the cache, an unknown cache, a stale generation or too many
  bytes are refused (nothing else is sent); a stream carrying something that is not a
  request, or a request not all sent, is shut down, never answered.
* A request being answered holds the cache like a peer's one-sided copy: the prompt's
  free waits for it (and fails with ``LLM_LINK_BUSY``, the cache intact, while a
  requester that does not read keeps it), and succeeds once the stream is gone.
* A stopped prompt (SIGSTOP): a pull asked meanwhile ends at its deadline or its cancel,
  whether the decoder's loop or a worker thread waits for its answer (up to or over
  ``STREAM_POLL_MAX_BYTES``), and its late answer never lands in the next pulls; one
  answered 50 ms late (after the decoder's short wait on its thread) completes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from typing import Any

import numpy as np
import pytest

from aiodatadist import LLMStatusCode, LLMTimeoutError, _native
from aiodatadist.testing import PromptSpec, RemotePair, remote_pair
from aiodatadist.transports.tcp_lane import STREAM_POLL_MAX_BYTES, STREAM_SPIN_US
from aiodatadist.transports.tcp_requests import STREAM_MAX_BYTES, encode_request
from aiodatadist.transports.tcp_streams import LOOP_MAX_BYTES, REQUEST_STREAM
from tests._procs import stop_now
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import Harness, RawClient, recv_exact, recv_payload

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]  # a peer process

PROMPT, RAW = 71, 73
SEED = 23
S = LLMStatusCode
BOUND_S = 5.0  # generous: a deadline or cancel was honoured, not a speed claim


def _segments(rows: list[tuple[int, int, int, int, int]]) -> bytes:
    return np.array(rows, dtype="<u8").reshape(-1, 5).tobytes()


async def _ask(
    sock: socket.socket, tag: int, cache: int, rows: list[tuple[int, ...]], **kw: object
) -> None:
    geometry = kw.pop("geometry", (4, 8, xc.SPECS["reg"].unit))
    gen = kw.pop("gen", None)
    frame = encode_request(tag, cache, gen, geometry, 2000, _segments(rows))  # type: ignore[arg-type]
    await asyncio.get_running_loop().sock_sendall(sock, frame)


async def _refusal(sock: socket.socket, tag: int) -> dict[str, object]:
    head = await recv_exact(sock, _native.SOCK_HEADER_BYTES)
    assert head[:8] == _native.SOCK_REFUSAL_MAGIC, head
    assert int.from_bytes(head[8:16], "little") == tag, head
    body = await recv_exact(sock, int.from_bytes(head[16:24], "little"))
    got: dict[str, object] = json.loads(body)
    return got


async def _served(prompt: Any, n: int, within: float) -> bool:
    """Whether the prompt has answered ``n`` requests of RAW's (within ``within`` s)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while (await prompt.ok("serve_stats", cluster_id=RAW))["stats"]["served"] < n:
        if loop.time() >= end:
            return False
        await asyncio.sleep(0.01)
    return True


async def _closed(sock: socket.socket, bound: float = 5) -> bool:
    """The peer closed ``sock`` (within ``bound`` s), having sent nothing more on it."""
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1), bound) == b""
    except ConnectionError:
        return True


async def test_requests_are_checked_refusals_keep_the_stream_and_junk_retires_it() -> None:
    async with Harness() as h:
        prompt = await h.peer(
            cluster_id=PROMPT,
            data_path="tcp",
            seed=SEED,
            options={"aiodatadist.ServeTimeout": "1000"},  # (the cut request's bound)
        )
        reg = prompt.cache_id("reg")
        unit = xc.SPECS["reg"].unit
        ref = xc.reference(SEED, "reg")
        async with RawClient(prompt.host, prompt.port) as raw:
            await raw.handshake(RAW)
            s = await raw.open_stream(REQUEST_STREAM, epoch=1)
            await _ask(s, 1, reg, [(1, 2 * unit, 0, 0, unit)])
            assert await recv_payload(s, 1, unit) == ref[1, 2 * unit : 3 * unit].tobytes()
            # Outside the cache: refused, and nothing else comes on the stream.
            await _ask(s, 2, reg, [(0, 8 * unit, 0, 0, unit)])
            r = await _refusal(s, 2)
            assert r["status"] != S.LLM_SUCCESS and r["stale"] is False, r
            assert "outside" in str(r["info"]), r
            # A cache it does not have (or no longer has, for this generation): stale.
            await _ask(s, 3, reg + 1000, [(0, 0, 0, 0, unit)])
            r = await _refusal(s, 3)
            assert (r["status"], r["stale"]) == (S.LLM_KV_CACHE_NOT_EXIST, True), r
            await _ask(s, 4, reg, [(0, 0, 0, 0, unit)], gen=(1 << 62) + 5)
            r = await _refusal(s, 4)
            assert (r["status"], r["stale"]) == (S.LLM_KV_CACHE_NOT_EXIST, True), r
            # More than a stream request may move (the same tensor read again and again).
            tensor = 8 * unit
            n = STREAM_MAX_BYTES // tensor + 1
            rows = [(i % 4, 0, 0, i * tensor, tensor) for i in range(n)]
            await _ask(s, 5, reg, rows, geometry=(1, n, tensor))
            r = await _refusal(s, 5)
            assert r["status"] == S.LLM_PARAM_INVALID, r
            # After every refusal the stream is in step: the next request is served on it.
            await _ask(s, 6, reg, [(3, 7 * unit, 0, 0, unit)])
            assert await recv_payload(s, 6, unit) == ref[3, 7 * unit : 8 * unit].tobytes()
            # Something that is not a request: the stream is retired, nothing answered.
            await asyncio.get_running_loop().sock_sendall(s, b"aNOTAREQUEST" * 8)
            assert await _closed(s)
            got = (await prompt.ok("serve_stats", cluster_id=RAW))["stats"]
            assert (got["served"], got["failed"]) == (2, 4), got
            # A request cut short: shut down once the serving cap passes, never answered.
            t = await raw.open_stream(REQUEST_STREAM, epoch=1)
            frame = encode_request(
                7, reg, None, (4, 8, unit), 2000, _segments([(0, 0, 0, 0, unit)])
            )
            await asyncio.get_running_loop().sock_sendall(t, frame[:40])
            assert await _closed(t, 10)
            got = (await prompt.ok("serve_stats", cluster_id=RAW))["stats"]
            assert (got["served"], got["failed"]) == (2, 4), got


async def test_a_free_waits_for_a_request_being_answered() -> None:
    """A requester that asks for a whole tensor and does not read: the serving thread
    holds the cache (its lease) while it waits to send, so the prompt's free fails after
    its bound (``LLM_LINK_BUSY``, still registered and served); once the requester's
    stream is gone the free succeeds."""
    async with Harness() as h:
        prompt = await h.peer(
            cluster_id=PROMPT,
            data_path="tcp",
            seed=SEED + 1,
            sync_ms=300,
            options={"aiodatadist.ServeTimeout": "20000"},
        )
        reg = prompt.cache_id("reg")
        unit = xc.SPECS["reg"].unit
        tensor = 8 * unit
        ref = xc.reference(SEED + 1, "reg")
        async with RawClient(prompt.host, prompt.port) as raw:
            await raw.handshake(RAW)
            s = await raw.open_stream(REQUEST_STREAM, epoch=1, rcvbuf=4096)
            rows = [(i % 4, 0, i, 0, tensor) for i in range(8)]  # (256 KiB: every tensor twice)
            # Asked one after another, never read: the answers fill the socket's buffers
            # (megabytes on loopback), then the serving thread waits to send.
            for tag in range(1, 65):
                await _ask(s, tag, reg, rows, geometry=(8, 8, unit))
                if not await _served(prompt, tag, 0.5):
                    break  # (waiting to send it)
            else:
                raise AssertionError("the answers never filled the socket's buffers")
            r = await prompt.call("free", name="reg")
            assert not r.get("ok") and "LINK_BUSY" in str(r), r
            # Still registered: a second stream is answered with the cache's bytes.
            u = await raw.open_stream(REQUEST_STREAM, epoch=1)
            s.close()  # (the first stream is replaced, its answer abandoned)
            await _ask(u, 2, reg, [(2, 3 * unit, 0, 0, unit)])
            assert await recv_payload(u, 2, unit) == ref[2, 3 * unit : 4 * unit].tobytes()
            await prompt.ok("free", name="reg")
            await _ask(u, 3, reg, [(2, 3 * unit, 0, 0, unit)])
            r3 = await _refusal(u, 3)
            assert (r3["status"], r3["stale"]) == (S.LLM_KV_CACHE_NOT_EXIST, True), r3


def _spec(seed: int) -> PromptSpec:
    return PromptSpec(num_tensors=2, num_blocks=8, block_shape=(4096,), dtype="uint8", seed=seed)


async def _pull(pair: RemotePair, src: list[int], dst: list[int], timeout: float = 10) -> None:
    cache = pair.decoder_cache()
    await pair.decoder.cache_manager.pull_blocks(pair.key(), cache.cache, src, dst, timeout=timeout)
    assert pair.mismatches(cache, src, dst) == []


def _small_spec(seed: int) -> PromptSpec:
    return PromptSpec(num_tensors=2, num_blocks=16, block_shape=(65536,), dtype="uint8", seed=seed)


# tiny: one 4 KiB block of both tensors; small: three 64 KiB blocks of both (384 KiB):
# the decoder's loop takes both answers. large: nine (1.1 MiB): a worker thread takes it.
SIZES = {"tiny": (_spec, 1), "small": (_small_spec, 3), "large": (_small_spec, 9)}


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_a_late_answer_never_lands_in_the_next_pulls(how: str, size: str) -> None:
    """The prompt is stopped while a small pull waits for its answer: the pull ends at its
    deadline (or its cancel); the prompt, resumed, answers it on a stream the decoder
    has retired. The next pulls, into the same blocks, land their own bytes."""
    spec, n = SIZES[size]

    def b(first: int) -> list[int]:
        return list(range(first, first + n))

    async with remote_pair(spec(SEED + 2), data_path="tcp") as rp:
        assert LOOP_MAX_BYTES < 3 * 2 * 65536 <= STREAM_POLL_MAX_BYTES < 9 * 2 * 65536
        assert 9 * 2 * 65536 <= STREAM_MAX_BYTES
        await _pull(rp, b(1), b(2))  # (the streams are up, the lane is kept)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        stop_now(rp.prompt.pid)
        try:
            if how == "timeout":
                with pytest.raises(LLMTimeoutError):
                    await _pull(rp, b(3), b(4), timeout=0.2)
            else:
                task = loop.create_task(_pull(rp, b(3), b(4)))
                await asyncio.sleep(0.1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert loop.time() - t0 < BOUND_S
            assert rp.decoder._rt.executor.in_flight == 0  # (a worker's job has returned)
        finally:
            os.kill(rp.prompt.pid, signal.SIGCONT)
        for i, to in ((5, 4), (6, 2), (7, 4), (0, 2)):
            await _pull(rp, b(i), b(to))


async def test_an_answer_after_the_short_wait_is_taken_by_the_loop() -> None:
    """The decoder waits for an answer on its own thread only briefly (``STREAM_SPIN_US``),
    then the loop waits: a pull the prompt answers 50 ms late completes, and the loop ran
    other callbacks meanwhile."""
    assert STREAM_SPIN_US < 50_000
    async with remote_pair(_spec(SEED + 3), data_path="tcp") as rp:
        await _pull(rp, [1], [2])
        loop = asyncio.get_running_loop()
        stop_now(rp.prompt.pid)
        try:
            loop.call_later(0.05, os.kill, rp.prompt.pid, signal.SIGCONT)
            ran = asyncio.Event()
            loop.call_soon(ran.set)
            t0 = loop.time()
            await _pull(rp, [4], [5])
            assert ran.is_set() and loop.time() - t0 < BOUND_S
        finally:
            os.kill(rp.prompt.pid, signal.SIGCONT)
