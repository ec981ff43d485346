"""The owner's side of the control-plane lease (LEASE/LEASED/UNLEASE) against a raw peer.

A hand-driven connection speaks the wire to an instance in this process: a granted lease
holds the cache (unregister refuses with LLM_LINK_BUSY until UNLEASE or the link's end),
a req granted twice or a flood of leases is refused without holding anything, a stale
generation says ``stale``, and a holder that falls silent loses its leases with its link
(the owner's heartbeat).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiodatadist import LLMDataDist, LLMException, LLMRole, LLMStatusCode, _wire
from aiodatadist._engine_lease import MAX_HELD
from aiodatadist._registration import LEASE_PAUSE_S
from aiodatadist.testing import make_blocks_cache
from tests.xproc.xproc_harness import RawClient

pytestmark = pytest.mark.asyncio

RAW_ID = 901


async def _owner() -> tuple[LLMDataDist, Any]:
    dd = LLMDataDist(LLMRole.PROMPT, 900)
    await dd.init({"llm.listenIpInfo": "127.0.0.1:0"})
    cache = make_blocks_cache(dd, model_id=1, num_blocks=4, seed=9)
    return dd, cache


async def _lease(
    raw: RawClient, req: int, cache_id: int, gen: int | None, *, write: bool = False
) -> dict[str, Any]:
    body: dict[str, Any] = {"req": req, "cache_id": cache_id}
    if gen is not None:
        body["gen"] = gen
    if write:
        body["write"] = True
    await raw.write(_wire.MsgType.LEASE, body)
    while True:
        msg = await raw.read()
        if msg.type == _wire.MsgType.LEASED and msg.body["req"] == req:
            return msg.body


def _gen(welcome: dict[str, Any], cache_id: int) -> int:
    (entry,) = [d for d in welcome["table"] if d["cache_id"] == cache_id]
    return int(entry["lease"][1])


async def _unregister_refused(dd: LLMDataDist, cache_id: int) -> bool:
    try:
        dd.cache_manager.unregister_cache(cache_id)
    except LLMException as e:
        assert e.status_code == LLMStatusCode.LLM_LINK_BUSY, e
        return True
    return False


async def test_a_granted_lease_holds_the_cache_until_unlease() -> None:
    dd, cache = await _owner()
    try:
        host, port = dd.listen_address
        cid = cache.cache.cache_id
        async with RawClient(host, port) as raw:
            welcome = await raw.handshake(RAW_ID)
            gen = _gen(welcome, cid)
            stale = await _lease(raw, 1, cid, gen + 1)
            assert stale["status"] == int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
            assert stale["stale"] is True
            ok = await _lease(raw, 2, cid, gen)
            assert ok["status"] == 0
            assert await _unregister_refused(dd, cid)  # a peer may be reading it
            await raw.write(_wire.MsgType.UNLEASE, {"req": 2})
            for _ in range(200):
                if not dd.cache_manager._caches.entries[cid].busy:
                    break
                await asyncio.sleep(0.005)
            dd.cache_manager.unregister_cache(cid)  # released: the free goes through
    finally:
        await dd.finalize()


async def test_a_req_granted_twice_is_refused_and_the_link_end_releases_all() -> None:
    dd, cache = await _owner()
    try:
        host, port = dd.listen_address
        cid = cache.cache.cache_id
        async with RawClient(host, port) as raw:
            gen = _gen(await raw.handshake(RAW_ID), cid)
            assert (await _lease(raw, 7, cid, gen))["status"] == 0
            again = await _lease(raw, 7, cid, gen)
            assert again["status"] == int(LLMStatusCode.LLM_LINK_BUSY)
            assert again.get("stale") is False
            assert dd.cache_manager._caches.entries[cid].busy == 1  # not two holds
        # The raw peer hung up without UNLEASE: its link's end releases what it held.
        for _ in range(400):
            if not dd.cache_manager._caches.entries[cid].busy:
                break
            await asyncio.sleep(0.005)
        dd.cache_manager.unregister_cache(cid)
    finally:
        await dd.finalize()


async def test_a_flood_of_leases_is_capped() -> None:
    dd, cache = await _owner()
    try:
        host, port = dd.listen_address
        cid = cache.cache.cache_id
        async with RawClient(host, port) as raw:
            gen = _gen(await raw.handshake(RAW_ID), cid)
            for req in range(MAX_HELD):
                await raw.write(_wire.MsgType.LEASE, {"req": req, "cache_id": cid, "gen": gen})
            statuses = []
            while len(statuses) < MAX_HELD:
                msg = await raw.read()
                if msg.type == _wire.MsgType.LEASED:
                    statuses.append(msg.body["status"])
            assert statuses == [0] * MAX_HELD
            over = await _lease(raw, MAX_HELD, cid, gen)
            assert over["status"] == int(LLMStatusCode.LLM_LINK_BUSY)
            assert dd.cache_manager._caches.entries[cid].busy == MAX_HELD
    finally:
        await dd.finalize()


async def test_a_refused_free_pauses_new_leases_so_a_retry_succeeds() -> None:
    # Back-to-back transfers from another host would hold the cache at every attempt.
    dd, cache = await _owner()
    try:
        host, port = dd.listen_address
        cid = cache.cache.cache_id
        async with RawClient(host, port) as raw:
            gen = _gen(await raw.handshake(RAW_ID), cid)
            assert (await _lease(raw, 1, cid, gen))["status"] == 0
            assert await _unregister_refused(dd, cid)  # held: refused...
            paused = await _lease(raw, 2, cid, gen)  # ...and no new lease meanwhile
            assert paused["status"] == int(LLMStatusCode.LLM_LINK_BUSY)
            assert "being freed" in paused["info"]
            await raw.write(_wire.MsgType.UNLEASE, {"req": 1})
            for _ in range(200):
                if not dd.cache_manager._caches.entries[cid].busy:
                    break
                await asyncio.sleep(0.005)
            dd.cache_manager.unregister_cache(cid)  # the retry goes through
            assert cid not in dd.cache_manager._caches.entries
    finally:
        await dd.finalize()


async def test_the_lease_pause_ends() -> None:
    dd, cache = await _owner()
    try:
        host, port = dd.listen_address
        cid = cache.cache.cache_id
        async with RawClient(host, port) as raw:
            gen = _gen(await raw.handshake(RAW_ID), cid)
            assert (await _lease(raw, 1, cid, gen))["status"] == 0
            assert await _unregister_refused(dd, cid)
            await raw.write(_wire.MsgType.UNLEASE, {"req": 1})
            await asyncio.sleep(LEASE_PAUSE_S + 0.1)  # the owner did not retry its free
            assert (await _lease(raw, 2, cid, gen))["status"] == 0  # leases again
    finally:
        await dd.finalize()


async def test_a_silent_lease_holder_loses_its_leases_with_its_link() -> None:
    # The requester took a lease and went silent (frozen, its host gone): the owner's
    # heartbeat loses the link, which releases its leases, so the cache can be freed.
    dd = LLMDataDist(LLMRole.PROMPT, 900)
    await dd.init({"llm.listenIpInfo": "127.0.0.1:0", "aiodatadist.HeartbeatTimeout": "400"})
    try:
        cache = make_blocks_cache(dd, model_id=1, num_blocks=4, seed=10)
        host, port = dd.listen_address
        cid = cache.cache.cache_id
        async with RawClient(host, port) as raw:
            welcome = await raw.handshake(RAW_ID)
            ok = await _lease(raw, 3, cid, _gen(welcome, cid))
            assert ok["status"] == 0
            assert await _unregister_refused(dd, cid)
            loop = asyncio.get_running_loop()
            start = loop.time()
            while dd.cache_manager._caches.entries[cid].busy:  # nothing read, nothing said
                assert loop.time() - start < 5.0, "the silent holder kept its lease"
                await asyncio.sleep(0.01)
            assert loop.time() - start >= 0.2  # not before a whole timeout (half: the edge)
            assert RAW_ID not in {link.remote_cluster_id for link in dd.links}
            dd.cache_manager.unregister_cache(cid)
    finally:
        await dd.finalize()
