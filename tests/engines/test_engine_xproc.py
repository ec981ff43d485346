"""The transfer engines (NIXL, Mooncake) as the data path between two processes, byte for byte.

Every scenario runs on both engines (``engine``: ``nixl``, ``mooncake``). The prompt is
``tests/xproc/peer_main.py`` (caches filled from a seed); the decoder lives in the test
process, so every pulled byte is compared with the numpy reference regenerated from that
seed. Both run the engine (``aiodatadist.Engines``); a test skips with the reason when
its engine cannot run here (``engine_unavailable``).

Leases: on one host the engine transfer runs under the lease page (as cma). The
control-plane lease (LEASE/LEASED/UNLEASE, for peers on other hosts) is forced here by
one test-only step: the decoder's engine path forgets the link's fd channel
(``EnginePath.fds = None``), which is exactly what a link between hosts lacks;
``test_engine_netns.py`` runs the real thing between network namespaces.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, DataPath, LLMException
from aiodatadist import LLMStatusCode as S
from aiodatadist.testing import engine_unavailable
from tests._procs import stop_now
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import (
    Harness,
    PeerProc,
    decoder_options,
    link,
    path_of,
    pull_and_check,
    until,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


@dataclass(frozen=True)
class Engine:
    name: str
    prompt: int  # cluster ids
    decoder: int
    seed: int
    abort_after_s: float  # a deadline that a 256 MiB pull overruns (it is aborted)
    kill_deadline_s: float  # a pull's deadline while its peer is killed
    kill_bound_s: float  # all pulls until the kill, and the failed one, within this

    @property
    def options(self) -> dict[str, str]:
        return {"aiodatadist.Engines": self.name}


ENGINES = {
    "nixl": Engine("nixl", 41, 42, 9, 0.01, 3.0, 15.0),
    # Mooncake cannot cancel: an aborted pull waits for the pieces in flight.
    "mooncake": Engine("mooncake", 51, 52, 13, 0.02, 5.0, 20.0),
}
LEASES = pytest.mark.parametrize(
    "control_lease", [False, True], ids=["lease-page", "control-lease"]
)


@pytest.fixture(params=list(ENGINES))
def engine(request: pytest.FixtureRequest) -> Engine:
    why = engine_unavailable(request.param)
    if why is not None:
        pytest.skip(why)
    return ENGINES[request.param]


async def linked(
    h: Harness, e: Engine, path: str | None = None, *, control_lease: bool = False, **kw: Any
) -> tuple[Any, dict[str, xc.Local], PeerProc]:
    path = path or e.name
    prompt = await h.peer(cluster_id=e.prompt, data_path=path, seed=e.seed, options=e.options, **kw)
    dd, local = await h.local(
        e.decoder, decoder_options(path, **e.options), big_mib=int(kw.get("big_mib", 0))
    )
    await link(dd, prompt, e.prompt)
    lk = dd._rt.links.find(e.prompt)
    assert lk is not None
    await asyncio.wait_for(lk.path.fds_settled.wait(), 5)
    if control_lease:
        lk.path.engines[DataPath(e.name)].fds = None  # test-only: as between hosts (above)
    return dd, local, prompt


def big_pull(dd: Any, e: Engine, big: xc.Local, timeout: float | None) -> Any:
    n = big.spec.shape[0]
    return dd.cache_manager.pull_blocks(
        BlocksCacheKey(e.prompt, xc.MODEL_BIG),
        big.cache,
        list(range(n)),
        list(range(n)),
        timeout=timeout,
    )


@LEASES
async def test_forced_engine_pull_and_push_exact_bytes(engine: Engine, control_lease: bool) -> None:
    e = engine
    async with Harness() as h:
        dd, local, prompt = await linked(h, e, control_lease=control_lease)
        lk = dd._rt.links.find(e.prompt)
        assert lk.data_path == e.name and lk.data_paths == (e.name,)
        for src in ("alloc", "reg"):
            assert path_of(dd, e.prompt, xc.SPECS[src].model_id) == e.name
            await pull_and_check(dd, local[src], e.prompt, e.seed, src, [0, 3, 5], [1, 2, 7])
            # A layer range, one tensor per layer, permuted: a new request.
            await pull_and_check(
                dd,
                local[src],
                e.prompt,
                e.seed,
                src,
                [6, 4],
                [0, 3],
                src_layers=(1, 3),
                dst_layers=(0, 2),
                tpl=1,
            )
            # The same pull again (NIXL: the prepared request is posted again).
            await pull_and_check(dd, local[src], e.prompt, e.seed, src, [0, 3, 5], [1, 2, 7])
            assert lk.path.used == e.name
        # Push: the prompt writes its "reg" blocks into our "alloc" cache over the engine.
        before = local["alloc"].matrix()
        r = await prompt.ok(
            "push",
            dst_cluster=e.decoder,
            src="reg",
            model_id=xc.MODEL_ALLOC,
            src_blocks=[2, 7],
            dst_blocks=[6, 0],
        )
        assert r["status"] == 0 and r["results"] == [0], r
        links = (await prompt.ok("links"))["links"]
        assert links == [{"cluster_id": e.decoder, "data_path": e.name}], links
        want = xc.expect_blocks(
            before, xc.reference(e.seed, "reg"), xc.SPECS["alloc"].unit, [2, 7], [6, 0], (0, 0, 4)
        )
        assert np.array_equal(local["alloc"].matrix(), want)


async def test_layerwise_over_the_engine_each_layer_exact(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pull_blocks_layerwise`` over the engine: one engine pull per layer, in order
    (``Path.pull_layers``; one pull of the whole would land the first layer later on
    Mooncake, whose every pull costs ~0.5 ms here), each layer exact the moment it is
    handed over, the blocks not named untouched."""
    e = engine
    async with Harness() as h:
        dd, local, _prompt = await linked(h, e)
        lk = dd._rt.links.find(e.prompt)
        ep = lk.path.engines[DataPath(e.name)]
        pulls: list[int] = []
        real = ep.pull

        async def pull(plan: Any, *a: Any) -> None:
            pulls.append(plan.total_bytes)
            await real(plan, *a)

        monkeypatch.setattr(ep, "pull", pull)
        spec = xc.SPECS["reg"]
        ref = xc.reference(e.seed, "reg")
        reg = local["reg"]
        cm = dd.cache_manager
        key = BlocksCacheKey(e.prompt, xc.MODEL_REG)
        for sb, db in (([0, 3, 5], [1, 2, 7]), ([6, 1], [0, 4])):
            before = reg.matrix()
            pulls.clear()
            got = []
            async for layer in cm.pull_blocks_layerwise(
                key, reg.cache, sb, db, tensor_num_per_layer=1, timeout=10
            ):
                t = layer.dst_layer
                want = xc.expect_blocks(before, ref, spec.unit, sb, db, (t, t, 1))
                assert np.array_equal(reg.matrix()[t], want[t]), layer
                assert len(pulls) > layer.index  # (its own engine pull was asked)
                got.append(layer.index)
            assert got == [0, 1, 2, 3]
            whole = xc.expect_blocks(before, ref, spec.unit, sb, db, (0, 0, spec.num_tensors))
            assert np.array_equal(reg.matrix(), whole)
            assert pulls == [len(sb) * spec.unit] * 4, pulls
            assert lk.path.used == e.name


