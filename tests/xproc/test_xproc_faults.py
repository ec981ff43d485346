"""Peers that die, links closed under queued pulls, and re-linking afterwards."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    LayerSynchronizer,
    LLMException,
    LLMRole,
    LLMStatusCode,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import cluster_info
from tests._procs import stop_now
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import (
    Harness,
    decoder_options,
    link,
    pull_and_check,
    stop_when_bytes_land,
    until,
)

pytestmark = pytest.mark.slow  # peer processes on every data path: the full run's

PROMPT, DECODER = 31, 32
SEED = 13
BIG_MIB = 256
S = LLMStatusCode


class _Always(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


@pytest.mark.asyncio
async def test_peer_killed_mid_pull_then_relink_to_restarted_peer() -> None:
    """SIGKILL of the prompt while a big tcp pull is half done: LLMException soon after
    the kill (from the closed connections, long before the deadline), the link is gone,
    and a restarted prompt links and serves again."""
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, data_path="tcp", seed=SEED, big_mib=BIG_MIB)
        dd, local = await h.local(DECODER, decoder_options("tcp"), big_mib=BIG_MIB)
        await link(dd, prompt, PROMPT)
        big = local["big"]
        nblocks = big.spec.shape[0]
        stamps: dict[str, float] = {}
        watcher = threading.Thread(
            target=stop_when_bytes_land, args=(big.views[0], prompt.pid, stamps), daemon=True
        )
        watcher.start()
        loop = asyncio.get_running_loop()
        pull = asyncio.ensure_future(
            dd.cache_manager.pull_blocks(
                BlocksCacheKey(PROMPT, xc.MODEL_BIG),
                big.cache,
                list(range(nblocks)),
                list(range(nblocks)),
                timeout=10.0,  # far past the kill: the deadline is not what ends it
            )
        )
        await asyncio.to_thread(watcher.join, 5)
        assert "stopped" in stamps, "no byte of the pull ever landed"
        # Frozen mid-transfer: some bytes landed, not all (a byte per page tells, and keeps
        # a loaded machine from spending seconds on the loop here before the kill).
        landed = [int(np.count_nonzero(v[::4096] == xc.BIG_FILL)) for v in big.views]
        assert 0 < sum(landed) < sum(v[::4096].size for v in big.views), landed
        assert not pull.done()
        prompt.kill(signal.SIGKILL)
        killed = loop.time()
        with pytest.raises(LLMException) as ei:
            await asyncio.wait_for(pull, 5)
        failed = loop.time()
        # A dead peer is noticed from its closed connections, not from the deadline.
        assert ei.value.status_code != S.LLM_TIMEOUT, ei.value
        assert failed - killed < 1.5, f"the pull failed {failed - killed:.2f} s after the kill"
        await prompt.wait_dead()
        await until(lambda: dd.links == [], what="the dead link to be dropped")
        with pytest.raises(LLMException) as ei:
            await dd.cache_manager.pull_blocks(
                BlocksCacheKey(PROMPT, xc.MODEL_REG), local["reg"].cache, [0], [0]
            )
        assert ei.value.status_code == S.LLM_NOT_YET_LINK

        # The prompt restarts (same cluster id, a new port): the decoder links again.
        again = await h.peer(cluster_id=PROMPT, data_path="tcp", seed=SEED + 1)
        await link(dd, again, PROMPT)
        await pull_and_check(dd, local["reg"], PROMPT, SEED + 1, "reg", [2, 5], [0, 1])
        await pull_and_check(dd, local["alloc"], PROMPT, SEED + 1, "alloc", [7], [7])


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["tcp", "shm"])
async def test_unlink_while_pulls_are_queued(path: str) -> None:
    """Unlink takes its place in the link's FIFO: pulls queued before it complete,
    pulls queued after it fail with LLM_NOT_YET_LINK.

    The link is kept busy meanwhile: over tcp by a real pull from a prompt frozen with
    SIGSTOP (its bytes cannot come until SIGCONT); over shm, where a frozen prompt
    does not stop a one-sided copy, by holding the link's slot as a transfer would.
    """
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, data_path=path, seed=SEED)
        dd, local = await h.local(DECODER, decoder_options(path))
        await link(dd, prompt, PROMPT)
        lk = dd._rt.links.find(PROMPT)
        assert lk is not None
        dst = local["alloc"]
        cm = dd.cache_manager
        key = BlocksCacheKey(PROMPT, xc.MODEL_ALLOC)

        def waiting() -> int:
            return len(getattr(lk.slot._lock, "_waiters", None) or ())

        async def queued(coro: object) -> asyncio.Future[object]:
            n = waiting()
            fut = asyncio.ensure_future(coro)  # type: ignore[arg-type]
            await until(lambda: waiting() > n or fut.done(), what="queued on the link")
            assert not fut.done(), fut
            return fut

        release = asyncio.Event()

        async def hold() -> None:
            async with lk.exclusive(None):
                await release.wait()

        if path == "tcp":
            stop_now(prompt.pid)  # (every thread stopped: its serving thread answers fast)
            busy = asyncio.ensure_future(cm.pull_blocks(key, dst.cache, [7], [7], timeout=15))
        else:
            busy = asyncio.ensure_future(hold())
        try:
            await until(lambda: lk.slot.busy, what="the link busy")
            first = [
                await queued(cm.pull_blocks(key, dst.cache, [b], [b], timeout=15)) for b in range(3)
            ]
            unlink = await queued(dd.unlink_clusters([cluster_info(PROMPT)], 15000))
            later = [
                await queued(cm.pull_blocks(key, dst.cache, [b], [b], timeout=15))
                for b in range(3, 6)
            ]
            assert waiting() == 7
        finally:
            prompt.kill(signal.SIGCONT)
            release.set()
        results = await asyncio.wait_for(
            asyncio.gather(busy, *first, unlink, *later, return_exceptions=True), 20
        )
        assert results[:4] == [None] * 4, results
        assert results[4] == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        for r in results[5:]:
            assert isinstance(r, LLMException) and r.status_code == S.LLM_NOT_YET_LINK, r
            assert "was closed" in str(r), r  # refused by the closed link, in its turn
        # Exactly the earlier pulls landed.
        done_blocks = [0, 1, 2, 7] if path == "tcp" else [0, 1, 2]
        want = xc.expect_blocks(
            xc.reference(None, "alloc"),
            xc.reference(SEED, "alloc"),
            dst.spec.unit,
            done_blocks,
            done_blocks,
            (0, 0, 4),
        )
        assert np.array_equal(dst.matrix(), want)
        assert dd.links == []
        # The prompt hears of the unlink; then the decoder links again.
        for _ in range(100):
            if not (await prompt.ok("links"))["links"]:
                break
            await asyncio.sleep(0.02)
        assert (await prompt.ok("links"))["links"] == []
        await link(dd, prompt, PROMPT)
        await pull_and_check(dd, dst, PROMPT, SEED, "alloc", [6], [6])


def _stop_when(pred: object, pid: int, out: dict[str, float]) -> None:
    """SIGSTOPs ``pid`` as soon as ``pred()`` holds (or after 5 s)."""
    import os

    end = time.monotonic() + 5
    while not pred() and time.monotonic() < end:  # type: ignore[operator]
        pass
    if pred():  # type: ignore[operator]
        os.kill(pid, signal.SIGSTOP)
        out["stopped"] = time.monotonic()


@pytest.mark.asyncio
async def test_serving_side_survives_decoders_dying_mid_transfer() -> None:
    """An in-process prompt serves subprocess decoders; one dies while the prompt sends to
    it, another while the prompt pushes to it. The prompt notices at once (not at the
    deadline), releases the cache, drops those links and keeps serving the rest."""
    mib = 192  # long enough to be caught mid-send on a loaded machine with today's movers
    async with Harness() as h:
        opts = decoder_options("tcp", **{"llm.listenIpInfo": "127.0.0.1:0"})
        opts["llm.SyncKvCacheWaitTime"] = "4000"
        dd, local = await h.local(PROMPT, opts, role=LLMRole.PROMPT, seed=SEED, big_mib=mib)
        assert dd.listen_address is not None
        host, port = dd.listen_address
        dying, pushed, healthy = await asyncio.gather(
            *(
                h.peer(cluster_id=c, role="decoder", listen=None, data_path="tcp", big_mib=mib)
                for c in (33, 34, 35)
            )
        )
        for d in (dying, pushed, healthy):
            assert (await d.ok("link", cluster_id=PROMPT, host=host, port=port))["status"] == 0
        await until(lambda: len(dd.links) == 3, what="three links")
        big = local["big"]
        entry = dd._rt.caches.entries[big.cache.cache_id]
        nblocks = big.spec.shape[0]
        loop = asyncio.get_running_loop()

        # 1. A decoder frozen, then killed, while the prompt serves its pull.
        stamps: dict[str, float] = {}
        watcher = threading.Thread(
            target=_stop_when, args=(lambda: entry.busy > 0, dying.pid, stamps), daemon=True
        )
        watcher.start()
        await dying.send(
            "pull_blocks",
            cluster_id=PROMPT,
            model_id=xc.MODEL_BIG,
            dst="big",
            src_blocks=list(range(nblocks)),
            dst_blocks=list(range(nblocks)),
            timeout=4,
        )
        await asyncio.to_thread(watcher.join, 6)
        assert "stopped" in stamps, "the prompt never started serving the pull"
        await asyncio.sleep(0.1)
        assert entry.busy == 1  # blocked sending to a frozen peer
        dying.kill(signal.SIGKILL)
        killed = loop.time()
        await until(lambda: entry.busy == 0, timeout=3, what="the serving job to end")
        await until(lambda: 33 not in {lk.remote_cluster_id for lk in dd.links}, timeout=3)
        assert loop.time() - killed < 2.0
        await dying.wait_dead()

        # 2. A decoder frozen, then killed, while the prompt pushes to it.
        pushed.kill(signal.SIGSTOP)
        task = await dd.cache_manager.transfer_cache_async(
            big.cache,
            _Always(),
            [TransferWithCacheKeyConfig(BlocksCacheKey(34, xc.MODEL_BIG), range(1), range(1))],
            list(range(nblocks)),
            list(range(nblocks)),
        )
        await until(lambda: entry.busy > 0, what="the push to start")
        await asyncio.sleep(0.2)
        assert not task.done()
        pushed.kill(signal.SIGKILL)
        killed = loop.time()
        status = await asyncio.wait_for(task.synchronize(), 6)
        assert status != S.LLM_SUCCESS
        assert status != S.LLM_TIMEOUT, "a dead peer must be noticed before the deadline"
        assert loop.time() - killed < 2.0
        await pushed.wait_dead()
        await until(lambda: [lk.remote_cluster_id for lk in dd.links] == [35], timeout=3)
        assert entry.busy == 0

        # 3. The healthy decoder is served both ways.
        r = await healthy.ok(
            "pull_blocks",
            cluster_id=PROMPT,
            model_id=xc.MODEL_REG,
            dst="reg",
            src_blocks=[1, 2],
            dst_blocks=[3, 4],
            timeout=5,
        )
        assert r["path"] == "tcp", r
        want = xc.expect_blocks(
            xc.reference(None, "reg"),
            xc.reference(SEED, "reg"),
            xc.SPECS["reg"].unit,
            [1, 2],
            [3, 4],
            (0, 0, 4),
        )
        assert (await healthy.ok("digest", name="reg"))["sha"] == xc.digests(want)
        task = await dd.cache_manager.transfer_cache_async(
            big.cache,
            _Always(),
            [TransferWithCacheKeyConfig(BlocksCacheKey(35, xc.MODEL_BIG), range(1), range(1))],
            list(range(nblocks)),
            list(range(nblocks)),
        )
        assert await asyncio.wait_for(task.synchronize(), 10) == S.LLM_SUCCESS
        want_big = np.full((2, big.spec.nbytes), xc.BIG_FILL, dtype=np.uint8)
        assert (await healthy.ok("digest", name="big"))["sha"] == xc.digests(want_big)


@pytest.mark.asyncio
async def test_relink_after_graceful_restart() -> None:
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, seed=SEED)
        dd, local = await h.local(DECODER)
        await link(dd, prompt, PROMPT)
        await pull_and_check(dd, local["reg"], PROMPT, SEED, "reg", [0], [0])
        await prompt.stop()  # finalize: the decoder hears the link close
        await until(lambda: dd.links == [], what="the link to close")
        again = await h.peer(cluster_id=PROMPT, seed=SEED + 2)
        await link(dd, again, PROMPT)
        await pull_and_check(dd, local["reg"], PROMPT, SEED + 2, "reg", [0, 1], [0, 1])
        await pull_and_check(dd, local["alloc"], PROMPT, SEED + 2, "alloc", [5], [2])
