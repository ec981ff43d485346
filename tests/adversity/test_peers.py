"""Peer attacks: kill -9 of either side mid-pull, a peer that truncates a segment we
mapped, a peer that frees the memory we push into.

* prompt killed mid-pull (every path): the pull in flight and the ones after end in an
  ``LLMException`` within their deadline; nothing of the dead prompt stays in
  ``/dev/shm`` (issue 9, finding 8).
* decoder killed mid-pull (every path): the prompt keeps serving another decoder
  (verified) and can re-register its cache within a bound.
* truncated segment: the decoder (a process of its own: a SIGBUS would kill it) gets an
  error or the right bytes, and lives (finding 4).
* push into freed memory: the decoder frees the cache a prompt pushes into and reuses
  the memory; nothing lands in it afterwards (finding 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    LayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMRole,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import cluster_info, make_blocks_cache
from tests.adversity._common import (
    NUM_BLOCKS,
    NUM_TENSORS,
    ActorProc,
    Figures,
    cache_spec,
    check_pull,
    fill_blocks,
    new_cluster_id,
    remove_segments_of,
    shm_entries,
    snapshot,
    start_prompt,
)
from tests.adversity._rig import decoder_options, rig

pytestmark = pytest.mark.slow  # actor processes under load for seconds: the full run's

PATHS = ["shm", "cma", "tcp"]
BIG_SHAPE = [256, 2, 64]  # fp16: 64 KiB per block per tensor, 32 MiB per cache
BIG_BLOCK = 2 * 256 * 2 * 64
SLACK = 3.0


def big_spec(name: str, model_id: int, allocate: bool) -> dict[str, object]:
    return {**cache_spec(name, model_id, allocate), "block_shape": BIG_SHAPE}


@pytest.fixture(scope="module")
def prompt() -> Iterator[ActorProc]:
    a = start_prompt()
    yield a
    a.stop()


@pytest.mark.adversity(ci=0.1, weight=0.5)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.asyncio
async def test_prompt_killed_mid_pull(path: str, budget: float) -> None:
    fig = Figures(f"kill-prompt[{path}]")
    rng = np.random.default_rng(random.randrange(1 << 32))
    victim = ActorProc.start(cluster_id=new_cluster_id())
    model = 0 if path == "shm" else 1
    name = "shm" if path == "shm" else "reg"
    seed = int(rng.integers(1 << 50))
    await victim.ok("cache", **big_spec(name, model, path == "shm"))
    await victim.ok("fill", name=name, seed=seed, blocks=list(range(NUM_BLOCKS)))
    dd = LLMDataDist(LLMRole.DECODER, new_cluster_id())
    await dd.init(decoder_options(path))
    try:
        status, _ = await dd.link_clusters(
            [cluster_info(victim.cluster_id, *victim.address)], 10_000
        )
        assert status == 0, status
        dst = make_blocks_cache(
            dd, num_tensors=NUM_TENSORS, num_blocks=NUM_BLOCKS, block_shape=tuple(BIG_SHAPE)
        )
        key = BlocksCacheKey(victim.cluster_id, model)
        blocks = list(range(NUM_BLOCKS))
        # A few good pulls, then the kill lands at a random moment of the next ones.
        kill_at = time.monotonic() + budget + float(rng.uniform(0.0, 0.15))
        killed = False
        failures = 0
        after_kill = 0  # pulls that succeeded after the kill
        while failures < 3:
            if not killed and time.monotonic() >= kill_at:
                victim.kill()
                killed = True
            timeout = 5.0
            for t in dst.tensors:
                t.view(np.uint8).fill(0)
            before = snapshot(dst.tensors)
            t0 = time.monotonic()
            task = asyncio.ensure_future(
                dd.cache_manager.pull_blocks(key, dst.cache, blocks, blocks, timeout=timeout)
            )
            if not killed and kill_at - time.monotonic() < 0.05:
                await asyncio.sleep(max(0.0, kill_at - time.monotonic()))
                victim.kill()  # mid-pull
                killed = True
            try:
                async with asyncio.timeout(timeout + SLACK + 5):
                    await task
            except LLMException as e:
                fig.faults += 1
                fig.error(e)
                failures += 1
                if time.monotonic() - t0 > timeout + SLACK:
                    fig.late(f"pull failed after {time.monotonic() - t0:.1f} s")
                continue
            except TimeoutError:
                fig.faults += 1
                fig.late(f"a pull from a killed prompt hung past {timeout + SLACK + 5} s")
                task.cancel()
                break
            bad, canary = check_pull(dst.tensors, before, blocks, blocks, seed)
            fig.pulls += 1
            fig.bytes += NUM_BLOCKS * NUM_TENSORS * BIG_BLOCK
            if bad or canary:
                fig.bad(
                    f"a pull around the kill returned wrong bytes ({bad} + {canary})", bad + canary
                )
            # Counted from the kill: a long budget makes many good pulls before it.
            after_kill += killed
            if after_kill > 50:
                fig.late("pulls from a killed prompt keep succeeding")
                break
    finally:
        await asyncio.wait_for(dd.finalize(), 30)
    victim.kill()
    await victim.wait_dead()
    victim.stop()
    # Nothing of the dead prompt stays in /dev/shm once a new instance started (a start-up
    # reaper may be what removes it).
    fresh = LLMDataDist(LLMRole.DECODER, new_cluster_id())
    await fresh.init(decoder_options("auto"))
    await fresh.finalize()
    left = [n for n in shm_entries() if n.startswith(f"aiodd-{victim.pid}-")]
    remove_segments_of(victim.pid)  # so that a failure here leaves nothing behind either
    fig.other["left_in_dev_shm"] = left
    fig.check()
    assert not left, f"a SIGKILLed prompt left {left} in /dev/shm"


@pytest.mark.adversity(ci=0.1, weight=0.5)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.asyncio
async def test_decoder_killed_mid_pull(path: str, prompt: ActorProc, budget: float) -> None:
    fig = Figures(f"kill-decoder[{path}]")
    rng = np.random.default_rng(random.randrange(1 << 32))
    model = 0 if path == "shm" else 1
    name = "shm" if path == "shm" else "reg"
    dec = ActorProc.start(cluster_id=new_cluster_id(), role="decoder", listen=False, data_path=path)
    try:
        await dec.ok(
            "cache",
            name="dst",
            num_tensors=NUM_TENSORS,
            num_blocks=NUM_BLOCKS,
            block_shape=[32, 2, 64],
            allocate=False,
        )
        r0 = await dec.ok(
            "link", cluster_id=prompt.cluster_id, host=prompt.address[0], port=prompt.address[1]
        )
        assert r0["status"] == 0, r0
        await dec.ok(
            "pull_loop",
            cluster_id=prompt.cluster_id,
            model_id=model,
            dst="dst",
            blocks=list(range(NUM_BLOCKS)),
            timeout=5.0,
        )
        await asyncio.sleep(budget + float(rng.uniform(0.0, 0.1)))
        fig.faults += 1
        dec.kill()
        await dec.wait_dead()
    finally:
        dec.stop()
    # The prompt serves another decoder (verified) and re-registers its cache in time.
    async with rig(path, prompt) as r:
        for k in range(3):
            seed = int(rng.integers(1 << 50))
            src = [int(b) for b in rng.choice(NUM_BLOCKS, 8, replace=False)]
            await r.fill(seed, src)
            before = snapshot(r.dst.tensors)
            await r.decoder.cache_manager.pull_blocks(r.key, r.dst.cache, src, src, timeout=5.0)
            bad, canary = check_pull(r.dst.tensors, before, src, src, seed)
            fig.pulls += 1
            fig.bytes += len(src) * r.block_bytes * NUM_TENSORS
            if bad or canary:
                fig.bad(f"pull {k} after the decoder died: {bad} + {canary}", bad + canary)
        t0 = time.monotonic()
        rr = await prompt.call(
            "reregister",
            name=name,
            seed=int(rng.integers(1 << 50)),
            poison=int(rng.integers(1 << 50)),
            timeout=20.0,
        )
        took = time.monotonic() - t0
        fig.other["reregister"] = {k: v for k, v in rr.items() if k != "tb"}
        if not rr.get("ok") or took > 10.0:
            fig.late(
                f"re-registering after a decoder died: {rr.get('error', 'ok')} after {took:.1f} s"[
                    :300
                ]
            )
    fig.check()


@pytest.mark.adversity(ci=0.0, weight=0.2)
@pytest.mark.asyncio
async def test_peer_truncates_mapped_segment(prompt: ActorProc) -> None:
    fig = Figures("truncated-segment")
    rng = np.random.default_rng(random.randrange(1 << 32))
    victim = ActorProc.start(cluster_id=new_cluster_id())
    dec = ActorProc.start(
        cluster_id=new_cluster_id(), role="decoder", listen=False, data_path="shm"
    )
    try:
        await victim.ok("cache", **cache_spec("shm", 0, True))
        await dec.ok(
            "cache",
            name="dst",
            num_tensors=NUM_TENSORS,
            num_blocks=NUM_BLOCKS,
            block_shape=[32, 2, 64],
            allocate=False,
        )
        r0 = await dec.ok(
            "link", cluster_id=victim.cluster_id, host=victim.address[0], port=victim.address[1]
        )
        assert r0["status"] == 0, r0
        blocks = list(range(NUM_BLOCKS))
        seed = int(rng.integers(1 << 50))
        await victim.ok("fill", name="shm", seed=seed, blocks=blocks)
        r1 = await dec.ok(
            "pull",
            cluster_id=victim.cluster_id,
            model_id=0,
            dst="dst",
            src_blocks=blocks,
            dst_blocks=blocks,
            seed=seed,
            timeout=5.0,
        )
        fig.pulls += 1
        assert r1["mismatches"] == 0, r1
        t = await victim.ok("truncate", name="shm")
        fig.other["truncate"] = t
        if t["how"] == "no fd reachable":
            pytest.skip(
                "the prompt's own segment has no descriptor, name or mapping "
                "reachable from its process: nothing to truncate"
            )
        fig.faults += 1
        t0 = time.monotonic()
        r2 = await dec.call(
            "pull",
            cluster_id=victim.cluster_id,
            model_id=0,
            dst="dst",
            src_blocks=blocks,
            dst_blocks=blocks,
            seed=seed,
            timeout=5.0,
        )
        took = time.monotonic() - t0
        alive = dec.proc.poll() is None
        fig.other["after"] = {k: v for k, v in r2.items() if k != "tb"}
        assert alive, f"the decoder died (rc {dec.proc.poll()}) pulling a truncated segment"
        if r2.get("ok"):
            assert t["truncated"] is False, f"success from a truncated segment: {r2}"
            if r2["mismatches"]:
                fig.bad(f"pull after a refused truncate: {r2['mismatches']}", r2["mismatches"])
        else:
            fig.errors[str(r2.get("status", r2.get("error")))[:40]] += 1
        if took > 5.0 + SLACK:
            fig.late(f"the pull from a truncated segment took {took:.1f} s")
    finally:
        dec.stop()
        victim.stop()
    fig.check()


class _SlowLayers(LayerSynchronizer):
    """Each layer is "computed" in 10 ms: the push spans a while, so the decoder's free
    lands in the middle of it."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        time.sleep(0.01)
        return True


