"""transfer_cache_async: the layer pipeline of the prompt side.

Layers go in synchronize_layer order and a layer is sent only after its
synchronize_layer returned True (the destination is inspected at synchronize time);
False stops the job; failures are per-config results; synchronize(timeout) reports
LLM_TIMEOUT without cancelling; TransferWithCacheKeyConfig (BlocksCacheKey with block
indices, CacheKeyByIdAndIndex rows) and TransferConfig (raw peer addresses, checked
against the peer's registered memory).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    CacheTask,
    DataType,
    LayerSynchronizer,
    LLMParamError,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import Pair, cluster_info, inproc_pair, make_blocks_cache
from tests.engine._util import (
    BOUND_S,
    SLOW_OPTIONS,
    big_cache,
    blocks_of,
    executor_of,
    link_of,
    snapshot,
    wait_until,
)

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
P, D = 1, 2
BLOCK = (256, 8, 16)  # 64 KiB blocks: every layer push runs on the executor
LAYERS = 4


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _setup(pair: Pair, model_id: int = 5, num_blocks: int = 8):
    src = pair.prompt_cache(seed=1, num_tensors=2 * LAYERS, num_blocks=num_blocks,
                            block_shape=BLOCK)
    dst = make_blocks_cache(pair.decoder, model_id=model_id, num_tensors=2 * LAYERS,
                            num_blocks=num_blocks, block_shape=BLOCK)
    return src, dst


def _layer_sent(src, dst, src_layer: int, dst_layer: int, s: list[int], d: list[int]) -> bool:
    return all(_same(dst.tensors[2 * dst_layer + k][d], src.tensors[2 * src_layer + k][s])
               for k in range(2))


def _layer_zero(dst, layer: int) -> bool:
    return all(not dst.tensors[2 * layer + k].view(np.uint8).any() for k in range(2))


class Recording(LayerSynchronizer):
    """A plain (sync) synchronizer that checks the destination each time it is asked."""

    def __init__(self, check, answer=lambda layer: True) -> None:
        self.calls: list[int] = []
        self.threads: list[str] = []
        self.problems: list[str] = []
        self._check = check
        self._answer = answer

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        assert timeout_in_millis is None
        self.calls.append(layer_index)
        self.threads.append(threading.current_thread().name)
        try:
            self._check(layer_index)
        except AssertionError as e:
            self.problems.append(f"layer {layer_index}: {e}")
        return self._answer(layer_index)


async def test_layers_in_order_each_sent_only_after_synchronize(pair: Pair) -> None:
    src, dst = _setup(pair)
    s, d = [1, 2, 5], [0, 3, 4]

    def check(layer: int) -> None:
        assert _layer_zero(dst, layer), "the layer was sent before synchronize_layer returned"
        for earlier in range(layer):
            assert _layer_sent(src, dst, earlier, earlier, s, d), f"layer {earlier} missing"

    sync = Recording(check)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, LAYERS), range(0, LAYERS))
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, sync, [cfg], s, d)
    assert isinstance(task, CacheTask)

    assert await task.synchronize(30_000) == S.LLM_SUCCESS
    assert await task.get_results() == [S.LLM_SUCCESS]
    assert task.done()
    assert sync.calls == [0, 1, 2, 3]
    assert sync.problems == []
    # A sync synchronizer runs on the instance's own thread, not on the loop's thread.
    assert all(n.startswith("aiodatadist-") for n in sync.threads)
    assert threading.current_thread().name not in sync.threads
    for layer in range(LAYERS):
        assert _layer_sent(src, dst, layer, layer, s, d)
    for t in range(2 * LAYERS):
        assert not dst.tensors[t][[1, 2, 5, 6, 7]].view(np.uint8).any()


async def test_async_synchronizer_releases_one_layer_at_a_time(pair: Pair) -> None:
    src, dst = _setup(pair)
    s, d = [0, 7], [7, 0]
    released = [asyncio.Event() for _ in range(LAYERS)]
    asked: list[int] = []

    class Stepper(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None):
            asked.append(layer_index)
            await released[layer_index].wait()
            return True

    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(1, 4), range(0, 3))
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, Stepper(), [cfg], s, d)
    for layer in range(1, 4):
        await wait_until(lambda lay=layer: asked[-1:] == [lay], what=f"layer {layer} asked")
        await asyncio.sleep(0.02)
        assert _layer_zero(dst, layer - 1), "sent before synchronize_layer returned True"
        released[layer].set()
        await wait_until(lambda lay=layer: _layer_sent(src, dst, lay, lay - 1, s, d),
                         what=f"layer {layer} to land")
        if layer < 3:
            assert _layer_zero(dst, layer), "the next layer went before it was released"
    assert await task.synchronize() == S.LLM_SUCCESS
    assert asked == [1, 2, 3]  # layer 0 is not covered: never asked
    assert _layer_zero(dst, 3)


async def test_false_stops_the_job(pair: Pair) -> None:
    src, dst = _setup(pair)
    other = make_blocks_cache(pair.decoder, model_id=6, num_tensors=2 * LAYERS, num_blocks=8,
                              block_shape=BLOCK)
    third = make_blocks_cache(pair.decoder, model_id=7, num_tensors=2 * LAYERS, num_blocks=8,
                              block_shape=BLOCK)
    s, d = [3], [3]
    sync = Recording(lambda layer: None, answer=lambda layer: layer != 2)
    configs = [
        TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 2), range(0, 2)),  # done
        TransferWithCacheKeyConfig(BlocksCacheKey(D, 6), range(1, 3), range(1, 3)),  # hit
        TransferWithCacheKeyConfig(BlocksCacheKey(D, 7), range(3, 4), range(3, 4)),  # never
    ]
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, sync, configs, s, d)

    assert await task.synchronize() == S.LLM_PARAM_INVALID
    assert await task.get_results() == [S.LLM_SUCCESS, S.LLM_PARAM_INVALID, None]
    assert sync.calls == [0, 1, 2]  # nothing is asked after False
    assert _layer_sent(src, dst, 0, 0, s, d) and _layer_sent(src, dst, 1, 1, s, d)
    assert _layer_sent(src, other, 1, 1, s, d)  # sent before the stop
    assert _layer_zero(other, 2)  # the refused layer was not sent
    assert all(not t.view(np.uint8).any() for t in third.tensors)


async def test_synchronizer_that_raises_fails_the_covering_configs(pair: Pair) -> None:
    src, dst = _setup(pair)

    class Broken(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            if layer_index == 1:
                raise RuntimeError("compute failed")
            return True

    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, LAYERS), range(0, LAYERS))
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, Broken(), [cfg],
                                                                [0], [0])
    assert await task.synchronize() == S.LLM_FAILED
    assert await task.get_results() == [S.LLM_FAILED]
    assert _layer_sent(src, dst, 0, 0, [0], [0]) and _layer_zero(dst, 1)


@pytest.mark.parametrize(
    ("target", "status"),
    [("unknown-model", S.LLM_KV_CACHE_NOT_EXIST), ("unlinked-cluster", S.LLM_NOT_YET_LINK),
     ("dst-layer-outside", S.LLM_PARAM_INVALID), ("dst-block-outside", S.LLM_PARAM_INVALID)],
)
async def test_first_failure_is_that_configs_result_and_stops_the_job(
    pair: Pair, target: str, status: LLMStatusCode
) -> None:
    src, dst = _setup(pair)
    small = make_blocks_cache(pair.decoder, model_id=8, num_tensors=2, num_blocks=8,
                              block_shape=BLOCK)
    good = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, LAYERS), range(0, LAYERS))
    s, d = [0, 1], [0, 1]
    if target == "unknown-model":
        bad = TransferWithCacheKeyConfig(BlocksCacheKey(D, 42), range(0, 1), range(0, 1))
    elif target == "unlinked-cluster":
        bad = TransferWithCacheKeyConfig(BlocksCacheKey(99, 5), range(0, 1), range(0, 1))
    elif target == "dst-layer-outside":
        bad = TransferWithCacheKeyConfig(BlocksCacheKey(D, 8), range(0, 2), range(0, 2))
    else:
        s, d = [0, 1], [0, 8]
        bad = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 1), range(0, 1))
    task = await pair.prompt.cache_manager.transfer_cache_async(
        src.cache, Recording(lambda layer: None), [bad, good], s, d
    )
    assert await task.synchronize() == status
    results = await task.get_results()
    if target == "dst-layer-outside":
        # Layer 0 of the 1-layer target went; layer 1 is outside it: the job stopped there.
        assert results == [status, None]
        assert _layer_sent(src, small, 0, 0, s, d)
        assert _layer_sent(src, dst, 0, 0, s, d) and _layer_zero(dst, 1)
    else:
        assert results == [status, None]  # the good config never got a layer
        assert all(not t.view(np.uint8).any() for t in dst.tensors)


async def test_layer_deadline_is_sync_kv_timeout() -> None:
    options = {**SLOW_OPTIONS, "llm.SyncKvCacheWaitTime": "10"}
    async with inproc_pair(prompt_id=601, decoder_id=602, options=options) as pair:
        src = big_cache(pair.prompt, model_id=0, fill=True)
        dst = big_cache(pair.decoder, model_id=1)
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(602, 1), range(0, 1), range(0, 1))
        all_blocks = list(range(64))
        loop = asyncio.get_running_loop()
        start = loop.time()
        task = await pair.prompt.cache_manager.transfer_cache_async(
            src.cache, Recording(lambda layer: None), [cfg], all_blocks, all_blocks
        )
        assert await task.synchronize(30_000) == S.LLM_TIMEOUT
        assert loop.time() - start < BOUND_S
        assert await task.get_results() == [S.LLM_TIMEOUT]
        assert executor_of(pair.prompt).in_flight == 0
        # The link still works (with a budget that does not depend on speed).
        await pair.decoder.cache_manager.pull_blocks(BlocksCacheKey(601, 0), dst.cache,
                                                     [9], [9], timeout=30)
        for t in range(2):
            assert (dst.tensors[t][9] == src.tensors[t][9][0]).all()


async def test_transfer_config_with_raw_addresses(pair: Pair) -> None:
    src = pair.prompt_cache(seed=1, num_tensors=2 * LAYERS, num_blocks=8, block_shape=BLOCK)
    dst = pair.decoder_cache(num_tensors=4, num_blocks=8, block_shape=BLOCK)  # no key needed
    addrs = dst.cache.tensor_addrs
    # Source layers 1 and 2 go to the destination's tensors 0..3, blocks 2,3 -> 6,1.
    cfg = TransferConfig(D, addrs, src_layer_range=range(1, 3))
    task = await pair.prompt.cache_manager.transfer_cache_async(
        src.cache, Recording(lambda layer: None), [cfg], [2, 3], [6, 1]
    )
    assert await task.synchronize() == S.LLM_SUCCESS
    for k in range(4):
        got, want = blocks_of(dst.tensors[k]), blocks_of(src.tensors[2 + k])
        assert np.array_equal(got[[6, 1]], want[[2, 3]])
        assert not got[[0, 2, 3, 4, 5, 7]].any()


async def test_transfer_config_rows_with_preoffset_addresses(pair: Pair) -> None:
    desc = CacheDesc(4, [3, 4096], DataType.DT_FLOAT, Placement.HOST)
    src = pair.prompt.cache_manager.allocate_cache(desc)
    for t, v in enumerate(src.tensors()):
        v[...] = np.arange(3 * 4096, dtype=np.float32).reshape(3, 4096) * (t + 1)
    dst = pair.decoder.cache_manager.allocate_cache(desc)
    row_bytes = 4096 * 4
    # Source row 2, layer 1 -> destination row 1 of tensors 0, 1 (the caller pre-offsets).
    addrs = [a + 1 * row_bytes for a in dst.tensor_addrs[:2]]
    cfg = TransferConfig(D, addrs, src_layer_range=range(1, 2), src_batch_index=2)
    task = await pair.prompt.cache_manager.transfer_cache_async(
        src, Recording(lambda layer: None), [cfg]
    )
    assert await task.synchronize() == S.LLM_SUCCESS
    d, s = dst.tensors(), src.tensors()
    assert np.array_equal(d[0][1], s[2][2]) and np.array_equal(d[1][1], s[3][2])
    assert not d[0][[0, 2]].any() and not d[2].any() and not d[3].any()


@pytest.mark.parametrize("where", ["unregistered", "past-the-end", "split-k-v", "prompt-own"])
async def test_transfer_config_addresses_outside_peer_memory_are_refused(
    pair: Pair, where: str
) -> None:
    src = pair.prompt_cache(seed=1, num_tensors=2, num_blocks=8, block_shape=BLOCK)
    dst = pair.decoder_cache(num_tensors=2, num_blocks=8, block_shape=BLOCK)
    other = pair.decoder_cache(num_tensors=2, num_blocks=8, block_shape=BLOCK)
    stray = np.zeros(8 * 64 * 1024, np.uint8)
    tensor_bytes = 8 * 64 * 1024
    s, d = [0], [0]
    if where == "unregistered":
        addrs = [stray.ctypes.data, dst.cache.tensor_addrs[1]]
    elif where == "past-the-end":
        # The address is inside tensor 0, but block 1 from there runs past its end.
        addrs = [dst.cache.tensor_addrs[0] + tensor_bytes - 64 * 1024, dst.cache.tensor_addrs[1]]
        d = [1]
    elif where == "split-k-v":
        addrs = [dst.cache.tensor_addrs[0], other.cache.tensor_addrs[1]]
    else:
        addrs = src.cache.tensor_addrs  # the prompt's own memory is not the peer's
    cfg = TransferConfig(D, addrs)
    task = await pair.prompt.cache_manager.transfer_cache_async(
        src.cache, Recording(lambda layer: None), [cfg], s, d
    )
    assert await task.synchronize() == S.LLM_PARAM_INVALID
    assert await task.get_results() == [S.LLM_PARAM_INVALID]
    assert not stray.any()
    for fc in (dst, other):
        assert all(not t.view(np.uint8).any() for t in fc.tensors)


async def test_cache_key_by_id_and_index_rows(pair: Pair) -> None:
    desc = CacheDesc(4, [3, 2048], DataType.DT_INT32, Placement.HOST)
    src = pair.prompt.cache_manager.allocate_cache(desc)
    for t, v in enumerate(src.tensors()):
        v[...] = np.arange(3 * 2048, dtype=np.int32).reshape(3, 2048) + 100_000 * t
    dst_desc = CacheDesc(2, [2, 2048], DataType.DT_INT32, Placement.HOST)
    dst = pair.decoder.cache_manager.allocate_cache(dst_desc)
    # Source row 2, layer 1 -> destination cache row 1, layer 0.
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(D, dst.cache_id, 1), range(1, 2),
                                     range(0, 1), src_batch_index=2)
    task = await pair.prompt.cache_manager.transfer_cache_async(
        src, Recording(lambda layer: None), [cfg]
    )
    assert await task.synchronize() == S.LLM_SUCCESS
    d, s = dst.tensors(), src.tensors()
    assert np.array_equal(d[0][1], s[2][2]) and np.array_equal(d[1][1], s[3][2])
    assert not d[0][0].any() and not d[1][0].any()


async def test_synchronize_timeout_does_not_cancel(pair: Pair) -> None:
    src, dst = _setup(pair)
    go = asyncio.Event()

    class Waits(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None):
            await go.wait()
            return True

    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 2), range(0, 2))
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, Waits(), [cfg],
                                                                [4], [4])
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await task.synchronize(20) == S.LLM_TIMEOUT
    assert await task.get_results(20) == [S.LLM_TIMEOUT]
    assert loop.time() - start < BOUND_S
    assert not task.done()
    # A cancelled synchronize() does not cancel the pipeline either.
    waiter = asyncio.create_task(task.synchronize())
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not task.done()
    go.set()
    assert await task == S.LLM_SUCCESS  # awaiting the task is synchronize()
    assert await task.get_results(0) == [S.LLM_SUCCESS]
    assert _layer_sent(src, dst, 0, 0, [4], [4]) and _layer_sent(src, dst, 1, 1, [4], [4])
    with pytest.raises(LLMParamError):
        await task.synchronize(-1)


async def test_cancel_stops_after_the_layer_in_flight(pair: Pair) -> None:
    src, dst = _setup(pair)
    go = asyncio.Event()

    class FirstOnly(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None):
            if layer_index > 0:
                await go.wait()
            return True

    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, LAYERS), range(0, LAYERS))
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, FirstOnly(), [cfg],
                                                                [2], [2])
    await wait_until(lambda: _layer_sent(src, dst, 0, 0, [2], [2]), what="layer 0")
    await task.cancel()
    assert task.done()
    assert await task.get_results(0) == [None]
    # Layers 1..3 never landed: a stopped job is not a success.
    assert await task.synchronize(0) == S.LLM_FAILED
    assert all(_layer_zero(dst, layer) for layer in range(1, LAYERS))
    # The link is free: a pull on it works.
    await pair.decoder.cache_manager.pull_blocks(BlocksCacheKey(P, 0),
                                                 dst.cache, [5], [5])
    for t in range(2 * LAYERS):
        assert _same(dst.tensors[t][5], src.tensors[t][5])


async def test_an_unexpected_error_is_that_configs_failure(pair: Pair) -> None:
    src, dst = _setup(pair)
    link = link_of(pair.prompt, D)
    sent = 0
    real_push = link.path.push

    async def push(*args):
        nonlocal sent
        if sent == 1:
            raise ConnectionResetError("the data path broke")
        sent += 1
        await real_push(*args)

    link.path.push = push
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, LAYERS), range(0, LAYERS))
    task = await pair.prompt.cache_manager.transfer_cache_async(
        src.cache, Recording(lambda layer: None), [cfg], [0], [0]
    )
    assert await task.synchronize(30_000) == S.LLM_FAILED
    assert await task.get_results(0) == [S.LLM_FAILED]
    assert _layer_sent(src, dst, 0, 0, [0], [0]) and _layer_zero(dst, 1)


async def test_ranges_changed_by_setters_are_checked_at_the_call(pair: Pair) -> None:
    src, dst = _setup(pair)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 1), range(0, 1))
    cfg.src_layer_range = range(0, LAYERS)  # now 4 source layers onto 1 destination layer
    with pytest.raises(LLMParamError, match="dst_layer_range"):
        await pair.prompt.cache_manager.transfer_cache_async(
            src.cache, Recording(lambda layer: None), [cfg], [0], [0]
        )
    assert all(not t.view(np.uint8).any() for t in dst.tensors)


async def test_a_config_changed_after_the_call_does_not_change_the_job(pair: Pair) -> None:
    src, dst = _setup(pair)
    go = asyncio.Event()

    class Waits(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None):
            await go.wait()
            return True

    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 1), range(0, 1))
    task = await pair.prompt.cache_manager.transfer_cache_async(src.cache, Waits(), [cfg],
                                                                [0], [0])
    cfg.dst_layer_range = range(3, 4)  # after the checks: must not redirect the push
    go.set()
    assert await task.synchronize(30_000) == S.LLM_SUCCESS
    assert _layer_sent(src, dst, 0, 0, [0], [0])
    assert _layer_zero(dst, 3)


def _bad_calls(src, rows, sync):
    key = BlocksCacheKey(D, 5)
    cfg = TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1))
    return {
        "no-synchronizer": ((src.cache, object(), [cfg], [0], [0]), TypeError),
        "synchronizer-none": ((src.cache, None, [cfg], [0], [0]), TypeError),
        "configs-not-list": ((src.cache, sync, cfg, [0], [0]), TypeError),
        "config-wrong-type": ((src.cache, sync, [key], [0], [0]), TypeError),
        "configs-empty": ((src.cache, sync, [], [0], [0]), LLMParamError),
        "src-cache-wrong-type": ((src.tensors[0], sync, [cfg], [0], [0]), TypeError),
        "src-without-dst": ((src.cache, sync, [cfg], [0], None), LLMParamError),
        "dst-without-src": ((src.cache, sync, [cfg], None, [0]), LLMParamError),
        "lengths-differ": ((src.cache, sync, [cfg], [0, 1], [0]), LLMParamError),
        "indices-empty": ((src.cache, sync, [cfg], [], []), LLMParamError),
        "negative-index": ((src.cache, sync, [cfg], [-1], [0]), LLMParamError),
        "range-beyond-layers": (
            (src.cache, sync, [TransferWithCacheKeyConfig(key, range(3, 5), range(0, 2))],
             [0], [0]), LLMParamError),
        "raw-addrs-count": (
            (src.cache, sync, [TransferConfig(D, [1, 2])], [0], [0]), LLMParamError),
        "blocks-key-from-rows": ((rows, sync, [cfg]), LLMParamError),
        "block-memory-size": ((src.cache, sync, [cfg], [0], [0], 123), LLMParamError),
    }


BAD_CASES = [
    "no-synchronizer", "synchronizer-none", "configs-not-list", "config-wrong-type",
    "configs-empty", "src-cache-wrong-type", "src-without-dst", "dst-without-src",
    "lengths-differ", "indices-empty", "negative-index",
    "range-beyond-layers", "raw-addrs-count", "blocks-key-from-rows", "block-memory-size",
]


@pytest.mark.parametrize("case", BAD_CASES)
async def test_bad_arguments_raise_before_anything_starts(pair: Pair, case: str) -> None:
    src, dst = _setup(pair)
    desc = CacheDesc(2 * LAYERS, [2, 1024], DataType.DT_FLOAT16, Placement.HOST)
    rows = pair.prompt.cache_manager.allocate_cache(desc)
    sync = Recording(lambda layer: None)
    args, exc = _bad_calls(src, rows, sync)[case]
    with pytest.raises(exc) as info:
        await pair.prompt.cache_manager.transfer_cache_async(*args)
    if exc is LLMParamError:
        assert info.value.status_code == S.LLM_PARAM_INVALID
    assert not pair.prompt.cache_manager._pipelines.tasks
    assert sync.calls == []
    assert all(not t.view(np.uint8).any() for t in dst.tensors)


async def test_odd_tensor_count_is_refused(pair: Pair) -> None:
    src = pair.prompt_cache(seed=1, num_tensors=3, num_blocks=4, block_shape=BLOCK)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 1), range(0, 1))
    with pytest.raises(LLMParamError):
        await pair.prompt.cache_manager.transfer_cache_async(
            src.cache, Recording(lambda layer: None), [cfg], [0], [0]
        )


async def test_a_decoder_may_push(pair: Pair) -> None:
    # The role is a label (upstream v2): a DECODER pushes to a PROMPT.
    src = pair.decoder_cache(seed=1, num_tensors=2, num_blocks=4, block_shape=BLOCK)
    dst = make_blocks_cache(pair.prompt, model_id=3, num_tensors=2, num_blocks=4,
                            block_shape=BLOCK)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(P, 3), range(0, 1), range(0, 1))
    sync = Recording(lambda layer: None)
    task = await pair.decoder.cache_manager.transfer_cache_async(src.cache, sync, [cfg], [0], [2])
    assert await task.synchronize() == S.LLM_SUCCESS
    assert sync.calls == [0]
    for t in range(2):
        assert np.array_equal(blocks_of(dst.tensors[t])[2], blocks_of(src.tensors[t])[0])


async def test_pushes_to_two_decoders(pair: Pair) -> None:
    from aiodatadist import LLMDataDist, LLMRole

    second = LLMDataDist(LLMRole.DECODER, 3)
    await second.init()
    try:
        status, _ = await second.link_clusters([cluster_info(P)])
        assert status == S.LLM_SUCCESS
        src, dst = _setup(pair)
        dst3 = make_blocks_cache(second, model_id=5, num_tensors=2 * LAYERS, num_blocks=8,
                                 block_shape=BLOCK)
        before = snapshot(dst3)
        configs = [
            TransferWithCacheKeyConfig(BlocksCacheKey(D, 5), range(0, 4), range(0, 4)),
            TransferWithCacheKeyConfig(BlocksCacheKey(3, 5), range(2, 4), range(0, 2)),
        ]
        task = await pair.prompt.cache_manager.transfer_cache_async(
            src.cache, Recording(lambda layer: None), configs, [6], [1]
        )
        assert await task.get_results(30_000) == [S.LLM_SUCCESS, S.LLM_SUCCESS]
        for layer in range(4):
            assert _layer_sent(src, dst, layer, layer, [6], [1])
        assert _layer_sent(src, dst3, 2, 0, [6], [1]) and _layer_sent(src, dst3, 3, 1, [6], [1])
        for t in range(4, 2 * LAYERS):
            assert np.array_equal(blocks_of(dst3.tensors[t]), before[t])
    finally:
        await second.finalize()
