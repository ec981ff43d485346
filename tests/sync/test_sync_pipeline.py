"""transfer_cache_async through aiodatadist.sync: a plain, blocking LayerSynchronizer."""

from __future__ import annotations

import threading
import time

import pytest

import aiodatadist.sync as sd
from aiodatadist._portal import PORTAL_THREAD_NAME
from aiodatadist.testing import make_blocks_cache
from tests.sync._util import BLOCK_SHAPE, BOUND_S, SyncPair, assert_pulled, untouched

S = sd.LLMStatusCode
LAYERS = 4


class Gate(sd.LayerSynchronizer):
    """Blocks in ``synchronize_layer(hold)`` until the test opens the gate."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.opened = threading.Event()
        self.waiting = threading.Event()
        self.calls: list[int] = []
        self.threads: set[str] = set()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append(layer_index)
        self.threads.add(threading.current_thread().name)
        if layer_index == self.hold:
            self.waiting.set()
            assert self.opened.wait(60)
        return True


def _caches(pair: SyncPair, seed: int, model_id: int):
    src = pair.prompt_cache(seed=seed, num_tensors=2 * LAYERS)
    dst = make_blocks_cache(
        pair.decoder, model_id=model_id, num_tensors=2 * LAYERS, block_shape=BLOCK_SHAPE
    )
    return src, dst


def test_a_blocking_synchronizer_stalls_no_other_call(pair: SyncPair) -> None:
    src, dst = _caches(pair, seed=301, model_id=5)
    pulled = pair.decoder_cache(num_tensors=2 * LAYERS)
    s, d = [1, 2, 5], [0, 3, 4]
    gate = Gate(hold=1)
    cfg = sd.TransferWithCacheKeyConfig(
        sd.BlocksCacheKey(pair.decoder.cluster_id, 5), range(0, LAYERS), range(0, LAYERS)
    )
    task = pair.prompt.cache_manager.transfer_cache_async(src.cache, gate, [cfg], s, d)
    assert isinstance(task, sd.CacheTask)
    assert isinstance(task.aio, __import__("aiodatadist").CacheTask)
    assert gate.waiting.wait(BOUND_S)

    # Layer 1's synchronizer blocks: a timed wait says so and leaves the push running.
    assert task.synchronize(timeout_in_millis=10) == S.LLM_TIMEOUT
    assert task.get_results(timeout_in_millis=10) == [S.LLM_TIMEOUT]
    assert not task.done()

    # Meanwhile other threads' calls run through the portal and the same link.
    errors: list[BaseException] = []

    def puller(blocks: list[int]) -> None:
        try:
            for b in blocks:
                pair.decoder.cache_manager.pull_blocks(pair.key(), pulled.cache, [b], [b])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=puller, args=(bl,)) for bl in ([0, 1, 2, 3], [4, 5, 6, 7])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert not any(t.is_alive() for t in threads), "pulls stalled behind the synchronizer"
    assert errors == []
    assert_pulled(pulled, list(range(8)), list(range(8)), 301)
    assert not task.done()
    # Layer 0 went, layers 1.. did not (its synchronizer has not returned).
    assert_pulled(dst, s, d, 301, tensors=[(0, 0), (1, 1)])
    assert untouched(dst.__class__(dst.cache, dst.tensors[2:]), d)

    gate.opened.set()
    assert task.synchronize() == S.LLM_SUCCESS
    assert task.get_results() == [S.LLM_SUCCESS]
    assert task.done()
    assert gate.calls == [0, 1, 2, 3]
    assert PORTAL_THREAD_NAME not in gate.threads
    assert_pulled(dst, s, d, 301)


def test_cancel_stops_the_pipeline(pair: SyncPair) -> None:
    src, dst = _caches(pair, seed=302, model_id=6)
    gate = Gate(hold=2)
    cfg = sd.TransferWithCacheKeyConfig(
        sd.BlocksCacheKey(pair.decoder.cluster_id, 6), range(0, LAYERS), range(0, LAYERS)
    )
    task = pair.prompt.cache_manager.transfer_cache_async(src.cache, gate, [cfg], [0], [7])
    assert gate.waiting.wait(BOUND_S)
    canceller = threading.Thread(target=task.cancel)
    canceller.start()
    time.sleep(0.05)
    gate.opened.set()  # the cancel ends once the synchronizer returned
    canceller.join(BOUND_S)
    assert not canceller.is_alive()
    assert task.done()
    assert task.synchronize() == S.LLM_FAILED
    assert task.get_results(0) == [None]
    assert_pulled(dst, [0], [7], 302, tensors=[(t, t) for t in range(4)])
    assert not any(dst.tensors[t][7].view("uint8").any() for t in range(4, 2 * LAYERS))


def test_bad_wait_argument_crosses_as_its_type(pair: SyncPair) -> None:
    src, _ = _caches(pair, seed=303, model_id=7)
    gate = Gate(hold=-1)
    cfg = sd.TransferWithCacheKeyConfig(
        sd.BlocksCacheKey(pair.decoder.cluster_id, 7), range(0, LAYERS), range(0, LAYERS)
    )
    task = pair.prompt.cache_manager.transfer_cache_async(src.cache, gate, [cfg], [0], [0])
    with pytest.raises(TypeError):
        task.synchronize("soon")  # type: ignore[arg-type]
    with pytest.raises(sd.LLMParamError):
        task.synchronize(-1)
    assert task.synchronize(30_000) == S.LLM_SUCCESS
