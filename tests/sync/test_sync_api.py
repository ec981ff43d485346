"""aiodatadist.sync: upstream's blocking API over the portal, real bytes, real errors.

Plain test functions: no event loop runs in the test's thread.
"""

from __future__ import annotations

import inspect
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import aiodatadist
import aiodatadist.sync as sd
from aiodatadist._portal import PORTAL_THREAD_NAME, portal
from aiodatadist.testing import cluster_info, make_blocks_cache
from tests.sync._util import BLOCK_SHAPE, SyncPair, assert_pulled, holding_link, untouched

S = sd.LLMStatusCode

# Upstream's `from llm_datadist import ...` surface (reference §2) plus DataPath.
UPSTREAM_NAMES = {
    "LLMDataDist", "LLMConfig", "LlmConfig", "LLMRole", "LLMClusterInfo", "LLMStatusCode",
    "LLMException", "Status", "DataType", "CacheDesc", "Cache", "KvCache", "CacheKey",
    "CacheKeyByIdAndIndex", "BlocksCacheKey", "Placement", "RegisterMemStatus",
    "LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask",
    "Memtype", "MemInfo",
}  # fmt: skip


def test_module_surface_mirrors_upstream() -> None:
    assert UPSTREAM_NAMES | {"DataPath"} <= set(sd.__all__)
    for name in sd.__all__:
        assert hasattr(sd, name), name
    # Value types are aiodatadist's own (one class each), the facades are blocking ones.
    for name in UPSTREAM_NAMES - {"LLMDataDist", "CacheTask"}:
        assert getattr(sd, name) is getattr(aiodatadist, name), name
    assert sd.LLMDataDist is not aiodatadist.LLMDataDist
    assert sd.CacheTask is not aiodatadist.CacheTask


def test_methods_are_blocking_with_the_async_signatures() -> None:
    for cls, src in ((sd.CacheManager, aiodatadist.CacheManager),
                     (sd.LLMDataDist, aiodatadist.LLMDataDist),
                     (sd.CacheTask, aiodatadist.CacheTask)):  # fmt: skip
        for name, member in vars(cls).items():
            if name.startswith("_") or not callable(member):
                continue
            assert not inspect.iscoroutinefunction(member), f"{cls.__name__}.{name}"
            target = getattr(src, name, None)
            if target is not None and name not in ("init", "finalize", "done"):
                assert inspect.signature(member) == inspect.signature(target), name
                assert member.__doc__ == target.__doc__, name
    assert "timeout" in inspect.signature(sd.LLMDataDist.link_clusters).parameters


def test_round_trip_in_one_process(pair: SyncPair) -> None:
    pair.prompt_cache(seed=101, num_blocks=8)
    dst = pair.decoder_cache(num_blocks=8)
    cm = pair.decoder.cache_manager
    assert isinstance(cm, sd.CacheManager)
    assert pair.decoder.kv_cache_manager is cm
    assert cm.aio is pair.decoder.aio.cache_manager

    assert cm.pull_blocks(pair.key(), dst.cache, [3, 1, 6], [0, 5, 2]) is None
    assert_pulled(dst, [3, 1, 6], [0, 5, 2], 101)
    assert untouched(dst, [1, 3, 4, 6, 7])
    # Layer ranges and tensors per layer, keywords as upstream.
    cm.pull_blocks(
        pair.key(),
        dst.cache,
        [7],
        [7],
        src_layer_range=range(1, 2),
        dst_layer_range=range(1, 2),
        tensor_num_per_layer=2,
    )
    assert_pulled(dst, [7], [7], 101, tensors=[(2, 2), (3, 3)])
    assert not dst.tensors[0][7].view(np.uint8).any()
    # A local copy: block 0 (which holds source block 3) into 4.
    cm.copy_blocks(dst.cache, {0: [4]})
    assert_pulled(dst, [3], [4], 101)

    assert [ln.remote_cluster_id for ln in pair.decoder.links] == [pair.prompt.cluster_id]
    status, per = pair.decoder.unlink_clusters([cluster_info(pair.prompt.cluster_id)])
    assert (status, per) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert pair.decoder.links == []
    with pytest.raises(sd.LLMException) as info:
        cm.pull_blocks(pair.key(), dst.cache, [2], [3])
    assert info.value.status_code == S.LLM_NOT_YET_LINK
    assert untouched(dst, [3])

    # Relink and pull again: the link is a fresh one.
    status, _ = pair.decoder.link_clusters([cluster_info(pair.prompt.cluster_id)], 3000)
    assert status == S.LLM_SUCCESS
    cm.pull_blocks(pair.key(), dst.cache, [2], [3])
    assert_pulled(dst, [2], [3], 101)


