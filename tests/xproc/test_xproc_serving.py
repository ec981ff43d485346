"""The serving side against a hostile or careless peer, and the link's security.

A raw control connection (the handshake done frame by frame with ``_wire``)
sends what a real decoder never would: segments outside the registered cache,
requests past their deadline, wrong MACs. The prompt must answer, send nothing
it should not, and keep serving everyone else.
"""

from __future__ import annotations

import asyncio
import os
import socket

import numpy as np
import pytest

from aiodatadist import LLMDataDist, LLMRole, LLMStatusCode, _wire
from aiodatadist.testing import cluster_info
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import (
    Harness,
    RawClient,
    assert_same,
    decoder_options,
    link,
    nothing_arrives,
    pull_and_check,
    recv_payload,
)

pytestmark = pytest.mark.slow  # peer processes on every data path: the full run's

PROMPT, DECODER, RAW = 21, 22, 23
SEED = 9
UNIT = xc.SPECS["reg"].unit
TENSOR = xc.SPECS["reg"].nbytes
S = LLMStatusCode

# (what it tries, segments (src_tensor, src_off, dst_tensor, dst_off, nbytes)); the
# destination side is always valid for the (4, 8, 4096) geometry the PULL claims.
HOSTILE = [
    ("past the end of a tensor", [(0, TENSOR - 100, 0, 0, 4096)]),
    ("a tensor that does not exist", [(4, 0, 0, 0, 4096)]),
    ("an offset far outside", [(1, 1 << 40, 0, 0, 16)]),
    ("a length that wraps around", [(0, 4096, 0, 0, (1 << 64) - 4096)]),
    ("one bad segment among good ones", [(0, 0, 0, 0, 4096), (3, TENSOR, 1, 0, 1)]),
]


