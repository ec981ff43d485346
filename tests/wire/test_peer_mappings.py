"""A peer that goes away takes its mappings in this process with it.

The decoder maps the prompt's segments and lease page (memfds sent over the fd
channel). When the prompt's connection closes (it finalized, crashed or was killed),
the link leaves the registry and nobody will ever unlink it: the mappings and fds must
go then, or the peer's memory (GiB of KV cache) stays alive in this process for good,
even past its finalize.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMRole,
    Placement,
)
from aiodatadist.testing import cluster_info

pytestmark = pytest.mark.asyncio


def _memfds(label: str) -> list[str]:
    """Mappings and fds of this process whose memfd name starts with ``label``."""
    found = []
    with open("/proc/self/maps") as f:
        found += [line for line in f if f"memfd:{label}" in line]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if f"memfd:{label}" in target:
            found.append(f"fd {fd} -> {target}")
    return found


@pytest.mark.parametrize("path", ["shm", "cma"])
async def test_a_closed_peer_leaves_no_mapping_behind(path: str) -> None:
    prompt = LLMDataDist(LLMRole.PROMPT, 31)
    decoder = LLMDataDist(LLMRole.DECODER, 32)
    await prompt.init({"llm.listenIpInfo": "127.0.0.1:0", "aiodatadist.DataPath": path})
    await decoder.init({"aiodatadist.DataPath": path})
    prompt_up = True
    try:
        desc = CacheDesc(1, [4, 1 << 16], DataType.DT_INT8, Placement.HOST)
        key = BlocksCacheKey(31, 0)
        if path == "shm":
            src = prompt.cache_manager.allocate_blocks_cache(desc, key)
        else:
            keep = [np.zeros((4, 1 << 16), np.int8)]
            src = prompt.cache_manager.register_blocks_cache(desc, keep, key)
        src.tensors()[0].view(np.uint8)[...] = 0x3C
        host, port = prompt.listen_address or ("", 0)
        status, _ = await decoder.link_clusters([cluster_info(31, host, port)])
        assert status == 0
        arrays = [np.zeros((4, 1 << 16), np.int8)]
        dst = decoder.cache_manager.register_blocks_cache(desc, arrays)
        await decoder.cache_manager.pull_blocks(key, dst, [0], [0], timeout=5)
        assert (arrays[0][0].view(np.uint8) == 0x3C).all()
        label = f"/aiodd-{os.getpid()}-31-"  # the prompt's segments and lease pages
        assert _memfds(label), "the decoder should map the prompt's memfds while linked"

        del src
        await prompt.finalize()
        prompt_up = False
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while decoder._rt.links.find(31) is not None:
            assert loop.time() < end, "the decoder did not notice the closed link"
            await asyncio.sleep(0.01)
        left = _memfds(label)
        assert not left, f"the gone peer's memfds are still held: {left}"
    finally:
        await decoder.finalize()
        if prompt_up:
            await prompt.finalize()
