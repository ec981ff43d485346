"""pull_blocks_layerwise from a prompt in another process, over shm, cma and tcp.

The prompt is a subprocess (``aiodatadist.testing.remote_pair``) serving a cache filled
with a pattern seeded per test; the decoder here checks each layer's bytes the moment it
is handed over, and that the layers beyond those in flight are still untouched then.
Leaving early (break, cancel) aborts what is in flight and leaves the link usable; a
prompt killed mid-iteration ends the iteration with an error, never a wrong layer.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, LLMException, LLMStatusCode
from aiodatadist._executor import ONE_SIDED_INLINE_MAX_BYTES
from aiodatadist._wire import MsgType
from aiodatadist.testing import PromptSpec, RemotePair, remote_pair
from aiodatadist.transports.tcp_requests import STREAM_MAX_BYTES
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import Harness, decoder_options, link

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]  # peer processes

PATHS = ["shm", "cma", "tcp"]
BOUND_S = 5.0  # generous: the cancel was honoured, not a speed claim
_seeds = itertools.count(0x1A7E_0001)


def _spec(path: str, **kw: object) -> PromptSpec:
    base: dict[str, object] = dict(
        num_tensors=8, num_blocks=16, block_shape=(128, 8, 16), dtype="fp16"
    )
    base.update(kw)
    return PromptSpec(seed=next(_seeds), allocate=(path == "shm"), **base)  # type: ignore[arg-type]


def _layer_bad(pair: RemotePair, dst, layer, sb, db, t: int) -> list:
    pairs = [(layer.src_layer * t + i, layer.dst_layer * t + i) for i in range(t)]
    return pair.mismatches(dst, sb, db, pairs)


def _untouched(dst, tensors: range) -> bool:
    return all(not dst.tensors[k].view("uint8").any() for k in tensors)


async def _skip_unless(pair: RemotePair, path: str) -> None:
    link = pair.decoder._rt.links.find(pair.prompt_id)
    assert link is not None
    if link.data_path != path:
        pytest.skip(f"{path} is not available here (the link uses {link.data_path})")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", [1, 2])
async def test_layers_exact_when_yielded(path: str, t: int) -> None:
    async with remote_pair(_spec(path), data_path=path) as pair:
        await _skip_unless(pair, path)
        dst = pair.decoder_cache()
        sb, db = [15, 3, 4, 9], [0, 1, 2, 14]
        cm = pair.decoder.cache_manager
        n = 0
        async with cm.pull_blocks_layerwise(
            pair.key(), dst.cache, sb, db, tensor_num_per_layer=t, depth=2
        ) as layers:
            async for layer in layers:
                assert _layer_bad(pair, dst, layer, sb, db, t) == [], layer
                n += 1
        assert n == 8 // t
        # Layer ranges with a destination offset.
        dst2 = pair.decoder_cache()
        seen = []
        async for layer in cm.pull_blocks_layerwise(
            pair.key(),
            dst2.cache,
            [7],
            [8],
            src_layer_range=range(1, 3),
            dst_layer_range=range(2, 4),
            tensor_num_per_layer=t,
        ):
            assert _layer_bad(pair, dst2, layer, [7], [8], t) == []
            seen.append((layer.src_layer, layer.dst_layer))
        assert seen == [(1, 2), (2, 3)]
        assert _untouched(dst2, range(0, 2 * t))


# The most a layered pull moves as one pull (Path.pull_at_once): what the path's pull
# moves without a thread handoff or a control message.
AT_ONCE = {"shm": ONE_SIDED_INLINE_MAX_BYTES, "cma": ONE_SIDED_INLINE_MAX_BYTES}
AT_ONCE["tcp"] = STREAM_MAX_BYTES


@pytest.mark.parametrize("path", PATHS)
async def test_a_small_iteration_is_one_pull_and_a_big_one_streams(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to the path's bound the layers come from one pull (shm, cma: copied inline, no
    mover thread; tcp: asked on the request stream, no control message), each exact and
    the rest of the cache untouched; over it, one layered job (shm, cma) or one
    control-plane request whose streams carry the layers (tcp)."""
    block = 32 * 1024  # (128, 8, 16) fp16: per block per tensor
    async with remote_pair(_spec(path, num_blocks=24), data_path=path) as pair:
        await _skip_unless(pair, path)
        dec = pair.decoder
        cm = dec.cache_manager
        link = dec._rt.links.find(pair.prompt_id)
        assert link is not None
        started: list[str] = []
        real_prestart = dec._rt.executor.prestart
        real_request = link.path.peer.request

        def prestart(*a: object, **k: object) -> object:
            started.append("layered job")
            return real_prestart(*a, **k)

        async def request(msg_type: object, body: object, binary: bytes) -> object:
            started.append(str(msg_type))
            return await real_request(msg_type, body, binary)

        monkeypatch.setattr(dec._rt.executor, "prestart", prestart)
        monkeypatch.setattr(link.path.peer, "request", request)
        n = AT_ONCE[path] // (8 * block)  # blocks that fill the bound over all 8 tensors
        for blocks, streamed in ((n, False), (n + 2, True)):
            sb = list(range(blocks))
            db = sb[::-1]
            dst = pair.decoder_cache()
            before = list(started)
            got = []
            async for layer in cm.pull_blocks_layerwise(
                pair.key(), dst.cache, sb, db, tensor_num_per_layer=2, timeout=60
            ):
                assert _layer_bad(pair, dst, layer, sb, db, 2) == [], layer
                got.append(layer.index)
            assert got == [0, 1, 2, 3]
            assert pair.mismatches(dst, sb, db) == []
            spare = [b for b in range(24) if b not in db]
            assert all(not dst.tensors[t][spare].view("uint8").any() for t in range(8))
            new = started[len(before) :]
            if not streamed:
                assert new == [], f"{blocks * 8 * block} bytes: {new}"
            elif path == "tcp":
                assert new == [str(MsgType.PULL)], new
            else:
                assert new == ["layered job"], new


