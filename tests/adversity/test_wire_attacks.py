"""Wire attacks against a real listening prompt (an actor process with a shared secret).

A siege runs on a thread for the whole module: garbage bytes, huge length prefixes,
a slowloris (a valid HELLO, a byte per second), a crowd of idle connections. While
it runs: a legitimate decoder (the right secret) keeps pulling verified bytes over
every path; decoders with a wrong secret are refused; an authenticated hostile peer
sends out-of-bounds PULL segments; silent peers queue huge requests with the largest
deadline and never read (issue 9, finding 5). The last test checks that the server
closed every hostile connection within its bound.
"""

from __future__ import annotations

import asyncio
import random
import resource
import time
from collections.abc import Iterator

import numpy as np
import pytest

from aiodatadist import LLMDataDist, LLMException, LLMRole, _wire
from aiodatadist.testing import cluster_info
from tests.adversity._common import (
    NUM_BLOCKS,
    NUM_TENSORS,
    ActorProc,
    Figures,
    cache_spec,
    check_pull,
    new_cluster_id,
    random_blocks,
    snapshot,
    start_prompt,
)
from tests.adversity._raw import RawClient, Siege, attacks
from tests.adversity._rig import Rig, decoder_options, rig

pytestmark = pytest.mark.slow  # actor processes under load for seconds: the full run's

SECRET = "adversity-secret-\u00e9"
HANDSHAKE_TIMEOUT = 10.0
with __import__("contextlib").suppress(Exception):
    from aiodatadist import _control

    HANDSHAKE_TIMEOUT = float(getattr(_control, "HANDSHAKE_TIMEOUT", 10.0))

TENSOR_BYTES = NUM_BLOCKS * 8192
SILENT_MODEL = 3


@pytest.fixture(scope="module")
def prompt() -> Iterator[ActorProc]:
    a = start_prompt(secret=SECRET)
    try:
        asyncio.run(a.ok("cache", **cache_spec("silent", SILENT_MODEL, False)))
    except BaseException:
        a.stop()
        raise
    yield a
    a.stop()


