"""An engine's push into a peer's fenced cache is refused, on the same host and across hosts.

A fence (``CacheEntry.fence``) marks bytes an aborted engine transfer may still write
into: a later transfer landing there could be overwritten after it reported success.
The owner's own transfers and a tcp push check the fenced blocks; an engine writes into
the owner's memory itself, so the owner tells it through the lease it writes under:

* same host: the cache's slot in the lease page counts the fences; the push's job reads
  it once it entered the lease, before a byte moves (here: NIXL and Mooncake in one
  process, the page shared over the link's fd channel as between two processes);
* across hosts: a ``LEASE`` that says ``write`` is refused while a fence is up (a raw
  client against a real owner; the lease names no blocks: the whole cache waits).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from aiodatadist import BlocksCacheKey, LLMDataDist, LLMException, LLMRole, LLMStatusCode, _wire
from aiodatadist._caches import CacheEntry, Region
from aiodatadist.testing import cluster_info, make_blocks_cache, pattern_mismatches
from tests._engines import require_engine
from tests.engines.test_engine_lease_wire import _lease
from tests.xproc.xproc_harness import RawClient

pytestmark = pytest.mark.asyncio

PROMPT, DECODER, RAW = 931, 932, 933
SHAPE: dict[str, Any] = {"num_tensors": 4, "num_blocks": 8, "block_shape": (16, 2, 64)}


def _raw(tensors: list[np.ndarray]) -> list[bytes]:
    return [t.tobytes() for t in tensors]


@pytest_asyncio.fixture(params=["nixl", "mooncake"])
async def engine_pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, Any, str]]:
    engine = request.param
    require_engine(engine)
    opts = {"aiodatadist.Engines": engine}
    prompt = LLMDataDist(LLMRole.PROMPT, PROMPT)
    await prompt.init({**opts, "llm.listenIpInfo": "127.0.0.1:0"})
    try:
        decoder = LLMDataDist(LLMRole.DECODER, DECODER)
        await decoder.init({**opts, "aiodatadist.DataPath": engine})
        try:
            assert prompt.listen_address is not None
            status, _ = await decoder.link_clusters([cluster_info(PROMPT, *prompt.listen_address)])
            assert status == 0, status
            yield prompt, decoder, engine
        finally:
            await decoder.finalize()
    finally:
        await prompt.finalize()


async def test_an_engine_push_into_a_fenced_cache_is_refused(
    engine_pair: tuple[Any, Any, str],
) -> None:
    prompt, decoder, engine = engine_pair
    seed = 0xF3 + (engine == "mooncake")
    target = make_blocks_cache(prompt, model_id=0, **SHAPE)
    other = make_blocks_cache(prompt, model_id=1, **SHAPE)
    src = make_blocks_cache(decoder, seed=seed, pattern=True, **SHAPE)
    cm, key = decoder.cache_manager, BlocksCacheKey(PROMPT, 0)
    await cm.push_blocks(key, src.cache, [7], [7], timeout=10)  # connected
    assert not pattern_mismatches(target.tensors, [7], [7], seed)
    entry: CacheEntry = prompt._rt.caches.entries[target.cache.cache_id]
    fence = entry.fence(Region(None))
    before = _raw(target.tensors)
    for blocks in ([1], [2, 3]):
        with pytest.raises(LLMException) as ei:
            await cm.push_blocks(key, src.cache, blocks, blocks, timeout=5)
        assert ei.value.status_code == LLMStatusCode.LLM_LINK_BUSY, ei.value
    assert _raw(target.tensors) == before  # nothing landed
    await cm.push_blocks(BlocksCacheKey(PROMPT, 1), src.cache, [4], [5], timeout=10)
    assert not pattern_mismatches(other.tensors, [4], [5], seed)  # its other cache: pushes
    entry.unfence(fence)
    await cm.push_blocks(key, src.cache, [1, 2], [2, 1], timeout=10)
    assert not pattern_mismatches(target.tensors, [1, 2], [2, 1], seed)
    assert set(decoder.stats().links[PROMPT].by_path) == {engine}


async def test_a_write_lease_is_refused_while_the_cache_is_fenced() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, PROMPT)
    await dd.init({"llm.listenIpInfo": "127.0.0.1:0"})
    try:
        cache = make_blocks_cache(dd, model_id=1, num_blocks=4, seed=9)
        cid = cache.cache.cache_id
        entry: CacheEntry = dd._rt.caches.entries[cid]
        assert dd.listen_address is not None
        async with RawClient(*dd.listen_address) as raw:
            await raw.handshake(RAW)
            fence = entry.fence(Region.of_rows(entry.addrs, np.array([[0, 0, 0, 0, 64]]), "dst"))
            refused = await _lease(raw, 1, cid, None, write=True)
            assert refused["status"] == int(LLMStatusCode.LLM_LINK_BUSY), refused
            assert entry.busy == 1  # the fence's own hold: nothing held for the refused lease
            read = await _lease(raw, 2, cid, None)  # a read may still be granted
            assert read["status"] == 0, read
            await raw.write(_wire.MsgType.UNLEASE, {"req": 2})
            entry.unfence(fence)
            for _ in range(400):
                if not entry.busy:
                    break
                await asyncio.sleep(0.005)
            assert entry.busy == 0
            granted = await _lease(raw, 3, cid, None, write=True)
            assert granted["status"] == 0, granted
            await raw.write(_wire.MsgType.UNLEASE, {"req": 3})
    finally:
        await dd.finalize()