def test_context_manager_inits_with_constructor_options(
    portal_kind: str, cluster_ids: tuple[int, int]
) -> None:
    opts = {"llm.SyncKvCacheWaitTime": "1234"}
    with sd.LLMDataDist(sd.LLMRole.PROMPT, cluster_ids[0], opts) as dd:
        assert dd.is_initialized
        assert dd.options.sync_kv_timeout_ms == 1234
        assert dd.role == sd.LLMRole.PROMPT and dd.cluster_id == cluster_ids[0]
        assert isinstance(dd.aio, aiodatadist.LLMDataDist)
        # The async instance's home is the portal.
        assert dd.aio._home_loop() is portal.loop()
        dd.init()  # idempotent
        assert "initialized" in repr(dd)
    assert not dd.is_initialized
    dd.finalize()  # idempotent
    with pytest.raises(RuntimeError, match="llm datadist is not initialized"):
        _ = dd.cache_manager


def test_errors_cross_the_portal_with_their_types(pair: SyncPair) -> None:
    pair.prompt_cache(seed=102)
    dst = pair.decoder_cache()
    cm = pair.decoder.cache_manager
    with pytest.raises(TypeError):
        cm.pull_blocks("not a key", dst.cache, [0], [0])
    with pytest.raises(sd.LLMParamError) as perr:
        cm.pull_blocks(pair.key(), dst.cache, [0], [])
    assert isinstance(perr.value, ValueError)
    assert perr.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(sd.LLMLinkError) as lerr:
        cm.pull_blocks(sd.BlocksCacheKey(424242, 0), dst.cache, [0], [0])
    assert lerr.value.status_code == S.LLM_NOT_YET_LINK
    with pytest.raises(TypeError):
        pair.decoder.link_clusters("nope")
    with pytest.raises(sd.LLMException) as role:  # a pull on a PROMPT instance
        pair.prompt.cache_manager.pull_blocks(
            sd.BlocksCacheKey(pair.decoder.cluster_id, 0), dst.cache, [0], [0]
        )
    assert isinstance(role.value.status_code, sd.LLMStatusCode)
    # A second initialized instance with the same cluster id: LLM_FAILED.
    twin = sd.LLMDataDist(sd.LLMRole.PROMPT, pair.prompt.cluster_id)
    with pytest.raises(sd.LLMException) as dup:
        twin.init()
    assert dup.value.status_code == S.LLM_FAILED
    assert not twin.is_initialized
    # The traceback of the portal-side failure is kept (where it really failed).
    assert "cache_manager" in "".join(
        str(f.filename) for f in __import__("traceback").extract_tb(perr.value.__traceback__)
    )


def test_timeout_crosses_the_portal_as_llm_timeout(pair: SyncPair) -> None:
    pair.prompt_cache(seed=103)
    dst = pair.decoder_cache()
    cm = pair.decoder.cache_manager
    with holding_link(pair.decoder, pair.prompt.cluster_id):
        with pytest.raises(sd.LLMTimeoutError) as info:
            cm.pull_blocks(pair.key(), dst.cache, [4], [4], timeout=0.05)
    assert info.value.status_code == S.LLM_TIMEOUT
    assert isinstance(info.value, TimeoutError)
    assert untouched(dst, [4])
    cm.pull_blocks(pair.key(), dst.cache, [4], [4])  # the link is healthy
    assert_pulled(dst, [4], [4], 103)


