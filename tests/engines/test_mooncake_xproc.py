"""The Mooncake Transfer Engine as the data path between two processes, byte for byte.

The prompt is ``tests/xproc/peer_main.py`` (caches filled from a seed); the decoder
lives in the test process, so every pulled byte is compared with the numpy reference
regenerated from that seed. Both run Mooncake (``aiodatadist.Engines``); every test
skips with the reason when Mooncake cannot run here (``engine_unavailable("mooncake")``).

Leases: on one host the engine transfer runs under the lease page (as cma). The
control-plane lease (LEASE/LEASED/UNLEASE, for peers on other hosts) is forced by one
test-only step: the decoder's engine path forgets the link's fd channel
(``EnginePath.fds = None``), which is exactly what a link between hosts lacks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, DataPath, LLMException
from aiodatadist import LLMStatusCode as S
from aiodatadist.testing import engine_unavailable
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

pytestmark = [pytest.mark.slow]

PROMPT, DECODER = 51, 52
SEED = 13
ENGINES = {"aiodatadist.Engines": "mooncake"}
LEASES = pytest.mark.parametrize(
    "control_lease", [False, True], ids=["lease-page", "control-lease"]
)


@pytest.fixture(autouse=True)
def _need_mooncake() -> None:
    why = engine_unavailable("mooncake")
    if why is not None:
        pytest.skip(why)


async def linked(
    h: Harness, path: str = "mooncake", *, control_lease: bool = False, **kw: Any
) -> tuple[Any, dict[str, xc.Local], PeerProc]:
    prompt = await h.peer(cluster_id=PROMPT, data_path=path, seed=SEED, options=ENGINES, **kw)
    dd, local = await h.local(
        DECODER, decoder_options(path, **ENGINES), big_mib=int(kw.get("big_mib", 0))
    )
    await link(dd, prompt, PROMPT)
    lk = dd._rt.links.find(PROMPT)
    assert lk is not None
    await asyncio.wait_for(lk.path.fds_settled.wait(), 5)
    if control_lease:
        lk.path.engines[DataPath.MOONCAKE].fds = None  # test-only: as between hosts
    return dd, local, prompt


def big_pull(dd: Any, big: xc.Local, timeout: float) -> Any:
    n = big.spec.shape[0]
    return dd.cache_manager.pull_blocks(
        BlocksCacheKey(PROMPT, xc.MODEL_BIG),
        big.cache,
        list(range(n)),
        list(range(n)),
        timeout=timeout,
    )


@pytest.mark.asyncio
@LEASES
async def test_forced_mooncake_pull_and_push_exact_bytes(control_lease: bool) -> None:
    async with Harness() as h:
        dd, local, prompt = await linked(h, control_lease=control_lease)
        lk = dd._rt.links.find(PROMPT)
        assert lk.data_path == "mooncake" and lk.data_paths == ("mooncake",)
        for src in ("alloc", "reg"):
            assert path_of(dd, PROMPT, xc.SPECS[src].model_id) == "mooncake"
            await pull_and_check(dd, local[src], PROMPT, SEED, src, [0, 3, 5], [1, 2, 7])
            await pull_and_check(
                dd,
                local[src],
                PROMPT,
                SEED,
                src,
                [6, 4],
                [0, 3],
                src_layers=(1, 3),
                dst_layers=(0, 2),
                tpl=1,
            )
            assert lk.path.used == "mooncake"
        # Push: the prompt writes its "reg" blocks into our "alloc" cache over Mooncake.
        before = local["alloc"].matrix()
        r = await prompt.ok(
            "push",
            dst_cluster=DECODER,
            src="reg",
            model_id=xc.MODEL_ALLOC,
            src_blocks=[2, 7],
            dst_blocks=[6, 0],
        )
        assert r["status"] == 0 and r["results"] == [0], r
        links = (await prompt.ok("links"))["links"]
        assert links == [{"cluster_id": DECODER, "data_path": "mooncake"}], links
        want = xc.expect_blocks(
            before, xc.reference(SEED, "reg"), xc.SPECS["alloc"].unit, [2, 7], [6, 0], (0, 0, 4)
        )
        assert np.array_equal(local["alloc"].matrix(), want)


@pytest.mark.asyncio
async def test_auto_offers_mooncake_but_keeps_host_memory_on_our_paths() -> None:
    async with Harness() as h:
        dd, local, _prompt = await linked(h, "auto")
        lk = dd._rt.links.find(PROMPT)
        assert "mooncake" in lk.data_paths and lk.data_path != "mooncake", lk.data_paths
        assert path_of(dd, PROMPT, xc.MODEL_ALLOC) == "shm"
        await pull_and_check(dd, local["reg"], PROMPT, SEED, "reg", [1, 2], [2, 1])


@pytest.mark.asyncio
@LEASES
async def test_cache_registered_after_linking_is_pullable(control_lease: bool) -> None:
    async with Harness() as h:
        dd, local, prompt = await linked(h, control_lease=control_lease)
        await pull_and_check(dd, local["reg"], PROMPT, SEED, "reg", [0], [0])  # connected
        for i, allocate in enumerate((False, True)):
            model_id, seed = 70 + i, 2000 + i
            await prompt.ok(
                "register", name=f"late{i}", model_id=model_id, seed=seed, allocate=allocate
            )
            spec = xc.Spec(f"late{i}", True, allocate, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE))
            before = local["reg"].matrix()
            await dd.cache_manager.pull_blocks(
                BlocksCacheKey(PROMPT, model_id), local["reg"].cache, [4, 1], [1, 5], timeout=5
            )
            want = xc.expect_blocks(
                before, xc.pattern(seed, spec), spec.unit, [4, 1], [1, 5], (0, 0, 4)
            )
            assert np.array_equal(local["reg"].matrix(), want)
            assert path_of(dd, PROMPT, model_id) == "mooncake"


@pytest.mark.asyncio
@LEASES
async def test_free_and_reregister_on_the_owner(control_lease: bool) -> None:
    """A pull racing the owner's free gets the old bytes whole or fails; after the free
    the key is gone; a re-registration under the key is read afresh."""
    async with Harness() as h:
        dd, local, prompt = await linked(h, control_lease=control_lease, big_mib=64)
        big = local["big"]
        pull = asyncio.ensure_future(big_pull(dd, big, 10))
        freed = await prompt.call("free", name="big", fill=0x5A)
        try:
            await pull
            assert all(bool((v == xc.BIG_FILL).all()) for v in big.views)
        except LLMException as e:
            assert e.status_code in (S.LLM_KV_CACHE_NOT_EXIST, S.LLM_FAILED), e
        if not freed.get("ok"):
            assert freed.get("status") == int(S.LLM_LINK_BUSY), freed
            await prompt.ok("free", name="big", fill=0x5A)
        await until(
            lambda: dd._rt.links.find(PROMPT).path.remote_table.blocks(xc.MODEL_BIG) is None,
            what="the table update",
        )
        with pytest.raises(LLMException) as ei:
            await big_pull(dd, big, 5)
        assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST, ei.value
        r = await prompt.call("cycle", name="reg", model_id=xc.MODEL_REG, seeds=[77], fill=0)
        assert r.get("ok"), r
        spec = xc.SPECS["reg"]
        before = local["reg"].matrix()
        await dd.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT, xc.MODEL_REG), local["reg"].cache, [0, 7], [7, 0], timeout=5
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


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_timeout_and_cancel_leave_the_link_usable(how: str) -> None:
    """The control-plane lease waits on the owner: a stopped owner makes the pull time
    out (or be cancelled) within its bound; once it runs again the link works."""
    async with Harness() as h:
        dd, local, prompt = await linked(h, control_lease=True)
        await pull_and_check(dd, local["reg"], PROMPT, SEED, "reg", [0], [0])
        loop = asyncio.get_running_loop()
        prompt.kill(signal.SIGSTOP)
        try:
            t0 = loop.time()
            pull = asyncio.ensure_future(
                dd.cache_manager.pull_blocks(
                    BlocksCacheKey(PROMPT, xc.MODEL_REG),
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
        await pull_and_check(dd, local["reg"], PROMPT, SEED, "reg", [2, 3], [3, 2])
        r = await prompt.call("free", name="reg")
        assert r.get("ok"), r


@pytest.mark.asyncio
async def test_deadline_aborts_a_big_transfer_and_nothing_lands_after() -> None:
    """A deadline mid-transfer: LLM_TIMEOUT, and once the call returned Mooncake writes
    no more bytes into our cache (no piece is submitted after the abort and every one in
    flight was waited for); the link then moves exact bytes again."""
    async with Harness() as h:
        dd, local, _prompt = await linked(h, big_mib=256)
        big = local["big"]
        timed_out = 0
        for _ in range(5):
            for v in big.views:
                v[...] = 0
            try:
                await big_pull(dd, big, 0.02)
            except LLMException as e:
                assert e.status_code == S.LLM_TIMEOUT, e
                timed_out += 1
            landed = [int(np.count_nonzero(v)) for v in big.views]
            await asyncio.sleep(0.3)
            assert [int(np.count_nonzero(v)) for v in big.views] == landed, "bytes landed late"
        assert timed_out, "no pull of 256 MiB took longer than 20 ms: nothing was aborted"
        await big_pull(dd, big, 30)
        assert all(bool((v == xc.BIG_FILL).all()) for v in big.views)


@pytest.mark.asyncio
@LEASES
async def test_peer_killed_mid_transfer_fails_within_bounds(control_lease: bool) -> None:
    async with Harness() as h:
        dd, local, prompt = await linked(h, control_lease=control_lease, big_mib=256)
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
                await big_pull(dd, big, 5.0)
                assert all(bool((v == xc.BIG_FILL).all()) for v in big.views)
        except LLMException as e:
            outcome = e
        assert outcome is not None, "50 pulls of a dead peer's memory succeeded"
        assert loop.time() - t0 < 20
        await asyncio.to_thread(watcher.join, 5)
        await prompt.wait_dead()
        # Nothing lands after the failed pull returned.
        landed = [v.copy() for v in big.views]
        await asyncio.sleep(0.3)
        assert all(np.array_equal(a, v) for a, v in zip(landed, big.views, strict=True))


@pytest.mark.asyncio
async def test_init_on_ipv6_fails_saying_why() -> None:
    """Mooncake's handshake resolves IPv4 only: an instance listening on IPv6 that asks
    for it fails ``init`` with LLM_FEATURE_NOT_ENABLED and the reason."""
    from aiodatadist import LLMDataDist, LLMRole

    dd = LLMDataDist(LLMRole.PROMPT, PROMPT)
    with pytest.raises(LLMException) as ei:
        await dd.init({"llm.listenIpInfo": "[::1]:0", **ENGINES})
    assert ei.value.status_code == S.LLM_FEATURE_NOT_ENABLED, ei.value
    assert "IPv4" in str(ei.value)
