"""shm pulls take no page faults in the decoder once its mapping of the prompt's cache is warm.

The decoder maps the prompt's segment at its first pull and fills that mapping's page
tables on a thread of its own (ext/shm.cpp). After that, a second identical pull, and a
pull of blocks never pulled before, take (almost) no minor page faults in the decoder:
faults are counts of the whole process, so this asserts them generously: under a quarter
of what faulting the mapping in lazily takes (one fault per 16 pages, 64 KiB at a time);
the rest of the process (the loop's other tasks, Python's allocations) faults now and
then, more on a loaded machine (85 in one pull of 8,192 pages beside two CPU burners).
Bytes are checked too.
"""

from __future__ import annotations

import asyncio
import resource
import time

import pytest

from aiodatadist.testing import PromptSpec, remote_pair

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]  # a peer process

PAGE = 4096


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


async def settle(timeout: float = 20.0) -> None:
    """Waits until this process takes no more faults (the mapping's filling has ended)."""
    end = time.monotonic() + timeout
    last = minor_faults()
    while time.monotonic() < end:
        await asyncio.sleep(0.2)
        now = minor_faults()
        if now == last:
            return
        last = now
    raise AssertionError("this process kept taking page faults")


async def test_warm_shm_mapping_takes_no_page_faults() -> None:
    # 8 tensors x 64 blocks of 128 KiB: a 64 MiB cache; pulls of 32 blocks (32 MiB).
    spec = PromptSpec(num_tensors=8, num_blocks=64, block_shape=(128, 8, 64), seed=9)
    first = list(range(0, 64, 2))
    other = list(range(1, 64, 2))  # never pulled before the faults are counted
    async with remote_pair(spec, data_path="shm") as pair:
        cm = pair.decoder.cache_manager
        dst = pair.decoder_cache(num_blocks=32)
        to = list(range(32))
        await cm.pull_blocks(pair.key(), dst.cache, first, to, timeout=60)  # maps it
        assert not pair.mismatches(dst, first, to)
        await settle()
        pages = len(to) * spec.num_tensors * spec.block_bytes // PAGE
        for blocks in (first, other):
            before = minor_faults()
            await cm.pull_blocks(pair.key(), dst.cache, blocks, to, timeout=60)
            faults = minor_faults() - before
            assert not pair.mismatches(dst, blocks, to)
            assert faults < pages // 64, f"{faults} minor faults pulling {pages} pages"
