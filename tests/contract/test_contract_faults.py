"""The contract, part 2: what goes wrong fails cleanly, on every data path (issue 12, item 5).

Unknown keys, bad block indices (refused before anything moves), a cache the peer frees
(the next pull fails, it never succeeds), and a cache re-registered under the same
``model_id`` (new bytes, never the old ones), each on ``inproc``, ``shm``, ``cma``,
``tcp``, ``nixl`` and ``mooncake``, on asyncio and uvloop.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, CacheKey, LLMException, LLMParamError, LLMStatusCode
from tests.contract.contract_side import PROMPT, Side
from tests.xproc import xproc_common as xc

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
FREED = 0xEE


async def test_faults(side: Side) -> None:
    cm = side.dd.cache_manager
    src = side.src()
    spec = xc.SPECS[src]
    assert spec.model_id is not None
    key = BlocksCacheKey(PROMPT, spec.model_id)
    dst = side.local["reg"]
    before = side.prefill(dst)

    # Unknown keys: nothing of that name on the prompt.
    with pytest.raises(LLMException) as ei:
        await cm.pull_blocks(BlocksCacheKey(PROMPT, 77), dst.cache, [0], [0], timeout=5)
    assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST, ei.value
    with pytest.raises(LLMException) as ei:
        await cm.pull_cache(CacheKey(PROMPT, req_id=999), side.local["rows_reg"].cache, 0)
    assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST, ei.value
    # Block indices beyond the prompt's cache, or beyond ours: refused before anything moves
    # (the valid block named first is not copied either).
    for sb, db in (([0, xc.NUM_BLOCKS], [0, 1]), ([1, 2], [3, xc.NUM_BLOCKS]), ([-1], [0])):
        with pytest.raises((LLMParamError, TypeError, ValueError)) as ei:
            await cm.pull_blocks(key, dst.cache, sb, db, timeout=5)
        if isinstance(ei.value, LLMException):
            assert ei.value.status_code == S.LLM_PARAM_INVALID, ei.value
    assert np.array_equal(dst.matrix(), before), "a refused pull moved bytes"
    # The link is fine after all of that.
    await side.pull("reg", src, [5, 1], [2, 6])

    # The prompt frees the cache (and reuses its memory): the next pull fails, moving nothing.
    await side.prompt.ok("free", name=src, fill=FREED)
    before = side.prefill(dst)
    with pytest.raises(LLMException) as ei:
        await cm.pull_blocks(key, dst.cache, [0, 3], [4, 7], timeout=5)
    assert ei.value.status_code == S.LLM_KV_CACHE_NOT_EXIST, ei.value
    assert np.array_equal(dst.matrix(), before), "a pull of a freed cache moved bytes"

    # Registered again under the same model_id: the new bytes.
    shm = side.path == "shm"
    fresh = xc.Spec("again", True, shm, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE), model_id=spec.model_id)
    seed = side.seed * 16 + 200
    await side.prompt.ok("register", name="again", model_id=spec.model_id, seed=seed, allocate=shm)
    await side.pull("reg", src, [0, 3, 6], [6, 3, 0], ref=xc.pattern(seed, fresh))
    # Freed and registered once more (a registered cache in the very same memory): only the
    # newest bytes, never the freed pattern nor the previous registration's.
    await side.prompt.ok(
        "cycle", name="again", model_id=spec.model_id, allocate=shm, seeds=[seed + 1], fill=FREED
    )
    await side.pull(
        "alloc",
        src,
        list(range(xc.NUM_BLOCKS)),
        list(range(xc.NUM_BLOCKS)),
        ref=xc.pattern(seed + 1, fresh),
    )