async def test_auto_offers_the_engine_but_keeps_host_memory_on_our_paths(engine: Engine) -> None:
    """Both sides run the engine, ``auto``: the link offers it, host memory still goes over
    shm/cma (device memory would go over NIXL: no GPU here to show it)."""
    e = engine
    async with Harness() as h:
        dd, local, _prompt = await linked(h, e, "auto")
        lk = dd._rt.links.find(e.prompt)
        assert e.name in lk.data_paths and lk.data_path != e.name, lk.data_paths
        assert path_of(dd, e.prompt, xc.MODEL_ALLOC) == "shm"
        assert path_of(dd, e.prompt, xc.MODEL_REG) in ("cma", "tcp")
        await pull_and_check(dd, local["reg"], e.prompt, e.seed, "reg", [1, 2], [2, 1])


@LEASES
async def test_cache_registered_after_linking_is_pullable(
    engine: Engine, control_lease: bool
) -> None:
    e = engine
    async with Harness() as h:
        dd, local, prompt = await linked(h, e, control_lease=control_lease)
        ep = dd._rt.links.find(e.prompt).path.engines[DataPath(e.name)]
        await pull_and_check(dd, local["reg"], e.prompt, e.seed, "reg", [0], [0])  # connected
        seen = ep._seen
        for i, allocate in enumerate((False, True)):
            model_id, seed = 70 + i, 1000 * e.seed + i
            await prompt.ok(
                "register", name=f"late{i}", model_id=model_id, seed=seed, allocate=allocate
            )
            spec = xc.Spec(f"late{i}", True, allocate, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE))
            before = local["reg"].matrix()
            await dd.cache_manager.pull_blocks(
                BlocksCacheKey(e.prompt, model_id), local["reg"].cache, [4, 1], [1, 5], timeout=5
            )
            want = xc.expect_blocks(
                before, xc.pattern(seed, spec), spec.unit, [4, 1], [1, 5], (0, 0, 4)
            )
            assert np.array_equal(local["reg"].matrix(), want)
            assert path_of(dd, e.prompt, model_id) == e.name
        if e.name == "nixl":
            # The peer's newer metadata reached the connection (Mooncake's segment name
            # never changes: its target checks its own current buffers).
            assert ep._seen is not seen


