"""Options in the constructor (``async with LLMDataDist(role, id, options)``), and a
second ``init``: the same options (or none) do nothing, other options are refused."""

from __future__ import annotations

import pytest

from aiodatadist import LLMDataDist, LLMParamError, LLMRole, LLMStatusCode

pytestmark = pytest.mark.asyncio

S = LLMStatusCode


async def test_async_with_uses_the_constructor_options() -> None:
    opts = {"llm.SyncKvCacheWaitTime": "250", "llm.listenIpInfo": "127.0.0.1:0"}
    async with LLMDataDist(LLMRole.PROMPT, 6201, opts) as dd:
        assert dd.is_initialized
        assert dd.options.sync_kv_timeout_ms == 250
        assert dd.listen_address is not None and dd.listen_address[0] == "127.0.0.1"
        await dd.init()  # again, no options: nothing happens
        await dd.init(dict(opts))  # the same options: nothing happens
        assert dd.options.sync_kv_timeout_ms == 250
    assert not dd.is_initialized


async def test_the_constructor_only_checks_the_type() -> None:
    with pytest.raises(TypeError, match="options"):
        LLMDataDist(LLMRole.PROMPT, 6202, [("llm.SyncKvCacheWaitTime", "1")])  # type: ignore[arg-type]
    dd = LLMDataDist(LLMRole.PROMPT, 6202, {"llm.SyncKvCacheWaitTime": "zero"})  # checked at init
    with pytest.raises(LLMParamError, match="SyncKvCacheWaitTime"):
        await dd.init()
    assert not dd.is_initialized


async def test_options_given_both_ways_must_agree() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 6203, {"llm.SyncKvCacheWaitTime": "250"})
    with pytest.raises(
        LLMParamError, match=r"constructor.s: key .llm\.SyncKvCacheWaitTime"
    ) as info:
        await dd.init({"llm.SyncKvCacheWaitTime": "300"})
    assert info.value.status_code == S.LLM_PARAM_INVALID
    assert not dd.is_initialized
    await dd.init({"llm.SyncKvCacheWaitTime": "250"})  # the same: fine
    assert dd.options.sync_kv_timeout_ms == 250
    await dd.finalize()


async def test_second_init_with_other_options_is_refused() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 6204)
    await dd.init({"llm.SyncKvCacheWaitTime": "250"})
    try:
        cm = dd.cache_manager
        for other in (
            {"llm.SyncKvCacheWaitTime": "300"},
            {},
            {"llm.SyncKvCacheWaitTime": "250", "aiodatadist.MoverThreads": "2"},
        ):
            with pytest.raises(LLMParamError, match="already initialized with other options") as e:
                await dd.init(other)
            assert "key" in str(e.value)
        await dd.init({"llm.SyncKvCacheWaitTime": "250"})
        await dd.init()
        assert dd.cache_manager is cm and dd.options.sync_kv_timeout_ms == 250
    finally:
        await dd.finalize()
    # After finalize, new options are fine.
    await dd.init({"llm.SyncKvCacheWaitTime": "300"})
    assert dd.options.sync_kv_timeout_ms == 300
    await dd.finalize()
