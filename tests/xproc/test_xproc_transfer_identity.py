"""tcp transfer identity: a pull that timed out (or was cancelled) while the prompt's
serving side was busy is never delivered into the decoder's next pull, and the serving
side is bounded and fair against peers that stop reading.

The prompt runs with one serving thread (and, for the code before ServeThreads existed,
one executor thread); a raw client (``X``) asks for a big pull and never reads its data
stream, so that thread is busy sending to it. Every pull uses source blocks whose bytes
differ from every other pull's (the prompt's seeded pattern), into the same destination
blocks: a stale or misdirected delivery shows as wrong bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    _native,
    _wire,
)
from aiodatadist.config import DataPath
from aiodatadist.testing import cluster_info
from aiodatadist.transports.base import Call
from aiodatadist.transports.tcp_requests import STREAM_MAX_BYTES
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import (
    Harness,
    PeerProc,
    RawClient,
    decoder_options,
    link,
    nothing_arrives,
    pull_and_check,
    recv_payload,
    until,
)

pytestmark = pytest.mark.slow  # peer processes on every data path: the full run's

PROMPT, DECODER, RAW = 61, 62, 63
SEED = 17
S = LLMStatusCode
BUSY = {"aiodatadist.ServeThreads": "1", "aiodatadist.ExecutorThreads": "1"}


async def hold_the_serving_thread(raw: RawClient, prompt_big: int, req: int, ms: int) -> None:
    """X: a 64 MiB pull it never reads, keeping the prompt's one serving thread busy."""
    tensor = xc.big_spec(64).nbytes
    await raw.pull(
        req,
        prompt_big,
        [(0, 0, 0, 0, tensor), (1, 0, 1, 0, tensor)],
        dst_geometry=(2, xc.big_spec(64).shape[0], xc.big_spec(64).unit),
        deadline_ms=ms,
    )


async def stats(prompt: object) -> dict[str, int]:
    r = await prompt.ok("serve_stats", cluster_id=DECODER)  # type: ignore[attr-defined]
    return dict(r["stats"])


# The decoder's pulls in the two tests below take WIDE blocks of the prompt's "wide" cache
# (distinct bytes per block): over STREAM_MAX_BYTES, so they are asked on the control
# connection and the prompt's one serving thread (the one X holds) serves them; a smaller
# one would be asked on the request stream and answered by its native thread at once.
WIDE = 264  # blocks per pull: 264 x 4 KiB x 4 tensors = 4.1 MiB
WIDE_MODEL = 44
WIDE_SPEC = xc.Spec("wide", True, False, (12 * WIDE, *xc.BLOCK_SHAPE), model_id=WIDE_MODEL)
WIDE_SEED = 4242


async def wide_setup(h: Harness) -> tuple[PeerProc, LLMDataDist, xc.Local, np.ndarray, xc.Local]:
    """The prompt (one serving thread, a "wide" cache), the linked decoder, its WIDE-block
    destination, the wide cache's reference bytes and the decoder's "reg" cache."""
    assert WIDE * WIDE_SPEC.unit * WIDE_SPEC.num_tensors > STREAM_MAX_BYTES
    prompt = await h.peer(cluster_id=PROMPT, data_path="tcp", seed=SEED, big_mib=64, options=BUSY)
    await prompt.ok(
        "register", name="wide", model_id=WIDE_MODEL, seed=WIDE_SEED,
        num_blocks=WIDE_SPEC.shape[0],
    )  # fmt: skip
    dd, local = await h.local(DECODER, decoder_options("tcp"))
    await link(dd, prompt, PROMPT)
    dst_spec = xc.Spec("wide_dst", True, False, (WIDE, *xc.BLOCK_SHAPE), model_id=45)
    dst = xc.make_cache(dd, dst_spec, None, DECODER)
    return prompt, dd, dst, xc.pattern(WIDE_SEED, WIDE_SPEC), local["reg"]


def wide_pull(dd: LLMDataDist, dst: xc.Local, n: int, timeout: float) -> Coroutine[Any, Any, None]:
    """Pull number ``n``: source blocks ``[n * WIDE, (n + 1) * WIDE)`` into all of ``dst``."""
    src = list(range(n * WIDE, (n + 1) * WIDE))
    return dd.cache_manager.pull_blocks(
        BlocksCacheKey(PROMPT, WIDE_MODEL), dst.cache, src, list(range(WIDE)),
        tensor_num_per_layer=2, timeout=timeout,
    )  # fmt: skip


async def wide_pull_and_check(dd: LLMDataDist, dst: xc.Local, ref: np.ndarray, n: int) -> None:
    await wide_pull(dd, dst, n, 5.0)
    span = slice(n * WIDE * WIDE_SPEC.unit, (n + 1) * WIDE * WIDE_SPEC.unit)
    assert np.array_equal(dst.matrix(), ref[:, span]), f"pull {n} holds other bytes"