@pytest.mark.adversity(ci=0.5, weight=0.5)
@pytest.mark.asyncio
async def test_push_into_freed_memory(budget: float) -> None:
    """A decoder frees (and reuses) the cache a prompt is pushing into: nothing may land
    in the reused memory once ``unregister_cache`` returned."""
    fig = Figures("push-into-freed")
    rng = np.random.default_rng(random.randrange(1 << 32))
    dec = ActorProc.start(cluster_id=new_cluster_id(), role="decoder")
    dd = LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    await dd.init({"llm.SyncKvCacheWaitTime": "10000"})
    try:
        await dec.ok("cache", **big_spec("dst", 5, False))
        status, _ = await dd.link_clusters([cluster_info(dec.cluster_id, *dec.address)], 10_000)
        assert status == 0, status
        src = make_blocks_cache(
            dd, num_tensors=NUM_TENSORS, num_blocks=NUM_BLOCKS, block_shape=tuple(BIG_SHAPE), seed=1
        )
        blocks = list(range(NUM_BLOCKS))
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(dec.cluster_id, 5), range(4), range(4))
        end = time.monotonic() + budget
        rounds = 0
        while rounds < 2 or time.monotonic() < end:
            rounds += 1
            poison = int(rng.integers(1 << 50))
            fill_blocks(src.tensors, poison + 2, blocks)  # this push's own pattern
            t0 = time.monotonic()
            try:
                task = await dd.cache_manager.transfer_cache_async(
                    src.cache, _SlowLayers(), [cfg], blocks, blocks
                )
            except LLMException as e:
                fig.error(e)
                task = None
            await asyncio.sleep(float(rng.uniform(0.0, 0.03)))
            rr = await dec.call("reregister", name="dst", seed=poison + 1, poison=poison)
            fig.faults += 1
            if task is not None:
                with contextlib.suppress(LLMException):
                    st = await task.synchronize(10_000)
                    fig.errors[f"push:{getattr(st, 'name', st)}"] += 1
            if time.monotonic() - t0 > 10.0 + SLACK:
                fig.late(f"round {rounds}: the push took {time.monotonic() - t0:.1f} s")
            if not rr.get("ok"):
                fig.errors[f"reregister:{rr.get('status', rr.get('error'))}"[:60]] += 1
                continue
            await asyncio.sleep(0.05)  # a late write would land by now
            chk = await dec.ok("check_old", poison=poison)
            if chk["changed"]:
                fig.bad(
                    f"round {rounds}: {chk['changed']} bytes written into freed memory",
                    int(chk["changed"]),
                )
        fig.other["rounds"] = rounds
    finally:
        await asyncio.wait_for(dd.finalize(), 30)
        dec.stop()
    fig.check()
