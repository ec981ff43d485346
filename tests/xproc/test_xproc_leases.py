"""One-sided integrity across real processes: leases, sealed memfd segments, crashes.

Issue 9, findings 2, 3, 4 and 8. A decoder reads (and a prompt writes) a peer's memory
over ``shm`` / ``cma`` only under a lease for that cache's current registration:

* (a) re-registration under the same ``model_id`` while a decoder pulls in a loop: every
  pull that succeeds holds exactly the bytes of a registration that was live, never the
  "freed" pattern the prompt writes into freed memory before reusing it;
* (b) unregister while a large pull runs: it waits for the pull (or fails with
  LLM_LINK_BUSY, registration unchanged); the pull is exact or an error;
* (c) a push (``transfer_cache_async``) while the decoder frees its destination: once the
  free returns, the freed memory is never written (a canary stays intact);
* (d) a prompt that tries to truncate its own segment gets EPERM, our pulls keep working;
* (e) SIGKILL of either side: nothing ever appears in /dev/shm, and the survivor's calls
  fail with an exception.

Each transfer writes a pattern unique to it: sources are filled from per-registration
seeds, destinations are prefilled with a per-pull byte before each pull.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    LayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    TransferWithCacheKeyConfig,
    _native,
)
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import (
    Harness,
    PeerProc,
    decoder_options,
    leftover_segments,
    link,
    until,
)

pytestmark = pytest.mark.slow  # peer processes on every data path: the full run's

PROMPT, DECODER = 61, 62
SEED = 5
FREED = 0xEE
MODEL = 7
PATHS = ["shm", "cma"]


def _spec(
    name: str, allocate: bool, num_blocks: int = xc.NUM_BLOCKS, model: int = MODEL
) -> xc.Spec:
    return xc.Spec(name, True, allocate, (num_blocks, *xc.BLOCK_SHAPE), model_id=model)


def _dev_shm() -> list[str]:
    return leftover_segments(None)


async def _pair(h: Harness, path: str, *, sync_ms: int = 5000) -> tuple[LLMDataDist, PeerProc]:
    prompt = await h.peer(cluster_id=PROMPT, data_path=path, seed=SEED, sync_ms=sync_ms)
    dd, _ = await h.local(DECODER, decoder_options(path, **{"llm.SyncKvCacheWaitTime": "8000"}))
    await link(dd, prompt, PROMPT)
    return dd, prompt


# ------------------------------------------------------------------ (a) re-registration


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_pulls_never_see_a_dead_registration(path: str) -> None:
    allocate = path == "shm"
    seeds = [1000 + i for i in range(12)]
    async with Harness() as h:
        dd, prompt = await _pair(h, path)
        await prompt.ok("register", name="cyc", model_id=MODEL, seed=999, allocate=allocate)
        live = {999, *seeds}
        refs = {s: xc.pattern(s, _spec("cyc", allocate)) for s in live}
        dst = xc.make_cache(dd, _spec("dst", True, model=40), None, DECODER)
        blocks = list(range(xc.NUM_BLOCKS))
        key = BlocksCacheKey(PROMPT, MODEL)
        # Sanity: the path really is the one-sided one.
        await dd.cache_manager.pull_blocks(key, dst.cache, blocks, blocks, timeout=5)
        lk = dd._rt.links.find(PROMPT)
        assert lk is not None
        assert lk.path.path_for(lk.path.remote_table.blocks(MODEL)).kinds[0] == path

        cycle = asyncio.create_task(
            prompt.call(
                "cycle", name="cyc", model_id=MODEL, allocate=allocate, seeds=seeds,
                fill=FREED, pause_ms=15, timeout=60,
            )
        )  # fmt: skip
        ok, errors, fills = 0, {}, itertools.count(1)
        end = time.monotonic() + 60
        while not cycle.done() or ok < 3:
            assert time.monotonic() < end, "no end to the cycle"
            canary = next(fills) % 200 + 1  # a per-pull prefill (never FREED)
            for v in dst.views:
                v.fill(canary)
            try:
                await dd.cache_manager.pull_blocks(key, dst.cache, blocks, blocks, timeout=5)
            except LLMException as e:
                errors[e.status_code] = errors.get(e.status_code, 0) + 1
                assert e.status_code in (
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    LLMStatusCode.LLM_FAILED,
                ), e
                continue
            ok += 1
            got = dst.matrix()
            assert not (got == FREED).all(axis=1).any(), "a success returned freed memory"
            match = [s for s, ref in refs.items() if np.array_equal(got, ref)]
            assert match, (
                f"pull {ok} succeeded with bytes of no live registration "
                f"({int((got == FREED).sum())} freed bytes, {int((got == canary).sum())} "
                f"untouched bytes); errors so far {errors}"
            )
        reply = await cycle
        assert reply["ok"], reply
        assert ok >= 3


# ------------------------------------------------------------------ (b) unregister vs pull


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_unregister_waits_for_a_running_pull(path: str) -> None:
    allocate = path == "shm"
    nblk = 4096  # 16 MiB per tensor, 64 MiB per pull
    async with Harness() as h:
        dd, prompt = await _pair(h, path)
        dst = xc.make_cache(dd, _spec("dst", True, nblk, model=41), None, DECODER)
        blocks = list(range(nblk))
        for rnd in range(3):
            seed = 2000 + rnd
            await prompt.ok(
                "register", name="large", model_id=MODEL, seed=seed, allocate=allocate,
                num_blocks=nblk,
            )  # fmt: skip
            ref = xc.pattern(seed, _spec("large", allocate, nblk))
            for v in dst.views:
                v.fill(rnd + 1)
            key = BlocksCacheKey(PROMPT, MODEL)
            await dd.cache_manager.pull_blocks(key, dst.cache, [0], [0], timeout=5)  # warm
            pull = asyncio.create_task(
                dd.cache_manager.pull_blocks(key, dst.cache, blocks, blocks, timeout=20)
            )
            if rnd % 2 == 0:
                # The free comes while the copy runs under the lease (it must wait for it).
                lk = dd._rt.links.find(PROMPT)
                assert lk is not None and lk.path.fds is not None
                remote = lk.path.remote_table.blocks(MODEL)
                assert remote is not None and remote.lease is not None
                page = lk.path.fds.page
                assert page is not None
                addr = page.addr(remote.lease[0])
                await asyncio.wait_for(asyncio.to_thread(_spin_until_read, addr, pull.done), 10)
            else:
                await asyncio.sleep(0)  # the free races the pull's start
            freed = await prompt.call("free", name="large", fill=FREED, timeout=30)
            try:
                await asyncio.wait_for(pull, 30)
            except LLMException as e:
                assert e.status_code in (
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    LLMStatusCode.LLM_FAILED,
                ), e
                continue
            finally:
                if not freed.get("ok"):
                    # LLM_LINK_BUSY: nothing changed; the cache is still registered.
                    assert freed.get("status") == LLMStatusCode.LLM_LINK_BUSY, freed
                    await prompt.ok("free", name="large")
            got = dst.matrix()
            assert np.array_equal(got, ref), (
                f"round {rnd}: a successful pull holds {int((got == FREED).sum())} freed bytes"
            )


def _spin_until_read(addr: int, done: Callable[[], bool]) -> None:
    """Spins (on a watcher thread, bounded) until a reader holds the lease slot at ``addr``
    (or ``done()``: the copy finished before the watcher saw it)."""
    end = time.monotonic() + 10
    while _native.lease_readers(addr) == 0 and not done() and time.monotonic() < end:
        pass


# ------------------------------------------------------------------ (c) push vs free


class Always(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_push_never_writes_a_freed_destination(path: str) -> None:
    allocate = path == "shm"
    nblk = 4096
    canary = 0xC3
    async with Harness() as h:
        dd, prompt = await _pair(h, path)
        for rnd in range(3):
            await prompt.ok(
                "register", name=f"src{rnd}", model_id=50 + rnd, seed=3000 + rnd,
                num_blocks=nblk,
            )  # fmt: skip
            dst = xc.make_cache(dd, _spec(f"dst{rnd}", allocate, nblk, model=60 + rnd), None,
                                DECODER)  # fmt: skip
            # Wait for the prompt to see the destination in our table.
            await prompt.ok("links")
            push = asyncio.create_task(
                prompt.call(
                    "push", dst_cluster=DECODER, src=f"src{rnd}", model_id=60 + rnd,
                    src_blocks=list(range(nblk)), dst_blocks=list(range(nblk)),
                    timeout_ms=20000, timeout=40,
                )
            )  # fmt: skip
            # Free while the push runs (the first bytes have landed).
            end = time.monotonic() + 20
            while not dst.views[0][: 4096 * 64].any() and not push.done():
                assert time.monotonic() < end
                await asyncio.sleep(0.001)
            cm = dd.cache_manager
            try:
                if allocate:
                    cm.deallocate_blocks_cache(dst.cache)
                else:
                    cm.unregister_cache(dst.cache.cache_id)
            except LLMException as e:
                assert e.status_code == LLMStatusCode.LLM_LINK_BUSY, e
                await push
                continue
            for v in dst.views:  # the freed memory, reused by us
                v.fill(canary)
            reply = await push
            assert reply["ok"], reply
            got = dst.matrix()
            assert (got == canary).all(), (
                f"round {rnd}: the push wrote {int((got != canary).sum())} bytes into freed "
                f"memory (push status {reply['status']:#x})"
            )


# ------------------------------------------------------------------ (d) hostile owner


@pytest.mark.asyncio
async def test_a_prompt_cannot_truncate_a_segment_we_map() -> None:
    async with Harness() as h:
        dd, prompt = await _pair(h, "shm")
        dst = xc.make_cache(dd, _spec("dst", True, model=42), None, DECODER)
        blocks = list(range(xc.NUM_BLOCKS))
        key = BlocksCacheKey(PROMPT, xc.MODEL_ALLOC)
        ref = xc.reference(SEED, "alloc")
        for rnd, size in enumerate((0, 4096, 1)):
            if rnd:
                reply = await prompt.ok("truncate", name="alloc", size=size)
                assert reply["errno"] == errno.EPERM, reply
            for v in dst.views:
                v.fill(rnd + 1)
            await dd.cache_manager.pull_blocks(key, dst.cache, blocks, blocks, timeout=5)
            assert np.array_equal(dst.matrix(), ref)


# ------------------------------------------------------------------ (e) kill -9


@pytest.mark.asyncio
async def test_killed_prompt_leaves_nothing_and_the_decoder_gets_errors() -> None:
    before = _dev_shm()
    async with Harness() as h:
        dd, prompt = await _pair(h, "auto")
        await prompt.ok("register", name="more", model_id=MODEL, seed=4, allocate=True)
        dst = xc.make_cache(dd, _spec("dst", True, model=43), None, DECODER)
        await dd.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT, MODEL), dst.cache, [0, 1], [0, 1], timeout=5
        )
        assert _dev_shm() == before  # nothing named, even while alive
        prompt.kill(signal.SIGKILL)
        await prompt.wait_dead()
        assert _dev_shm() == before and not leftover_segments(prompt.pid)
        for model in (MODEL, xc.MODEL_ALLOC, xc.MODEL_REG):
            with pytest.raises(LLMException):
                await dd.cache_manager.pull_blocks(
                    BlocksCacheKey(PROMPT, model), dst.cache, [0], [0], timeout=3
                )
        # The decoder's own caches still free at once.
        dd.cache_manager.deallocate_blocks_cache(dst.cache)


@pytest.mark.asyncio
async def test_killed_decoder_leaves_nothing_and_the_prompt_carries_on() -> None:
    before = _dev_shm()
    async with Harness() as h:
        prompt_dd, caches = await h.local(
            PROMPT,
            {"llm.listenIpInfo": "127.0.0.1:0", "llm.SyncKvCacheWaitTime": "5000"},
            role=LLMRole.PROMPT,
            seed=SEED,
        )
        host, port = prompt_dd.listen_address or ("", 0)
        decoder = await h.peer(cluster_id=DECODER, role="decoder", listen=None)
        reply = await decoder.ok("link", cluster_id=PROMPT, host=host, port=port)
        assert reply["status"] == 0, reply
        reply = await decoder.ok(
            "pull_blocks", cluster_id=PROMPT, model_id=xc.MODEL_ALLOC, dst="alloc",
            src_blocks=[0, 1], dst_blocks=[2, 3],
        )  # fmt: skip
        assert reply["path"] == "shm", reply
        assert _dev_shm() == before
        decoder.kill(signal.SIGKILL)
        await decoder.wait_dead()
        assert _dev_shm() == before and not leftover_segments(decoder.pid)
        # A push to the dead decoder fails with an exception (or a failed status).
        cm = prompt_dd.cache_manager
        try:
            task = await cm.transfer_cache_async(
                caches["alloc"].cache,
                Always(),
                [
                    TransferWithCacheKeyConfig(
                        BlocksCacheKey(DECODER, xc.MODEL_ALLOC), range(2), range(2)
                    )
                ],
                [0],
                [0],
            )
        except LLMException:
            pass
        else:
            assert await task.synchronize(5000) != LLMStatusCode.LLM_SUCCESS
        # Freeing what the dead decoder had mapped does not wait for it.
        t0 = time.monotonic()
        cm.deallocate_blocks_cache(caches["alloc"].cache)
        cm.unregister_cache(caches["reg"].cache.cache_id)
        assert time.monotonic() - t0 < 2.5


# ------------------------------------------------------------------ a stalled reader


def _link_pages(cm: Any) -> list[Any]:
    """The live lease pages our links own (not the serve book's words)."""
    from aiodatadist._leases import LeasePage

    return [p for p in cm.leases._pages if not p.retired and isinstance(p.page, LeasePage)]


def _stop_when_reading(addr: int, pid: int, out: dict[str, float]) -> None:
    """Stops ``pid`` (SIGSTOP) the moment it holds a reader on the lease slot at ``addr``
    (spins on a watcher thread, bounded)."""
    end = time.monotonic() + 10
    while _native.lease_readers(addr) == 0 and time.monotonic() < end:
        pass
    os.kill(pid, signal.SIGSTOP)
    out["stopped"] = time.monotonic()


@pytest.mark.asyncio
@pytest.mark.parametrize("ending", ["resume", "kill"])
async def test_a_stalled_reader_holds_off_unregister(ending: str) -> None:
    """A decoder stopped in the middle of a one-sided copy keeps its lease: unregister waits
    ``sync_kv_timeout`` and fails with LLM_LINK_BUSY, changing nothing; once the copy ends
    (or its process dies) the cache frees at once."""
    async with Harness() as h:
        prompt_dd, caches = await h.local(
            PROMPT,
            {
                "llm.listenIpInfo": "127.0.0.1:0",
                "llm.SyncKvCacheWaitTime": "400",
                "aiodatadist.DataPath": "cma",
            },
            role=LLMRole.PROMPT,
            seed=SEED,
            big_mib=512,  # a copy long enough to be caught mid-way under load
        )
        host, port = prompt_dd.listen_address or ("", 0)
        decoder = await h.peer(
            cluster_id=DECODER, role="decoder", listen=None, data_path="cma", big_mib=512
        )
        reply = await decoder.ok("link", cluster_id=PROMPT, host=host, port=port)
        assert reply["status"] == 0, reply
        cm = prompt_dd.cache_manager
        big = caches["big"].cache
        entry = cm._caches.entries[big.cache_id]
        assert entry.lease is not None
        slot, gen = entry.lease
        # The page goes to the decoder over the fd channel, which the decoder connects
        # after its link call returned: on a loaded machine that may take a moment.
        await until(
            lambda: len(_link_pages(cm)) == 1,
            10,
            "the decoder's link to own one lease page of ours",
        )
        addr = _link_pages(cm)[0].page.addr(slot)
        nblk = big.cache_desc.shape[0]
        out: dict[str, float] = {}
        watcher = asyncio.create_task(asyncio.to_thread(_stop_when_reading, addr, decoder.pid, out))
        await decoder.send(
            "pull_blocks", cluster_id=PROMPT, model_id=xc.MODEL_BIG, dst="big",
            src_blocks=list(range(nblk)), dst_blocks=list(range(nblk)), timeout=60,
        )  # fmt: skip
        await asyncio.wait_for(watcher, 15)
        try:
            assert _native.lease_readers(addr) == 1, "the decoder was not stopped mid-copy"
            t0 = time.monotonic()
            with pytest.raises(LLMException) as info:
                cm.unregister_cache(big.cache_id)
            waited = time.monotonic() - t0
            assert info.value.status_code == LLMStatusCode.LLM_LINK_BUSY
            assert 0.2 <= waited < 5, waited  # it waited (half the 400 ms at least)
            # Nothing changed: still registered, same lease, still current on the page.
            assert cm.table.blocks(xc.MODEL_BIG) is entry and entry.lease == (slot, gen)
            assert _native.lease_gen(addr) == gen and not entry.freed
        finally:
            if ending == "resume":
                os.kill(decoder.pid, signal.SIGCONT)
            else:
                decoder.kill(signal.SIGKILL)
        if ending == "resume":
            reply = await decoder.reply(30)
            assert reply["ok"] and reply["path"] == "cma", reply
            want = xc.digests(np.full((xc.BIG_TENSORS, big.cache_desc.size), xc.BIG_FILL,
                                      dtype=np.uint8))  # fmt: skip
            assert (await decoder.ok("digest", name="big"))["sha"] == want
        else:
            await decoder.wait_dead()
        cm.unregister_cache(big.cache_id)  # no reader left (or its process is dead)
        assert cm.table.blocks(xc.MODEL_BIG) is None
