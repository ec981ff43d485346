"""A cross-loop transfer_cache_async cancelled on the awaiting side never loses a started
CacheTask (issue 9, finding 7): the task is returned, or its pipeline is stopped before
the call raises.

The instances live on the test's loop (A); a thread runs loop B, which awaits
``transfer_cache_async`` and cancels it at random points, many rounds. A round that
raised ``CancelledError`` must leave no pipeline running (the manager's task set holds
no live task, and the peer's destination stops changing); a round that returned a task
must complete it with the bytes of that round's own pattern.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheTask,
    LayerSynchronizer,
    LLMStatusCode,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import Pair, fill_pattern, make_blocks_cache, pattern_mismatches
from tests.engine._util import snapshot

pytestmark = pytest.mark.asyncio

P, D = 1, 2
LAYERS, NB, BLOCK = 4, 8, (16, 2, 64)
ROUNDS = 150


class _Slow(LayerSynchronizer):
    """Each layer is 'computed' for a moment: the pipeline runs for a few ms."""

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        await asyncio.sleep(0.001)
        return True


@pytest.fixture
def loop_b() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="loop-B", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        assert not thread.is_alive()
        loop.close()


@pytest.mark.slow  # hundreds of cross-loop calls
async def test_cancelled_cross_loop_call_never_loses_a_started_task(
    pair: Pair, loop_b: asyncio.AbstractEventLoop
) -> None:
    cm = pair.prompt.cache_manager
    src = make_blocks_cache(pair.prompt, num_tensors=2 * LAYERS, num_blocks=NB, block_shape=BLOCK)
    dst = make_blocks_cache(pair.decoder, model_id=5, num_tensors=2 * LAYERS, num_blocks=NB,
                            block_shape=BLOCK)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(LAYERS), range(LAYERS))
    s, d = [0, 5, 2], [7, 1, 4]
    rng = random.Random(0x7A5C)
    returned = abandoned = 0

    async def on_b(delay: float) -> CacheTask | None:
        t = asyncio.create_task(cm.transfer_cache_async(src.cache, _Slow(), [cfg], s, d))
        asyncio.get_running_loop().call_later(delay, t.cancel)
        try:
            return await t
        except asyncio.CancelledError:
            return None

    for r in range(ROUNDS):
        seed = 0x7A5C_0000 + r
        fill_pattern(src.tensors, seed)
        delay = rng.choice([0.0, rng.uniform(0, 0.0005), rng.uniform(0, 0.003)])
        fut = asyncio.run_coroutine_threadsafe(on_b(delay), loop_b)
        task = await asyncio.wait_for(asyncio.wrap_future(fut), 10)
        if task is None:
            abandoned += 1
            # No pipeline outlives the call that raised: none is left running ...
            running = [t for t in cm._pipelines.tasks if not t.done()]
            assert running == [], f"round {r}: a pipeline runs"
            # ... and the peer's destination stops changing.
            before = snapshot(dst)
            await asyncio.sleep(0.01)
            assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(dst), strict=True))
        else:
            returned += 1
            assert await task.synchronize(10_000) == LLMStatusCode.LLM_SUCCESS
            assert pattern_mismatches(dst.tensors, s, d, seed) == [], f"round {r}"
    # Both outcomes happened: the race was really exercised.
    assert returned > 0 and abandoned > 0, (returned, abandoned)
