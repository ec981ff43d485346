"""The calls issue 11 adds to the async API (two-sided links, switch_role, push, copy_cache,
swap_blocks, v2 keyword names), through aiodatadist.sync.

Each is guarded on the async API having the call, so that this file runs before they land.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import aiodatadist
import aiodatadist.sync as sd
from aiodatadist.testing import cluster_info, make_blocks_cache
from tests.sync._util import BLOCK_SHAPE, BOUND_S, SyncPair, assert_pulled, open_pair, untouched

S = sd.LLMStatusCode
ADD, ACM = aiodatadist.LLMDataDist, aiodatadist.CacheManager

def _rows(dd: sd.LLMDataDist, rows: int = 2, row_bytes: int = 1024, tensors: int = 4,
          seed: int | None = None) -> tuple[sd.Cache, list[np.ndarray]]:  # fmt: skip
    desc = sd.CacheDesc(tensors, [rows, row_bytes], sd.DataType.DT_UINT8, sd.Placement.HOST)
    arrays = [np.zeros((rows, row_bytes), np.uint8) for _ in range(tensors)]
    if seed is not None:
        rng = np.random.default_rng(seed)
        for a in arrays:
            a[...] = rng.integers(0, 256, a.shape, dtype=np.uint8)
    return dd.cache_manager.register_cache(desc, arrays), arrays


def test_v2_and_v1_keyword_names(pair: SyncPair) -> None:
    pair.prompt_cache(seed=501)
    dst = pair.decoder_cache()
    cm = pair.decoder.cache_manager
    cm.pull_blocks(pair.key(), dst.cache, src_blocks=[2], dst_blocks=[0])
    cm.pull_blocks(pair.key(), dst.cache, prompt_blocks=[3], decoder_blocks=[1])
    assert_pulled(dst, [2, 3], [0, 1], 501)
    with pytest.raises(TypeError):
        cm.pull_blocks(pair.key(), dst.cache, src_blocks=[4], prompt_blocks=[4], dst_blocks=[2])
    assert untouched(dst, [2])


def test_check_link_status(pair: SyncPair) -> None:
    assert pair.decoder.check_link_status(pair.prompt.cluster_id) is None
    with pytest.raises(sd.LLMException) as info:
        pair.decoder.check_link_status(4242)
    assert info.value.status_code == S.LLM_NOT_YET_LINK


def test_switch_role_refused_while_linked(pair: SyncPair) -> None:
    with pytest.raises(sd.LLMException) as info:
        pair.decoder.switch_role(sd.LLMRole.PROMPT)
    assert info.value.status_code == S.LLM_EXIST_LINK
    assert pair.decoder.role == sd.LLMRole.DECODER
    status, _ = pair.decoder.unlink_clusters([cluster_info(pair.prompt.cluster_id)])
    assert status == S.LLM_SUCCESS
    pair.decoder.switch_role(sd.LLMRole.MIX, {"llm.listenIpInfo": "127.0.0.1:0"})
    assert pair.decoder.role == sd.LLMRole.MIX
    assert pair.decoder.listen_address is not None
    pair.decoder.switch_role(sd.LLMRole.DECODER)
    assert pair.decoder.listen_address is None


def test_push_blocks_and_push_cache(pair: SyncPair) -> None:
    # The decoder writes into the prompt's caches over its link.
    target = make_blocks_cache(pair.prompt, model_id=9, block_shape=BLOCK_SHAPE)
    src = make_blocks_cache(pair.decoder, seed=502, pattern=True, block_shape=BLOCK_SHAPE)
    cm = pair.decoder.cache_manager
    cm.push_blocks(sd.BlocksCacheKey(pair.prompt.cluster_id, 9), src.cache, [1, 6], [4, 0])
    assert_pulled(target, [1, 6], [4, 0], 502)
    assert untouched(target, [1, 2, 3, 5, 6, 7])

    remote, remote_arrays = _rows(pair.prompt)
    local, local_arrays = _rows(pair.decoder, seed=503)
    key = sd.CacheKeyByIdAndIndex(pair.prompt.cluster_id, remote.cache_id, 1)
    cm.push_cache(key, local, src_batch_index=0)
    for r, a in zip(remote_arrays, local_arrays, strict=True):
        assert np.array_equal(r[1], a[0])
        assert not r[0].any()


def test_copy_cache(pair: SyncPair) -> None:
    src, src_arrays = _rows(pair.decoder, seed=504)
    dst, dst_arrays = _rows(pair.decoder)
    pair.decoder.cache_manager.copy_cache(dst, src, dst_batch_index=1, src_batch_index=0,
                                          offset=128, size=256)  # fmt: skip
    for d, s in zip(dst_arrays, src_arrays, strict=True):
        assert np.array_equal(d[1, 128:384], s[0, 128:384])
        assert not d[1, :128].any() and not d[1, 384:].any() and not d[0].any()


def test_swap_blocks_host_and_device(pair: SyncPair) -> None:
    cm = pair.decoder.cache_manager
    host = make_blocks_cache(pair.decoder, seed=505, pattern=True, block_shape=BLOCK_SHAPE)
    desc = sd.CacheDesc(4, [8, *BLOCK_SHAPE], sd.DataType.DT_FLOAT16, sd.Placement.DEVICE)
    tensors = [np.zeros(desc.shape, np.float16) for _ in range(4)]
    device = cm.register_blocks_cache(desc, tensors)
    cm.swap_blocks(host.cache, device, {2: 5, 7: 0})
    dev = host.__class__(device, tensors)
    assert_pulled(dev, [2, 7], [5, 0], 505)
    assert untouched(dev, [1, 2, 3, 4, 6, 7])


def _rank_table(*ranks: int) -> str:
    devices = [{"device_id": str(r), "device_ip": f"192.168.1.{r + 1}", "rank_id": str(r)}
               for r in ranks]  # fmt: skip
    return json.dumps({"version": "1.0", "server_count": "1", "status": "completed",
                       "server_list": [{"server_id": "127.0.0.1", "device": devices}]})  # fmt: skip


def test_two_sided_link_in_one_process(portal_kind: str, cluster_ids: tuple[int, int]) -> None:
    a_id, b_id = cluster_ids
    a = sd.LLMDataDist(sd.LLMRole.MIX, a_id)
    b = sd.LLMDataDist(sd.LLMRole.MIX, b_id)
    with a, b:
        a_cache = make_blocks_cache(a, model_id=0, seed=506, pattern=True,
                                    block_shape=BLOCK_SHAPE)  # fmt: skip
        b_cache = make_blocks_cache(b, model_id=0, seed=507, pattern=True,
                                    block_shape=BLOCK_SHAPE)  # fmt: skip
        a_dst = make_blocks_cache(a, block_shape=BLOCK_SHAPE)
        b_dst = make_blocks_cache(b, block_shape=BLOCK_SHAPE)
        members = {a_id: 0, b_id: 1}
        table = _rank_table(0, 1)
        a_comm = a.link("sync-comm", members, table)
        b_comm = b.link("sync-comm", members, table)
        assert isinstance(a_comm, int) and isinstance(b_comm, int)
        for dd, comm in ((a, a_comm), (b, b_comm)):
            deadline = time.monotonic() + BOUND_S
            while (st := dd.query_register_mem_status(comm)) == sd.RegisterMemStatus.PREPARING:
                assert time.monotonic() < deadline, "stuck in PREPARING"
                time.sleep(0.01)
            assert st == sd.RegisterMemStatus.OK
        # Both sides pull from each other.
        a.cache_manager.pull_blocks(sd.BlocksCacheKey(b_id, 0), a_dst.cache, [1], [2])
        b.cache_manager.pull_blocks(sd.BlocksCacheKey(a_id, 0), b_dst.cache, [3], [4])
        assert_pulled(a_dst, [1], [2], 507)
        assert_pulled(b_dst, [3], [4], 506)
        a.unlink(a_comm)
        b.unlink(b_comm)
        with pytest.raises(sd.LLMException) as info:
            a.query_register_mem_status(a_comm)
        assert info.value.status_code == S.LLM_NOT_YET_LINK
        del a_cache, b_cache


def test_unknown_attribute_of_the_async_api_is_an_attribute_error(pair: SyncPair) -> None:
    with pytest.raises(AttributeError):
        pair.decoder.no_such_call  # noqa: B018
    with pytest.raises(AttributeError):
        pair.decoder.cache_manager.no_such_call  # noqa: B018


def test_open_pair_without_link(portal_kind: str, cluster_ids: tuple[int, int]) -> None:
    with open_pair(*cluster_ids, link=False) as p:
        assert p.decoder.links == []
