"""The serving side is fair and bounded (issue 9, finding 5), and the tcp path takes
any deadline (finding 9, tcp part).

Peers that ask for the largest deadline the wire allows (about 24.9 days) and then stop
reading hold at most one serving thread each, for at most ``aiodatadist.ServeTimeout``;
they never starve other decoders, and the cache they pulled from can be freed after.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import numpy as np
import pytest

from aiodatadist import LLMRole, LLMStatusCode, _native, _wire
from aiodatadist.config import DataPath
from aiodatadist.testing import cluster_info
from aiodatadist.transports.base import Call
from aiodatadist.transports.tcp import deadline_ms
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import (
    Harness,
    RawClient,
    decoder_options,
    link,
    pull_and_check,
)

pytestmark = pytest.mark.slow  # peer processes on every data path: the full run's

PROMPT, DECODER, RAW = 71, 72, 73
SEED = 23
S = LLMStatusCode


async def silent_pull(raw: RawClient, prompt_big: int, req: int) -> None:
    """A 64 MiB pull with the largest deadline, on a stream this client never reads."""
    spec = xc.big_spec(64)
    await raw.pull(
        req,
        prompt_big,
        [(0, 0, 0, 0, spec.nbytes), (1, 0, 1, 0, spec.nbytes)],
        dst_geometry=(2, spec.shape[0], spec.unit),
        deadline_ms=_wire.MAX_DEADLINE_MS,
    )


@pytest.mark.asyncio
async def test_silent_peers_do_not_starve_others_and_are_capped() -> None:
    async with Harness() as h:
        # Two serving threads (the old executor's default): the two silent peers would
        # hold both of them if a peer could take more than its share, or keep them.
        prompt = await h.peer(
            cluster_id=PROMPT,
            data_path="tcp",
            seed=SEED,
            big_mib=64,
            options={"aiodatadist.ServeThreads": "2", "aiodatadist.ServeTimeout": "2000"},
        )
        big = prompt.cache_id("big")
        dd, local = await h.local(DECODER, decoder_options("tcp"))
        await link(dd, prompt, PROMPT)
        loop = asyncio.get_running_loop()
        async with (
            RawClient(prompt.host, prompt.port) as a,
            RawClient(prompt.host, prompt.port) as b,
        ):
            for i, raw in enumerate((a, b)):
                await raw.handshake(RAW + i)
                await raw.open_stream(0)
            started = loop.time()
            for raw in (a, b):
                await silent_pull(raw, big, 1)
                await silent_pull(raw, big, 2)  # queued behind its first: its share is one
            await asyncio.sleep(0.3)  # both are stuck sending by now
            # Another decoder's pulls are served, with the right bytes, in their normal time.
            for blocks in ([1, 2], [5], [0, 7]):
                await pull_and_check(
                    dd,
                    local["reg"],
                    PROMPT,
                    SEED,
                    "reg",
                    blocks,
                    [3, 4][: len(blocks)],
                    timeout=2.0,
                )
            # The cap (ServeTimeout, 2 s from arrival) ends the silent requests: each
            # gets its DONE (a timeout) long before the 24.9 days it asked for.
            for raw in (a, b):
                first = await raw.done(timeout=10)
                assert first["req"] == 1 and first["status"] == S.LLM_TIMEOUT, first
                second = await raw.done(timeout=10)
                assert second["req"] == 2 and second["status"] != S.LLM_SUCCESS, second
            assert loop.time() - started < 9.0
            # Nothing holds the cache any more: it can be freed.
            assert (await prompt.ok("free", name="big"))["ok"]
        await pull_and_check(dd, local["reg"], PROMPT, SEED, "reg", [6], [0], timeout=2.0)


def test_deadline_ms_takes_any_deadline() -> None:
    top = _wire.MAX_DEADLINE_MS
    assert deadline_ms(None, 5.0) == top
    assert deadline_ms(math.inf, 5.0) == top
    assert deadline_ms(math.nan, 5.0) == top
    assert deadline_ms(1e300, 5.0) == top
    assert deadline_ms(5.0 + 10**7, 5.0) == top  # 115 days: more than the wire allows
    assert deadline_ms(6.5, 5.0) == 1500
    assert deadline_ms(4.0, 5.0) == 1  # already past: the server answers it at once
    assert deadline_ms(-math.inf, 5.0) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("far", [math.inf, 1e300, None], ids=["inf", "1e300", "none"])
async def test_tcp_pull_with_an_unbounded_deadline(far: float | None) -> None:
    """The tcp path itself takes any call deadline (before: OverflowError on inf)."""
    async with Harness() as h:
        opts = decoder_options("tcp", **{"llm.listenIpInfo": "127.0.0.1:0"})
        prompt, _ = await h.local(PROMPT, opts, role=LLMRole.PROMPT, seed=SEED)
        assert prompt.listen_address is not None
        host, port = prompt.listen_address
        dd, local = await h.local(DECODER, decoder_options("tcp"))
        status, _ = await dd.link_clusters([cluster_info(PROMPT, host, port)], 5000)
        assert status == S.LLM_SUCCESS
        lk = dd._rt.links.find(PROMPT)
        assert lk is not None
        remote = lk.path.remote_table.blocks(xc.MODEL_REG)
        assert remote is not None
        path = lk.path.path_for(remote)
        assert path.kinds == (DataPath.TCP,)
        dst = local["reg"]
        mine = dd.cache_manager.table.by_id(dst.cache.cache_id)
        assert mine is not None
        spec = xc.SPECS["reg"]
        geo = _native.Geometry(spec.num_tensors, spec.shape[0], spec.unit)
        plan = _native.Plan.blocks(geo, geo, [2, 5], [6, 1], 0, 0, spec.num_tensors)
        before = dst.matrix()
        call = Call("pull_blocks", far, dd._rt.executor)
        await asyncio.wait_for(path.pull(plan, remote, mine, call), 10)
        want = xc.expect_blocks(
            before,
            xc.reference(SEED, "reg"),
            spec.unit,
            [2, 5],
            [6, 1],
            (0, 0, spec.num_tensors),
        )
        assert (dst.matrix() == want).all()


@pytest.mark.asyncio
async def test_a_peer_that_stops_reading_replies_is_dropped_within_the_cap() -> None:
    """A linked peer floods requests and never reads the replies: once its DONEs no longer
    fit, the serving side waits at most ServeTimeout for one, then closes that link (it
    never waits forever), and everyone else is still served."""
    async with Harness() as h:
        prompt = await h.peer(
            cluster_id=PROMPT,
            data_path="tcp",
            seed=SEED,
            options={"aiodatadist.ServeTimeout": "1000"},
        )
        dd, local = await h.local(DECODER, decoder_options("tcp"))
        await link(dd, prompt, PROMPT)
        async with RawClient(prompt.host, prompt.port, rcvbuf=4096) as raw:
            await raw.handshake(RAW)
            assert raw.writer is not None
            writer = raw.writer
            frame = _wire.encode(
                _wire.MsgType.PULL,
                {
                    "req": 1,
                    "cache_id": 424242,  # no such cache: a DONE each, at once
                    "dst_geometry": [4, 8, 4096],
                    "deadline_ms": 1000,
                    "streams": 1,
                    "epoch": 1,
                },
                _wire.segments_to_bytes(np.array([(0, 0, 0, 0, 16)], dtype=np.uint64)),
            )

            async def flood() -> None:
                for _ in range(200_000):
                    writer.write(frame * 64)
                    await writer.drain()

            flooding = asyncio.ensure_future(flood())
            loop = asyncio.get_running_loop()
            end = loop.time() + 30
            try:
                while True:
                    links = (await prompt.ok("links"))["links"]
                    if RAW not in [lk["cluster_id"] for lk in links]:
                        break
                    assert loop.time() < end, "the silent peer's link was never closed"
                    await asyncio.sleep(0.2)
            finally:
                flooding.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(flooding, 5)
        await pull_and_check(dd, local["reg"], PROMPT, SEED, "reg", [3], [5], timeout=2.0)