@pytest.mark.parametrize("path", PATHS)
async def test_break_and_cancel_leave_the_link_usable(path: str) -> None:
    # 4 tensors x 16 blocks x 4 MiB, one mover thread: a layer is still moving when the
    # caller leaves.
    spec = _spec(path, num_tensors=4, block_shape=(4 << 20,), dtype="uint8")
    async with remote_pair(spec, data_path=path, options={"aiodatadist.MoverThreads": "1"}) as pair:
        await _skip_unless(pair, path)
        dec = pair.decoder
        cm = dec.cache_manager
        link = dec._rt.links.find(pair.prompt_id)
        every = list(range(16))
        dst = pair.decoder_cache()

        async def verify() -> None:
            s, d = [2, 11], [5, 0]
            await cm.pull_blocks(pair.key(), dst.cache, s, d, timeout=60)
            assert pair.mismatches(dst, s, d) == []

        async with cm.pull_blocks_layerwise(
            pair.key(), dst.cache, every, every, tensor_num_per_layer=1, timeout=60
        ) as layers:
            async for layer in layers:
                assert _layer_bad(pair, dst, layer, every, every, 1) == []
                break
        assert dec._rt.executor.in_flight == 0 and not link.slot.busy
        await verify()

        got: list[int] = []

        async def consume() -> None:
            async for layer in cm.pull_blocks_layerwise(
                pair.key(), dst.cache, every, every, tensor_num_per_layer=1, timeout=60
            ):
                got.append(layer.index)
                await asyncio.sleep(30)  # "computing": the next layers are in flight

        task = asyncio.create_task(consume())
        loop = asyncio.get_running_loop()
        while not got:
            assert not task.done()
            await asyncio.sleep(0.001)
        start = loop.time()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert loop.time() - start < BOUND_S
        while dec._rt.executor.in_flight or link.slot.busy:  # the stream is collected now
            assert loop.time() - start < BOUND_S
            await asyncio.sleep(0.001)
        await verify()


