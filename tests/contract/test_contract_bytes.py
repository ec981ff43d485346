"""The contract, part 1: bytes land exactly, on every data path (issue 12, item 5).

Blocks (random, non-contiguous, all layers; one block of one tensor), layer ranges with
one and two tensors per layer and different source and destination ranges, rows
(``pull_cache``), pushes both ways, and many pulls at once on one link. Each test runs
on ``inproc``, ``shm``, ``cma``, ``tcp``, ``nixl`` and ``mooncake`` (the ``side``
fixture), on asyncio and uvloop.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from tests.contract.contract_side import DECODER, PROMPT, Side
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import assert_same

pytestmark = pytest.mark.asyncio

NB = xc.NUM_BLOCKS


def _scattered(rng: np.random.Generator, k: int) -> list[int]:
    """``k`` distinct block ids in random order, never one ascending run."""
    while True:
        ids = [int(b) for b in rng.choice(NB, k, replace=False)]
        if ids != list(range(ids[0], ids[0] + k)):
            return ids


async def _blocks(side: Side) -> None:
    """Random non-contiguous blocks, every layer, into registered and allocated caches;
    then one block of one tensor. Blocks not named keep the transfer's fill byte."""
    rng = np.random.default_rng(side.seed)
    for src in side.sources():
        for dst in ("reg", "alloc"):
            await side.pull(dst, src, _scattered(rng, 5), _scattered(rng, 5))
        await side.pull(
            "reg",
            src,
            [int(rng.integers(NB))],
            [int(rng.integers(NB))],
            src_layers=(3, 4),
            dst_layers=(1, 2),
            tpl=1,
        )
    # Every block at once, permuted.
    perm = [int(b) for b in rng.permutation(NB)]
    await side.pull("alloc", side.src(), list(range(NB)), perm)


async def _layers_and_rows(side: Side) -> None:
    """Layer ranges with ``tensor_num_per_layer`` 2 and 1, source and destination ranges that
    differ; rows of a ``pull_cache`` by request id and by cache id and index."""
    src = side.src()
    # K and V per layer: prompt layer 1 -> decoder layer 0, and layer 0 -> layer 1.
    await side.pull("reg", src, [3, 4], [6, 1], src_layers=(1, 2), dst_layers=(0, 1))
    await side.pull("alloc", src, [0, 7], [7, 0], src_layers=(0, 1), dst_layers=(1, 2))
    # One tensor per layer: tensors 1..2 -> 2..3, and tensor 3 -> tensor 0.
    await side.pull("reg", src, [0, 5], [1, 2], src_layers=(1, 3), dst_layers=(2, 4), tpl=1)
    await side.pull("alloc", src, [2, 6], [5, 3], src_layers=(3, 4), dst_layers=(0, 1), tpl=1)

    cm = side.dd.cache_manager
    for dst_name in ("rows_reg", "rows_alloc"):
        dst = side.local[dst_name]
        for src_name in side.sources("rows"):
            spec = xc.SPECS[src_name]
            assert spec.req_base is not None
            ref = side.ref(src_name)
            # By request id: remote row 2 -> local row 1, every tensor.
            want = side.prefill(dst)
            await cm.pull_cache(
                CacheKey(PROMPT, req_id=spec.req_base + 2), dst.cache, 1, timeout=10
            )
            want = xc.expect_row(want, ref, spec.unit, 2, 1, (0, 0, 4))
            assert_same(dst.matrix(), want)
            side.check_path()
            # By cache id and index, one layer (K, V): remote layer 1 -> local layer 0, row 3.
            want = side.prefill(dst)
            await cm.pull_cache(
                CacheKeyByIdAndIndex(PROMPT, side.prompt.cache_id(src_name), 0),
                dst.cache,
                3,
                src_layer_range=range(1, 2),
                dst_layer_range=range(0, 1),
                timeout=10,
            )
            want = xc.expect_row(want, ref, spec.unit, 0, 3, (2, 0, 2))
            assert_same(dst.matrix(), want)
            # Part of a row, one tensor per layer: tensor 3 -> tensor 1, row 1 -> row 0.
            want = side.prefill(dst)
            await cm.pull_cache(
                CacheKey(PROMPT, req_id=spec.req_base + 1),
                dst.cache,
                0,
                1000,
                src_layer_range=range(3, 4),
                dst_layer_range=range(1, 2),
                tensor_num_per_layer=1,
                timeout=10,
            )
            want = xc.expect_row(want, ref, spec.unit, 1, 0, (3, 1, 1), size=1000)
            assert_same(dst.matrix(), want)
            side.check_path()