@pytest.mark.asyncio
async def test_given_up_pulls_are_never_delivered_into_the_next_one() -> None:
    """Finding 1. While X holds the serving thread, the decoder's pull A times out (its
    request stays with the server, which is busy) and pull B is cancelled (its request,
    with a long deadline, queued behind A's); then X lets go and the decoder pulls C.
    C must hold exactly C's bytes (before: B's), and the link must stay in step."""
    async with Harness() as h:
        prompt, dd, dst, ref, reg = await wide_setup(h)
        for rnd in range(3):
            async with RawClient(prompt.host, prompt.port) as x:
                await x.handshake(RAW + rnd)
                await x.open_stream(0)
                await hold_the_serving_thread(x, prompt.cache_id("big"), 1, 3000)
                await asyncio.sleep(0.2)  # the serving thread is now stuck sending to X
                # A: times out while the serving side is busy.
                with pytest.raises(LLMException) as ei:
                    await wide_pull(dd, dst, 3 * rnd, 0.3)
                assert ei.value.status_code == S.LLM_TIMEOUT, ei.value
                # B: other source blocks, a long deadline, cancelled.
                b = asyncio.ensure_future(wide_pull(dd, dst, 3 * rnd + 1, 10.0))
                await asyncio.sleep(0.3)
                b.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(b, 5)
            # X is gone (its stream closed): the serving thread is free again. C: yet other
            # source blocks into the same destination blocks; only C's bytes may land.
            await wide_pull_and_check(dd, dst, ref, 3 * rnd + 2)
        # The link is in step: one more pull of other blocks (and a tiny one).
        await wide_pull_and_check(dd, dst, ref, 9)
        await pull_and_check(dd, reg, PROMPT, SEED, "reg", [0, 3], [1, 2], timeout=5.0)


@pytest.mark.asyncio
async def test_cancelled_pull_is_dropped_by_the_serving_side() -> None:
    async with Harness() as h:
        prompt, dd, dst, ref, _ = await wide_setup(h)
        before = await stats(prompt)
        async with RawClient(prompt.host, prompt.port) as x:
            await x.handshake(RAW)
            await x.open_stream(0)
            await hold_the_serving_thread(x, prompt.cache_id("big"), 1, 1500)
            await asyncio.sleep(0.2)
            # A pull with a long deadline, cancelled while the server still has it.
            pull = asyncio.ensure_future(wide_pull(dd, dst, 1, 10.0))
            await asyncio.sleep(0.3)
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(pull, 5)
            # The server learns it (CANCEL) while X still holds the thread.
            was = cancelled(before)
            await until_stats(prompt, lambda st: cancelled(st) == was + 1)
        after = await stats(prompt)
        assert after["served"] == before["served"], (before, after)  # never served
        await wide_pull_and_check(dd, dst, ref, 2)
        final = await stats(prompt)
        assert final["served"] == before["served"] + 1, (before, final)


def cancelled(st: dict[str, int]) -> int:
    return st["cancelled_queued"] + st["cancelled_running"]


async def until_stats(prompt: object, pred: object, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        s = await stats(prompt)
        if pred(s):  # type: ignore[operator]
            return
        if loop.time() > end:
            raise AssertionError(f"serving stats never matched: {s}")
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_a_request_for_retired_streams_is_refused_without_touching_any() -> None:
    """Stream epochs on the wire: a PULL naming the streams of an epoch the requester has
    replaced gets a failed DONE and no byte on any stream; a data stream of an old epoch
    is refused; the current epoch is served, each stream's bytes after their header."""
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, data_path="tcp", seed=SEED)
        reg = prompt.cache_id("reg")
        unit = xc.SPECS["reg"].unit
        ref = xc.reference(SEED, "reg")
        async with RawClient(prompt.host, prompt.port) as raw:
            await raw.handshake(RAW)
            old = await raw.open_stream(0, epoch=1)
            new = await raw.open_stream(0, epoch=2)  # a new set: epoch 1 is retired
            await raw.pull(1, reg, [(0, 0, 0, 0, unit)], epoch=1)
            done = await raw.done()
            assert done["req"] == 1 and done["status"] != S.LLM_SUCCESS, done
            assert "stale" in done["info"], done
            assert await nothing_arrives(new, 0.2) == 0
            with pytest.raises((AssertionError, OSError, TimeoutError)):
                await raw.open_stream(0, epoch=1)  # a stream of a dead epoch: refused
            await raw.pull(2, reg, [(1, 2 * unit, 0, 0, unit)], epoch=2)
            assert await recv_payload(new, 2, unit) == ref[1, 2 * unit : 3 * unit].tobytes()
            assert (await raw.done())["status"] == S.LLM_SUCCESS
            # Retired by the server: closed, never written to.
            old.setblocking(False)
            try:
                data = old.recv(1)  # BlockingIOError (still open) fails the test
            except ConnectionError:
                data = b""
            assert data == b"", data
            got = (await prompt.ok("serve_stats", cluster_id=RAW))["stats"]
            assert (got["stale"], got["served"]) == (1, 1), got


