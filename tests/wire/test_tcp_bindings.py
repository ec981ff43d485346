"""A key whose binding moved is never served under its old meaning, on any data path.

The prompt re-binds a key (a later registration takes a blocks cache's ``model_id``, a
row key is removed and bound to another cache) and the decoder pulls right away, before
the prompt's table update reached it. The one-sided paths refuse the stale lease
generation and refresh; tcp requests carry the generation too (``PULL.gen``), so the
serving side refuses a cache that lost the binding and the decoder refreshes and gets
the key's current bytes: never the displaced cache's bytes as a success.

Every cache here holds bytes unique to it; the decoder's blocks are prefilled with a
byte no source holds. Last, a tcp peer going away: data streams that cannot be
reconnected fail the pull with an engine error, not a bare socket error.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import inproc_pair

pytestmark = pytest.mark.asyncio

P = 1
PATHS = ["tcp", "shm", "cma"]


def _blocks(dd: LLMDataDist, path: str, fill: int, model_id: int | None) -> KvCache:
    desc = CacheDesc(2, [4, 1024], DataType.DT_INT8, Placement.HOST)
    key = None if model_id is None else BlocksCacheKey(dd.cluster_id, model_id)
    cm = dd.cache_manager
    if path == "shm":
        cache = cm.allocate_blocks_cache(desc, key)
    else:
        arrays = [np.zeros((4, 1024), np.int8) for _ in range(2)]
        cache = cm.register_blocks_cache(desc, arrays, key)
        cache._keep = arrays  # type: ignore[attr-defined]
    for t in cache.tensors():
        t.view(np.uint8)[...] = fill
    return cache


def _rows(dd: LLMDataDist, path: str, fill: int, keys: list[CacheKey]) -> KvCache:
    desc = CacheDesc(1, [2, 1024], DataType.DT_INT8, Placement.HOST)
    cm = dd.cache_manager
    if path == "shm":
        cache = cm.allocate_cache(desc, keys)
    else:
        arrays = [np.zeros((2, 1024), np.int8)]
        cache = cm.register_cache(desc, arrays, keys)
        cache._keep = arrays  # type: ignore[attr-defined]
    for t in cache.tensors():
        t.view(np.uint8)[...] = fill
    return cache


def _held(cache: KvCache, block: int) -> set[int]:
    return {int(v) for t in cache.tensors() for v in np.unique(t.view(np.uint8)[block])}


@pytest.mark.parametrize("path", PATHS)
async def test_a_displaced_blocks_cache_is_not_served_under_its_model_id(path: str) -> None:
    async with inproc_pair(data_path=path) as pair:
        _blocks(pair.prompt, path, 0x11, model_id=0)
        dst = _blocks(pair.decoder, "tcp", 0x77, model_id=None)
        cm = pair.decoder.cache_manager
        await cm.pull_blocks(BlocksCacheKey(P, 0), dst, [0], [0], timeout=5)
        assert _held(dst, 0) == {0x11}
        # A later registration takes model_id 0; the first cache stays registered (by id).
        # No await in between: the decoder's table still maps model_id 0 to the first.
        _blocks(pair.prompt, path, 0x22, model_id=0)
        await cm.pull_blocks(BlocksCacheKey(P, 0), dst, [1], [1], timeout=5)
        assert _held(dst, 1) == {0x22}, "the displaced cache was served under model_id 0"


@pytest.mark.parametrize("path", PATHS)
async def test_a_replaced_blocks_cache_is_pulled_after_one_refresh(path: str) -> None:
    """Unregister + register under the same model_id: the pull finds the new cache (tcp
    used to fail it with LLM_KV_CACHE_NOT_EXIST from the serving side)."""
    async with inproc_pair(data_path=path) as pair:
        first = _blocks(pair.prompt, path, 0x11, model_id=0)
        dst = _blocks(pair.decoder, "tcp", 0x77, model_id=None)
        cm = pair.decoder.cache_manager
        await cm.pull_blocks(BlocksCacheKey(P, 0), dst, [0], [0], timeout=5)
        pcm = pair.prompt.cache_manager
        if path == "shm":
            pcm.deallocate_blocks_cache(first)
        else:
            pcm.unregister_cache(first.cache_id)
        _blocks(pair.prompt, path, 0x33, model_id=0)
        await cm.pull_blocks(BlocksCacheKey(P, 0), dst, [2], [2], timeout=5)
        assert _held(dst, 2) == {0x33}


@pytest.mark.parametrize("path", PATHS)
async def test_a_row_key_bound_elsewhere_is_not_served_from_its_old_row(path: str) -> None:
    async with inproc_pair(data_path=path) as pair:
        key = CacheKey(P, req_id=5)
        _rows(pair.prompt, path, 0x44, [key])
        dst = _rows(pair.decoder, "tcp", 0x77, [])
        cm = pair.decoder.cache_manager
        await cm.pull_cache(key, dst, 0)
        assert _held(dst, 0) == {0x44}
        pcm = pair.prompt.cache_manager
        pcm.remove_cache_key(key)
        _rows(pair.prompt, path, 0x55, [key])  # the key now names another cache's row
        await cm.pull_cache(key, dst, 1)
        assert _held(dst, 1) == {0x55}, "the key's old row was served after it moved"


class _Ready(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


@pytest.mark.parametrize("path", PATHS)
async def test_a_push_never_lands_in_a_displaced_cache(path: str) -> None:
    """transfer_cache_async from the prompt (the serving end of the link, so over tcp its
    streams are the ones the decoder connects) to a model_id the decoder just moved to
    another cache: the bytes land in the new cache, the displaced one is untouched.
    (The pipeline builds its plan in a later task, so the prompt's table may already be
    fresh here: this guards the push direction end to end, the pull tests above force
    the stale table.)"""
    async with inproc_pair(data_path=path) as pair:
        src = _blocks(pair.prompt, "tcp", 0x5A, model_id=None)
        first = _blocks(pair.decoder, path, 0x11, model_id=3)
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(2, 3), range(0, 1), range(0, 1))
        cm = pair.prompt.cache_manager
        task = await cm.transfer_cache_async(src, _Ready(), [cfg], [0], [0])
        assert await task.get_results(5000) == [LLMStatusCode.LLM_SUCCESS]
        assert _held(first, 0) == {0x5A}
        second = _blocks(pair.decoder, path, 0x22, model_id=3)  # takes model_id 3
        task = await cm.transfer_cache_async(src, _Ready(), [cfg], [0], [1])
        assert await task.get_results(5000) == [LLMStatusCode.LLM_SUCCESS]
        assert _held(first, 1) == {0x11}, "the push wrote the cache that lost model_id 3"
        assert _held(second, 1) == {0x5A}


# ------------------------------------------------------------------ a peer going away


async def test_streams_that_cannot_be_reconnected_fail_as_an_engine_error() -> None:
    """The prompt stopped listening (it is going away; its control connection is still up
    for a moment) after our data streams were retired by a failed transfer: the next
    pull cannot connect new streams. It raises LLMException(LLM_LINK_FAILED), never a
    bare ConnectionRefusedError, and writes nothing."""
    async with inproc_pair(data_path="tcp") as pair:
        _blocks(pair.prompt, "tcp", 0x11, model_id=0)
        dst = _blocks(pair.decoder, "tcp", 0x77, model_id=None)
        cm = pair.decoder.cache_manager
        await cm.pull_blocks(BlocksCacheKey(P, 0), dst, [0], [0], timeout=5)
        link = pair.decoder._rt.links.find(P)
        assert link is not None
        server = pair.prompt._server
        assert server is not None and server._server is not None
        server._server.close()  # no new connections: new data streams are refused
        link.path.peer.streams.drop(0)  # (what a failed transfer does)
        with pytest.raises(LLMException) as info:
            await cm.pull_blocks(BlocksCacheKey(P, 0), dst, [1], [1], timeout=5)
        assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert _held(dst, 1) == {0x77}