@LEASES
async def test_free_and_reregister_on_the_owner(engine: Engine, control_lease: bool) -> None:
    """A pull racing the owner's free gets the old bytes whole or fails; after the free
    the key is gone; a re-registration under the key is read afresh."""
    e = engine
    async with Harness() as h:
        dd, local, prompt = await linked(h, e, control_lease=control_lease, big_mib=64)
        big = local["big"]
        pull = asyncio.ensure_future(big_pull(dd, e, big, 10))
        freed = await prompt.call("free", name="big", fill=0x5A)
        try:
            await pull
            # Done before the free took the cache, or the free waited: the old bytes whole.
            assert all(bool((v == xc.BIG_FILL).all()) for v in big.views)
        except LLMException as exc:
            assert exc.status_code in (S.LLM_KV_CACHE_NOT_EXIST, S.LLM_FAILED), exc
        if not freed.get("ok"):
            assert freed.get("status") == int(S.LLM_LINK_BUSY), freed
            await prompt.ok("free", name="big", fill=0x5A)
        await until(
            lambda: dd._rt.links.find(e.prompt).path.remote_table.blocks(xc.MODEL_BIG) is None,
            what="the table update",
        )
        with pytest.raises(LLMException) as ei:
            await big_pull(dd, e, big, 5)
        assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST, ei.value
        # Re-register "reg" under the same key with new bytes: the pull reads them.
        r = await prompt.call("cycle", name="reg", model_id=xc.MODEL_REG, seeds=[77], fill=0)
        assert r.get("ok"), r
        spec = xc.SPECS["reg"]
        before = local["reg"].matrix()
        await dd.cache_manager.pull_blocks(
            BlocksCacheKey(e.prompt, xc.MODEL_REG), local["reg"].cache, [0, 7], [7, 0], timeout=5
        )
        want = xc.expect_blocks(
            before,
            xc.pattern(77, xc.Spec("reg", True, False, spec.shape)),
            spec.unit,
            [0, 7],
            [7, 0],
            (0, 0, 4),
        )
        assert np.array_equal(local["reg"].matrix(), want)


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_timeout_and_cancel_leave_the_link_usable(engine: Engine, how: str) -> None:
    """The control-plane lease waits on the owner: a stopped owner makes the pull time
    out (or be cancelled) within its bound; once it runs again the link works."""
    e = engine
    async with Harness() as h:
        dd, local, prompt = await linked(h, e, control_lease=True)
        await pull_and_check(dd, local["reg"], e.prompt, e.seed, "reg", [0], [0])
        loop = asyncio.get_running_loop()
        stop_now(prompt.pid)  # (every thread stopped: its serving thread answers fast)
        try:
            t0 = loop.time()
            pull = asyncio.ensure_future(
                dd.cache_manager.pull_blocks(
                    BlocksCacheKey(e.prompt, xc.MODEL_REG),
                    local["reg"].cache,
                    [1],
                    [1],
                    timeout=0.5 if how == "timeout" else 30,
                )
            )
            if how == "timeout":
                with pytest.raises(LLMException) as ei:
                    await asyncio.wait_for(pull, 5)
                assert ei.value.status_code == S.LLM_TIMEOUT, ei.value
            else:
                await asyncio.sleep(0.2)
                pull.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(pull, 5)
            assert loop.time() - t0 < 3.0
        finally:
            prompt.kill(signal.SIGCONT)
        await pull_and_check(dd, local["reg"], e.prompt, e.seed, "reg", [2, 3], [3, 2])
        # The owner let go of every lease (none leaked by the abandoned request).
        r = await prompt.call("free", name="reg")
        assert r.get("ok"), r


