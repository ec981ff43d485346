"""finalize awaited from another thread's loop: handed to the instance's home loop."""

from __future__ import annotations

import asyncio
import threading
import time

from aiodatadist import LLMDataDist, LLMRole, TransferConfig
from aiodatadist.testing import make_blocks_cache


class _SlowLayers:
    """A plain ``synchronize_layer`` that blocks: finalize waits (bounded) for it."""

    def synchronize_layer(self, layer: int, timeout: object) -> bool:
        time.sleep(0.3)
        return True


def test_finalize_from_another_loop_while_the_home_finalize_runs() -> None:
    """A second ``finalize`` awaited on another thread's loop while the home loop's one
    runs is handed to the home loop: it returns once that one has finished (it waited on
    the home loop's lock from the wrong loop, forever, when the instance forgot its home
    as finalize began); after finalize a third one still returns at once."""
    home = asyncio.new_event_loop()
    runner = threading.Thread(target=home.run_forever, daemon=True)
    runner.start()
    try:

        async def setup() -> LLMDataDist:
            dd = LLMDataDist(LLMRole.PROMPT, 1)
            await dd.init({"aiodatadist.FinalizeTimeout": "3000"})
            src = make_blocks_cache(dd, num_tensors=4, num_blocks=4)
            await dd.cache_manager.transfer_cache_async(
                src.cache, _SlowLayers(), [TransferConfig(2, [1, 2, 3, 4])], [0], [0]
            )
            return dd

        dd = asyncio.run_coroutine_threadsafe(setup(), home).result(10)
        first = asyncio.run_coroutine_threadsafe(dd.finalize(), home)
        time.sleep(0.1)  # the home finalize is waiting for the blocked layer
        second_done = threading.Event()

        def foreign() -> None:
            asyncio.run(dd.finalize())
            second_done.set()

        threading.Thread(target=foreign, daemon=True).start()
        first.result(10)
        assert second_done.wait(5), "the other loop's finalize never returned"
        assert not dd.is_initialized
        asyncio.run(asyncio.wait_for(dd.finalize(), 5))  # idempotent, from anywhere
    finally:
        home.call_soon_threadsafe(home.stop)
        runner.join(5)
        home.close()
