"""A fence covers the blocks an aborted engine transfer named, not the whole cache.

An engine request that cannot be recalled (NIXL's on the wire, Mooncake's in flight)
may still write into the local blocks it named after its call returned at the deadline:
those bytes are fenced (``CacheEntry.fence`` with a ``Region``) until it ended. Here a
fence is put on a real cache as the engines' reapers put it (the reapers themselves:
``tests/engines/test_nixl_fence.py``, ``test_engine_xproc.py``) and real transfers meet
it: a pull, a peer's push over tcp, a local copy that touches a fenced byte refuses with
``LLM_LINK_BUSY`` and moves nothing; one that touches none moves its exact bytes, so a
decoder's KV pool keeps serving while one peer's aborted request is out; the cache
cannot be freed until the fence lifts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, LLMException, LLMStatusCode
from aiodatadist import _native as native
from aiodatadist._caches import CacheEntry, Region
from aiodatadist.testing import inproc_pair, make_blocks_cache, pattern_mismatches

T, NB, BLOCK = 4, 8, (16, 2, 64)  # 4 tensors (2 layers of K,V) x 8 blocks of 4 KiB
BB = 16 * 2 * 64 * 2
PATHS = ["inproc", "shm", "cma", "tcp"]


def _region(addrs: Sequence[int], blocks: Sequence[int], tensors: range = range(T)) -> Region:
    """The bytes blocks ``blocks`` of ``tensors`` span in a cache at ``addrs``."""
    geo = native.Geometry(T, NB, BB)
    plan = native.Plan.blocks(
        geo, geo, list(blocks), list(blocks), tensors.start, tensors.start, len(tensors)
    )
    return Region.of(addrs, plan, "dst")


# ------------------------------------------------------------------ the rule


def _brute(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(s < f and t < e for s, e in a for t, f in b)


def test_overlap_is_exact_on_bytes() -> None:
    """Random ranges (sorted or not, overlapping among themselves) against a brute force;
    ranges that only touch end to start do not overlap."""
    rng = random.Random(0xF3)
    for _ in range(400):
        a = [
            (s, s + rng.randint(1, 40))
            for s in (rng.randint(0, 400) for _ in range(rng.randint(0, 8)))
        ]
        b = [
            (s, s + rng.randint(1, 40))
            for s in (rng.randint(0, 400) for _ in range(rng.randint(0, 8)))
        ]
        ra, rb = (
            Region((np.array([s for s, _ in x], np.uint64), np.array([e for _, e in x], np.uint64)))
            for x in (a, b)
        )
        assert ra.overlaps(rb) == rb.overlaps(ra) == _brute(a, b), (a, b)
    touching = Region((np.array([0, 100], np.uint64), np.array([50, 150], np.uint64)))
    between = Region((np.array([50], np.uint64), np.array([100], np.uint64)))
    assert not touching.overlaps(between)
    assert Region(None).overlaps(between) and between.overlaps(Region(None))


def test_a_plans_region_is_its_blocks_of_its_tensors() -> None:
    addrs = [1 << 30, 2 << 30, 3 << 30, 4 << 30]
    fenced = _region(addrs, [2, 3], range(0, 2))  # layer 0 of blocks 2, 3
    assert fenced.overlaps(_region(addrs, [3]))
    assert fenced.overlaps(_region(addrs, [5, 2], range(1, 2)))
    assert not fenced.overlaps(_region(addrs, [1, 4]))  # the neighbouring blocks
    assert not fenced.overlaps(_region(addrs, [2, 3], range(2, 4)))  # layer 1 of them
    assert not fenced.overlaps(_region([a + (1 << 20) for a in addrs], [2, 3]))  # elsewhere


def test_fence_and_unfence_one_of_several() -> None:
    addrs = [1 << 30, 2 << 30, 3 << 30, 4 << 30]
    e = CacheEntry(7, T, NB, BB, True, addrs)
    first, second = e.fence(_region(addrs, [0])), e.fence(_region(addrs, [5]))
    assert e.late_writes == 2 and e.busy == 2
    for blocks in ([0], [5], [4, 5]):
        with pytest.raises(LLMException) as ei:
            e.check_no_late_writes(None, _region(addrs, blocks))
        assert ei.value.status_code == LLMStatusCode.LLM_LINK_BUSY
    e.check_no_late_writes(None, _region(addrs, [1, 2, 3, 4, 6, 7]))
    with pytest.raises(LLMException):
        e.check_no_late_writes()  # no region given: the whole cache
    with pytest.raises(LLMException) as ei:
        e.mark_freed()
    assert ei.value.status_code == LLMStatusCode.LLM_LINK_BUSY
    e.unfence(first)
    e.check_no_late_writes(None, _region(addrs, [0]))
    with pytest.raises(LLMException):
        e.check_no_late_writes(None, _region(addrs, [5]))
    e.unfence(second)
    assert e.late_writes == 0 and e.busy == 0
    e.check_no_late_writes()
    e.mark_freed()


# ------------------------------------------------------- transfers meet it


def _fence(
    dd: object, cache: object, blocks: Sequence[int], tensors: range = range(T)
) -> tuple[CacheEntry, Region]:
    entry = dd._rt.caches.entries[cache.cache_id]  # type: ignore[attr-defined]
    return entry, entry.fence(_region(entry.addrs, blocks, tensors))


def _busy(ei: pytest.ExceptionInfo[LLMException]) -> None:
    assert ei.value.status_code == LLMStatusCode.LLM_LINK_BUSY, ei.value


def _raw(tensors: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [t.view(np.uint8).reshape(NB, -1).copy() for t in tensors]


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_a_pull_touching_fenced_blocks_is_refused_and_others_move(path: str) -> None:
    seed = 0x5E0 + PATHS.index(path)  # (a pattern of its own per path)
    async with inproc_pair(data_path=path) as pair:
        shape = {"num_tensors": T, "num_blocks": NB, "block_shape": BLOCK}
        make_blocks_cache(
            pair.prompt, model_id=0, seed=seed, pattern=True, allocate=path == "shm", **shape
        )
        dst = make_blocks_cache(pair.decoder, **shape)
        cm, key = pair.decoder.cache_manager, BlocksCacheKey(pair.prompt.cluster_id, 0)
        await cm.pull_blocks(key, dst.cache, [7], [7])  # linked, and a fast lane learned
        entry, fence = _fence(pair.decoder, dst.cache, [2, 3], range(0, 2))  # layer 0
        before = _raw(dst.tensors)
        for src, dsts in (([0, 1], [2, 5]), ([1], [3])):
            with pytest.raises(LLMException) as ei:
                await cm.pull_blocks(key, dst.cache, src, dsts, timeout=5)
            _busy(ei)
        with pytest.raises(LLMException) as ei:
            async for _ in cm.pull_blocks_layerwise(key, dst.cache, [0], [3]):
                pass
        _busy(ei)
        with pytest.raises(LLMException) as ei:
            cm.unregister_cache(dst.cache.cache_id)
        _busy(ei)
        assert all(np.array_equal(a, b) for a, b in zip(before, _raw(dst.tensors), strict=True))
        # Blocks the fence does not cover move, on the whole path and on the fast lane.
        for src, dsts in (([4, 5, 6], [0, 1, 4]), ([6], [6]), ([1], [5])):
            await cm.pull_blocks(key, dst.cache, src, dsts, timeout=5)
            assert not pattern_mismatches(dst.tensors, src, dsts, seed)
        # Layer 1 of a fenced block is not fenced.
        await cm.pull_blocks(
            key, dst.cache, [0], [2], src_layer_range=range(1, 2), dst_layer_range=range(1, 2)
        )
        assert not pattern_mismatches(dst.tensors, [0], [2], seed, [(2, 2), (3, 3)])
        assert np.array_equal(_raw(dst.tensors)[0][2], before[0][2])  # layer 0 untouched
        entry.unfence(fence)
        await cm.pull_blocks(key, dst.cache, [0, 1], [2, 3], timeout=5)
        assert not pattern_mismatches(dst.tensors, [0, 1], [2, 3], seed)
        cm.unregister_cache(dst.cache.cache_id)


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_a_peers_push_into_fenced_blocks_is_refused_and_others_land(path: str) -> None:
    """A push into the prompt's fenced blocks is refused whichever path carries it: the
    prompt's tcp serving side checks the blocks against its fences; in one process
    (inproc) the pusher checks the owner's entry itself; a one-sided push (shm, cma)
    finds the fence count the owner publishes in the cache's lease slot, which names no
    blocks, so every push into that cache waits (its other caches take pushes)."""
    seed = 0x5E7 + PATHS.index(path)
    async with inproc_pair(data_path=path) as pair:
        shape = {"num_tensors": T, "num_blocks": NB, "block_shape": BLOCK}
        target = make_blocks_cache(pair.prompt, model_id=0, allocate=path == "shm", **shape)
        other = make_blocks_cache(pair.prompt, model_id=1, allocate=path == "shm", **shape)
        src = make_blocks_cache(pair.decoder, seed=seed, pattern=True, **shape)
        cm, key = pair.decoder.cache_manager, BlocksCacheKey(pair.prompt.cluster_id, 0)
        await cm.push_blocks(key, src.cache, [7], [7], timeout=5)  # linked, leases known
        assert not pattern_mismatches(target.tensors, [7], [7], seed)
        entry, fence = _fence(pair.prompt, target.cache, [1])
        before = _raw(target.tensors)
        with pytest.raises(LLMException) as ei:
            await cm.push_blocks(key, src.cache, [0, 2], [0, 1], timeout=5)
        _busy(ei)
        assert all(np.array_equal(a, b) for a, b in zip(before, _raw(target.tensors), strict=True))
        if path in ("shm", "cma"):  # the lease slot names no blocks: the whole cache waits
            with pytest.raises(LLMException) as ei:
                await cm.push_blocks(key, src.cache, [3, 2], [0, 2], timeout=5)
            _busy(ei)
            assert all(
                np.array_equal(a, b) for a, b in zip(before, _raw(target.tensors), strict=True)
            )
        else:
            await cm.push_blocks(key, src.cache, [3, 2], [0, 2], timeout=5)
            assert not pattern_mismatches(target.tensors, [3, 2], [0, 2], seed)
        # The owner's other cache takes pushes meanwhile.
        await cm.push_blocks(BlocksCacheKey(pair.prompt.cluster_id, 1), src.cache, [4], [3])
        assert not pattern_mismatches(other.tensors, [4], [3], seed)
        entry.unfence(fence)
        await cm.push_blocks(key, src.cache, [5, 6], [1, 0], timeout=5)
        assert not pattern_mismatches(target.tensors, [5, 6], [1, 0], seed)
        moved = pair.decoder.stats().links[pair.prompt.cluster_id].by_path
        assert set(moved) == {path}, moved  # every push took the path under test


@pytest.mark.asyncio
async def test_a_copy_touching_fenced_blocks_is_refused_and_others_move() -> None:
    seed = 0x5E8
    async with inproc_pair() as pair:
        fc = make_blocks_cache(
            pair.decoder, seed=seed, pattern=True, num_tensors=T, num_blocks=NB, block_shape=BLOCK
        )
        cm = pair.decoder.cache_manager
        entry, fence = _fence(pair.decoder, fc.cache, [4])
        before = _raw(fc.tensors)
        for info in ({4: [0]}, {0: [4]}, {1: [2, 4]}):  # from it, into it
            with pytest.raises(LLMException) as ei:
                await cm.copy_blocks(fc.cache, info)
            _busy(ei)
        assert all(np.array_equal(a, b) for a, b in zip(before, _raw(fc.tensors), strict=True))
        await cm.copy_blocks(fc.cache, {5: [0, 1], 3: [6]})
        assert not pattern_mismatches(fc.tensors, [5, 5, 3], [0, 1, 6], seed)
        entry.unfence(fence)
        await cm.copy_blocks(fc.cache, {7: [4]})
        assert not pattern_mismatches(fc.tensors, [7], [4], seed)