async def test_deadline_aborts_a_big_transfer_and_nothing_lands_after(engine: Engine) -> None:
    """A deadline mid-transfer: LLM_TIMEOUT, and once the call returned the engine writes
    no more bytes into our cache, or the cache is fenced until it cannot (NIXL: its
    requests are cut small and the one in flight waited for; Mooncake: no piece is
    submitted after the abort, and those in flight go to a reaper); the link then moves
    exact bytes again."""
    e = engine
    async with Harness() as h:
        dd, local, _prompt = await linked(h, e, big_mib=256)
        big = local["big"]
        entry = dd.cache_manager._caches.entries[big.cache.cache_id]
        timed_out = 0
        for _ in range(5):
            for v in big.views:
                v[...] = 0
            try:
                await big_pull(dd, e, big, e.abort_after_s)
            except LLMException as exc:
                assert exc.status_code == S.LLM_TIMEOUT, exc
                timed_out += 1
            await until(lambda: not entry.late_writes, 10)
            landed = [int(np.count_nonzero(v)) for v in big.views]
            await asyncio.sleep(0.3)
            assert [int(np.count_nonzero(v)) for v in big.views] == landed, "bytes landed late"
        assert timed_out, f"no pull of 256 MiB took longer than {e.abort_after_s} s"
        await big_pull(dd, e, big, 30)
        assert all(bool((v == xc.BIG_FILL).all()) for v in big.views)


async def test_a_deadline_holds_while_the_loop_is_blocked(engine: Engine) -> None:
    """The engine job polls its control, which carries the deadline: with the event loop
    (whose timer aborts jobs) blocked for 0.5 s once a 512 MiB pull with a 50 ms timeout
    moves bytes, the job still stops there and the call raises LLM_TIMEOUT, not every
    byte landed (before: the job ran to the end and the call returned success 0.5 s past
    its deadline). The link then moves exact bytes again."""
    e = engine
    async with Harness() as h:
        dd, local, _prompt = await linked(h, e, big_mib=512)
        big = local["big"]
        entry = dd.cache_manager._caches.entries[big.cache.cache_id]
        for _attempt in range(5):
            for v in big.views:
                v[...] = 0
            pull = asyncio.ensure_future(big_pull(dd, e, big, 0.05))
            await until(lambda p=pull: p.done() or any(v[0] for v in big.views), 10)
            if pull.done():  # the deadline passed before a byte landed (a loaded machine)
                with pytest.raises(LLMException):
                    await pull
                await until(lambda: not entry.late_writes, 30, "the fence lifted")
                continue
            asyncio.get_running_loop().call_soon(time.sleep, 0.5)  # blocks the loop, timer too
            with pytest.raises(LLMException) as ei:
                await pull
            assert ei.value.status_code == S.LLM_TIMEOUT, ei.value
            break
        else:
            pytest.fail("no pull moved a byte before its 50 ms deadline in 5 tries")
        await until(lambda: not entry.late_writes, 30, "the fence lifted")
        assert not all(bool(v.all()) for v in big.views), "every byte landed: nothing ended it"
        await big_pull(dd, e, big, 30)
        assert all(bool((v == xc.BIG_FILL).all()) for v in big.views)