@pytest.mark.parametrize("path", ["cma", "tcp"])
async def test_prompt_killed_mid_iteration(path: str) -> None:
    # The iteration is one transfer, big enough to be still moving when the prompt dies
    # (1 GiB over cma, 256 MiB over tcp; one mover thread), 8 layers of one tensor each.
    # Both move it in one native job (tcp: one request, every stream carrying its part of
    # each layer in order); the prompt is killed once that job runs, so the kill lands
    # mid-job however late the loop wakes.
    block = (8 << 20,) if path == "cma" else (2 << 20,)
    spec = _spec(path, num_tensors=8, block_shape=block, dtype="uint8")
    async with remote_pair(spec, data_path=path, options={"aiodatadist.MoverThreads": "1"}) as pair:
        await _skip_unless(pair, path)
        dst = pair.decoder_cache()
        sb = db = list(range(16))
        got: list[int] = []

        async def consume() -> None:
            async for layer in pair.decoder.cache_manager.pull_blocks_layerwise(
                pair.key(), dst.cache, sb, db, tensor_num_per_layer=1, depth=1, timeout=60
            ):
                # A layer handed over is whole, whatever happens later.
                assert _layer_bad(pair, dst, layer, sb, db, 1) == []
                got.append(layer.index)

        task = asyncio.create_task(consume())
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while not pair.decoder._rt.executor.in_flight:
            assert not task.done() and loop.time() < end
            await asyncio.sleep(0.0005)
        pair.prompt.kill()
        await pair.prompt.wait_exit(10)
        with pytest.raises(LLMException):
            await task
        assert len(got) < 8
        for k in got:
            assert pair.mismatches(dst, sb, db, [(k, k)]) == []