@pytest.mark.asyncio
async def test_server_started_transfers_recover_after_a_failure() -> None:
    """The direction whose streams the client owns but the server uses: after a failed
    server-started transfer, the client connects a new epoch (on CANCEL) and the next
    server-started transfer works."""
    async with Harness() as h:
        opts = decoder_options("tcp", **{"llm.listenIpInfo": "127.0.0.1:0"})
        server, server_caches = await h.local(PROMPT, opts, role=LLMRole.PROMPT, seed=SEED)
        assert server.listen_address is not None
        host, port = server.listen_address
        client, _ = await h.local(DECODER, decoder_options("tcp"), seed=SEED + 1)
        status, _ = await client.link_clusters([cluster_info(PROMPT, host, port)], 5000)
        assert status == S.LLM_SUCCESS
        await until(lambda: server._rt.links.find(DECODER) is not None, what="the link")
        lk = server._rt.links.find(DECODER)
        assert lk is not None
        await lk.path.refresh(None)
        remote = lk.path.remote_table.blocks(xc.MODEL_REG)
        assert remote is not None
        path = lk.path.path_for(remote)
        assert path.kinds == (DataPath.TCP,)
        streams = path.streams  # type: ignore[attr-defined]
        first_epoch = streams.epoch[1]
        spec = xc.SPECS["reg"]
        geo = _native.Geometry(spec.num_tensors, spec.shape[0], spec.unit)
        server_reg = server.cache_manager.table.blocks(xc.MODEL_REG)
        assert server_reg is not None
        ex = server._rt.executor
        loop = asyncio.get_running_loop()
        plan = _native.Plan.blocks(geo, geo, [3], [5], 0, 0, spec.num_tensors)
        with pytest.raises(LLMException) as ei:  # a deadline already passed: not clean
            await path.pull(plan, remote, server_reg, Call("pull_blocks", loop.time(), ex))
        assert ei.value.status_code == S.LLM_TIMEOUT, ei.value
        await until(lambda: streams.epoch[1] > first_epoch, what="a new epoch of streams")
        plan = _native.Plan.blocks(geo, geo, [2, 6], [0, 1], 0, 0, spec.num_tensors)
        await asyncio.wait_for(
            path.pull(plan, remote, server_reg, Call("pull_blocks", loop.time() + 5, ex)), 10
        )
        got = server_caches["reg"].matrix()
        want = xc.reference(SEED + 1, "reg")
        unit = spec.unit
        assert (got[:, 0:unit] == want[:, 2 * unit : 3 * unit]).all()
        assert (got[:, unit : 2 * unit] == want[:, 6 * unit : 7 * unit]).all()


@pytest.mark.asyncio
async def test_push_bytes_of_another_transfer_are_refused_by_the_serving_side() -> None:
    """Push direction: the serving side checks each stream's header before it writes a
    byte of its registered memory; a given-up push's bytes ahead on the stream fail the
    request (nothing written) and retire the stream; the next epoch's push lands."""
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, data_path="tcp", seed=SEED)
        reg = prompt.cache_id("reg")
        unit = xc.SPECS["reg"].unit
        before = (await prompt.ok("digest", name="reg"))["sha"]
        assert before == xc.digests(xc.reference(SEED, "reg"))

        async def push(raw: RawClient, req: int, epoch: int) -> None:
            await raw.write(
                _wire.MsgType.PUSH,
                {
                    "req": req,
                    "cache_id": reg,
                    "src_geometry": [4, 8, 4096],
                    "deadline_ms": 3000,
                    "streams": 1,
                    "epoch": epoch,
                },
                _wire.segments_to_bytes(np.array([(0, 0, 1, 0, unit)], dtype=np.uint64)),
            )

        async with RawClient(prompt.host, prompt.port) as raw:
            await raw.handshake(RAW)
            stream = await raw.open_stream(0, epoch=1)
            stream.sendall(_native.sock_header(5, unit) + b"\xee" * unit)  # push 5's bytes
            await push(raw, 6, epoch=1)
            done = await raw.done()
            assert done["req"] == 6 and done["status"] != S.LLM_SUCCESS, done
            assert "carries transfer 5, not transfer 6" in done["info"], done
            assert (await prompt.ok("digest", name="reg"))["sha"] == before
            # A new epoch, a clean push: exactly its bytes land.
            fresh = await raw.open_stream(0, epoch=2)
            payload = bytes(range(256)) * (unit // 256)
            fresh.sendall(_native.sock_header(7, unit) + payload)
            await push(raw, 7, epoch=2)
            assert (await raw.done())["status"] == S.LLM_SUCCESS
        want = xc.reference(SEED, "reg")
        want[1, :unit] = np.frombuffer(payload, dtype=np.uint8)
        assert (await prompt.ok("digest", name="reg"))["sha"] == xc.digests(want)
