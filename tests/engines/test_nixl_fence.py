"""An aborted NIXL pull whose request is still on the wire fences the blocks it named.

Over UCX's tcp transport a READ already sent keeps delivering bytes after the request is
released (and after the peer's agent is removed): seen with the peer stopped mid-pull.
The call still ends at its deadline; until the request is over the blocks it named take
no transfer (the cache's others do) and the cache cannot be freed, so no later success
can be overwritten by the aborted pull's bytes, and the owner's lease stays held, so the owner
cannot free or re-register memory the request may still read or write. Here: both ends
on this host with ``UCX_TLS=tcp`` (UCX's inter-host transport), the prompt SIGSTOPped
mid-transfer.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, DataPath, LLMException, LLMStatusCode, _engine_lease
from aiodatadist import _native as native
from tests._engines import require_engine
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import Harness, link, until

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

PROMPT, DECODER = 85, 86
MIB = 256
TCP_ONLY = {"UCX_TLS": "tcp"}
KEY = BlocksCacheKey(PROMPT, xc.MODEL_BIG)
BLOCKS = list(range(xc.big_spec(MIB).shape[0]))


async def _linked_over_tcp(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Any, Any, list[np.ndarray]]:
    """The prompt (its "big" cache) and a decoder, both NIXL over UCX's tcp transport,
    linked, with a cache of ours (0x11) connected by a one-block pull: (prompt, dd, our
    cache, its bytes)."""
    require_engine("nixl")
    nixl = {"aiodatadist.DataPath": "nixl", "llm.SyncKvCacheWaitTime": "5000"}
    spec = xc.big_spec(MIB)
    prompt = await h.peer(cluster_id=PROMPT, data_path="nixl", big_mib=MIB, env=TCP_ONLY, seed=3)
    monkeypatch.setenv("UCX_TLS", "tcp")  # read when this process's agent starts
    dd, _ = await h.local(DECODER, nixl)
    monkeypatch.delenv("UCX_TLS")
    nbytes = (spec.shape[0], spec.shape[1] * 2)  # fp16 blocks of 1 MiB
    raw = [np.full(nbytes, 0x11, np.uint8) for _ in range(2)]
    ours = dd.cache_manager.register_blocks_cache(spec.desc(), [r.view(np.float16) for r in raw])
    await link(dd, prompt, PROMPT)
    await dd.cache_manager.pull_blocks(KEY, ours, [0], [0], timeout=10)  # connects
    return prompt, dd, ours, raw


async def test_an_aborted_pull_in_flight_fences_its_destination(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with Harness() as h:
        prompt, dd, dst, raw = await _linked_over_tcp(h, monkeypatch)
        cm, key, blocks = dd.cache_manager, KEY, BLOCKS

        named, last = blocks[:-2], blocks[-1]  # (the last two: not named by the call)
        task = asyncio.ensure_future(cm.pull_blocks(key, dst, named, named, timeout=0.5))
        await asyncio.sleep(0.03)
        os.kill(prompt.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(LLMException) as e:
                await task
            assert e.value.status_code == LLMStatusCode.LLM_TIMEOUT
            assert time.monotonic() - t0 < 5  # the deadline held
            entry = cm._caches.entries[dst.cache_id]
            assert entry.late_writes == 1, "no request was in flight at the stop"
            # Fenced: no transfer into the blocks the call named, no free, while the
            # aborted READ may still land.
            with pytest.raises(LLMException) as busy:
                await cm.pull_blocks(key, dst, [0], [0], timeout=2)
            assert busy.value.status_code == LLMStatusCode.LLM_LINK_BUSY
            with pytest.raises(LLMException) as busy:
                await cm.copy_blocks(dst, {last: [named[-1]]})
            assert busy.value.status_code == LLMStatusCode.LLM_LINK_BUSY
            with pytest.raises(LLMException) as busy:
                cm.unregister_cache(dst.cache_id)
            assert busy.value.status_code == LLMStatusCode.LLM_LINK_BUSY
            # The blocks it did not name take transfers meanwhile.
            for t, r in enumerate(raw):
                r[last] = 0x3C + t
            await cm.copy_blocks(dst, {last: [last - 1]})
            assert all(bool((r[last - 1] == 0x3C + t).all()) for t, r in enumerate(raw))
        finally:
            os.kill(prompt.pid, signal.SIGCONT)
        # The request ends once the prompt runs again.
        await until(lambda: not entry.late_writes, 10, "the aborted request's end")
        for r in raw:
            r[...] = 0x33
        await asyncio.sleep(0.5)
        assert all(bool((r == 0x33).all()) for r in raw)  # nothing lands after the fence
        await cm.pull_blocks(key, dst, blocks, blocks, timeout=20)  # the link works
        assert all(bool((r == xc.BIG_FILL).all()) for r in raw)  # the prompt's "big"
        cm.unregister_cache(dst.cache_id)


async def test_finalize_waits_for_an_aborted_request_still_on_the_wire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with Harness() as h:
        prompt, dd, dst, raw = await _linked_over_tcp(h, monkeypatch)
        cm, key, blocks = dd.cache_manager, KEY, BLOCKS

        task = asyncio.ensure_future(cm.pull_blocks(key, dst, blocks, blocks, timeout=0.5))
        await asyncio.sleep(0.03)
        os.kill(prompt.pid, signal.SIGSTOP)
        resumed = asyncio.get_running_loop().create_future()

        def resume() -> None:
            os.kill(prompt.pid, signal.SIGCONT)
            resumed.set_result(time.monotonic())

        try:
            with pytest.raises(LLMException):
                await task
            assert cm._caches.entries[dst.cache_id].late_writes == 1
            asyncio.get_running_loop().call_later(1.0, resume)
            await dd.finalize()  # waits for the request the prompt finishes once resumed
            done = time.monotonic()
        finally:
            if not resumed.done():
                resume()
        assert done >= await resumed  # not before the request could end
        for r in raw:
            r[...] = 0x33
        await asyncio.sleep(0.5)
        assert all(bool((r == 0x33).all()) for r in raw)  # nothing after finalize


@pytest.mark.parametrize(
    ("op", "lease"), [("pull", "lease-page"), ("push", "control-lease")], ids=lambda v: v
)
async def test_an_aborted_request_in_flight_keeps_the_owners_lease(
    monkeypatch: pytest.MonkeyPatch, op: str, lease: str
) -> None:
    """Until the reaped request ended, the owner's cache stays leased: its lease page
    counts us as a reader, or the control-plane lease is not released (no UNLEASE), so
    the owner's free waits (or refuses) instead of freeing memory the request may still
    read (a pull) or write (a push)."""
    unleased: list[int] = []
    real_unlease = _engine_lease._unlease

    async def spy(peer: object, req: int) -> None:
        unleased.append(req)
        await real_unlease(peer, req)  # type: ignore[arg-type]

    monkeypatch.setattr(_engine_lease, "_unlease", spy)
    async with Harness() as h:
        prompt, dd, ours, _raw = await _linked_over_tcp(h, monkeypatch)
        cm = dd.cache_manager
        lk = dd._rt.links.find(PROMPT)
        ep = lk.path.engines[DataPath.NIXL]
        await asyncio.wait_for(lk.path.fds_settled.wait(), 5)
        page = await ep.fds.peer_page(asyncio.get_running_loop().time() + 5)
        if lease == "control-lease":
            ep.fds = None  # test-only: as between hosts (test_engine_xproc.py)
        key, blocks = KEY, BLOCKS
        addr = page.addr(lk.path.remote_table.blocks(xc.MODEL_BIG).lease[0])
        await cm.pull_blocks(key, ours, [0], [0], timeout=10)  # (under the lease to test)
        move = cm.pull_blocks if op == "pull" else cm.push_blocks
        await asyncio.sleep(0.1)  # (the connecting pull's UNLEASE is out)
        unleased.clear()
        task = asyncio.ensure_future(move(key, ours, blocks, blocks, timeout=0.5))
        await asyncio.sleep(0.03)
        os.kill(prompt.pid, signal.SIGSTOP)
        try:
            with pytest.raises(LLMException) as e:
                await task
            assert e.value.status_code == LLMStatusCode.LLM_TIMEOUT
            entry = cm._caches.entries[ours.cache_id]
            assert entry.late_writes == 1, "no request was in flight at the stop"
            await asyncio.sleep(0.2)
            # Returned at its deadline, and the owner's cache is still leased.
            if lease == "lease-page":
                assert native.lease_readers(addr) == 1
            else:
                assert unleased == [], "UNLEASE sent with a request still in flight"
        finally:
            os.kill(prompt.pid, signal.SIGCONT)
        # The request ends once the prompt runs again.
        await until(lambda: not entry.late_writes, 10, "the aborted request's end")
        for _ in range(100):
            if native.lease_readers(addr) == 0 and (lease == "lease-page" or unleased):
                break
            await asyncio.sleep(0.01)
        assert native.lease_readers(addr) == 0  # let go once the request ended
        if lease == "control-lease":
            assert len(unleased) == 1, unleased
        assert (await prompt.ok("free", name="big"))["ok"]  # no lease left behind
        cm.unregister_cache(ours.cache_id)
