"""Soak with verified bytes over every data path, with re-registrations in between.

Every pull writes a pattern unique to it (the source blocks are re-filled from a
per-transfer seed first), so a stale, misdirected or old-memory delivery cannot pass;
every byte of the destination is checked after every pull: the named blocks hold the
transfer's pattern, every other byte is what it was before. Every few pulls the prompt
frees its cache and registers new memory under the same key, reusing the old memory
(poisoned): the next pull must bring the new bytes or fail, never the old ones
(issue 9, finding 2).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import numpy as np
import pytest

from aiodatadist import LLMException, LLMStatusCode
from tests.adversity._common import (
    NUM_BLOCKS,
    ActorProc,
    Figures,
    check_pull,
    random_blocks,
    snapshot,
    start_prompt,
)
from tests.adversity._rig import Rig, path_in_use, rig

pytestmark = pytest.mark.slow  # actor processes under load for seconds: the full run's

PATHS = ["inproc", "shm", "cma", "tcp"]


@pytest.fixture(scope="module")
def prompt() -> Iterator[ActorProc]:
    a = start_prompt()
    yield a
    a.stop()


async def reregister(r: Rig, fig: Figures, seed: int, poison: int) -> bool:
    rr = await r.reregister(seed=seed, poison=poison)
    fig.other["reregistrations"] = r.reregistrations
    if rr.get("ok"):
        return True
    # LLM_LINK_BUSY within its deadline is allowed: the registration is unchanged.
    status = rr.get("status")
    what = LLMStatusCode(status).name if status in set(LLMStatusCode) else rr.get("error", "?")
    fig.errors["reregister:" + str(what)[:60]] += 1
    return False


@pytest.mark.adversity(ci=0.6, weight=3.0)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.asyncio
async def test_soak_verified_bytes(path: str, prompt: ActorProc, budget: float) -> None:
    fig = Figures(f"soak[{path}]")
    rng = np.random.default_rng(random.randrange(1 << 32))
    base = int(rng.integers(1 << 40))
    n = 0
    async with rig(path, prompt) as r:
        fig.other["path_in_use"] = path_in_use(r.decoder, r.prompt_id, r.model_id)
        if path != "inproc":
            assert fig.other["path_in_use"] in (path, "?"), fig.other
        cm = r.decoder.cache_manager
        end = time.monotonic() + budget
        while time.monotonic() < end:
            n += 1
            seed = base + n
            src, dst = random_blocks(rng, NUM_BLOCKS, NUM_BLOCKS, 12)
            layers = None
            tensors = None
            if rng.random() < 0.3:
                a = int(rng.integers(0, 4))
                b = int(rng.integers(a + 1, 5))
                layers = range(a, b)
                tensors = list(range(2 * a, 2 * b))
            before = snapshot(r.dst.tensors)
            pull = cm.pull_blocks(
                r.key,
                r.dst.cache,
                src,
                dst,
                src_layer_range=layers,
                dst_layer_range=layers,
                tensor_num_per_layer=2,
                timeout=10.0,
            )
            seeds = [seed]
            try:
                if n % 23 == 0:
                    # Re-registration, then a pull at once: the new memory (this
                    # transfer's pattern in every block) or an error, never the old one.
                    if not await reregister(r, fig, seed, base + (1 << 41) + n):
                        await r.fill(seed, src)
                    await pull
                elif n % 37 == 0:
                    # Re-registration while the pull is in flight: the bytes of before
                    # (read under the old lease) or of after, never the reused memory.
                    old_seed = base + (1 << 42) + n
                    seeds = [old_seed, seed]
                    await r.fill(old_seed, src)
                    task = asyncio.ensure_future(pull)
                    await asyncio.sleep(float(rng.uniform(0, 0.002)))
                    await reregister(r, fig, seed, base + (1 << 41) + n)
                    await task
                else:
                    await r.fill(seed, src)
                    await pull
            except LLMException as e:
                # Allowed right after a re-registration (the table may lag, the old lease
                # is revoked); never success with the wrong bytes.
                fig.error(e)
                bad, canary = check_pull(r.dst.tensors, before, src, dst, None, tensors)
                if canary:
                    fig.bad(f"failed pull {n} touched {canary} canary bytes", canary)
                continue
            results = [check_pull(r.dst.tensors, before, src, dst, s, tensors) for s in seeds]
            bad, canary = min(results)
            fig.pulls += 1
            fig.bytes += len(src) * r.block_bytes * (len(tensors) if tensors else 8)
            if bad or canary:
                fig.bad(
                    f"pull {n} ({path}, {len(src)} blocks, after {r.reregistrations} "
                    f"re-registrations): {bad} named + {canary} canary bytes wrong",
                    bad + canary,
                )
        # The link is still good: one last verified pull of every block.
        seed = base + n + 1
        src = list(range(NUM_BLOCKS))
        await r.fill(seed, src)
        before = snapshot(r.dst.tensors)
        await cm.pull_blocks(r.key, r.dst.cache, src, src, timeout=10.0)
        bad, canary = check_pull(r.dst.tensors, before, src, src, seed)
        fig.pulls += 1
        if bad:
            fig.bad(f"final pull: {bad} bytes wrong", bad)
    fig.other["attempts"] = n
    fig.check()
    assert fig.pulls > n // 2, f"most pulls failed: {fig.errors}"