@LEASES
async def test_peer_killed_mid_transfer_fails_within_bounds(
    engine: Engine, control_lease: bool
) -> None:
    e = engine
    async with Harness() as h:
        dd, local, prompt = await linked(h, e, control_lease=control_lease, big_mib=256)
        big = local["big"]

        def kill_when_bytes_land() -> None:
            end = time.monotonic() + 5
            v = big.views[0]
            while v[0] == 0 and time.monotonic() < end:
                time.sleep(0.0005)
            os.kill(prompt.pid, signal.SIGKILL)

        watcher = threading.Thread(target=kill_when_bytes_land, daemon=True)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        watcher.start()
        outcome: LLMException | None = None
        try:
            for _ in range(50):  # until the kill lands (every pull is exact until then)
                await big_pull(dd, e, big, e.kill_deadline_s)
                assert all(bool((v == xc.BIG_FILL).all()) for v in big.views)
        except LLMException as exc:
            outcome = exc
        assert outcome is not None, "50 pulls of a dead peer's memory succeeded"
        assert loop.time() - t0 < e.kill_bound_s
        await asyncio.to_thread(watcher.join, 5)
        await prompt.wait_dead()
        # Nothing lands after the failed pull returned.
        landed = [v.copy() for v in big.views]
        await asyncio.sleep(0.3)
        assert all(np.array_equal(a, v) for a, v in zip(landed, big.views, strict=True))


async def test_forced_engine_to_a_peer_without_it_says_why(engine: Engine) -> None:
    e = engine
    async with Harness() as h:
        prompt = await h.peer(cluster_id=e.prompt, seed=e.seed)  # auto, no engine
        dd, local = await h.local(e.decoder, decoder_options(e.name))  # forces (starts) it
        await link(dd, prompt, e.prompt)
        with pytest.raises(LLMException) as ei:
            await dd.cache_manager.pull_blocks(
                BlocksCacheKey(e.prompt, xc.MODEL_REG), local["reg"].cache, [0], [0]
            )
        assert ei.value.status_code == S.LLM_FEATURE_NOT_ENABLED
        assert e.name in str(ei.value) and "does not run it" in str(ei.value), ei.value


async def test_mooncake_init_on_ipv6_fails_saying_why() -> None:
    """Mooncake's handshake resolves IPv4 only: an instance listening on IPv6 that asks
    for it fails ``init`` with LLM_FEATURE_NOT_ENABLED and the reason."""
    from aiodatadist import LLMDataDist, LLMRole

    why = engine_unavailable("mooncake")
    if why is not None:
        pytest.skip(why)
    e = ENGINES["mooncake"]
    dd = LLMDataDist(LLMRole.PROMPT, e.prompt)
    with pytest.raises(LLMException) as ei:
        await dd.init({"llm.listenIpInfo": "[::1]:0", **e.options})
    assert ei.value.status_code == S.LLM_FEATURE_NOT_ENABLED, ei.value
    assert "IPv4" in str(ei.value)


