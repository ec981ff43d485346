"""Transfer metrics and ``LLMDataDist.stats()``: counted once per transfer, in the one path.

Real transfers on real links (in-process, and the cross-process paths over loopback:
``tcp``, ``cma``, ``shm``; a subprocess peer in the slow test), with the bytes checked:
counts and byte totals are exact, errors are counted under their ``LLMStatusCode``
name, histograms hold one observation per completed transfer, a queued transfer is in
flight, and a link that goes away folds into the instance totals. Also the INFO log
lines (link up, link lost, unlink) and that no transfer logs above DEBUG.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    LayerSynchronizer,
    LLMCacheNotFoundError,
    LLMStatusCode,
    LLMTimeoutError,
    TransferWithCacheKeyConfig,
)
from aiodatadist.metrics import BUCKETS, Stats
from aiodatadist.metrics._core import InstanceMetrics, LinkMetrics
from aiodatadist.testing import Pair, PromptSpec, cluster_info, inproc_pair, remote_pair
from tests.engine._util import blocks_of

P, D = 1, 2
SHAPE = (16, 2, 64)  # 4 KiB blocks in fp16
BLOCK_BYTES = 16 * 2 * 64 * 2
TENSORS = 4


def _filled(pair: Pair, *, allocate: bool = False, seed: int = 7) -> tuple[Any, Any]:
    src = pair.prompt_cache(
        seed=seed, num_tensors=TENSORS, num_blocks=16, block_shape=SHAPE, allocate=allocate
    )
    dst = pair.decoder_cache(num_tensors=TENSORS, num_blocks=16, block_shape=SHAPE)
    return src, dst


def _landed(src: Any, dst: Any, s: list[int], d: list[int], tensors: range) -> bool:
    return all(
        np.array_equal(blocks_of(dst.tensors[t])[d], blocks_of(src.tensors[t])[s]) for t in tensors
    )


async def _pull(pair: Pair, dst: Any, s: list[int], d: list[int], **kw: Any) -> None:
    await pair.decoder.cache_manager.pull_blocks(pair.key(0), dst.cache, s, d, **kw)


def _link(dd: Any, remote: int) -> Any:
    link = dd._rt.links.find(remote)
    assert link is not None
    return link


# ----------------------------------------------------------------- counting


@pytest.mark.asyncio
async def test_pulls_are_counted_with_exact_bytes_and_histograms(pair: Pair) -> None:
    src, dst = _filled(pair)
    before = pair.decoder.stats()
    assert (before.totals.transfers, before.totals.bytes) == (0, 0)
    shapes = [([1], [2]), ([3, 4, 5], [6, 7, 8]), ([9, 0], [10, 11])]
    for s, d in shapes:
        await _pull(pair, dst, s, d)
        assert _landed(src, dst, s, d, range(TENSORS))
    # One layer (K and V) of one block: 2 tensors.
    await _pull(pair, dst, [12], [12], src_layer_range=range(1, 2), dst_layer_range=range(1, 2))
    assert _landed(src, dst, [12], [12], range(2, 4))

    want = sum(len(s) for s, _ in shapes) * TENSORS * BLOCK_BYTES + 2 * BLOCK_BYTES
    stats = pair.decoder.stats()
    for scope in (stats.totals, stats.links[P]):
        assert (scope.transfers, scope.bytes, scope.errors, scope.in_flight) == (4, want, 0, 0)
        assert scope.by_kind == {"pull": {"transfers": 4, "bytes": want}}
        assert scope.by_path == {"inproc": {"transfers": 4, "bytes": want}}
        assert scope.by_kind_path == {"pull": {"inproc": {"transfers": 4, "bytes": want}}}
        for h in (scope.latency, scope.queue_wait):
            assert h.count == 4 == sum(h.counts)
            assert h.bounds == list(BUCKETS) and len(h.counts) == len(BUCKETS) + 1
            assert h.p50 is not None and h.p50 <= h.p90 <= h.p99  # type: ignore[operator]
        # Every call's queue wait is part of its latency (the slot was free: 0).
        assert scope.latency.sum > 0 and scope.queue_wait.sum == 0
        assert scope.queue_wait.counts[0] == 4
    assert stats.links[P].data_paths == ["inproc"]
    assert stats.totals.data_paths == []
    # A pull is counted where it was called (the decoder), not on the serving side.
    assert pair.prompt.stats().totals.transfers == 0
    # Plain data: JSON takes it.
    assert json.loads(json.dumps(stats.to_dict()))["links"][str(P)]["bytes"] == want


@pytest.mark.asyncio
async def test_pushes_transfer_cache_async_layers_and_copies(pair: Pair) -> None:
    src = pair.prompt_cache(seed=3, num_tensors=TENSORS, num_blocks=8, block_shape=SHAPE)
    dst = pair.decoder_cache(model_id=5, num_tensors=TENSORS, num_blocks=8, block_shape=SHAPE)
    await pair.prompt.cache_manager.push_blocks(BlocksCacheKey(D, 5), src.cache, [1, 2], [3, 4])
    assert _landed(src, dst, [1, 2], [3, 4], range(TENSORS))

    class Ready(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    layers = TENSORS // 2
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(layers), range(layers))
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, Ready(), [cfg], [5], [6])
    assert await task.synchronize(30_000) == LLMStatusCode.LLM_SUCCESS
    assert _landed(src, dst, [5], [6], range(TENSORS))

    # A local copy on the decoder: kind copy, path local, no link.
    await pair.decoder.cache_manager.copy_blocks(dst.cache, {3: [0, 7]})
    assert _landed(dst, dst, [3, 3], [0, 7], range(TENSORS))

    pushed = 2 * TENSORS * BLOCK_BYTES + TENSORS * BLOCK_BYTES
    prompt = pair.prompt.stats()
    assert prompt.links[D].by_kind_path == {
        "push": {"inproc": {"transfers": 1 + layers, "bytes": pushed}}
    }
    decoder = pair.decoder.stats()
    copied = 2 * TENSORS * BLOCK_BYTES
    assert decoder.totals.by_kind_path == {"copy": {"local": {"transfers": 1, "bytes": copied}}}
    assert decoder.links[P].transfers == 0  # copies belong to no link
    # Copies have no slot: a latency observation, no queue wait.
    assert (decoder.totals.latency.count, decoder.totals.queue_wait.count) == (1, 0)


@pytest.mark.asyncio
async def test_errors_by_code_cancels_and_in_flight(pair: Pair) -> None:
    src, dst = _filled(pair)
    missing = BlocksCacheKey(P, 99)
    with pytest.raises(LLMCacheNotFoundError):
        await pair.decoder.cache_manager.pull_blocks(missing, dst.cache, [0], [0])

    link = _link(pair.decoder, P)
    # Held slot: a pull queues behind it, in flight, until its deadline.
    async with link.exclusive(None):
        with pytest.raises(LLMTimeoutError):
            await _pull(pair, dst, [1], [1], timeout=0.02)
        queued = asyncio.ensure_future(_pull(pair, dst, [2], [2]))
        for _ in range(100):
            await asyncio.sleep(0)
        s = pair.decoder.stats()
        assert (s.links[P].in_flight, s.totals.in_flight) == (1, 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued

    stats = pair.decoder.stats()
    for scope in (stats.totals, stats.links[P]):
        assert scope.errors_by_code == {"LLM_KV_CACHE_NOT_EXIST": 1, "LLM_TIMEOUT": 1}
        assert scope.errors_by_kind == {"pull": scope.errors_by_code}
        assert (scope.errors, scope.cancelled, scope.in_flight, scope.transfers) == (2, 1, 0, 0)
        assert scope.latency.count == 0  # histograms hold completed transfers only

    # The link still works, and now counts one.
    await _pull(pair, dst, [3], [4])
    assert _landed(src, dst, [3], [4], range(TENSORS))
    assert pair.decoder.stats().links[P].transfers == 1


@pytest.mark.asyncio
async def test_queue_wait_is_the_time_spent_behind_the_slot(pair: Pair) -> None:
    src, dst = _filled(pair)
    link = _link(pair.decoder, P)
    held = 0.05
    await link.slot.acquire(None)
    queued = asyncio.ensure_future(_pull(pair, dst, [1], [2]))
    await asyncio.sleep(held)
    link.slot.release()
    await queued
    assert _landed(src, dst, [1], [2], range(TENSORS))
    h = pair.decoder.stats().links[P].queue_wait
    assert h.count == 1 and h.sum >= held * 0.9
    # Its one observation sits in the bucket covering the wait.
    (i,) = [i for i, n in enumerate(h.counts) if n]
    assert BUCKETS[i] >= h.sum and (i == 0 or BUCKETS[i - 1] < h.sum)


@pytest.mark.asyncio
async def test_a_link_that_goes_folds_into_the_totals() -> None:
    async with inproc_pair() as pair:
        src, dst = _filled(pair)
        await _pull(pair, dst, [1, 2], [1, 2])
        one = 2 * TENSORS * BLOCK_BYTES
        status, _ = await pair.decoder.unlink_clusters([cluster_info(P)])
        assert status == LLMStatusCode.LLM_SUCCESS
        s = pair.decoder.stats()
        assert s.links == {} and (s.totals.transfers, s.totals.bytes) == (1, one)
        assert s.totals.latency.count == 1

        status, _ = await pair.decoder.link_clusters([cluster_info(P)])
        assert status == LLMStatusCode.LLM_SUCCESS
        await _pull(pair, dst, [3], [3])
        assert _landed(src, dst, [3], [3], range(TENSORS))
        s = pair.decoder.stats()
        assert (s.links[P].transfers, s.links[P].bytes) == (1, one // 2)  # a new link
        assert (s.totals.transfers, s.totals.bytes) == (2, one + one // 2)
        decoder = pair.decoder
    # Finalized: the last totals stay readable.
    s = decoder.stats()
    assert (s.links, s.totals.transfers, s.totals.latency.count) == ({}, 2, 2)


# ------------------------------------------------------------- data paths


@pytest.mark.parametrize(("path", "allocate"), [("tcp", False), ("cma", False), ("shm", True)])
@pytest.mark.asyncio
async def test_the_path_that_moved_the_bytes_is_counted(path: str, allocate: bool) -> None:
    async with inproc_pair(data_path=path) as pair:
        link = _link(pair.decoder, P)
        if path == "cma" and link.path.cma is None:
            pytest.skip(f"process_vm_readv refused here (errno {link.path.cma_refused_errno})")
        src, dst = _filled(pair, allocate=allocate, seed=11)
        await _pull(pair, dst, [1, 5], [2, 9])
        await _pull(pair, dst, [4], [4])
        assert _landed(src, dst, [1, 5, 4], [2, 9, 4], range(TENSORS))
        moved = path
        want = 3 * TENSORS * BLOCK_BYTES
        s = pair.decoder.stats().links[P]
        assert s.by_path == {moved: {"transfers": 2, "bytes": want}}
        assert moved in s.data_paths
        assert s.latency.count == 2


@pytest.mark.slow  # a prompt in a subprocess
@pytest.mark.asyncio
async def test_a_peer_process_counts_per_path() -> None:
    spec = PromptSpec(num_tensors=4, num_blocks=8, seed=21, allocate=True)
    async with remote_pair(spec, data_path="auto") as pair:
        dst = pair.decoder_cache()
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1, 2], [3, 4])
        assert not pair.mismatches(dst, [1, 2], [3, 4])
        with pytest.raises(LLMCacheNotFoundError):
            await pair.decoder.cache_manager.pull_blocks(
                BlocksCacheKey(pair.prompt_id, 42), dst.cache, [0], [0]
            )
        s = pair.decoder.stats().links[pair.prompt_id]
        assert s.by_path == {"shm": {"transfers": 1, "bytes": 2 * 4 * spec.block_bytes}}
        assert s.errors_by_code == {"LLM_KV_CACHE_NOT_EXIST": 1}


@pytest.mark.slow  # a prompt in a subprocess
@pytest.mark.asyncio
async def test_auto_picks_per_transfer_and_each_is_counted_on_its_path() -> None:
    # One auto link: the prompt's shared-memory cache goes over shm, its registered one
    # over cma (tcp where the kernel refuses CMA): two paths on one link, counted apart.
    from tests.xproc import xproc_common as xc
    from tests.xproc.xproc_harness import Harness, decoder_options, link, pull_and_check

    async with Harness() as h:
        prompt = await h.peer(cluster_id=11, data_path="auto", seed=5)
        dd, local = await h.local(12, decoder_options("auto"))
        await link(dd, prompt, 11)
        reg_path = "cma" if dd._rt.links.find(11).path.cma is not None else "tcp"
        await pull_and_check(dd, local["alloc"], 11, 5, "alloc", [3, 7], [0, 1])
        await pull_and_check(dd, local["reg"], 11, 5, "reg", [2], [4])
        await pull_and_check(dd, local["alloc"], 11, 5, "alloc", [5], [6])
        unit = xc.SPECS["alloc"].unit * xc.SPECS["alloc"].num_tensors  # one block, all tensors
        assert xc.SPECS["reg"].unit == xc.SPECS["alloc"].unit
        s = dd.stats().links[11]
        assert s.by_path == {
            "shm": {"transfers": 2, "bytes": 3 * unit},
            reg_path: {"transfers": 1, "bytes": unit},
        }
        assert s.latency.count == 3


# ------------------------------------------------------------- threads


@pytest.mark.asyncio
async def test_stats_from_another_thread_while_links_come_and_go(pair: Pair) -> None:
    src, dst = _filled(pair)
    stop = threading.Event()
    problems: list[BaseException] = []
    reads = [0]

    def scrape() -> None:
        while not stop.is_set():
            try:
                json.dumps(pair.decoder.stats().to_dict())
                reads[0] += 1
            except BaseException as e:  # pragma: no cover - what the test looks for
                problems.append(e)
                return

    t = threading.Thread(target=scrape)
    t.start()
    try:
        for i in range(20):
            await _pull(pair, dst, [i % 16], [(i + 1) % 16])
            assert _landed(src, dst, [i % 16], [(i + 1) % 16], range(TENSORS))
            if i % 5 == 4:
                await pair.decoder.unlink_clusters([cluster_info(P)])
                await pair.decoder.link_clusters([cluster_info(P)])
    finally:
        stop.set()
        await asyncio.to_thread(t.join)
    assert not problems and reads[0] > 0
    s = pair.decoder.stats()
    assert (s.totals.transfers, s.totals.bytes) == (20, 20 * TENSORS * BLOCK_BYTES)


def test_registration_from_threads_while_snapshotting() -> None:
    metrics = InstanceMetrics(1)
    stop = threading.Event()
    problems: list[BaseException] = []

    def churn(base: int) -> None:
        try:
            for i in range(300):
                m = LinkMetrics()
                metrics.register(base + i, m, ["tcp"])
                m.done("pull", f"p{i % 7}", 10, 1e-4, 2e-4)
                m.failed("pull", TimeoutError())
                metrics.retire(base + i, m)
        except BaseException as e:  # pragma: no cover - what the test looks for
            problems.append(e)

    def snap() -> None:
        while not stop.is_set():
            try:
                metrics.snapshot()
            except BaseException as e:  # pragma: no cover
                problems.append(e)
                return

    readers = [threading.Thread(target=snap) for _ in range(2)]
    writers = [threading.Thread(target=churn, args=(k * 1000,)) for k in range(4)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not problems
    s: Stats = metrics.snapshot()
    assert (s.totals.transfers, s.totals.bytes, s.links) == (1200, 12000, {})
    assert s.totals.errors_by_code == {"LLM_FAILED": 1200}
    assert s.totals.latency.count == 1200


# ------------------------------------------------------------------- logs


def _info(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("aiodatadist") and r.levelno >= logging.INFO
    ]


@pytest.mark.parametrize("path", ["inproc", "tcp"])
@pytest.mark.asyncio
async def test_info_lines_for_link_up_unlink_and_lost(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiodatadist")
    async with inproc_pair(data_path=path) as pair:
        up = [m for m in _info(caplog) if m.startswith("link up")]
        assert any(f"cluster {D} -> {P}" in m and path in m for m in up), up
        src, dst = _filled(pair)

        caplog.clear()
        await _pull(pair, dst, [1], [1])
        assert _landed(src, dst, [1], [1], range(TENSORS))
        with pytest.raises(LLMCacheNotFoundError):
            await pair.decoder.cache_manager.pull_blocks(BlocksCacheKey(P, 9), dst.cache, [0], [0])
        with pytest.raises(LLMTimeoutError):
            async with _link(pair.decoder, P).exclusive(None):
                await _pull(pair, dst, [2], [2], timeout=0.01)
        assert _info(caplog) == []  # nothing per transfer above DEBUG, failures included

        caplog.clear()
        await pair.decoder.unlink_clusters([cluster_info(P, *pair.extra.get("address", ()))])
        lines = _info(caplog)
        assert f"unlink: cluster {D} -> {P} (asked by unlink_clusters)" in lines, lines

        if path == "tcp":
            # The prompt links back, then goes away: the decoder's side is lost.
            status, _ = await pair.decoder.link_clusters([cluster_info(P, *pair.extra["address"])])
            assert status == LLMStatusCode.LLM_SUCCESS
            caplog.clear()
            await pair.prompt.finalize()
            for _ in range(200):
                if any("lost" in m for m in _info(caplog)):
                    break
                await asyncio.sleep(0.01)
            lines = _info(caplog)
            assert f"unlink: cluster {P} -> {D} (asked by finalize)" in lines, lines
            assert f"link to cluster {P} lost: the peer unlinked" in lines, lines
