"""The NIXL fast lane (``EngineLane``): small pulls posted on the loop thread, checked
byte for byte.

The lane is asked for the way the runner asks (``link.path.lane(remote, local)``, after
a pull went the whole way) and driven directly: every pull names other blocks and
tensors of the seeded prompt cache, into a destination first filled with a sentinel of
its own, and the whole destination is compared with the numpy reference. Then what must
turn the lane off: the peer re-registering its cache (a new lease generation), the
peer killed, a link without the lease page (as between hosts), a connection whose small
reads were never seen to complete in the post, Mooncake (which cannot complete one
without the peer's engine thread).
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, DataPath, LLMException
from aiodatadist import LLMStatusCode as S
from aiodatadist.testing import engine_unavailable
from aiodatadist.transports.engine import EngineLane
from tests._procs import dead_now
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import Harness, PeerProc, decoder_options, link, until

pytestmark = [pytest.mark.slow]

PROMPT, DECODER = 61, 62
SEED = 21
UNIT = xc.SPECS["reg"].unit  # bytes of one block of one tensor


def _need(engine: str) -> None:
    why = engine_unavailable(engine)
    if why is not None:
        pytest.skip(why)


async def linked(h: Harness, engine: str = "nixl") -> tuple[Any, dict[str, xc.Local], PeerProc]:
    opts = {"aiodatadist.Engines": engine}
    prompt = await h.peer(cluster_id=PROMPT, data_path=engine, seed=SEED, options=opts)
    dd, local = await h.local(DECODER, decoder_options(engine, **opts))
    await link(dd, prompt, PROMPT)
    await asyncio.wait_for(dd._rt.links.find(PROMPT).path.fds_settled.wait(), 5)
    return dd, local, prompt


async def warm(dd: Any, local: xc.Local) -> None:
    """Two pulls the whole way: the first post to a peer does not complete inside the call
    (UCX connects its endpoint then), the second does, and so the connection offers lanes."""
    for _ in range(2):
        await whole_path(dd, local, [1], [2])


async def whole_path(dd: Any, local: xc.Local, src: list[int], dst: list[int]) -> None:
    """One ``pull_blocks`` of tensor 0 (layer 0, one tensor per layer)."""
    await dd.cache_manager.pull_blocks(
        BlocksCacheKey(PROMPT, xc.MODEL_REG), local.cache, src, dst,
        src_layer_range=range(0, 1), dst_layer_range=range(0, 1), tensor_num_per_layer=1,
        timeout=5.0,
    )  # fmt: skip


def entries(dd: Any, local: xc.Local) -> tuple[Any, Any, Any]:
    """(the link's path, the peer's entry of its "reg" cache, our entry of ``local``)."""
    lk = dd._rt.links.find(PROMPT)
    remote = lk.path.remote_table.blocks(xc.MODEL_REG)
    return lk.path, remote, dd._rt.caches.entries[local.cache.cache_id]


def fill(local: xc.Local, value: int) -> np.ndarray:
    for v in local.views:
        v[...] = value
    return local.matrix()


@pytest.mark.asyncio
async def test_lane_moves_exact_bytes_on_the_loop_thread() -> None:
    _need("nixl")
    async with Harness() as h:
        dd, local, _prompt = await linked(h)
        reg = local["reg"]
        path, remote, mine = entries(dd, reg)
        # No connection before the first transfer. The first post usually does not complete
        # inside the call (UCX connects its endpoint then), now and then it does: a lane is
        # offered once one did (a connection where none did: see below).
        assert path.lane(remote, mine) is None
        await whole_path(dd, reg, [1], [2])
        early = path.lane(remote, mine)
        assert early is None or isinstance(early, EngineLane)
        await whole_path(dd, reg, [1], [2])
        lane = path.lane(remote, mine)
        assert isinstance(lane, EngineLane) and lane.kind == DataPath.NIXL and lane.usable()
        assert lane.max_bytes >= xc.NUM_BLOCKS * xc.NUM_TENSORS * UNIT
        src_ref = xc.reference(SEED, "reg")
        pulls = [
            ([0], [7], (0, 0, 1)),
            ([3, 5], [1, 0], (0, 2, 2)),
            ([6], [6], (3, 1, 1)),
            (list(range(8)), [7, 6, 5, 4, 3, 2, 1, 0], (0, 0, 4)),
            ([2, 4], [5, 3], (1, 0, 3)),
            ([0], [7], (0, 0, 1)),  # a repeat: the kept request is posted again
        ]
        for i, (src, dst, span) in enumerate(pulls):
            before = fill(reg, 0x11 + i)  # a sentinel of this pull's own
            n = lane.pull(src, dst, span)
            assert n == len(src) * span[2] * UNIT
            want = xc.expect_blocks(before, src_ref, UNIT, src, dst, span)
            np.testing.assert_array_equal(reg.matrix(), want)
        # What it declines moves nothing (the whole path then says what is wrong).
        before = fill(reg, 0x77)
        for src, dst, span in (([8], [0], (0, 0, 1)), ([0, 1], [2, 2], (0, 0, 1))):
            assert lane.pull(src, dst, span) == 0
        np.testing.assert_array_equal(reg.matrix(), before)
        lane.close()


@pytest.mark.asyncio
async def test_pull_blocks_takes_the_lane_and_counts_it() -> None:
    _need("nixl")
    async with Harness() as h:
        dd, local, _prompt = await linked(h)
        reg = local["reg"]
        await warm(dd, reg)  # the whole way: the lane is made after it
        lanes = dd.cache_manager._lanes.snapshot()
        assert [x["path"] for x in lanes] == ["nixl"], lanes
        src_ref = xc.reference(SEED, "reg")
        pulls = (([4], [0]), ([7], [3]), ([2], [2]))
        for i, (src, dst) in enumerate(pulls):
            before = fill(reg, 0x21 + i)
            await whole_path(dd, reg, src, dst)
            want = xc.expect_blocks(before, src_ref, UNIT, src, dst, (0, 0, 1))
            np.testing.assert_array_equal(reg.matrix(), want)
        # Those pulls went through the kept lane: it made their requests.
        (lane,) = [r.lane for rs in dd.cache_manager._lanes._routes.values() for r in rs]
        assert isinstance(lane, EngineLane)
        made = set(lane._reqs)
        assert {((4,), (0,), (0, 0, 1)), ((7,), (3,), (0, 0, 1))} <= made, made


@pytest.mark.asyncio
async def test_lane_is_not_used_after_the_peer_reregistered() -> None:
    _need("nixl")
    async with Harness() as h:
        dd, local, prompt = await linked(h)
        reg = local["reg"]
        await warm(dd, reg)
        path, remote, mine = entries(dd, reg)
        lane = path.lane(remote, mine)
        assert lane is not None and lane.pull([1], [2], (0, 0, 1)) == UNIT
        version = path.remote_table.version
        # The owner frees "reg" and registers the same memory again, with new bytes.
        new_seed = 777
        r = await prompt.ok("cycle", name="reg", model_id=xc.MODEL_REG, seeds=[new_seed], fill=0x5A)
        assert r["busy"] == 0, r
        # At once (before any news reaches us) the old lease is gone: nothing moves.
        before = fill(reg, 0x33)
        assert lane.pull([1], [2], (0, 0, 1)) == 0
        assert lane.pull([4], [5], (0, 0, 1)) == 0
        np.testing.assert_array_equal(reg.matrix(), before)
        # Once the table update arrived, the lane says it is done for.
        await until(lambda: path.remote_table.version != version, 5, "the table update")
        assert not lane.usable() or lane.pull([1], [2], (0, 0, 1)) == 0
        np.testing.assert_array_equal(reg.matrix(), before)
        # The whole path reads the new registration; a new lane reads it too.
        spec = xc.SPECS["reg"]
        new_ref = xc.pattern(new_seed, spec)
        await whole_path(dd, reg, [1], [2])
        np.testing.assert_array_equal(
            reg.matrix(), xc.expect_blocks(before, new_ref, UNIT, [1], [2], (0, 0, 1))
        )
        path, remote2, mine = entries(dd, reg)
        assert remote2 is not remote and remote2.lease != remote.lease
        lane2 = path.lane(remote2, mine)
        assert lane2 is not None
        before = fill(reg, 0x44)
        assert lane2.pull([6, 0], [3, 4], (0, 0, 2)) == 4 * UNIT
        np.testing.assert_array_equal(
            reg.matrix(), xc.expect_blocks(before, new_ref, UNIT, [6, 0], [3, 4], (0, 0, 2))
        )


@pytest.mark.asyncio
@pytest.mark.parametrize("noticed", [False, True], ids=["at-once", "link-noticed"])
async def test_lane_with_the_peer_killed_fails_or_declines_at_once(noticed: bool) -> None:
    _need("nixl")
    async with Harness() as h:
        dd, local, prompt = await linked(h)
        reg = local["reg"]
        await warm(dd, reg)
        path, remote, mine = entries(dd, reg)
        lane = path.lane(remote, mine)
        assert lane is not None and lane.pull([3], [3], (0, 0, 1)) == UNIT
        prompt.kill(signal.SIGKILL)
        if noticed:
            await prompt.wait_dead()
            lk = dd._rt.links.find(PROMPT)
            await until(lambda: not lane.usable() or lk is None, 10, "the lane turned off")
        else:
            dead_now(prompt.pid)  # the lease page is still mapped, the gen still current
        before = fill(reg, 0x55)
        t0 = time.monotonic()
        try:
            n = lane.pull([1], [2], (0, 0, 1))
        except LLMException as e:
            assert e.status_code in (S.LLM_LINK_FAILED, S.LLM_FAILED), e
        else:
            # Declined (nothing moved) only once the link noticed: before, the page and the
            # lease are as they were, and the engine's post must fail.
            assert noticed and n == 0, n
            np.testing.assert_array_equal(reg.matrix(), before)
        assert time.monotonic() - t0 < 1.0  # on the loop thread: never a long wait
        # The link notices, the lane is off, and the whole path fails within its deadline.
        lk = dd._rt.links.find(PROMPT)
        await until(lambda: not lane.usable() or lk is None, 10, "the lane turned off")
        with pytest.raises(LLMException):
            await whole_path(dd, reg, [1], [2])


@pytest.mark.asyncio
async def test_no_lane_without_the_lease_page_or_an_inline_completion() -> None:
    _need("nixl")
    async with Harness() as h:
        dd, local, _prompt = await linked(h)
        reg = local["reg"]
        await warm(dd, reg)
        path, remote, mine = entries(dd, reg)
        eng = path.engines[DataPath.NIXL]
        assert eng.lane(remote, mine) is not None
        # A connection whose last small read did not complete inside its post: no lane,
        # and no inline post on the whole path either (it polls on the executor).
        eng._conn.completes_inline = False
        assert eng.lane(remote, mine) is None
        before = fill(reg, 0x66)
        await whole_path(dd, reg, [5], [0])  # the executor's post completes at once again
        np.testing.assert_array_equal(
            reg.matrix(),
            xc.expect_blocks(before, xc.reference(SEED, "reg"), UNIT, [5], [0], (0, 0, 1)),
        )
        assert eng._conn.completes_inline and eng.lane(remote, mine) is not None
        # As between hosts (no fd channel, so a lease is a control-plane round trip per
        # transfer, which a synchronous lane cannot take): no lane.
        eng.fds = None
        assert eng.lane(remote, mine) is None


@pytest.mark.asyncio
async def test_mooncake_offers_no_lane() -> None:
    _need("mooncake")
    async with Harness() as h:
        dd, local, _prompt = await linked(h, "mooncake")
        reg = local["reg"]
        before = fill(reg, 0x12)
        await whole_path(dd, reg, [1], [2])
        np.testing.assert_array_equal(
            reg.matrix(),
            xc.expect_blocks(before, xc.reference(SEED, "reg"), UNIT, [1], [2], (0, 0, 1)),
        )
        path, remote, mine = entries(dd, reg)
        assert path.lane(remote, mine) is None
