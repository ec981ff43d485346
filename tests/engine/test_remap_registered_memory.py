"""``remap_registered_memory``: upstream's checks, then an honest refusal.

Upstream re-maps device memory after a fault (and marks the call reserved). The host
data paths register host memory only, which has nothing to remap, so a call that
passes the checks is refused with ``LLM_PARAM_INVALID`` rather than reporting a remap
that did not happen.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiodatadist import (
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMParamError,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
)

pytestmark = pytest.mark.asyncio


async def test_checks_then_refuses() -> None:
    async with LLMDataDist(LLMRole.DECODER, 7301) as dd:
        cm = dd.cache_manager
        tensor = np.zeros((4, 4096), np.uint8)
        cache = cm.register_blocks_cache(
            CacheDesc(1, [4, 4096], DataType.DT_UINT8, Placement.DEVICE), [tensor]
        )
        addr = tensor.ctypes.data
        bad = [
            ("x", "must be a MemInfo or a list"),
            ([MemInfo(Memtype.MEM_TYPE_DEVICE, addr, 64), "x"], "mem_infos[1] must be a MemInfo"),
            (MemInfo(Memtype.MEM_TYPE_HOST, addr, 64), "MEM_TYPE_DEVICE"),
            (MemInfo(Memtype.MEM_TYPE_DEVICE, 0, 64), "must not be zero"),
            (MemInfo(Memtype.MEM_TYPE_DEVICE, addr, 0), "size must be > 0"),
        ]
        for arg, text in bad:
            with pytest.raises(LLMParamError, match=text.replace("[", r"\[")) as info:
                cm.remap_registered_memory(arg)  # type: ignore[arg-type]
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        # Inside registered (host) memory: nothing to remap, refused, and said why.
        for arg in (
            MemInfo(Memtype.MEM_TYPE_DEVICE, addr, 64),
            [MemInfo(Memtype.MEM_TYPE_DEVICE, addr, 64)],
        ):
            with pytest.raises(LLMParamError, match=f"host memory \\(cache {cache.cache_id}\\)"):
                cm.remap_registered_memory(arg)
        # Outside any registration.
        other = np.zeros(4096, np.uint8)
        with pytest.raises(LLMParamError, match="not registered memory"):
            cm.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_DEVICE, other.ctypes.data, 64))
        # The cache is untouched and still usable.
        cm.unregister_cache(cache.cache_id)
