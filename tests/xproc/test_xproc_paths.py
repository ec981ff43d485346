"""Prompt in one process, decoder in another, on every data path, checked byte for byte.

The prompt is ``peer_main.py`` (caches filled from a seed); the decoder lives in
the test process, so every pulled byte is compared with the numpy reference
regenerated from that seed. ``auto`` must pick ``shm`` for the prompt's
allocated caches and ``cma`` (or ``tcp`` where the kernel refuses CMA) for its
registered ones.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheKey,
    CacheKeyByIdAndIndex,
    LLMException,
    LLMStatusCode,
)
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import (
    Harness,
    assert_same,
    decoder_options,
    link,
    path_of,
    pull_and_check,
    until,
)

pytestmark = pytest.mark.slow  # peer processes on every data path: the full run's

PATHS = ["shm", "cma", "tcp", "auto"]
PROMPT, DECODER = 11, 12
SEED = 5


def sources(path: str, kind: str = "blocks") -> list[str]:
    """The prompt caches a path can reach: shm only reaches allocated (shared) memory."""
    names = ["alloc", "reg"] if kind == "blocks" else ["rows_alloc", "rows_reg"]
    return names[:1] if path == "shm" else names


def expected_path(path: str, src: str, cma_ok: bool) -> str:
    if path != "auto":
        return path
    if xc.SPECS[src].allocate:
        return "shm"
    return "cma" if cma_ok else "tcp"


async def linked(h: Harness, path: str, **peer_kw: object) -> tuple[object, dict, object, bool]:
    prompt = await h.peer(cluster_id=PROMPT, data_path=path, seed=SEED, **peer_kw)
    dd, local = await h.local(DECODER, decoder_options(path))
    await link(dd, prompt, PROMPT)
    lk = dd._rt.links.find(PROMPT)
    assert lk is not None
    cma_ok = lk.path.cma is not None
    if path == "cma" and not cma_ok:
        pytest.skip(
            f"the kernel refuses process_vm_readv here (errno {lk.path.cma_refused_errno}); "
            "cma cannot be forced"
        )
    if path == "auto":
        want = ("shm", "cma", "tcp") if cma_ok else ("shm", "tcp")
        assert lk.data_paths == want, lk.data_paths
        assert lk.data_path == "shm", lk.data_path
    else:
        assert lk.data_path == path
    return dd, local, prompt, cma_ok


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_pull_blocks(path: str) -> None:
    async with Harness() as h:
        dd, local, _, cma_ok = await linked(h, path)
        for src in sources(path):
            assert path_of(dd, PROMPT, xc.SPECS[src].model_id) == expected_path(path, src, cma_ok)
            dst = local[src]
            # Every block, permuted, all layers.
            perm = [3, 7, 0, 5, 1, 6, 2, 4]
            await pull_and_check(dd, dst, PROMPT, SEED, src, list(range(8)), perm)
            # A layer range, K and V (tensor_num_per_layer=2): layer 1 -> layer 0.
            await pull_and_check(
                dd, dst, PROMPT, SEED, src, [3, 4], [6, 7], src_layers=(1, 2), dst_layers=(0, 1)
            )
            # One tensor per layer: tensors 1..2 -> 2..3.
            await pull_and_check(
                dd,
                dst,
                PROMPT,
                SEED,
                src,
                [0, 5],
                [1, 2],
                src_layers=(1, 3),
                dst_layers=(2, 4),
                tpl=1,
            )
        if path == "shm":
            # Forced shm cannot reach user-registered memory: refused, not silently rerouted.
            with pytest.raises(LLMException) as ei:
                await dd.cache_manager.pull_blocks(
                    BlocksCacheKey(PROMPT, xc.MODEL_REG), local["reg"].cache, [0], [0]
                )
            assert ei.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_pull_cache(path: str) -> None:
    async with Harness() as h:
        dd, local, prompt, _ = await linked(h, path)
        dst = local["rows_reg"]
        cm = dd.cache_manager
        for src in sources(path, "rows"):
            spec = xc.SPECS[src]
            ref = xc.reference(SEED, src)
            assert spec.req_base is not None
            for v in dst.views:
                v[...] = 0
            want = dst.matrix()
            # By request id: remote row 2 -> local row 1, every tensor.
            await cm.pull_cache(CacheKey(PROMPT, req_id=spec.req_base + 2), dst.cache, 1)
            want = xc.expect_row(want, ref, spec.unit, 2, 1, (0, 0, 4))
            assert_same(dst.matrix(), want)
            # By cache id and index, one layer (K, V): remote layer 1 -> local layer 0, row 3.
            await cm.pull_cache(
                CacheKeyByIdAndIndex(PROMPT, prompt.cache_id(src), 0),
                dst.cache,
                3,
                src_layer_range=range(1, 2),
                dst_layer_range=range(0, 1),
            )
            want = xc.expect_row(want, ref, spec.unit, 0, 3, (2, 0, 2))
            assert_same(dst.matrix(), want)
            # Part of a row, one tensor per layer.
            await cm.pull_cache(
                CacheKey(PROMPT, req_id=spec.req_base + 1),
                dst.cache,
                0,
                1000,
                src_layer_range=range(3, 4),
                dst_layer_range=range(0, 1),
                tensor_num_per_layer=1,
            )
            want = xc.expect_row(want, ref, spec.unit, 1, 0, (3, 0, 1), size=1000)
            assert_same(dst.matrix(), want)


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_transfer_cache_async(path: str) -> None:
    """The prompt pushes into the decoder over the link the decoder made (prompt is server)."""
    async with Harness() as h:
        _, local, prompt, _cma_ok = await linked(h, path)
        # shm writes need the decoder's cache in shared memory; cma/tcp take any.
        targets = ["alloc"] if path == "shm" else ["alloc", "reg"]
        for dst_name in targets:
            dst = local[dst_name]
            spec = xc.SPECS[dst_name]
            src_name = "reg" if dst_name == "alloc" else "alloc"
            ref = xc.reference(SEED, src_name)
            want = dst.matrix()
            r = await prompt.ok(
                "push",
                dst_cluster=DECODER,
                src=src_name,
                model_id=spec.model_id,
                src_blocks=[0, 2, 3],
                dst_blocks=[5, 7, 1],
            )
            assert r["status"] == 0 and r["results"] == [0], r
            want = xc.expect_blocks(want, ref, spec.unit, [0, 2, 3], [5, 7, 1], (0, 0, 4))
            assert_same(dst.matrix(), want)
            # One layer into another layer of the decoder.
            r = await prompt.ok(
                "push",
                dst_cluster=DECODER,
                src=src_name,
                model_id=spec.model_id,
                src_blocks=[4],
                dst_blocks=[0],
                src_layers=[1, 2],
                dst_layers=[0, 1],
            )
            assert r["status"] == 0 and r["results"] == [0], r
            want = xc.expect_blocks(want, ref, spec.unit, [4], [0], (2, 0, 2))
            assert_same(dst.matrix(), want)
            # By raw destination addresses (TransferConfig): prompt layer 0 -> decoder layer 1.
            addrs = dst.cache.tensor_addrs
            r = await prompt.ok(
                "push",
                dst_cluster=DECODER,
                src=src_name,
                dst_addrs=[addrs[2], addrs[3]],
                src_blocks=[6],
                dst_blocks=[2],
                src_layers=[0, 1],
            )
            assert r["status"] == 0 and r["results"] == [0], r
            want = xc.expect_blocks(want, ref, spec.unit, [6], [2], (0, 2, 2))
            assert_same(dst.matrix(), want)
        if path == "auto":
            # The prompt's side of the link picks by the decoder's memory, too.
            r = await prompt.ok("links")
            # Its preferred path; the decoder's cache is not in shared memory, so a push
            # goes over cma (when the kernel allows it), as the transfer above did.
            assert r["links"] == [{"cluster_id": DECODER, "data_path": "shm"}]


@pytest.mark.asyncio
@pytest.mark.parametrize("allocate", [True, False], ids=["allocated", "registered"])
async def test_registration_after_link(allocate: bool) -> None:
    """Caches registered after the link reach the linked peer, both ways."""
    async with Harness() as h:
        dd, local, prompt, cma_ok = await linked(h, "auto")
        spec = xc.Spec("late", True, allocate, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE), model_id=5)
        lk = dd._rt.links.find(PROMPT)
        assert lk is not None
        assert lk.path.remote_table.blocks(5) is None
        # Pulled at once: the pull itself must bring the fresh table in.
        await prompt.ok("register", name="late", model_id=5, seed=77, allocate=allocate)
        dst = local["reg"]
        await dd.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT, 5), dst.cache, [1, 6], [0, 3], timeout=5
        )
        want = xc.expect_blocks(
            xc.reference(None, "reg"), xc.pattern(77, spec), spec.unit, [1, 6], [0, 3], (0, 0, 4)
        )
        assert_same(dst.matrix(), want)
        want_path = "shm" if allocate else ("cma" if cma_ok else "tcp")
        assert path_of(dd, PROMPT, 5) == want_path
        # Registered and left alone: the update arrives without any pull asking for it.
        await prompt.ok("register", name="later", model_id=6, seed=78, allocate=allocate)
        await until(lambda: lk.path.remote_table.blocks(6) is not None, what="table update")
        # And the decoder's own late registration reaches the prompt, which pushes into it.
        late = xc.make_cache(dd, spec, None, DECODER)
        r = await prompt.ok(
            "push", dst_cluster=DECODER, src="alloc", model_id=5, src_blocks=[2], dst_blocks=[4]
        )
        assert r["status"] == 0 and r["results"] == [0], r
        want = xc.expect_blocks(
            xc.pattern(None, spec), xc.reference(SEED, "alloc"), spec.unit, [2], [4], (0, 0, 4)
        )
        assert_same(late.matrix(), want)


@pytest.mark.asyncio
async def test_registration_from_another_thread_reaches_the_peer() -> None:
    """Registration is synchronous and may run off the loop (a sync fixture, a worker
    thread); the table update still reaches the linked peer, which then pushes into it."""
    async with Harness() as h:
        dd, _local, prompt, _cma_ok = await linked(h, "tcp")
        spec = xc.Spec("late", True, False, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE), model_id=5)
        made: list[Any] = []
        worker = threading.Thread(
            target=lambda: made.append(xc.make_cache(dd, spec, None, DECODER))
        )
        worker.start()
        await asyncio.to_thread(worker.join, 10)
        assert made, "registration on a worker thread failed"
        r = await prompt.ok(
            "push", dst_cluster=DECODER, src="alloc", model_id=5, src_blocks=[2], dst_blocks=[4]
        )
        assert r["status"] == 0 and r["results"] == [0], r
        want = xc.expect_blocks(
            xc.pattern(None, spec), xc.reference(SEED, "alloc"), spec.unit, [2], [4], (0, 0, 4)
        )
        assert_same(made[0].matrix(), want)


def _mapped(name: str) -> bool:
    # Segments are memfds: their mappings show as "/memfd:<label> (deleted)".
    with open("/proc/self/maps") as f:
        return any(f"/memfd:{name} " in line for line in f)


@pytest.mark.asyncio
async def test_freed_caches_leave_the_peer() -> None:
    """A cache the prompt frees disappears from the decoder's view (pulls then fail with
    LLM_KV_CACHE_NOT_EXIST), and the decoder lets go of its shared-memory mapping."""
    async with Harness() as h:
        dd, local, prompt, _ = await linked(h, "auto")
        lk = dd._rt.links.find(PROMPT)
        assert lk is not None
        await prompt.ok("register", name="late", model_id=5, seed=77, allocate=True)
        await dd.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT, 5), local["alloc"].cache, [0], [0]
        )
        late = lk.path.remote_table.blocks(5)
        assert late is not None and late.shm_name is not None
        assert _mapped(late.shm_name)
        for name, model in (("late", 5), ("reg", xc.MODEL_REG)):
            await prompt.ok("free", name=name)
            await until(lambda m=model: lk.path.remote_table.blocks(m) is None, what="update")
            with pytest.raises(LLMException) as ei:
                await dd.cache_manager.pull_blocks(
                    BlocksCacheKey(PROMPT, model), local["reg"].cache, [0], [0]
                )
            assert ei.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        # The next transfer over the link no longer keeps the freed segment mapped.
        await pull_and_check(dd, local["alloc"], PROMPT, SEED, "alloc", [1], [1])
        assert not _mapped(late.shm_name)


@pytest.mark.asyncio
@pytest.mark.parametrize(("prompt_streams", "decoder_streams"), [(1, 3), (4, 1)])
async def test_tcp_streams_may_differ_between_peers(
    prompt_streams: int, decoder_streams: int
) -> None:
    """``aiodatadist.TcpStreams`` is each side's own setting: peers that differ still link,
    pull and push (the linking side's count is used for the link)."""
    async with Harness() as h:
        prompt = await h.peer(
            cluster_id=PROMPT, data_path="tcp", seed=SEED, tcp_streams=prompt_streams
        )
        opts = decoder_options("tcp", **{"aiodatadist.TcpStreams": str(decoder_streams)})
        dd, local = await h.local(DECODER, opts)
        await link(dd, prompt, PROMPT)
        await pull_and_check(dd, local["reg"], PROMPT, SEED, "reg", list(range(8)), list(range(8)))
        dst = local["alloc"]
        want = dst.matrix()
        r = await prompt.ok(
            "push",
            dst_cluster=DECODER,
            src="reg",
            model_id=xc.MODEL_ALLOC,
            src_blocks=[0, 1, 2, 3, 4, 5],
            dst_blocks=[7, 6, 5, 4, 3, 2],
        )
        assert r["status"] == 0 and r["results"] == [0], r
        want = xc.expect_blocks(
            want,
            xc.reference(SEED, "reg"),
            dst.spec.unit,
            [0, 1, 2, 3, 4, 5],
            [7, 6, 5, 4, 3, 2],
            (0, 0, 4),
        )
        assert_same(dst.matrix(), want)