@pytest.mark.parametrize("path", ["shm", "cma"])
async def test_peer_frees_its_cache_mid_iteration(path: str) -> None:
    # The prompt frees its cache while the iteration's one job copies it under the lease.
    # The free revokes the lease and waits for the job, which sees the revoke after its
    # current layer and fails there: the layers handed over before are exact, no layer
    # holding freed bytes is ever handed over; or the free gives up (LLM_LINK_BUSY) and
    # every layer lands exact.
    prompt_id, decoder_id, model, nblk, freed_fill = 71, 72, 7, 4096, 0xEE
    allocate = path == "shm"
    spec = xc.Spec("large", True, allocate, (nblk, *xc.BLOCK_SHAPE), model_id=model)
    async with Harness() as h:
        prompt = await h.peer(cluster_id=prompt_id, data_path=path, seed=5, sync_ms=5000)
        opts = decoder_options(
            path, **{"llm.SyncKvCacheWaitTime": "8000", "aiodatadist.MoverThreads": "1"}
        )
        dd, _ = await h.local(decoder_id, opts)
        await link(dd, prompt, prompt_id)
        dst_spec = xc.Spec("dst", True, True, (nblk, *xc.BLOCK_SHAPE), model_id=41)
        dst = xc.make_cache(dd, dst_spec, None, decoder_id)
        seed = next(_seeds)
        await prompt.ok(
            "register", name="large", model_id=model, seed=seed, allocate=allocate,
            num_blocks=nblk,
        )  # fmt: skip
        ref = xc.pattern(seed, spec)
        blocks = list(range(nblk))
        got: list[int] = []
        bad: list[int] = []

        async def consume() -> None:
            async for layer in dd.cache_manager.pull_blocks_layerwise(
                BlocksCacheKey(prompt_id, model), dst.cache, blocks, blocks,
                tensor_num_per_layer=1, timeout=30,
            ):  # fmt: skip
                k = layer.dst_layer
                if not np.array_equal(dst.matrix()[k], ref[k]):
                    bad.append(k)
                got.append(k)

        task = asyncio.create_task(consume())
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while not dd._rt.executor.in_flight and not task.done():  # the one job runs
            assert loop.time() < end
            await asyncio.sleep(0.0005)
        freed = await prompt.call("free", name="large", fill=freed_fill, timeout=30)
        try:
            await asyncio.wait_for(task, 30)
        except LLMException as e:
            assert e.status_code in (LLMStatusCode.LLM_FAILED, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
            assert len(got) < xc.NUM_TENSORS
        else:
            assert got == list(range(xc.NUM_TENSORS))  # the job ended before the revoke
        finally:
            if not freed.get("ok"):
                assert freed.get("status") == LLMStatusCode.LLM_LINK_BUSY, freed
        assert bad == [], f"layers {bad} were handed over with bytes that are not the source's"
        for k in got:
            assert np.array_equal(dst.matrix()[k], ref[k])


@pytest.mark.parametrize("path", ["shm", "cma"])
async def test_layers_never_come_from_a_dead_registration(path: str) -> None:
    # The prompt frees and re-registers its cache under the same key (a new seed each
    # time, freed memory filled with FREED first) while the decoder iterates layer by
    # layer in a loop. A stream that started on a registration gone by then is refused
    # before a byte moves (the lease is not current: the runner refreshes and retries) or
    # fails (revoked mid-copy); every layer handed over holds the bytes of one live
    # registration, never freed memory, and never a mix of two.
    prompt_id, decoder_id, model, freed = 73, 74, 7, 0xEE
    allocate = path == "shm"
    spec = xc.Spec("cyc", True, allocate, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE), model_id=model)
    async with Harness() as h:
        prompt = await h.peer(cluster_id=prompt_id, data_path=path, seed=5, sync_ms=5000)
        dd, _ = await h.local(
            decoder_id, decoder_options(path, **{"llm.SyncKvCacheWaitTime": "8000"})
        )
        await link(dd, prompt, prompt_id)
        first = next(_seeds)
        await prompt.ok("register", name="cyc", model_id=model, seed=first, allocate=allocate)
        seeds = [next(_seeds) for _ in range(12)]
        refs = {s: xc.pattern(s, spec) for s in (first, *seeds)}
        dst_spec = xc.Spec("dst", True, True, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE), model_id=40)
        dst = xc.make_cache(dd, dst_spec, None, decoder_id)
        blocks = list(range(xc.NUM_BLOCKS))
        key = BlocksCacheKey(prompt_id, model)
        cycle = asyncio.create_task(
            prompt.call(
                "cycle", name="cyc", model_id=model, allocate=allocate, seeds=seeds,
                fill=freed, pause_ms=15, timeout=60,
            )
        )  # fmt: skip
        ok, errors, fills = 0, {}, itertools.count(1)
        loop = asyncio.get_running_loop()
        end = loop.time() + 60
        while not cycle.done() or ok < 3:
            assert loop.time() < end, "no end to the cycle"
            canary = next(fills) % 200 + 1  # a per-stream prefill (never FREED)
            for v in dst.views:
                v.fill(canary)
            got: list[int] = []
            try:
                async for layer in dd.cache_manager.pull_blocks_layerwise(
                    key, dst.cache, blocks, blocks, tensor_num_per_layer=1, timeout=5
                ):
                    got.append(layer.dst_layer)
                    row = dst.matrix()[layer.dst_layer]
                    assert not (row == freed).all(), f"layer {layer.dst_layer}: freed memory"
                    assert any(np.array_equal(row, r[layer.dst_layer]) for r in refs.values())
            except LLMException as e:
                errors[e.status_code] = errors.get(e.status_code, 0) + 1
                assert e.status_code in (
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    LLMStatusCode.LLM_FAILED,
                ), e
                continue
            ok += 1
            full = dst.matrix()
            match = [s for s, r in refs.items() if np.array_equal(full, r)]
            assert match, f"stream {ok}: layers of more than one registration; errors {errors}"
        reply = await cycle
        assert reply["ok"], reply
        assert ok >= 3
