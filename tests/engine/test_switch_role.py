"""``switch_role``: checks, LLM_EXIST_LINK, the listener it (re)starts or stops, and
upstream's switch-role sample flow (link, pull, unlink, swap roles, link back, pull)."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from aiodatadist import (
    BlocksCacheKey,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMParamError,
    LLMRole,
    LLMStatusCode,
)
from aiodatadist.testing import make_blocks_cache, pattern_mismatches
from tests.engine.test_two_sided import rank_table

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
BLOCK = (16, 2, 64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def remote(cluster_id: int, address: tuple[str, int]) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_remote_ip_info(*address)
    return info


async def pull_checked(client: LLMDataDist, server: LLMDataDist, seed: int) -> None:
    dst = make_blocks_cache(client, num_tensors=2, num_blocks=4, block_shape=BLOCK)
    await client.cache_manager.pull_blocks(
        BlocksCacheKey(server.cluster_id, 0), dst.cache, [2, 0], [1, 3]
    )
    assert pattern_mismatches(dst.tensors, [2, 0], [1, 3], seed) == []
    client.cache_manager.unregister_cache(dst.cache.cache_id)


async def test_sample_flow_swaps_roles_and_links_back(caplog: pytest.LogCaptureFixture) -> None:
    port_p = free_port()
    # Every link goes over tcp (what the sample does across hosts), not in-process.
    tcp = {"aiodatadist.DataPath": "tcp"}
    p = LLMDataDist(LLMRole.PROMPT, 6001, {**tcp, "llm.listenIpInfo": f"127.0.0.1:{port_p}"})
    d = LLMDataDist(LLMRole.DECODER, 6002, tcp)
    await p.init()
    await d.init()
    try:
        seed_p, seed_d = 0x6001, 0x6002
        make_blocks_cache(
            p, num_tensors=2, num_blocks=4, block_shape=BLOCK, model_id=0, seed=seed_p, pattern=True
        )
        make_blocks_cache(
            d, num_tensors=2, num_blocks=4, block_shape=BLOCK, model_id=0, seed=seed_d, pattern=True
        )
        status, _ = await d.link_clusters([remote(6001, ("127.0.0.1", port_p))])
        assert status == S.LLM_SUCCESS
        await pull_checked(d, p, seed_p)
        for dd in (p, d):  # a link exists: refused, nothing changes
            with pytest.raises(LLMException) as info:
                await dd.switch_role(LLMRole.MIX)
            assert info.value.status_code == S.LLM_EXIST_LINK
        assert (p.role, d.role) == (LLMRole.PROMPT, LLMRole.DECODER)
        assert p.listen_address == ("127.0.0.1", port_p)
        status, _ = await d.unlink_clusters([remote(6001, ("127.0.0.1", port_p))])
        assert status == S.LLM_SUCCESS
        async with asyncio.timeout(5):  # p's side closes when the peer's UNLINK arrives
            while True:
                if not p.links:
                    break
                await asyncio.sleep(0.01)

        # Swap: the decoder becomes the prompt and listens; the prompt becomes a client.
        port_d = free_port()
        with caplog.at_level(logging.INFO, logger="aiodatadist"):
            await d.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port_d}"})
            await p.switch_role(LLMRole.DECODER)
        assert "switch_role DECODER -> PROMPT" in caplog.text
        assert "switch_role PROMPT -> DECODER" in caplog.text
        assert (p.role, d.role) == (LLMRole.DECODER, LLMRole.PROMPT)
        assert d.listen_address == ("127.0.0.1", port_d)
        assert p.listen_address is None  # a pure client now: its old port is closed
        status, _ = await d.link_clusters([remote(6001, ("127.0.0.1", port_p))], timeout=500)
        assert status == S.LLM_LINK_FAILED
        status, _ = await p.link_clusters([remote(6002, ("127.0.0.1", port_d))])
        assert status == S.LLM_SUCCESS
        assert p.links[0].path.peer.info.role == int(LLMRole.PROMPT)  # the new role travels
        await pull_checked(p, d, seed_d)
        status, _ = await p.unlink_clusters([remote(6002, ("127.0.0.1", port_d))])
        assert status == S.LLM_SUCCESS
    finally:
        await p.finalize()
        await d.finalize()


async def test_same_role_and_restart_elsewhere() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 6011)
    await dd.init()
    try:
        await dd.switch_role(LLMRole.DECODER)  # v2: allowed
        assert dd.role == LLMRole.DECODER and dd.listen_address is None
        port1, port2 = free_port(), free_port()
        await dd.switch_role(LLMRole.DECODER, {"llm.listenIpInfo": f"127.0.0.1:{port1}"})
        assert dd.listen_address == ("127.0.0.1", port1)
        await dd.switch_role(LLMRole.MIX, {"llm.listenIpInfo": f"127.0.0.1:{port2}"})
        assert dd.listen_address == ("127.0.0.1", port2) and dd.role == LLMRole.MIX
        with socket.socket() as s:  # the first port is free again
            s.bind(("127.0.0.1", port1))
        await dd.switch_role(LLMRole.PROMPT, {})
        assert dd.listen_address is None and dd.role == LLMRole.PROMPT
        # What upstream's switch-role sample passes: all of LLMConfig.generate_options().
        cfg = LLMConfig()
        cfg.listen_ip_info = f"127.0.0.1:{port1}"
        opts = cfg.generate_options()
        assert set(opts) > {"llm.listenIpInfo"}
        await dd.switch_role(LLMRole.DECODER, {**opts, "ge.exec.deviceId": "0"})
        assert dd.listen_address == ("127.0.0.1", port1) and dd.role == LLMRole.DECODER
    finally:
        await dd.finalize()


@pytest.mark.parametrize(
    ("role", "options", "exc", "words"),
    [
        (1, None, TypeError, "role"),
        ("PROMPT", None, TypeError, "role"),
        (LLMRole.PROMPT, [("llm.listenIpInfo", "127.0.0.1:0")], TypeError, "switch_options"),
        (LLMRole.PROMPT, {"llm.listenIpInfo": 26000}, TypeError, "switch_options"),
        (LLMRole.PROMPT, {1: "x"}, TypeError, "switch_options key"),
        (LLMRole.PROMPT, {"llm.listenIpInfo": "nowhere"}, LLMParamError, "listenIpInfo"),
        (LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:70000"}, LLMParamError, "listenIpInfo"),
        (LLMRole.PROMPT, {"llm.ListenPort": "1"}, LLMParamError, "llm.ListenPort"),
        (LLMRole.PROMPT, {"llm.listenIpInfoo": "127.0.0.1:1"}, LLMParamError, "listenIpInfoo"),
        (LLMRole.PROMPT, {"llm.MemoryUtilization": "2"}, LLMParamError, "MemoryUtilization"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
async def test_bad_arguments_change_nothing(role, options, exc, words) -> None:
    port = free_port()
    dd = LLMDataDist(LLMRole.DECODER, 6021, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
    await dd.init()
    try:
        with pytest.raises(exc, match=words):
            await dd.switch_role(role, options)
        assert dd.role == LLMRole.DECODER
        assert dd.listen_address == ("127.0.0.1", port)  # not stopped
    finally:
        await dd.finalize()


async def test_exist_link_while_a_comm_is_establishing() -> None:
    a = LLMDataDist(LLMRole.MIX, 6031, {"llm.LinkTotalTime": "30"})
    b = LLMDataDist(LLMRole.MIX, 6032)
    await a.init()
    await b.init()
    try:
        comm_id = await a.link("pending", {6031: 0, 6032: 1}, rank_table([0, 1]))
        assert not a.links  # b never joins: establishing, no link yet
        with pytest.raises(LLMException) as info:
            await a.switch_role(LLMRole.PROMPT)
        assert info.value.status_code == S.LLM_EXIST_LINK
        assert a.role == LLMRole.MIX
        await a.unlink(comm_id)
        await a.switch_role(LLMRole.PROMPT)
        assert a.role == LLMRole.PROMPT
    finally:
        await a.finalize()
        await b.finalize()


async def test_switch_role_needs_init() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 6041)
    with pytest.raises(RuntimeError, match="not initialized"):
        await dd.switch_role(LLMRole.PROMPT)


async def test_a_port_in_use_keeps_the_old_listener() -> None:
    port = free_port()
    dd = LLMDataDist(LLMRole.DECODER, 6051, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
    await dd.init()
    try:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            taken = busy.getsockname()[1]
            with pytest.raises(LLMParamError, match="cannot listen"):
                await dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{taken}"})
        assert dd.role == LLMRole.DECODER
        assert dd.listen_address == ("127.0.0.1", port)  # listening where it was
    finally:
        await dd.finalize()
