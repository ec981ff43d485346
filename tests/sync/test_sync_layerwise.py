"""The blocking pull_blocks_layerwise: a plain iterator over the portal, one call per layer.

Each layer's bytes are checked when it is handed over; leaving early (``close``, the
``with`` block, a ``break`` then dropping the iterator) aborts what is in flight and
leaves the link usable; argument errors come at the call; a layer's error at its step.
"""

from __future__ import annotations

import gc

import pytest

import aiodatadist.sync as sd
from aiodatadist.testing import cluster_info, pattern_mismatches
from tests.sync._util import SyncPair, assert_pulled

BLOCK = (256, 8, 16)  # 64 KiB per block per tensor: every layer runs on the executor


def _layer_ok(dst, seed: int, layer, sb: list[int], db: list[int], t: int = 2) -> None:
    pairs = [(layer.src_layer * t + i, layer.dst_layer * t + i) for i in range(t)]
    bad = pattern_mismatches(dst.tensors, sb, db, seed, pairs)
    assert not bad, f"layer {layer}: {bad[0]}"


def test_layers_in_order_with_exact_bytes(pair: SyncPair) -> None:
    pair.prompt_cache(seed=4101, num_tensors=8, num_blocks=8, block_shape=BLOCK)
    dst = pair.decoder_cache(num_tensors=8, num_blocks=8, block_shape=BLOCK)
    sb, db = [7, 0, 3], [1, 2, 5]
    with pair.decoder.cache_manager.pull_blocks_layerwise(
        pair.key(), dst.cache, sb, db, src_layer_range=range(1, 4), dst_layer_range=range(0, 3)
    ) as layers:
        assert isinstance(layers, sd.LayerIterator) and len(layers) == 3
        seen = []
        for layer in layers:
            _layer_ok(dst, 4101, layer, sb, db)
            seen.append((layer.index, layer.src_layer, layer.dst_layer))
    assert seen == [(0, 1, 0), (1, 2, 1), (2, 3, 2)]


def test_leaving_early_aborts_and_the_link_stays_usable(pair: SyncPair) -> None:
    pair.prompt_cache(seed=4102, num_tensors=8, num_blocks=8, block_shape=BLOCK)
    dst = pair.decoder_cache(num_tensors=8, num_blocks=8, block_shape=BLOCK)
    cm = pair.decoder.cache_manager
    it = cm.pull_blocks_layerwise(pair.key(), dst.cache, [1], [1], tensor_num_per_layer=1)
    first = next(it)
    _layer_ok(dst, 4102, first, [1], [1], t=1)
    it.close()
    assert list(it) == []  # closed: nothing more
    for layer in cm.pull_blocks_layerwise(pair.key(), dst.cache, [2], [2], depth=3):
        if layer.index == 1:
            break
    gc.collect()
    cm.pull_blocks(pair.key(), dst.cache, [5, 6], [5, 6])
    assert_pulled(dst, [5, 6], [5, 6], 4102)


def test_errors_at_the_call_and_at_the_step(pair: SyncPair) -> None:
    pair.prompt_cache(seed=4103, num_tensors=8, num_blocks=8, block_shape=BLOCK)
    dst = pair.decoder_cache(num_tensors=8, num_blocks=8, block_shape=BLOCK)
    cm = pair.decoder.cache_manager
    with pytest.raises(sd.LLMParamError):
        cm.pull_blocks_layerwise(pair.key(), dst.cache, [0], [0], depth=0)
    with pytest.raises(TypeError):
        cm.pull_blocks_layerwise(pair.key(), "cache", [0], [0])
    it = cm.pull_blocks_layerwise(pair.key(), dst.cache, [3], [3], depth=1)
    _layer_ok(dst, 4103, next(it), [3], [3])
    # The iteration is one transfer, on the link's slot ahead of the unlink (FIFO): every
    # layer lands; a call after the unlink raises at the call.
    pair.decoder.unlink_clusters([cluster_info(pair.prompt.cluster_id)], force=True)
    rest = list(it)
    assert len(rest) == 3
    for layer in rest:
        _layer_ok(dst, 4103, layer, [3], [3])
    with pytest.raises(sd.LLMException) as info:
        cm.pull_blocks_layerwise(pair.key(), dst.cache, [3], [3])
    assert info.value.status_code == sd.LLMStatusCode.LLM_NOT_YET_LINK