async def test_blocks_layers_and_rows(side: Side) -> None:
    """Items 1 and 2 of the contract on one link (one peer: the suite stays short)."""
    await _blocks(side)
    await _layers_and_rows(side)


async def test_push(side: Side) -> None:
    """The decoder pushes into the prompt (``push_blocks``; the prompt's digests prove the
    bytes), and the prompt pushes into the decoder (``transfer_cache_async``)."""
    # The prompt pushes into the decoder over the link the decoder made (first: the
    # decoder's pushes below change the prompt's caches).
    dst_name = "alloc" if side.path == "shm" else "reg"
    dst = side.local[dst_name]
    spec = xc.SPECS[dst_name]
    before = side.prefill(dst)
    r = await side.prompt.ok(
        "push",
        dst_cluster=DECODER,
        src=side.src(),
        model_id=spec.model_id,
        src_blocks=[1, 4, 6],
        dst_blocks=[5, 0, 2],
        src_layers=[1, 2],
        dst_layers=[0, 1],
    )
    assert r["status"] == 0 and r["results"] == [0], r
    want = xc.expect_blocks(
        before, side.ref(side.src()), spec.unit, [1, 4, 6], [5, 0, 2], (2, 0, 2)
    )
    assert_same(dst.matrix(), want)
    await side.check_prompt_path()

    targets = ["alloc"] if side.path == "shm" else ["alloc", "reg"]  # shm writes shared memory
    src = side.local["reg"]
    moves = [
        ([0, 2, 5], [7, 1, 4], None, None, 2),
        ([3], [0], (1, 2), (0, 1), 2),
        ([6, 1], [2, 5], (0, 1), (3, 4), 1),
    ]
    for dst_name in targets:
        spec = xc.SPECS[dst_name]
        assert spec.model_id is not None
        want = side.ref(dst_name)
        for sb, db, sl, dl, tpl in moves:
            data = side.randomize(src)  # bytes of this push only
            await side.dd.cache_manager.push_blocks(
                BlocksCacheKey(PROMPT, spec.model_id),
                src.cache,
                sb,
                db,
                src_layer_range=xc.layer_range(sl),
                dst_layer_range=xc.layer_range(dl),
                tensor_num_per_layer=tpl,
                timeout=10,
            )
            want = xc.expect_blocks(want, data, spec.unit, sb, db, xc.tensor_span(4, sl, dl, tpl))
            r = await side.prompt.ok("digest", name=dst_name)
            assert r["sha"] == xc.digests(want), (dst_name, sb, db, sl, dl, tpl)
            side.check_path()


async def test_many_pulls_at_once_on_one_link(side: Side) -> None:
    """16 pulls gathered on one link, from four caches of different patterns (registered
    after the link), into disjoint blocks of two caches: each lands exactly."""
    caches = 4
    shm = side.path == "shm"
    refs: list[np.ndarray] = []
    for i in range(caches):
        seed = side.seed * 16 + 100 + i
        await side.prompt.ok("register", name=f"c{i}", model_id=40 + i, seed=seed, allocate=shm)
        spec = xc.Spec(f"c{i}", True, shm, (NB, *xc.BLOCK_SHAPE), model_id=40 + i)
        refs.append(xc.pattern(seed, spec))
    rng = np.random.default_rng(side.seed + 1)
    unit = xc.SPECS["reg"].unit
    pulls = []
    wants = {}
    for dst_name in ("reg", "alloc"):
        dst = side.local[dst_name]
        want = side.prefill(dst)
        src_blocks = [int(b) for b in rng.permutation(NB)]
        for j in range(NB):
            c = (j + (dst_name == "alloc")) % caches
            sb, db = [src_blocks[j]], [j]
            pulls.append(
                side.dd.cache_manager.pull_blocks(
                    BlocksCacheKey(PROMPT, 40 + c), dst.cache, sb, db, timeout=20
                )
            )
            want = xc.expect_blocks(want, refs[c], unit, sb, db, (0, 0, 4))
        wants[dst_name] = want
    results = await asyncio.gather(*pulls, return_exceptions=True)
    assert all(r is None for r in results), results
    for dst_name, want in wants.items():
        assert_same(side.local[dst_name].matrix(), want)
    side.check_path()
