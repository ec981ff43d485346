"""Upstream's error text: ``"[{api}] failed, error code is LLMStatusCode.{NAME}, {info}."``
(``handle_llm_status(ret, "[pull_blocks]", info)``), from the builder and from real calls."""

from __future__ import annotations

import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMCacheNotFoundError,
    LLMLinkError,
    LLMParamError,
    LLMStatusCode,
)
from aiodatadist.errors import failure, format_error, raise_for_status
from aiodatadist.testing import Pair

S = LLMStatusCode


def test_the_api_name_is_in_brackets() -> None:
    assert (
        format_error("push_blocks", S.LLM_PARAM_INVALID, "dst_blocks can not be empty")
        == "[push_blocks] failed, error code is LLMStatusCode.LLM_PARAM_INVALID, "
        "dst_blocks can not be empty."
    )
    assert format_error("swap_blocks", S.LLM_FAILED) == (
        "[swap_blocks] failed, error code is LLMStatusCode.LLM_FAILED."
    )


def test_an_api_already_in_brackets_is_not_bracketed_twice() -> None:
    assert format_error("[pull_blocks]", S.LLM_TIMEOUT, "x") == (
        "[pull_blocks] failed, error code is LLMStatusCode.LLM_TIMEOUT, x."
    )
    with pytest.raises(LLMCacheNotFoundError) as info:
        raise_for_status(S.LLM_KV_CACHE_NOT_EXIST, "[pull_cache]", "key")
    assert str(info.value) == (
        "[pull_cache] failed, error code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, key."
    )
    assert str(failure(S.LLM_LINK_BUSY, "busy", api="[unregister_cache]")) == (
        "[unregister_cache] failed, error code is LLMStatusCode.LLM_LINK_BUSY, busy."
    )


@pytest.mark.asyncio
async def test_real_calls_carry_their_api_name(pair: Pair) -> None:
    src = pair.decoder_cache(seed=1, num_tensors=2, num_blocks=4, block_shape=(16, 2, 64))
    cm = pair.decoder.cache_manager
    with pytest.raises(LLMLinkError) as link_err:
        await cm.push_blocks(BlocksCacheKey(77, 0), src.cache, [0], [0])
    assert str(link_err.value) == (
        "[push_blocks] failed, error code is LLMStatusCode.LLM_NOT_YET_LINK, no link to cluster 77."
    )
    with pytest.raises(LLMCacheNotFoundError) as missing:
        await cm.pull_blocks(BlocksCacheKey(1, 42), src.cache, [0], [0])
    assert str(missing.value).startswith(
        "[pull_blocks] failed, error code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "
    )
    with pytest.raises(LLMParamError) as own:
        await cm.push_blocks(BlocksCacheKey(2, 0), src.cache, [0], [0])
    assert str(own.value) == (
        "[push_blocks] failed, error code is LLMStatusCode.LLM_PARAM_INVALID, "
        "cannot push to this instance's own cluster_id 2."
    )


@pytest.mark.asyncio
async def test_argument_errors_of_a_call_carry_it_too(pair: Pair) -> None:
    # Upstream checks these natively, so its clients see "[pull_blocks] failed, ..." and
    # match on it; a value type's own check (outside any call) keeps the plain message.
    src = pair.decoder_cache(seed=2, num_tensors=2, num_blocks=4, block_shape=(16, 2, 64))
    cm = pair.decoder.cache_manager
    prefix = "[pull_blocks] failed, error code is LLMStatusCode.LLM_PARAM_INVALID, "
    for src_blocks, dst_blocks in (([0, 1], [0]), ([0], [9])):
        with pytest.raises(LLMParamError) as info:
            await cm.pull_blocks(BlocksCacheKey(1, 0), src.cache, src_blocks, dst_blocks)
        assert str(info.value).startswith(prefix), str(info.value)
    with pytest.raises(LLMParamError) as plain:
        CacheDesc(1, [4, 16], DataType.DT_FLOAT16, batch_dim_index=5)
    assert "failed, error code is" not in str(plain.value)