def listening_addresses(pid: int) -> list[str]:
    """Local addresses (hex ``ip:port`` of /proc/net/tcp) of the LISTEN sockets ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    out.append(cols[1])
    return out


@pytest.mark.asyncio
async def test_listen_stays_on_loopback() -> None:
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT)
        assert prompt.host == "127.0.0.1"
        addrs = listening_addresses(prompt.pid)
        assert addrs == [f"0100007F:{prompt.port:04X}"], addrs
        # In this process: the server socket itself.
        dd = LLMDataDist(LLMRole.PROMPT, PROMPT + 100)
        await dd.init({"llm.listenIpInfo": "127.0.0.1:0"})
        h.dds.append(dd)
        assert dd.listen_address is not None and dd.listen_address[0] == "127.0.0.1"
        sock = dd._server._server.sockets[0]
        assert sock.getsockname()[0] == "127.0.0.1"
        # No listen option: no server at all (a pure client).
        plain = LLMDataDist(LLMRole.DECODER, PROMPT + 101)
        await plain.init({})
        h.dds.append(plain)
        assert plain.listen_address is None


@pytest.mark.asyncio
async def test_hostile_pull_is_refused_and_nothing_is_sent() -> None:
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, data_path="tcp", tcp_streams=1, seed=SEED)
        dd, local = await h.local(DECODER, decoder_options("tcp"))
        await link(dd, prompt, PROMPT)
        reg = prompt.cache_id("reg")
        ref = xc.reference(SEED, "reg")
        async with RawClient(prompt.host, prompt.port) as raw:
            welcome = await raw.handshake(RAW)
            assert {d["cache_id"] for d in welcome["table"]} >= {reg}
            stream = await raw.open_stream(0)
            for req, (what, segs) in enumerate(HOSTILE, start=1):
                await raw.pull(req, reg, segs)
                done = await raw.done()
                assert done["req"] == req
                assert done["status"] == S.LLM_PARAM_INVALID, (what, done)
                assert await nothing_arrives(stream, 0.05) == 0, what
            # A cache id that is not registered.
            await raw.pull(99, 424242, [(0, 0, 0, 0, 16)])
            done = await raw.done()
            assert done["status"] == S.LLM_KV_CACHE_NOT_EXIST, done
            assert await nothing_arrives(stream, 0.1) == 0
            # The same connection is still served, and gets exactly the registered bytes.
            await raw.pull(100, reg, [(2, 3 * UNIT, 0, 0, UNIT), (0, 0, 1, 0, 512)])
            data = await recv_payload(stream, 100, UNIT + 512)
            done = await raw.done()
            assert done == {"req": 100, "status": 0, "info": ""}
            assert data == ref[2, 3 * UNIT : 4 * UNIT].tobytes() + ref[0, :512].tobytes()
            # And so is everyone else.
            await pull_and_check(dd, local["reg"], PROMPT, SEED, "reg", [1, 2], [5, 6])


@pytest.mark.asyncio
async def test_hostile_push_is_refused_and_memory_untouched() -> None:
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, data_path="tcp", tcp_streams=1, seed=SEED)
        reg = prompt.cache_id("reg")
        before = await prompt.ok("digest", name="reg")
        assert before["sha"] == xc.digests(xc.reference(SEED, "reg"))
        async with RawClient(prompt.host, prompt.port) as raw:
            await raw.handshake(RAW)
            stream = await raw.open_stream(0)
            for req, (what, segs) in enumerate(HOSTILE, start=1):
                # PUSH: the segments' destination side is the prompt's cache.
                flipped = [(d_t, d_o, s_t, s_o, n) for s_t, s_o, d_t, d_o, n in segs]
                await raw.write(
                    _wire.MsgType.PUSH,
                    {
                        "req": req,
                        "cache_id": reg,
                        "src_geometry": [4, 8, 4096],
                        "deadline_ms": 2000,
                        "streams": 1,
                        "epoch": 1,
                    },
                    _wire.segments_to_bytes(np.array(flipped, dtype=np.uint64).reshape(-1, 5)),
                )
                stream.sendall(b"\xee" * 4096)  # bytes the server must never take
                done = await raw.done()
                assert done["status"] == S.LLM_PARAM_INVALID, (what, done)
        after = await prompt.ok("digest", name="reg")
        assert after["sha"] == before["sha"]


@pytest.mark.asyncio
async def test_impossible_peer_geometry_is_answered() -> None:
    """A PULL whose destination geometry the native core refuses (tensor size past
    2**62 bytes) gets DONE LLM_PARAM_INVALID; the requester is not left waiting for a
    DONE that never comes."""
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, data_path="tcp", tcp_streams=1, seed=SEED)
        reg = prompt.cache_id("reg")
        async with RawClient(prompt.host, prompt.port) as raw:
            await raw.handshake(RAW)
            stream = await raw.open_stream(0)
            await raw.pull(1, reg, [(0, 0, 0, 0, UNIT)], dst_geometry=(1, 1 << 40, 1 << 40))
            done = await raw.done(3)
            assert done["req"] == 1 and done["status"] == S.LLM_PARAM_INVALID, done
            assert await nothing_arrives(stream, 0.05) == 0
            # The link still serves.
            await raw.pull(2, reg, [(1, UNIT, 0, 0, UNIT)])
            await recv_payload(stream, 2, UNIT)
            assert (await raw.done())["status"] == 0


@pytest.mark.asyncio
async def test_request_past_its_deadline_is_dropped() -> None:
    """Requests are served one at a time; one that waited past its deadline is dropped."""
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, data_path="tcp", tcp_streams=1, seed=SEED)
        reg = prompt.cache_id("reg")
        async with RawClient(prompt.host, prompt.port) as raw:
            await raw.handshake(RAW)
            # No data stream yet: the first request waits for one until its deadline ...
            await raw.pull(1, reg, [(0, 0, 0, 0, UNIT)], deadline_ms=600)
            # ... and the second, queued behind it, is past its own deadline when its turn comes.
            await raw.pull(2, reg, [(0, 0, 0, 0, UNIT)], deadline_ms=150)
            first = await raw.done(5)
            assert first["req"] == 1 and first["status"] == S.LLM_TIMEOUT, first
            second = await raw.done(0.3)  # no second wait for streams
            assert second["req"] == 2 and second["status"] == S.LLM_TIMEOUT, second
            assert "after its deadline" in second["info"], second
            # The link still serves a request in time.
            stream = await raw.open_stream(0)
            await raw.pull(3, reg, [(1, UNIT, 0, 0, UNIT)], deadline_ms=3000)
            data = await recv_payload(stream, 3, UNIT)
            assert (await raw.done())["status"] == 0
            assert data == xc.reference(SEED, "reg")[1, UNIT : 2 * UNIT].tobytes()


@pytest.mark.asyncio
async def test_wrong_secret_is_refused() -> None:
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, secret="alpha-secret", seed=SEED)
        info = [cluster_info(PROMPT, prompt.host, prompt.port)]
        for i, extra in enumerate(({"aiodatadist.SharedSecret": "beta-secret"}, {})):
            dd, _ = await h.local(DECODER + 10 * i, decoder_options(**extra))
            status, statuses = await dd.link_clusters(info, 3000)  # never raises
            assert status == S.LLM_LINK_FAILED and statuses == [S.LLM_LINK_FAILED], extra
            assert dd.links == []
        # What a client without the secret learns: the challenge, then a refusal.
        async with RawClient(prompt.host, prompt.port) as raw:
            _, challenge = await raw.hello(RAW, want_auth=True)
            assert challenge.type == _wire.MsgType.CHALLENGE
            assert set(challenge.body) == {"cluster_id", "nonce", "auth_required"}
            assert challenge.body["auth_required"] is True
            await raw.write(_wire.MsgType.AUTH, {"mac": "ab" * 32})
            refuse = await raw.read()
            assert refuse.type == _wire.MsgType.REFUSE, refuse
            assert refuse.body["status"] == S.LLM_LINK_FAILED
            assert refuse.body["reason"] == _wire.AUTH_FAILED_REASON
            with pytest.raises(_wire.ConnectionClosed):
                await raw.read(5)
        # The right secret links, and the link works.
        dd, local = await h.local(
            DECODER + 30, decoder_options(**{"aiodatadist.SharedSecret": "alpha-secret"})
        )
        await link(dd, prompt, PROMPT)
        await pull_and_check(dd, local["reg"], PROMPT, SEED, "reg", [0, 7], [7, 0])


@pytest.mark.asyncio
async def test_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    async with Harness() as h:
        prompt = await h.peer(
            cluster_id=PROMPT, seed=SEED, env={"AIODATADIST_SECRET": "env-secret"}
        )
        info = [cluster_info(PROMPT, prompt.host, prompt.port)]
        monkeypatch.setenv("AIODATADIST_SECRET", "not-it")
        wrong, _ = await h.local(DECODER)
        assert await wrong.link_clusters(info, 3000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        monkeypatch.setenv("AIODATADIST_SECRET", "env-secret")
        dd, local = await h.local(DECODER + 1)
        await link(dd, prompt, PROMPT)
        await pull_and_check(dd, local["alloc"], PROMPT, SEED, "alloc", [3], [4])
        monkeypatch.delenv("AIODATADIST_SECRET")
        none, _ = await h.local(DECODER + 2)
        assert await none.link_clusters(info, 3000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        assert_same(
            local["alloc"].matrix()[:, 4 * UNIT : 5 * UNIT],
            xc.reference(SEED, "alloc")[:, 3 * UNIT : 4 * UNIT],
        )


@pytest.mark.asyncio
async def test_failed_links_return_a_status_and_never_raise() -> None:
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, seed=SEED)
        dd, local = await h.local(DECODER)
        loop = asyncio.get_running_loop()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # accepts, never answers
            writer.close()

        mute = await asyncio.start_server(silent, "127.0.0.1", 0)
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
        try:
            mute_port = mute.sockets[0].getsockname()[1]
            started = loop.time()
            status, statuses = await dd.link_clusters(
                [
                    cluster_info(PROMPT + 50, prompt.host, prompt.port),  # another cluster id
                    cluster_info(PROMPT + 51, "127.0.0.1", closed.getsockname()[1]),
                    cluster_info(PROMPT + 52, "127.0.0.1", mute_port),
                    cluster_info(PROMPT, prompt.host, prompt.port),  # the one that works
                ],
                500,
            )
            assert loop.time() - started < 3
        finally:
            closed.close()
            mute.close()
            await mute.wait_closed()
        assert statuses[:3] == [S.LLM_LINK_FAILED] * 3, statuses
        assert statuses[3] == S.LLM_SUCCESS and status == S.LLM_LINK_FAILED
        assert [lk.remote_cluster_id for lk in dd.links] == [PROMPT]
        # Linking again to a linked cluster says so.
        again = await dd.link_clusters([cluster_info(PROMPT, prompt.host, prompt.port)])
        assert again == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
        await pull_and_check(dd, local["reg"], PROMPT, SEED, "reg", [4], [4])


@pytest.mark.asyncio
async def test_garbage_on_the_wire_closes_only_that_connection() -> None:
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, seed=SEED)
        dd, local = await h.local(DECODER)
        await link(dd, prompt, PROMPT)
        # Not our protocol at all.
        async with RawClient(prompt.host, prompt.port) as raw:
            assert raw.writer is not None
            raw.writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            with pytest.raises(_wire.ConnectionClosed):
                await raw.read(5)
        # A data stream with a made-up link token.
        async with RawClient(prompt.host, prompt.port) as raw:
            raw.welcome = {"link_token": "00" * 16}
            with pytest.raises((AssertionError, OSError, TimeoutError)):
                await raw.open_stream(0)
        # A linked peer that breaks the format after the handshake is dropped ...
        async with RawClient(prompt.host, prompt.port) as raw:
            await raw.handshake(RAW)
            assert raw.writer is not None
            raw.writer.write(b"ADDW" + bytes([_wire.PROTOCOL_VERSION, 99]) + bytes(10))
            with pytest.raises(_wire.ConnectionClosed):
                await raw.done(5)
        # ... and an oversized frame is refused from its header alone.
        async with RawClient(prompt.host, prompt.port) as raw:
            await raw.handshake(RAW + 1)
            assert raw.writer is not None
            raw.writer.write(
                _wire.HEADER.pack(
                    _wire.MAGIC, _wire.PROTOCOL_VERSION, int(_wire.MsgType.PULL), 0, 1 << 30, 0
                )
            )
            with pytest.raises(_wire.ConnectionClosed):
                await raw.done(5)
        links = (await prompt.ok("links"))["links"]
        assert [lk["cluster_id"] for lk in links] == [DECODER]
        await pull_and_check(dd, local["alloc"], PROMPT, SEED, "alloc", [2, 3], [3, 2])