@pytest.mark.parametrize(
    ("op", "control_lease"),
    [("pull", True), ("push", False)],
    ids=["pull-control-lease", "push-lease-page"],
)
async def test_mooncake_keeps_its_deadline_with_the_owner_frozen_mid_transfer(
    op: str, control_lease: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mooncake cannot cancel, and a frozen peer fails its requests only after the stall
    timeouts (5 s each here): the call still ends at its deadline. The requests in flight
    go to a reaper: the bytes of ours they may touch stay fenced (a copy into them is
    refused, one between blocks the call did not name moves) and the owner's lease held
    (its page counts us, or no UNLEASE yet) until they ended, so neither side's memory
    is freed under them; then the link moves exact bytes again and the owner frees its
    cache. (A pull under the control-plane lease is stopped once its bytes flow, after
    the LEASE round trip; a push under the lease page is submitted to the owner already
    stopped.)"""
    from aiodatadist import _engine_lease
    from aiodatadist import _native as native

    e = ENGINES["mooncake"]
    why = engine_unavailable(e.name)
    if why is not None:
        pytest.skip(why)
    unleased: list[int] = []
    real_unlease = _engine_lease._unlease

    async def spy(peer: Any, req: int) -> None:
        unleased.append(req)
        await real_unlease(peer, req)

    async with Harness() as h:
        dd, local, prompt = await linked(h, e, big_mib=256)
        lk = dd._rt.links.find(e.prompt)
        ep = lk.path.engines[DataPath(e.name)]
        page = await ep.fds.peer_page(asyncio.get_running_loop().time() + 5)
        if control_lease:
            ep.fds = None  # test-only: as between hosts (above)
        addr = page.addr(lk.path.remote_table.blocks(xc.MODEL_BIG).lease[0])
        big = local["big"]
        entry = dd.cache_manager._caches.entries[big.cache.cache_id]
        n = big.spec.shape[0]
        key = BlocksCacheKey(e.prompt, xc.MODEL_BIG)
        move = dd.cache_manager.pull_blocks if op == "pull" else dd.cache_manager.push_blocks
        await move(key, big.cache, [0], [0], timeout=10)  # connected
        await asyncio.sleep(0.1)  # (its UNLEASE is out)
        monkeypatch.setattr(_engine_lease, "_unlease", spy)
        loop = asyncio.get_running_loop()
        # A pull is stopped once its bytes flow (its requests are out by then); a push
        # goes to a stopped owner, and its requests must be out before the deadline (on
        # a loaded machine that can take a while: a second, well short of the stall).
        timeout = 0.5 if op == "pull" else 1.0
        try:
            blocks = list(range(n - 2))  # (the last two: blocks the call did not name)
            if op == "pull":
                for v in big.views:
                    v[...] = 0
                task = asyncio.ensure_future(move(key, big.cache, blocks, blocks, timeout=timeout))
                await until(lambda: any(v[0] for v in big.views) or task.done(), 5)
                stop_now(prompt.pid)
            else:
                stop_now(prompt.pid)
                task = asyncio.ensure_future(move(key, big.cache, blocks, blocks, timeout=timeout))
            t0 = loop.time()
            with pytest.raises(LLMException) as ei:
                await asyncio.wait_for(task, 10)
            assert ei.value.status_code == S.LLM_TIMEOUT, ei.value
            # The deadline held (before: the stall timeouts, 5 s each).
            assert loop.time() - t0 < timeout + 1.0
            await asyncio.sleep(0.2)
            assert entry.late_writes == 1, "no request was in flight at the deadline"
            if control_lease:
                assert unleased == [], "UNLEASE sent with requests still in flight"
            else:
                assert native.lease_readers(addr) == 1  # still leased
            # Only what those requests may touch is fenced (some of the blocks the call
            # named); the cache's other blocks take transfers meanwhile.
            cm = dd.cache_manager
            with pytest.raises(LLMException) as busy:
                await cm.copy_blocks(big.cache, {n - 1: blocks})
            assert busy.value.status_code == S.LLM_LINK_BUSY, busy.value
            rows = [v.reshape(n, -1) for v in big.views]  # (block, its bytes) per tensor
            for t, r in enumerate(rows):
                r[n - 1] = 0x3C + t
            await cm.copy_blocks(big.cache, {n - 1: [n - 2]})
            assert all(bool((r[n - 2] == 0x3C + t).all()) for t, r in enumerate(rows))
        finally:
            prompt.kill(signal.SIGCONT)
        await until(lambda: not entry.late_writes, 30, "the fence lifted")
        await until(
            lambda: native.lease_readers(addr) == 0 and (bool(unleased) or not control_lease), 5
        )
        await pull_and_check(dd, local["reg"], e.prompt, e.seed, "reg", [2, 3], [3, 2])
        assert (await prompt.call("free", name="big")).get("ok")  # no lease left behind
