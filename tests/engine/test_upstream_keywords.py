"""Upstream's keyword names: ``pull_blocks`` takes v2's (``src_cache_key``, ``dst_cache``,
``src_blocks``, ``dst_blocks``) and v1's (``prompt_cache_key``, ``decoder_kv_cache``,
``prompt_blocks``, ``decoder_blocks``); one parameter under both names is a TypeError;
``pull_cache`` and the push / copy methods take upstream's names."""

from __future__ import annotations

import inspect

import pytest

from aiodatadist import CacheManager
from aiodatadist.testing import Pair
from tests.engine._util import Tracker, assert_bytes, instrument, reference_pull, snapshot

pytestmark = pytest.mark.asyncio

BLOCK = (16, 2, 64)


def _caches(pair: Pair, seed: int):
    src = pair.prompt_cache(seed=seed, pattern=True, num_tensors=4, num_blocks=8, block_shape=BLOCK)
    dst = pair.decoder_cache(
        seed=seed + 1000, pattern=True, num_tensors=4, num_blocks=8, block_shape=BLOCK
    )
    return src, dst


SPELLINGS = {
    "positional": lambda key, cache, s, d: ((key, cache, s, d), {}),
    "v2": lambda key, cache, s, d: (
        (),
        {"src_cache_key": key, "dst_cache": cache, "src_blocks": s, "dst_blocks": d},
    ),
    "v1": lambda key, cache, s, d: (
        (),
        {
            "prompt_cache_key": key,
            "decoder_kv_cache": cache,
            "prompt_blocks": s,
            "decoder_blocks": d,
        },
    ),
    "mixed": lambda key, cache, s, d: (
        (key,),
        {"decoder_kv_cache": cache, "src_blocks": s, "decoder_blocks": d},
    ),
    "positional-v1-blocks": lambda key, cache, s, d: (
        (key, cache),
        {"prompt_blocks": s, "decoder_blocks": d},
    ),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
async def test_every_spelling_pulls(pair: Pair, spelling: str) -> None:
    src, dst = _caches(pair, seed=501 + list(SPELLINGS).index(spelling))
    s, d = [3, 6], [0, 5]
    want = reference_pull(snapshot(src), snapshot(dst), s, d, 0, 0, 4)
    args, kw = SPELLINGS[spelling](pair.key(), dst.cache, s, d)
    await pair.decoder.cache_manager.pull_blocks(*args, **kw, src_layer_range=None, timeout=5)
    assert_bytes(dst, want)


BOTH = {
    "src_blocks+prompt_blocks": lambda k, c: (
        (k, c),
        {"src_blocks": [0], "prompt_blocks": [0], "dst_blocks": [0]},
    ),
    "dst_blocks+decoder_blocks": lambda k, c: (
        (k, c, [0]),
        {"dst_blocks": [0], "decoder_blocks": [0]},
    ),
    "positional+prompt_blocks": lambda k, c: ((k, c, [0], [0]), {"prompt_blocks": [0]}),
    "positional+decoder_kv_cache": lambda k, c: (
        (k, c),
        {"decoder_kv_cache": c, "src_blocks": [0], "dst_blocks": [0]},
    ),
    "src_cache_key+prompt_cache_key": lambda k, c: (
        (),
        {
            "src_cache_key": k,
            "prompt_cache_key": k,
            "dst_cache": c,
            "src_blocks": [0],
            "dst_blocks": [0],
        },
    ),
}


@pytest.mark.parametrize("case", list(BOTH))
async def test_one_parameter_under_both_names_is_a_type_error(pair: Pair, case: str) -> None:
    _src, dst = _caches(pair, seed=520)
    tracker = Tracker()
    instrument(pair.decoder, 1, tracker)
    before = snapshot(dst)
    args, kw = BOTH[case](pair.key(), dst.cache)
    with pytest.raises(TypeError) as info:
        await pair.decoder.cache_manager.pull_blocks(*args, **kw)
    new, old = case.split("+")[0], case.split("+")[1]
    msg = str(info.value)
    assert old in msg and (new in msg or new == "positional"), msg
    assert tracker.events == []
    assert_bytes(dst, before)


async def test_unknown_or_missing_arguments_are_type_errors(pair: Pair) -> None:
    _src, dst = _caches(pair, seed=530)
    cm = pair.decoder.cache_manager
    with pytest.raises(TypeError, match="unexpected keyword argument 'src_block'"):
        await cm.pull_blocks(pair.key(), dst.cache, [0], [0], src_block=[0])
    with pytest.raises(TypeError, match="'dst_cache'"):
        await cm.pull_blocks(pair.key(), src_blocks=[0], dst_blocks=[0])
    with pytest.raises(TypeError, match="'src_cache_key'"):
        await cm.pull_blocks(dst_cache=dst.cache, src_blocks=[0], dst_blocks=[0])
    # A row key with only dst_blocks (src_blocks defaulted) is not a spelling problem.
    with pytest.raises(TypeError, match="src_cache_key"):
        await cm.pull_blocks(object(), dst.cache, dst_blocks=[0])


async def test_signatures_show_upstream_v2_names() -> None:
    sig = inspect.signature(CacheManager.pull_blocks)
    names = list(sig.parameters)
    assert names[:5] == ["self", "src_cache_key", "dst_cache", "src_blocks", "dst_blocks"]
    p = sig.parameters
    assert p["src_cache_key"].default is inspect.Parameter.empty
    assert p["dst_cache"].default is inspect.Parameter.empty
    assert p["src_blocks"].default == () and p["dst_blocks"].default == ()
    for kw in ("src_layer_range", "dst_layer_range", "tensor_num_per_layer", "timeout"):
        assert p[kw].kind is inspect.Parameter.KEYWORD_ONLY
    doc = CacheManager.pull_blocks.__doc__ or ""
    for v1 in ("prompt_cache_key", "decoder_kv_cache", "prompt_blocks", "decoder_blocks"):
        assert v1 in doc
    expected = {
        "pull_cache": [
            "cache_key",
            "cache",
            "batch_index",
            "size",
            "src_layer_range",
            "dst_layer_range",
            "tensor_num_per_layer",
            "timeout",
        ],
        "push_blocks": [
            "dst_cache_key",
            "src_cache",
            "src_blocks",
            "dst_blocks",
            "src_layer_range",
            "dst_layer_range",
            "tensor_num_per_layer",
            "timeout",
        ],
        "push_cache": [
            "dst_cache_key",
            "src_cache",
            "src_batch_index",
            "src_layer_range",
            "dst_layer_range",
            "size",
            "tensor_num_per_layer",
            "timeout",
        ],
        "copy_cache": [
            "dst",
            "src",
            "dst_batch_index",
            "src_batch_index",
            "offset",
            "size",
            "req_id",
            "timeout",
        ],
        "swap_blocks": ["src_cache", "dst_cache", "src_to_dst", "timeout"],
    }
    for name, params in expected.items():
        got = list(inspect.signature(getattr(CacheManager, name)).parameters)[1:]
        assert got == params, name


async def test_upstream_push_keywords(pair: Pair) -> None:
    # push_blocks with every parameter named as upstream (the decoder pushes to the prompt).
    src = pair.decoder_cache(seed=540, pattern=True, num_tensors=4, num_blocks=8, block_shape=BLOCK)
    dst = pair.prompt_cache(
        model_id=3, seed=1540, pattern=True, num_tensors=4, num_blocks=8, block_shape=BLOCK
    )
    want = reference_pull(snapshot(src), snapshot(dst), [1], [2], 2, 0, 2)
    await pair.decoder.cache_manager.push_blocks(
        dst_cache_key=pair.key(3),
        src_cache=src.cache,
        src_blocks=[1],
        dst_blocks=[2],
        src_layer_range=range(1, 2),
        dst_layer_range=range(0, 1),
        tensor_num_per_layer=2,
        timeout=5,
    )
    assert_bytes(dst, want)
