"""Threads: an instance's coroutines awaited on another thread's loop are bridged to the
instance's own loop; when that loop is gone the call raises RuntimeError."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from aiodatadist import BlocksCacheKey, LLMDataDist, LLMRole, LLMStatusCode
from aiodatadist.testing import Pair, cluster_info
from tests.engine._util import (
    ALL_BIG,
    BOUND_S,
    Tracker,
    assert_big_pulled,
    big_cache,
    blocks_of,
    executor_of,
    instrument,
)

pytestmark = pytest.mark.asyncio

BLOCK = (256, 8, 16)


async def _in_thread(fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` on a new thread; awaits its result without blocking this loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def target() -> None:
        try:
            result, ok = fn(), True
        except BaseException as e:
            result, ok = e, False

        def settle() -> None:
            if ok:
                fut.set_result(result)
            else:
                fut.set_exception(result)

        loop.call_soon_threadsafe(settle)

    threading.Thread(target=target, name="foreign", daemon=True).start()
    return await asyncio.wait_for(fut, 15)


async def test_pull_awaited_on_another_threads_loop(pair: Pair) -> None:
    src = pair.prompt_cache(seed=1, num_tensors=4, num_blocks=8, block_shape=BLOCK)
    dst = pair.decoder_cache(num_tensors=4, num_blocks=8, block_shape=BLOCK)
    tracker = Tracker()
    channel = instrument(pair.decoder, 1, tracker)
    owner_loop = asyncio.get_running_loop()
    seen_loops: list[asyncio.AbstractEventLoop] = []
    inner_pull = channel.inner.pull

    async def spy(*args: Any) -> None:
        seen_loops.append(asyncio.get_running_loop())
        await inner_pull(*args)

    channel.inner.pull = spy  # type: ignore[method-assign]
    cm = pair.decoder.cache_manager

    async def foreign() -> asyncio.AbstractEventLoop:
        await cm.pull_blocks(pair.key(), dst.cache, [1, 2, 3], [4, 5, 6], timeout=30)
        await cm.pull_blocks(pair.key(), dst.cache, [7], [0], timeout=30)
        return asyncio.get_running_loop()

    foreign_loop = await _in_thread(lambda: asyncio.run(foreign()))

    assert foreign_loop is not owner_loop
    assert seen_loops == [owner_loop, owner_loop], "the transfer ran on the caller's loop"
    assert all(n.startswith("aiodatadist-2-") for n in tracker.threads)
    for t in range(4):
        got, want = blocks_of(dst.tensors[t]), blocks_of(src.tensors[t])
        assert (got[[4, 5, 6, 0]] == want[[1, 2, 3, 7]]).all()
    # The owner loop still uses the instance normally.
    await cm.pull_blocks(pair.key(), dst.cache, [0], [7])
    assert (blocks_of(dst.tensors[0])[7] == blocks_of(src.tensors[0])[0]).all()


@pytest.mark.slow  # a big pull
async def test_cancel_on_the_foreign_side_cancels_on_the_owner(slow_pair: Pair) -> None:
    pair = slow_pair
    big_cache(pair.prompt, model_id=0, fill=True)
    dst = big_cache(pair.decoder)
    cm = pair.decoder.cache_manager
    executor = executor_of(pair.decoder)

    async def foreign() -> tuple[str, float, int]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            await asyncio.wait_for(
                cm.pull_blocks(pair.key(), dst.cache, ALL_BIG, ALL_BIG, timeout=60), 0.01
            )
        except TimeoutError:
            # Right after the cancel the native job has returned, as on the owner loop.
            return "timeout", loop.time() - start, executor.in_flight
        return "completed", loop.time() - start, executor.in_flight

    outcome, elapsed, in_flight = await _in_thread(lambda: asyncio.run(foreign()))
    assert outcome == "timeout"
    assert elapsed < BOUND_S
    assert in_flight == 0, "the foreign caller saw its cancel before the native job returned"
    assert executor.in_flight == 0
    await cm.pull_blocks(pair.key(), dst.cache, ALL_BIG, ALL_BIG, timeout=60)
    assert_big_pulled(dst, ALL_BIG, ALL_BIG)


async def test_link_calls_are_bridged_too(pair: Pair) -> None:
    src = pair.prompt_cache(seed=1, num_tensors=2, num_blocks=4, block_shape=BLOCK)
    dst = pair.decoder_cache(num_tensors=2, num_blocks=4, block_shape=BLOCK)

    async def foreign() -> list[Any]:
        out = [await pair.decoder.unlink_clusters([cluster_info(1)])]
        out.append(await pair.decoder.link_clusters([cluster_info(1)]))
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [3], [3])
        return out

    results = await _in_thread(lambda: asyncio.run(foreign()))
    ok = (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
    assert results == [ok, ok]
    assert (blocks_of(dst.tensors[1])[3] == blocks_of(src.tensors[1])[3]).all()


async def test_owner_loop_gone_is_runtime_error() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 901)
    peer = LLMDataDist(LLMRole.PROMPT, 902)

    async def setup() -> None:
        await dd.init()
        await peer.init()
        await dd.link_clusters([cluster_info(902)])

    await _in_thread(lambda: asyncio.run(setup()))  # that loop is closed now
    try:
        from aiodatadist.testing import make_blocks_cache

        dst = make_blocks_cache(dd, num_tensors=2, num_blocks=4, block_shape=BLOCK)
        with pytest.raises(RuntimeError, match="not running"):
            await dd.cache_manager.pull_blocks(BlocksCacheKey(902, 0), dst.cache, [0], [0])
        with pytest.raises(RuntimeError, match="not running"):
            await dd.unlink_clusters([cluster_info(902)])
        with pytest.raises(RuntimeError, match="not running"):
            await dd.finalize()
    finally:
        # Nobody can finalize them now; stop their threads by hand.
        for inst in (dd, peer):
            executor_of(inst).shutdown(0)
            inst._initialized = False


async def test_in_process_link_needs_one_loop() -> None:
    ready = threading.Event()
    holder: dict[str, Any] = {}

    def other_loop() -> None:
        async def main() -> None:
            holder["loop"] = asyncio.get_running_loop()
            holder["stop"] = stop = asyncio.Event()
            holder["dd"] = dd = LLMDataDist(LLMRole.PROMPT, 903)
            await dd.init()
            ready.set()
            await stop.wait()

        asyncio.run(main())

    thread = threading.Thread(target=other_loop, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        async with LLMDataDist(LLMRole.DECODER, 904) as mine:
            _status, per = await mine.link_clusters([cluster_info(903)])
            assert per == [LLMStatusCode.LLM_LINK_FAILED]
            assert mine.links == []
        # Finalize the other instance from here: bridged to its own loop.
        await holder["dd"].finalize()
        assert not holder["dd"].is_initialized
    finally:
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        thread.join(10)


async def test_transfer_cache_async_and_its_task_from_another_loop(pair: Pair) -> None:
    from aiodatadist import LayerSynchronizer, TransferWithCacheKeyConfig
    from aiodatadist.testing import make_blocks_cache

    src = pair.prompt_cache(seed=1, num_tensors=4, num_blocks=4, block_shape=BLOCK)
    dst = make_blocks_cache(pair.decoder, model_id=5, num_tensors=4, num_blocks=4,
                            block_shape=BLOCK)

    class Slow(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            threading.Event().wait(0.1)  # still running when the foreign side waits
            return True

    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(2, 5), range(0, 2), range(0, 2))

    async def foreign() -> tuple[Any, Any, Any]:
        task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, Slow(), [cfg],
                                                                    [3], [0])
        early = await task.get_results(1)
        return early, await task.synchronize(), await task.get_results()

    early, status, results = await _in_thread(lambda: asyncio.run(foreign()))
    assert early == [LLMStatusCode.LLM_TIMEOUT]
    assert status == LLMStatusCode.LLM_SUCCESS
    assert results == [LLMStatusCode.LLM_SUCCESS]
    for t in range(4):
        assert (blocks_of(dst.tensors[t])[0] == blocks_of(src.tensors[t])[3]).all()
