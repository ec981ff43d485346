"""A peer's engine agent must be its own: an agent named for another cluster (metadata a
hostile peer replays from a third instance) is refused before anything is read."""

from __future__ import annotations

import pytest

from aiodatadist import BlocksCacheKey, LLMException, LLMStatusCode
from aiodatadist.testing import inproc_pair, make_blocks_cache
from tests._engines import require_engine

pytestmark = pytest.mark.asyncio


async def test_a_peer_presenting_another_clusters_nixl_agent_is_refused() -> None:
    require_engine("nixl")
    options = {"aiodatadist.Engines": "nixl"}
    async with inproc_pair(data_path="tcp", options=options) as pair:
        make_blocks_cache(pair.prompt, model_id=2, num_blocks=4, seed=31)
        dst = make_blocks_cache(pair.decoder, num_blocks=4)
        key = BlocksCacheKey(pair.prompt.cluster_id, 2)
        link = pair.decoder._rt.links.get(pair.prompt.cluster_id)
        await pair.decoder.cache_manager.pull_blocks(key, dst.cache, [1], [1])  # (tables)
        info = link.path.peer.info.engines["nixl"]
        own = info["name"]
        prefix, pid, cluster, rand = own.split("-")
        assert (prefix, cluster) == ("aiodd", str(pair.prompt.cluster_id))
        from aiodatadist.config import DataPath

        link.path.forced = DataPath.NIXL
        pair.decoder.cache_manager._lanes.clear()  # (the tcp pull's lane would take the next)
        for t in dst.tensors:
            t.view("uint8")[...] = 0x44
        # The same metadata, claimed under another cluster's agent name.
        link.path.peer.info.engines["nixl"] = {**info, "name": f"aiodd-{pid}-999-{rand}"}
        with pytest.raises(LLMException, match="not one of its own") as e:
            await pair.decoder.cache_manager.pull_blocks(key, dst.cache, [0], [0])
        assert e.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert all(bool((t.view("uint8") == 0x44).all()) for t in dst.tensors)
        # Its own agent: the pull goes through NIXL.
        link.path.peer.info.engines["nixl"] = info
        await pair.decoder.cache_manager.pull_blocks(key, dst.cache, [0], [0])
        assert link.path.used == DataPath.NIXL
