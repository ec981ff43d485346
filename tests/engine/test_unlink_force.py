"""Force unlink from both sides (three upstream samples do it): LLM_SUCCESS on each side,
and both can link again; a non-forced unlink of an unlinked cluster stays LLM_NOT_YET_LINK."""

from __future__ import annotations

import pytest

from aiodatadist import BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMRole, LLMStatusCode
from aiodatadist.testing import cluster_info, make_blocks_cache, pattern_mismatches

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
BLOCK = (16, 2, 64)


def remote(cluster_id: int, address: tuple[str, int]) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_remote_ip_info(*address)
    return info


async def pull_checked(d: LLMDataDist, p: LLMDataDist, seed: int) -> None:
    dst = make_blocks_cache(d, num_tensors=2, num_blocks=4, block_shape=BLOCK)
    await d.cache_manager.pull_blocks(BlocksCacheKey(p.cluster_id, 0), dst.cache, [1, 3], [0, 2])
    assert pattern_mismatches(dst.tensors, [1, 3], [0, 2], seed) == []
    d.cache_manager.unregister_cache(dst.cache.cache_id)


@pytest.mark.parametrize("route", ["inproc", "tcp"])
async def test_force_unlink_from_both_sides(route: str) -> None:
    opts = {"aiodatadist.DataPath": "tcp"} if route == "tcp" else {}
    listen = {"llm.listenIpInfo": "127.0.0.1:0"} if route == "tcp" else {}
    p = LLMDataDist(LLMRole.PROMPT, 6101, {**opts, **listen})
    d = LLMDataDist(LLMRole.DECODER, 6102, opts)
    await p.init()
    await d.init()
    try:
        seed = 0x6101
        make_blocks_cache(
            p, num_tensors=2, num_blocks=4, block_shape=BLOCK, model_id=0, seed=seed, pattern=True
        )
        to_p = remote(6101, p.listen_address) if route == "tcp" else cluster_info(6101)
        for _ in range(2):  # and again after both sides tore down
            status, per = await d.link_clusters([to_p])
            assert (status, per) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            await pull_checked(d, p, seed)
            status, per = await d.unlink_clusters([to_p], force=True)
            assert (status, per) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            assert d.links == []
            # P's side: gone already (in-process) or closed by the goodbye, or still
            # there: a forced unlink succeeds either way.
            status, per = await p.unlink_clusters([cluster_info(6102)], force=True)
            assert (status, per) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            assert p.links == []
            # Idempotent: once more on each side.
            assert (await d.unlink_clusters([to_p], force=True))[0] == S.LLM_SUCCESS
            assert (await p.unlink_clusters([cluster_info(6102)], force=True))[0] == S.LLM_SUCCESS
    finally:
        await d.finalize()
        await p.finalize()


async def test_non_forced_unlink_of_an_unlinked_cluster() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 6111)
    await dd.init()
    try:
        status, per = await dd.unlink_clusters([cluster_info(6112)])
        assert (status, per) == (S.LLM_NOT_YET_LINK, [S.LLM_NOT_YET_LINK])
        status, per = await dd.unlink_clusters([cluster_info(6112), cluster_info(6113)], force=True)
        assert (status, per) == (S.LLM_SUCCESS, [S.LLM_SUCCESS, S.LLM_SUCCESS])
    finally:
        await dd.finalize()


async def test_check_link_status() -> None:
    p, d = LLMDataDist(LLMRole.PROMPT, 6121), LLMDataDist(LLMRole.DECODER, 6122)
    await p.init()
    await d.init()
    try:
        with pytest.raises(Exception) as info:
            d.check_link_status(6121)
        assert getattr(info.value, "status_code", None) == S.LLM_NOT_YET_LINK
        assert "check_link_status" in str(info.value)
        await d.link_clusters([cluster_info(6121)])
        assert d.check_link_status(6121) is None
        assert p.check_link_status(6122) is None
        with pytest.raises(TypeError):
            d.check_link_status("6121")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            d.check_link_status(-1)
        await d.unlink_clusters([cluster_info(6121)], force=True)
        with pytest.raises(ConnectionError):  # LLMLinkError
            d.check_link_status(6121)
    finally:
        await d.finalize()
        await p.finalize()


@pytest.mark.parametrize("route", ["inproc", "tcp"])
async def test_a_cluster_named_twice_in_one_link_call(route: str) -> None:
    # Linked once; the repeat answers LLM_ALREADY_LINK (not a second handshake the peer
    # refuses), and the link works.
    opts = {"aiodatadist.DataPath": "tcp"} if route == "tcp" else {}
    listen = {"llm.listenIpInfo": "127.0.0.1:0"} if route == "tcp" else {}
    async with LLMDataDist(LLMRole.PROMPT, 6121, {**opts, **listen}) as p:
        async with LLMDataDist(LLMRole.DECODER, 6122, opts) as d:
            seed = 0x6121
            make_blocks_cache(
                p,
                num_tensors=2,
                num_blocks=4,
                block_shape=BLOCK,
                model_id=0,
                seed=seed,
                pattern=True,
            )
            info = remote(6121, p.listen_address) if route == "tcp" else cluster_info(6121)
            status, each = await d.link_clusters([info, info], timeout=3000)
            assert each == [S.LLM_SUCCESS, S.LLM_ALREADY_LINK]
            assert status == S.LLM_ALREADY_LINK
            assert [link.remote_cluster_id for link in d.links] == [6121]
            await pull_checked(d, p, seed)


async def test_an_unlink_returns_once_the_peer_dropped_its_side() -> None:
    # Upstream's server removes its side before answering the unlink, so code that
    # unlinks and then (say) switch_role's the peer relies on it: no LLM_EXIST_LINK race.
    opts = {"aiodatadist.DataPath": "tcp"}
    async with LLMDataDist(LLMRole.PROMPT, 6131, {**opts, "llm.listenIpInfo": "127.0.0.1:0"}) as p:
        async with LLMDataDist(LLMRole.DECODER, 6132, opts) as d:
            to_p = remote(6131, p.listen_address)
            for _ in range(3):
                assert (await d.link_clusters([to_p]))[0] == S.LLM_SUCCESS
                assert [link.remote_cluster_id for link in p.links] == [6132]
                assert (await d.unlink_clusters([to_p]))[0] == S.LLM_SUCCESS
                assert p.links == []  # at once: no await in between
                await p.switch_role(LLMRole.DECODER, {"llm.listenIpInfo": "127.0.0.1:0"})
                to_p = remote(6131, p.listen_address)