@pytest.fixture(scope="module")
def siege(prompt: ActorProc) -> Iterator[Siege]:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    idle = max(8, min(200, soft // 8))
    s = Siege(prompt.address, attacks(HANDSHAKE_TIMEOUT, np.random.default_rng(), idle)).start()
    yield s
    s.close()


async def verified_pulls(
    r: Rig, fig: Figures, rng: np.random.Generator, seconds: float, *, least: int = 3
) -> None:
    """Verified pulls for ``seconds`` (at least ``least``); every one must succeed."""
    end = time.monotonic() + seconds
    k = 0
    while k < least or time.monotonic() < end:
        k += 1
        seed = int(rng.integers(1 << 50))
        src, dst = random_blocks(rng, NUM_BLOCKS, NUM_BLOCKS, 16)
        await r.fill(seed, src)
        before = snapshot(r.dst.tensors)
        await r.decoder.cache_manager.pull_blocks(r.key, r.dst.cache, src, dst, timeout=5.0)
        bad, canary = check_pull(r.dst.tensors, before, src, dst, seed)
        fig.pulls += 1
        fig.bytes += len(src) * r.block_bytes * NUM_TENSORS
        if bad or canary:
            fig.bad(f"{r.path} pull {k}: {bad} + {canary} bytes wrong", bad + canary)


@pytest.mark.adversity(ci=0.5, weight=1.0)
@pytest.mark.parametrize("path", ["tcp", "cma", "shm"])
@pytest.mark.asyncio
async def test_legit_decoder_served_under_siege(
    path: str, prompt: ActorProc, siege: Siege, budget: float
) -> None:
    fig = Figures(f"siege-legit[{path}]")
    rng = np.random.default_rng(random.randrange(1 << 32))
    async with rig(path, prompt, secret=SECRET) as r:
        await verified_pulls(r, fig, rng, budget)
        # Wrong secrets, meanwhile: refused within the link timeout, never linked.
        for wrong in ("", "adversity-secret-e", SECRET + "x"):
            dd = LLMDataDist(LLMRole.DECODER, new_cluster_id())
            opts = decoder_options(path)
            if wrong:
                opts["aiodatadist.SharedSecret"] = wrong
            await dd.init(opts)
            try:
                t0 = time.monotonic()
                fig.faults += 1
                try:
                    status, _ = await dd.link_clusters(
                        [cluster_info(prompt.cluster_id, *prompt.address)], 3000
                    )
                except LLMException as e:
                    fig.error(e)
                    status = e.status_code
                took = time.monotonic() - t0
                assert status != 0, f"a decoder with secret {wrong!r} was linked"
                fig.errors[f"link:{getattr(status, 'name', status)}"] += 1
                if took > 3.0 + 3.0:
                    fig.late(f"wrong secret {wrong!r}: refused after {took:.1f} s")
                assert not dd.links
            finally:
                await dd.finalize()
        await verified_pulls(r, fig, rng, 0.0)
    fig.check()


OOB = [
    ("src past the end", [(0, TENSOR_BYTES, 0, 0, 8192)]),
    ("src straddles the end", [(0, TENSOR_BYTES - 4096, 0, 0, 8192)]),
    ("huge nbytes", [(0, 0, 0, 0, 1 << 63)]),
    ("offset wraps", [(0, (1 << 64) - 8192, 0, 0, 16384)]),
    ("tensor past the end", [(NUM_TENSORS, 0, 0, 0, 8192)]),
    ("tensor 2**64-1", [((1 << 64) - 1, 0, 0, 0, 1)]),
    ("dst past its geometry", [(0, 0, 0, TENSOR_BYTES, 8192)]),
    ("one good, one bad", [(0, 0, 0, 0, 8192), (1, TENSOR_BYTES, 1, 0, 8192)]),
]


@pytest.mark.adversity(ci=0.5, weight=0.5)
@pytest.mark.asyncio
async def test_out_of_bounds_requests_refused(
    prompt: ActorProc, siege: Siege, budget: float
) -> None:
    fig = Figures("oob-requests")
    rng = np.random.default_rng(random.randrange(1 << 32))
    async with RawClient(*prompt.address, secret=SECRET.encode(), cluster_id=new_cluster_id()) as c:
        welcome = await c.handshake()
        assert welcome.type == _wire.MsgType.WELCOME, welcome
        table = c.welcome["table"]
        ids = [d["cache_id"] for d in table if d.get("model_id") == 1]
        assert ids, table
        cache_id = int(ids[0])
        await c.open_stream(0)
        geo = (NUM_TENSORS, NUM_BLOCKS, 8192)
        end = time.monotonic() + budget
        rounds = 0
        while rounds == 0 or time.monotonic() < end:
            rounds += 1
            for i, (what, segs) in enumerate(OOB):
                req = rounds * 100 + i
                fig.faults += 1
                t0 = time.monotonic()
                await c.pull(req, cache_id, segs, dst_geometry=geo, deadline_ms=2000)
                try:
                    done = await c.done(timeout=2.0 + 5.0)
                except TimeoutError:
                    fig.late(f"{what}: no DONE within 7 s")
                    continue
                took = time.monotonic() - t0
                assert done["req"] == req, (what, done)
                assert done["status"] != 0, f"{what}: served ({done})"
                fig.errors[f"oob:{done['status']:#x}"] += 1
                if took > 7.0:
                    fig.late(f"{what}: DONE after {took:.1f} s")
            # An unknown cache id.
            await c.pull(rounds * 100 + 99, 1 << 60, [(0, 0, 0, 0, 8192)], dst_geometry=geo)
            done = await c.done(timeout=7.0)
            assert done["status"] != 0, done
    # Still serving a legitimate decoder, every path.
    for path in ("tcp", "cma"):
        async with rig(path, prompt, secret=SECRET) as r:
            await verified_pulls(r, fig, rng, 0.0, least=2)
    fig.other["rounds"] = rounds
    fig.check()


@pytest.mark.adversity(ci=0.5, weight=0.5)
@pytest.mark.asyncio
async def test_silent_peers_do_not_starve_others(
    prompt: ActorProc, siege: Siege, budget: float
) -> None:
    """Peers that queue huge pulls with the largest deadline and never read must not hold
    the serving side: other decoders' pulls succeed within their deadline, and the
    prompt can free the cache they named within a bound."""
    fig = Figures("silent-peers")
    rng = np.random.default_rng(random.randrange(1 << 32))
    rows = 200
    segs = [(i % NUM_TENSORS, 0, i, 0, TENSOR_BYTES) for i in range(rows)]
    geo = (rows, NUM_BLOCKS, 8192)
    max_deadline = int(getattr(_wire, "MAX_DEADLINE_MS", 2**31 - 1))
    clients: list[RawClient] = []
    try:
        for _ in range(3):
            c = RawClient(*prompt.address, secret=SECRET.encode(), cluster_id=new_cluster_id())
            await c.__aenter__()
            clients.append(c)
            w = await c.handshake()
            assert w.type == _wire.MsgType.WELCOME, w
            silent = [
                d["cache_id"] for d in c.welcome["table"] if d.get("model_id") == SILENT_MODEL
            ]
            assert silent, c.welcome["table"]
            await c.open_stream(0)
            for k in range(2):
                fig.faults += 1
                await c.pull(
                    k + 1, int(silent[0]), segs, dst_geometry=geo, deadline_ms=max_deadline
                )
        await asyncio.sleep(0.3)  # the serving side is now stuck on them, if it can be
        async with rig("tcp", prompt, secret=SECRET) as r:
            t0 = time.monotonic()
            try:
                await verified_pulls(r, fig, rng, budget)
            except LLMException as e:
                fig.error(e)
                fig.late(
                    f"a legitimate pull failed behind silent peers after "
                    f"{time.monotonic() - t0:.1f} s: {e}"[:300]
                )
        # The prompt frees the cache the silent peers named: done (or LLM_LINK_BUSY)
        # within a bound, not after their 24-day deadline.
        t0 = time.monotonic()
        try:
            reply = await prompt.call("free", name="silent", timeout=20.0)
        except TimeoutError:
            reply = {"ok": False, "error": "no reply in 20 s"}
        took = time.monotonic() - t0
        fig.other["free"] = {k: v for k, v in reply.items() if k != "tb"}
        if took > 15.0:
            fig.late(f"freeing the cache silent peers named took {took:.1f} s: {reply}")
        freed = bool(reply.get("ok"))
        # The silent peers go away: what the server still had running for them ends, and
        # the cache can be freed within a bound.
        for c in clients:
            await c.__aexit__(None, None, None)
        clients.clear()
        t0 = time.monotonic()
        while not freed:
            reply = await prompt.call("free", name="silent", timeout=20.0)
            freed = bool(reply.get("ok"))
            if not freed:
                if time.monotonic() - t0 > 10.0:
                    fig.late(
                        f"the cache silent peers named is still busy 10 s after they "
                        f"left: {reply.get('error')}"[:300]
                    )
                    break
                await asyncio.sleep(0.2)
        fig.other["freed_after_leaving_s"] = round(time.monotonic() - t0, 2)
        if freed:
            # Registered again for the other loop's run of this test.
            await prompt.ok("cache", **cache_spec("silent", SILENT_MODEL, False))
    finally:
        for c in clients:
            await c.__aexit__(None, None, None)
    fig.check()


@pytest.mark.asyncio
async def test_hostile_connections_closed_in_time(prompt: ActorProc, siege: Siege) -> None:
    """Every hostile connection of the siege was closed by the server within its bound
    (the slowest: the handshake timeout); then the server still serves (verified)."""
    fig = Figures("siege")
    await asyncio.to_thread(siege.join, max(a.bound for a in siege.plan) + 15)
    assert not siege.thread.is_alive(), "the siege did not end"
    assert not siege.failure, siege.failure
    for a in siege.plan:
        fig.faults += 1
        if not a.ok:
            fig.late(f"{a.kind}: closed after {a.closed_after} s (bound {a.bound} s) {a.error}")
    fig.other["connections"] = len(siege.plan)
    async with rig("tcp", prompt, secret=SECRET) as r:
        await verified_pulls(r, fig, np.random.default_rng(random.randrange(1 << 32)), 0.0)
    fig.check()