def test_not_initialized_is_upstreams_runtime_error(portal_kind: str) -> None:
    dd = sd.LLMDataDist(sd.LLMRole.DECODER, 7777)
    with pytest.raises(RuntimeError, match=r"^llm datadist is not initialized$"):
        _ = dd.cache_manager
    with pytest.raises(RuntimeError, match=r"^llm datadist is not initialized$"):
        dd.link_clusters([cluster_info(1)])
    assert dd.links == []
    with pytest.raises(TypeError):
        sd.LLMDataDist("DECODER", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        sd.LLMDataDist(sd.LLMRole.DECODER, 1, options=[("a", "b")])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        sd.LLMDataDist(sd.LLMRole.DECODER, -1)


def test_32_threads_hammer_one_link(pair: SyncPair) -> None:
    n = 200
    src = pair.prompt_cache(seed=104, num_blocks=n, num_tensors=2)
    dst = pair.decoder_cache(num_blocks=n, num_tensors=2)
    cm = pair.decoder.cache_manager
    key = pair.key()
    perm = [(i * 37 + 11) % n for i in range(n)]  # a permutation: every pull its own pair
    threads: set[str] = set()

    def pull(i: int) -> int:
        threads.add(threading.current_thread().name)
        cm.pull_blocks(key, dst.cache, [i], [perm[i]])
        return i

    with ThreadPoolExecutor(32) as pool:
        done = list(pool.map(pull, range(n)))
    assert done == list(range(n))
    assert len(threads) > 1
    assert_pulled(dst, list(range(n)), perm, 104)
    del src


def test_a_call_from_the_portal_thread_is_refused(pair: SyncPair) -> None:
    dst = pair.decoder_cache()
    cm = pair.decoder.cache_manager
    names: list[str] = []

    def on_portal() -> None:
        names.append(threading.current_thread().name)
        cm.pull_blocks(pair.key(), dst.cache, [0], [0])  # would wait for itself

    with pytest.raises(RuntimeError, match="portal thread"):
        portal.call(on_portal)
    assert names == [PORTAL_THREAD_NAME]
    with pytest.raises(RuntimeError, match="portal thread"):
        portal.call(lambda: pair.decoder.finalize())
    assert pair.decoder.is_initialized


def test_a_thread_running_its_own_loop_may_call(pair: SyncPair) -> None:
    import asyncio

    pair.prompt_cache(seed=105)
    dst = pair.decoder_cache()
    errors: list[BaseException] = []

    async def main() -> None:
        # Blocks this loop for the call (documented); it must not deadlock.
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [6], [1])

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive()
    assert errors == []
    assert_pulled(dst, [6], [1], 105)


def test_registration_calls_run_on_the_portal(pair: SyncPair) -> None:
    desc = sd.CacheDesc(2, [4, *BLOCK_SHAPE], sd.DataType.DT_FLOAT16, sd.Placement.HOST)
    tensors = [np.zeros(desc.shape, np.float16) for _ in range(2)]
    cm = pair.prompt.cache_manager
    cache = cm.register_blocks_cache(desc, tensors, sd.BlocksCacheKey(pair.prompt.cluster_id, 3))
    assert isinstance(cache, sd.Cache)
    with pytest.raises(sd.LLMException):  # overlapping memory
        cm.register_blocks_cache(desc, tensors, sd.BlocksCacheKey(pair.prompt.cluster_id, 4))
    assert cm.unregister_cache(cache.cache_id) is None
    allocated = make_blocks_cache(pair.prompt, allocate=True, model_id=5, seed=1)
    cm.deallocate_blocks_cache(allocated.cache)
