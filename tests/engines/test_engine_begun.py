"""Small engine pulls submitted on the loop thread (``EngineConn.begin``: Mooncake), and
what happens when the executor job that waits for them never runs.

A small Mooncake pull is submitted before its executor job is queued (a submit only
queues the request), so the network round trip overlaps the hand-off. When the call's
deadline passes, or it is cancelled, while that job still waits for a worker (here: every
worker of the instance's executor is kept busy on purpose), the worker skips the job:
``Begun.abandon`` must then fence the local cache until the request ended, let go of the
remote cache's lease, and leave the link usable. Checked byte for byte, with the lease
page and with the control-plane lease (as between hosts).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, DataPath, LLMException, _native
from aiodatadist import LLMStatusCode as S
from aiodatadist.testing import engine_unavailable
from tests._procs import stop_now
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import Harness, PeerProc, decoder_options, link, until

pytestmark = [pytest.mark.slow]

PROMPT, DECODER = 71, 72
SEED = 23
UNIT = xc.SPECS["reg"].unit
OPTS = {"aiodatadist.Engines": "mooncake"}


@pytest.fixture(autouse=True)
def _need_mooncake() -> None:
    why = engine_unavailable("mooncake")
    if why is not None:
        pytest.skip(why)


async def linked(h: Harness, control_lease: bool) -> tuple[Any, dict[str, xc.Local], PeerProc]:
    prompt = await h.peer(cluster_id=PROMPT, data_path="mooncake", seed=SEED, options=OPTS)
    dd, local = await h.local(DECODER, decoder_options("mooncake", **OPTS))
    await link(dd, prompt, PROMPT)
    lk = dd._rt.links.find(PROMPT)
    await asyncio.wait_for(lk.path.fds_settled.wait(), 5)
    if control_lease:
        lk.path.engines[DataPath.MOONCAKE].fds = None  # test-only: as between hosts
    return dd, local, prompt


async def pull(dd: Any, local: xc.Local, src: list[int], dst: list[int], timeout: float) -> None:
    await dd.cache_manager.pull_blocks(
        BlocksCacheKey(PROMPT, xc.MODEL_REG), local.cache, src, dst,
        src_layer_range=range(0, 1), dst_layer_range=range(0, 1), tensor_num_per_layer=1,
        timeout=timeout,
    )  # fmt: skip


def fill(local: xc.Local, value: int) -> np.ndarray:
    for v in local.views:
        v[...] = value
    return local.matrix()


def expect(before: np.ndarray, src: list[int], dst: list[int]) -> np.ndarray:
    return xc.expect_blocks(before, xc.reference(SEED, "reg"), UNIT, src, dst, (0, 0, 1))


async def occupy_workers(dd: Any) -> tuple[list[Any], threading.Event]:
    """Every worker of ``dd``'s executor blocked until the returned event is set (and
    their futures, to await after): a job queued now waits in the queue."""
    ex = dd._rt.executor
    gate = threading.Event()
    started = threading.Semaphore(0)

    def block(_control: _native.Control) -> None:
        started.release()
        gate.wait(10)

    busy = [ex.submit(block, _native.Control()) for _ in ex.threads]
    for _ in busy:
        await asyncio.to_thread(started.acquire, True, 5)
    return busy, gate


@pytest.mark.asyncio
@pytest.mark.parametrize("control_lease", [False, True], ids=["lease-page", "control-lease"])
async def test_small_pulls_are_begun_on_the_loop_and_exact(control_lease: bool) -> None:
    async with Harness() as h:
        dd, local, _prompt = await linked(h, control_lease)
        reg = local["reg"]
        eng = dd._rt.links.find(PROMPT).path.engines[DataPath.MOONCAKE]
        begun: list[Any] = []
        await pull(dd, reg, [0], [0], 5.0)  # connects
        conn = eng._conn
        real = conn.begin

        def spy(*a: Any) -> Any:  # counts what was begun (the real begin runs)
            b = real(*a)
            begun.append(b)
            return b

        conn.begin = spy
        for i, (src, dst) in enumerate([([1], [2]), ([7], [0]), ([3, 4], [5, 6])]):
            before = fill(reg, 0x30 + i)
            await pull(dd, reg, src, dst, 5.0)
            np.testing.assert_array_equal(reg.matrix(), expect(before, src, dst))
        assert len(begun) == 3 and all(b is not None for b in begun)
        assert eng._conn is conn
        # The whole cache (128 KiB: 4 requests begun at once), every byte exact.
        before = fill(reg, 0x3F)
        await dd.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT, xc.MODEL_REG), reg.cache, list(range(8)), list(range(8)),
            timeout=5.0,
        )  # fmt: skip
        want = xc.expect_blocks(
            before, xc.reference(SEED, "reg"), UNIT, list(range(8)), list(range(8)), (0, 0, 4)
        )
        np.testing.assert_array_equal(reg.matrix(), want)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["deadline", "cancel"])
@pytest.mark.parametrize("control_lease", [False, True], ids=["lease-page", "control-lease"])
async def test_a_begun_pull_whose_job_never_ran(how: str, control_lease: bool) -> None:
    async with Harness() as h:
        dd, local, prompt = await linked(h, control_lease)
        reg = local["reg"]
        await pull(dd, reg, [0], [0], 5.0)  # connects
        mine = dd._rt.caches.entries[reg.cache.cache_id]
        conn = dd._rt.links.find(PROMPT).path.engines[DataPath.MOONCAKE]._conn
        real, begun = conn.begin, []

        def spy(*a: Any) -> Any:  # keeps what was begun (the real begin runs)
            begun.append(real(*a))
            return begun[-1]

        conn.begin = spy
        # Every worker of the executor busy: the pull's job waits in the queue.
        busy, gate = await occupy_workers(dd)
        before = fill(reg, 0x41)
        task = asyncio.create_task(pull(dd, reg, [5], [1], 0.05 if how == "deadline" else 5.0))
        try:
            await asyncio.sleep(0.1)  # the deadline passes, or the cancel comes, in the queue
            assert not task.done() and mine.busy  # the skipped job's result waits for a worker
            if how == "cancel":
                task.cancel()
            asyncio.get_running_loop().call_later(0.1, gate.set)
            if how == "cancel":
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                with pytest.raises(LLMException) as got:
                    await task
                assert got.value.status_code == S.LLM_TIMEOUT, got.value
        finally:
            gate.set()
            await asyncio.gather(*busy)
        # The request was submitted before the job was queued: the cache stays fenced
        # until a thread of its own saw it end, then takes transfers again.
        await until(lambda: not mine.late_writes, 10, "the local cache unfenced")
        # It was begun, and abandoned (its job never ran): the request had been submitted,
        # so its bytes landed although the call failed (the named blocks are "undefined").
        assert len(begun) == 1 and begun[0] is not None and begun[0]._claimed
        np.testing.assert_array_equal(reg.matrix(), expect(before, [5], [1]))
        conn.begin = real
        # The owner's lease was let go (it can free the cache; re-registers it after).
        r = await prompt.call(
            "cycle", name="reg", model_id=xc.MODEL_REG, seeds=[SEED * 16 + 1], fill=0x5A
        )
        assert r.get("ok") and r["busy"] == 0, r
        # The link is usable, and exact.
        before = fill(reg, 0x42)
        await pull(dd, reg, [2, 6], [3, 4], 5.0)
        np.testing.assert_array_equal(reg.matrix(), expect(before, [2, 6], [3, 4]))


@pytest.mark.asyncio
async def test_an_abandoned_pull_still_in_flight_keeps_the_owners_lease() -> None:
    """As above with the owner stopped, so the abandoned request stays in flight: until it
    ended the owner's cache stays leased (its lease page counts us as a reader), so the
    owner cannot free or re-bind memory the request still reads; it used to be let go
    as the call returned."""
    async with Harness() as h:
        dd, local, prompt = await linked(h, False)
        reg = local["reg"]
        await pull(dd, reg, [0], [0], 5.0)  # connects
        mine = dd._rt.caches.entries[reg.cache.cache_id]
        lk = dd._rt.links.find(PROMPT)
        page = await lk.path.engines[DataPath.MOONCAKE].fds.peer_page(
            asyncio.get_running_loop().time() + 5
        )
        addr = page.addr(lk.path.remote_table.blocks(xc.MODEL_REG).lease[0])
        busy, gate = await occupy_workers(dd)
        stop_now(prompt.pid)
        try:
            task = asyncio.create_task(pull(dd, reg, [5], [1], 0.05))
            await asyncio.sleep(0.1)  # the deadline passes in the queue
            asyncio.get_running_loop().call_later(0.1, gate.set)
            with pytest.raises(LLMException) as got:
                await task
            assert got.value.status_code == S.LLM_TIMEOUT, got.value
            await asyncio.sleep(0.2)
            assert mine.late_writes == 1  # abandoned, its request in flight: fenced
            assert _native.lease_readers(addr) == 1  # and the owner's cache still leased
        finally:
            gate.set()
            prompt.kill(signal.SIGCONT)
            await asyncio.gather(*busy)
        await until(lambda: not mine.late_writes, 10, "the local cache unfenced")
        await until(lambda: _native.lease_readers(addr) == 0, 5, "the lease let go")
        r = await prompt.call(
            "cycle", name="reg", model_id=xc.MODEL_REG, seeds=[SEED * 16 + 2], fill=0x5A
        )
        assert r.get("ok") and r["busy"] == 0, r
