"""Small repeated pulls and the fast lane (issue 13, item 1), on every data path.

Once a ``pull_blocks`` between a prompt cache and a decoder cache went the whole way, the
one-sided paths (``inproc``, ``shm``, ``cma``) keep a lane for the pair and move the next
small pulls synchronously (``aiodatadist._lanes``). Whatever the path, small repeated
pulls land exactly their own bytes (a fill unique to each pull), a re-registered prompt
cache gives its new bytes and a freed one fails, bad arguments fail as on the whole path,
the link's FIFO order holds (a small pull never overtakes a big one in flight), and the
decoder's own cache freed and registered again is pulled into correctly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    LLMException,
    LLMParamError,
    LLMStatusCode,
)
from tests.contract.contract_side import PROMPT, Side
from tests.xproc import xproc_common as xc

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
FREED = 0xEE
LANED = {"inproc", "shm", "cma", "tcp"}  # the paths that keep lanes (engines may, too)


def _count_whole_path(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the transfers that go the whole way (``aiodatadist._runner.run``)."""
    from aiodatadist import _runner

    calls: list[int] = []
    real = _runner.run

    async def run(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return await real(*args, **kw)

    monkeypatch.setattr(_runner, "run", run)
    return calls


def _pulled(side: Side) -> int:
    return sum(n for (kind, _), (n, _) in side.link().metrics.counts.items() if kind == "pull")


async def test_small_repeated_pulls(side: Side, monkeypatch: pytest.MonkeyPatch) -> None:
    cm = side.dd.cache_manager
    src = side.src()
    spec = xc.SPECS[src]
    assert spec.model_id is not None
    whole = _count_whole_path(monkeypatch)
    await side.pull("reg", src, [1], [2])  # the whole way: the lane is made after it
    assert len(whole) == 1
    lanes = cm._lanes.snapshot()
    if side.path in LANED:
        assert lanes == [{"cluster_id": PROMPT, "model_id": spec.model_id, "path": side.path}]
    counted = _pulled(side)
    rng = np.random.default_rng(side.seed)
    for _ in range(12):
        s, d = (int(x) for x in rng.choice(xc.NUM_BLOCKS, 2, replace=False))
        await side.pull("reg", src, [s], [d])  # every byte checked, each with its own fill
    if side.path in LANED:
        assert len(whole) == 1, whole  # all twelve took the lane
    # Another shape (layer ranges) goes the whole way, and its lane replaces the first.
    await side.pull("reg", src, [3], [4], src_layers=(1, 2), dst_layers=(2, 3), tpl=1)
    await side.pull("reg", src, [5, 0], [1, 7])
    await side.pull("reg", src, [6, 2], [0, 3])
    assert _pulled(side) == counted + 15  # counted like any transfer, on the path
    if side.path in LANED:
        assert len(whole) == 3, whole

    # The prompt re-registers the cache in the same memory, with new bytes: only those.
    shm = side.path == "shm"
    fresh = xc.Spec("again", True, shm, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE), model_id=spec.model_id)
    seed = side.seed * 16 + 300
    await side.prompt.ok("free", name=src, fill=FREED)
    key = BlocksCacheKey(PROMPT, spec.model_id)
    before = side.prefill(side.local["reg"])
    with pytest.raises(LLMException) as ei:  # freed: it fails, and moves nothing
        await cm.pull_blocks(key, side.local["reg"].cache, [2], [3], timeout=5)
    assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST, ei.value
    assert np.array_equal(side.local["reg"].matrix(), before), "a pull of a freed cache moved bytes"
    await side.prompt.ok("register", name="again", model_id=spec.model_id, seed=seed, allocate=shm)
    for s, d in ((2, 3), (6, 0), (2, 3)):
        await side.pull("reg", src, [s], [d], ref=xc.pattern(seed, fresh))
    await side.prompt.ok(
        "cycle", name="again", model_id=spec.model_id, allocate=shm, seeds=[seed + 1], fill=FREED
    )
    for s, d in ((4, 5), (4, 5)):
        await side.pull("reg", src, [s], [d], ref=xc.pattern(seed + 1, fresh))


async def test_bad_arguments_after_a_lane_fail_as_on_the_whole_path(side: Side) -> None:
    cm = side.dd.cache_manager
    src = side.src()
    spec = xc.SPECS[src]
    assert spec.model_id is not None
    key = BlocksCacheKey(PROMPT, spec.model_id)
    await side.pull("reg", src, [1], [2])
    dst = side.local["reg"]
    before = side.prefill(dst)
    nb = xc.NUM_BLOCKS
    bad: list[tuple[Any, Any, dict[str, Any], type[BaseException]]] = [
        ([nb], [0], {}, LLMParamError),  # beyond the prompt's cache
        ([0], [nb], {}, LLMParamError),  # beyond ours
        ([-1], [0], {}, LLMParamError),
        ([0, 1], [3, 3], {}, LLMParamError),  # one destination twice
        ([0, 1], [3], {}, LLMParamError),  # lengths differ
        ([True], [0], {}, TypeError),
        ([1.0], [0], {}, TypeError),
        ([0], [1], {"timeout": 0}, LLMParamError),
        ([0], [1], {"timeout": float("nan")}, LLMParamError),
        ([0], [1], {"tensor_num_per_layer": True}, TypeError),
    ]
    for sb, db, kw, exc in bad:
        with pytest.raises(exc):
            await cm.pull_blocks(key, dst.cache, sb, db, **kw)
    assert np.array_equal(dst.matrix(), before), "a refused pull moved bytes"
    await side.pull("reg", src, [6], [5])  # and the link is fine


async def test_a_small_pull_never_overtakes_one_in_flight(side: Side) -> None:
    cm = side.dd.cache_manager
    src = side.src()
    await side.pull("reg", src, [1], [2])  # the lane exists (on the paths that keep one)
    big, model = await side.big()
    n = big.spec.shape[0]
    bulk = asyncio.ensure_future(
        cm.pull_blocks(
            BlocksCacheKey(PROMPT, model), big.cache, list(range(n)), list(range(n)), timeout=60
        )
    )  # (an order test: generous deadlines, a loaded machine took > 5 s for 256 MiB once)
    while not side.link().slot.busy and not bulk.done():  # noqa: ASYNC110 - a step at a time
        await asyncio.sleep(0)
    assert not bulk.done(), "the big pull ended before it could be overtaken"
    await side.pull("reg", src, [3], [0], timeout=60)
    assert bulk.done(), "a small pull finished while the link's slot was held"
    await bulk
    for v in big.views:
        assert (v[::4093] == xc.BIG_FILL).all()


async def test_our_cache_freed_and_registered_again(side: Side) -> None:
    cm = side.dd.cache_manager
    src = side.src()
    spec = xc.SPECS[src]
    assert spec.model_id is not None
    key = BlocksCacheKey(PROMPT, spec.model_id)
    await side.pull("reg", src, [1], [2])
    old = side.local["reg"]
    cm.unregister_cache(old.cache.cache_id)
    with pytest.raises(LLMParamError):  # not a live cache of ours any more
        await cm.pull_blocks(key, old.cache, [3], [4], timeout=5)
    # Registered again (new arrays): the pull lands in the new memory, not the old.
    side.local["reg"] = xc.make_cache(side.dd, old.spec, None, side.dd.cluster_id)
    old_bytes = old.matrix().copy()
    await side.pull("reg", src, [3], [4])
    await side.pull("reg", src, [5], [6])
    assert np.array_equal(old.matrix(), old_bytes), "a pull wrote into unregistered memory"
