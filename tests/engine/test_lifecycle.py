"""LLMDataDist lifecycle: init/finalize (idempotent, async with), the cache manager,
cluster ids, several instances in one process, option errors, link/unlink in-process."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheManager,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMLinkError,
    LLMParamError,
    LLMRole,
    LLMStatusCode,
)
from aiodatadist.testing import cluster_info, inproc_pair, make_blocks_cache
from tests.engine._util import blocks_of

pytestmark = pytest.mark.asyncio

S = LLMStatusCode


def _aiodd_threads(cluster_id: int) -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith(f"aiodatadist-{cluster_id}-") and t.is_alive()]


def _xfer_threads(cluster_id: int) -> list[str]:
    """The transfer executor's threads (not the serving executor's, ``-serve-``)."""
    return [n for n in _aiodd_threads(cluster_id) if "-serve-" not in n]


def _serve_threads(cluster_id: int) -> list[str]:
    prefix = f"aiodatadist-{cluster_id}-serve-"
    return [n for n in _aiodd_threads(cluster_id) if n.startswith(prefix)]


async def test_init_and_finalize_are_idempotent() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 301)
    assert not dd.is_initialized and dd.role == LLMRole.DECODER and dd.cluster_id == 301
    await dd.init({})
    cm = dd.cache_manager
    threads = _aiodd_threads(301)
    await dd.init({})  # a second init with the same options changes nothing
    assert dd.is_initialized
    assert dd.cache_manager is cm
    assert dd.options.sync_kv_timeout_ms == 1000
    assert _aiodd_threads(301) == threads
    await dd.finalize()
    assert not dd.is_initialized
    await dd.finalize()  # twice: fine
    assert _aiodd_threads(301) == []
    # And it can be initialized again, afresh.
    await dd.init({"llm.SyncKvCacheWaitTime": "5"})
    assert dd.options.sync_kv_timeout_ms == 5
    assert dd.cache_manager is not cm
    await dd.finalize()


async def test_async_with() -> None:
    async with LLMDataDist(LLMRole.PROMPT, 302) as dd:
        assert dd.is_initialized
        fc = make_blocks_cache(dd, seed=1)
        assert fc.cache.cache_id >= 1
    assert not dd.is_initialized
    with pytest.raises(RuntimeError):
        dd.cache_manager  # noqa: B018
    await dd.finalize()  # after async with: still fine


async def test_async_with_finalizes_on_error() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 303)
    with pytest.raises(KeyError):
        async with dd:
            raise KeyError("boom")
    assert not dd.is_initialized


async def test_cache_manager_before_init_is_runtime_error() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 304)
    with pytest.raises(RuntimeError, match="not initialized"):
        dd.cache_manager  # noqa: B018
    with pytest.raises(RuntimeError, match="not initialized"):
        dd.kv_cache_manager  # noqa: B018
    with pytest.raises(RuntimeError):
        await dd.link_clusters([cluster_info(1)])
    with pytest.raises(RuntimeError):
        await dd.unlink_clusters([cluster_info(1)])
    await dd.finalize()  # finalize before init: a no-op


async def test_kv_cache_manager_alias() -> None:
    async with LLMDataDist(LLMRole.DECODER, 305) as dd:
        assert isinstance(dd.cache_manager, CacheManager)
        assert dd.kv_cache_manager is dd.cache_manager


async def test_constructor_argument_types() -> None:
    with pytest.raises(TypeError):
        LLMDataDist("DECODER", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LLMDataDist(LLMRole.DECODER, "1")  # type: ignore[arg-type]
    with pytest.raises(LLMParamError):
        LLMDataDist(LLMRole.DECODER, -1)
    with pytest.raises(LLMParamError):
        LLMDataDist(LLMRole.DECODER, 2**64)


async def test_two_initialized_instances_with_one_cluster_id() -> None:
    a = LLMDataDist(LLMRole.PROMPT, 306)
    b = LLMDataDist(LLMRole.DECODER, 306)
    await a.init()
    try:
        with pytest.raises(LLMException) as info:
            await b.init()
        assert info.value.status_code == S.LLM_FAILED
        assert not b.is_initialized
        with pytest.raises(RuntimeError):
            b.cache_manager  # noqa: B018
    finally:
        await a.finalize()
    await b.init()  # the id is free again
    assert b.is_initialized
    await b.finalize()


async def test_several_instances_in_one_process_move_real_bytes() -> None:
    prompts = [LLMDataDist(LLMRole.PROMPT, 310 + i) for i in range(3)]
    decoder = LLMDataDist(LLMRole.DECODER, 320)
    for dd in [*prompts, decoder]:
        await dd.init()
    try:
        srcs = [make_blocks_cache(p, model_id=0, seed=i + 1, num_tensors=2, num_blocks=4,
                                  block_shape=(64, 8, 16)) for i, p in enumerate(prompts)]
        dst = make_blocks_cache(decoder, num_tensors=2, num_blocks=4, block_shape=(64, 8, 16))
        status, per = await decoder.link_clusters([cluster_info(p.cluster_id) for p in prompts])
        assert status == S.LLM_SUCCESS and per == [S.LLM_SUCCESS] * 3
        assert sorted(link.remote_cluster_id for link in decoder.links) == [310, 311, 312]
        for i, p in enumerate(prompts):
            assert [link.remote_cluster_id for link in p.links] == [320]
            await decoder.cache_manager.pull_blocks(BlocksCacheKey(p.cluster_id, 0), dst.cache,
                                                    [3 - i], [i])
        for i in range(3):
            for t in range(2):
                assert np.array_equal(blocks_of(dst.tensors[t])[i],
                                      blocks_of(srcs[i].tensors[t])[3 - i])
        # Each instance has its own executor threads.
        names = [set(_xfer_threads(dd.cluster_id)) for dd in [*prompts, decoder]]
        assert all(len(n) == 2 for n in names)
        assert len(set().union(*names)) == 8
    finally:
        for dd in [decoder, *prompts]:
            await dd.finalize()


@pytest.mark.parametrize(
    ("options", "exc"),
    [
        ({"llm.SyncKvCacheWaitTime": "abc"}, LLMParamError),
        ({"llm.SyncKvCacheWaitTime": "0"}, LLMParamError),
        ({"llm.SyncKvCacheWaitTime": 100}, TypeError),
        ({"aiodatadist.ExecutorThreads": "0"}, LLMParamError),
        ({"aiodatadist.ExecutorThreads": "65"}, LLMParamError),
        ({"aiodatadist.MoverThreads": "x"}, LLMParamError),
        ({"aiodatadist.FinalizeTimeout": "-1"}, LLMParamError),
        ({"aiodatadist.DataPath": "carrier-pigeon"}, LLMParamError),
        ({"llm.EnableCacheManager": "yes"}, LLMParamError),
        ({"llm.listenIpInfo": "not-an-address"}, LLMParamError),
        ({1: "1"}, TypeError),
        ("llm.SyncKvCacheWaitTime=1", TypeError),
        ([("llm.SyncKvCacheWaitTime", "1")], TypeError),
    ],
    ids=lambda v: str(v)[:40] if not isinstance(v, type) else v.__name__,
)
async def test_option_errors_surface_from_init(options, exc: type[BaseException]) -> None:
    dd = LLMDataDist(LLMRole.DECODER, 330)
    with pytest.raises(exc) as info:
        await dd.init(options)
    if exc is LLMParamError:
        assert info.value.status_code == S.LLM_PARAM_INVALID
    assert not dd.is_initialized
    assert _aiodd_threads(330) == []  # a refused init leaves no threads behind
    await dd.init({})  # and the instance is still usable
    await dd.finalize()


async def test_llm_config_options_are_used() -> None:
    cfg = LLMConfig()
    cfg.sync_kv_timeout = 250
    cfg.executor_threads = 3
    cfg.serve_threads = 2
    async with LLMDataDist(LLMRole.DECODER, 331) as dd:
        pass
    await dd.init(cfg.generate_options())
    try:
        assert dd.options.sync_kv_timeout_ms == 250
        assert len(_xfer_threads(331)) == 3
        assert len(_serve_threads(331)) == 2  # peers' requests: apart from our transfers
    finally:
        await dd.finalize()
    assert _aiodd_threads(331) == []


async def test_link_and_unlink_statuses() -> None:
    async with inproc_pair(prompt_id=340, decoder_id=341, link=False) as pair:
        d = pair.decoder
        assert d.links == []
        status, per = await d.link_clusters([cluster_info(340)])
        assert (status, per) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert [link.data_path for link in d.links] == ["inproc"]
        status, per = await d.link_clusters([cluster_info(340)])
        assert per == [S.LLM_ALREADY_LINK] and status == S.LLM_ALREADY_LINK
        # The prompt sees the link too (one link, two ends).
        status, per = await pair.prompt.link_clusters([cluster_info(341)])
        assert per == [S.LLM_ALREADY_LINK]
        status, per = await d.link_clusters([cluster_info(341)])  # itself
        assert per == [S.LLM_PARAM_INVALID]
        status, per = await d.link_clusters([cluster_info(999)])  # nobody, no address
        assert per == [S.LLM_LINK_FAILED]
        status, per = await d.link_clusters([cluster_info(340), cluster_info(999)])
        assert per == [S.LLM_ALREADY_LINK, S.LLM_LINK_FAILED] and status == S.LLM_LINK_FAILED
        with pytest.raises(TypeError):
            await d.link_clusters(cluster_info(340))
        with pytest.raises(LLMParamError):
            await d.link_clusters([LLMClusterInfo()])  # no remote_cluster_id
        with pytest.raises(LLMParamError):
            await d.link_clusters([cluster_info(340)], timeout=0)
        status, per = await d.link_clusters([cluster_info(1000 + i) for i in range(17)])
        assert status == S.LLM_CLUSTER_NUM_EXCEED_LIMIT

        src = pair.prompt_cache(num_tensors=2, num_blocks=4, block_shape=(64, 8, 16))
        dst = pair.decoder_cache(num_tensors=2, num_blocks=4, block_shape=(64, 8, 16))
        await d.cache_manager.pull_blocks(pair.key(), dst.cache, [2], [1])
        status, per = await d.unlink_clusters([cluster_info(340)])
        assert (status, per) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert d.links == [] and pair.prompt.links == []  # both ends are gone
        status, per = await d.unlink_clusters([cluster_info(340)])
        assert per == [S.LLM_NOT_YET_LINK]
        with pytest.raises(LLMLinkError) as info:
            await d.cache_manager.pull_blocks(pair.key(), dst.cache, [2], [1])
        assert info.value.status_code == S.LLM_NOT_YET_LINK
        # Relink: pulls work again.
        status, _ = await d.link_clusters([cluster_info(340)])
        assert status == S.LLM_SUCCESS
        await d.cache_manager.pull_blocks(pair.key(), dst.cache, [3], [0])
        for t in range(2):
            assert np.array_equal(blocks_of(dst.tensors[t])[0], blocks_of(src.tensors[t])[3])
        # force=True closes at once.
        status, per = await d.unlink_clusters([cluster_info(340)], force=True)
        assert per == [S.LLM_SUCCESS] and d.links == []


async def test_finalize_unlinks_the_peer() -> None:
    async with inproc_pair(prompt_id=350, decoder_id=351) as pair:
        src = pair.prompt_cache(num_tensors=2, num_blocks=4, block_shape=(64, 8, 16))
        dst = pair.decoder_cache(num_tensors=2, num_blocks=4, block_shape=(64, 8, 16))
        await pair.prompt.finalize()
        assert pair.decoder.links == []
        with pytest.raises(LLMLinkError):
            await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0], [0])
        del src


async def test_failed_init_leaves_the_instance_as_it_was() -> None:
    # A listen address that is taken: init fails, and the instance is still a clean,
    # uninitialized one that a later init (on a free port) brings up normally.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        dd = LLMDataDist(LLMRole.PROMPT, 931)
        with pytest.raises(LLMException) as info:
            await dd.init({"llm.listenIpInfo": f"127.0.0.1:{port}"})
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert not dd.is_initialized
        assert dd._home_loop() is None
        with pytest.raises(RuntimeError, match="not initialized"):
            _ = dd.cache_manager
        await dd.finalize()  # a no-op, from any loop
    await dd.init({"llm.listenIpInfo": "127.0.0.1:0"})
    try:
        assert dd.listen_address is not None
    finally:
        await dd.finalize()
