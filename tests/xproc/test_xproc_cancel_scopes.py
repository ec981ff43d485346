"""Cancel scopes around a pull from a prompt in another process (issue 9, finding 6).

The cross-process variant of tests/engine/test_cancel_scopes.py: the prompt is a
subprocess (``aiodatadist.testing.remote_pair``), the decoder here is forced to shm, cma
or tcp. A big pull in flight is cancelled by ``asyncio.timeout``, ``task.cancel()``,
``anyio.move_on_after``, ``anyio.fail_after`` and an anyio task-group cancel: each scope
absorbs its own cancel, the call ends within a generous bound with its native job
returned and the slot free, and a follow-up pull verifies the prompt's pattern (a seed
of this test's own).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable
from typing import Any

import anyio
import pytest

from aiodatadist.testing import PromptSpec, RemotePair, remote_pair
from tests.engine._util import CANCEL_ATTEMPTS, SCOPE_KINDS, cancel_in_flight

pytestmark = pytest.mark.slow  # peer processes on every data path: the full run's

PATHS = ["shm", "cma", "tcp"]
END_BOUND_S = 2.0  # generous: the cancel was honoured, not a speed claim
_seeds = itertools.count(0x5C0_0001)


async def _cancelled_by(pair: RemotePair, dst: Any, kind: str) -> bool:
    """One big pull cancelled by ``kind`` while in flight; False (the link verified) when
    it ended before the cancel could land, so nothing was cancelled."""
    dec = pair.decoder
    nb = pair.spec.num_blocks
    executor = dec._rt.executor
    assert executor is not None
    link = dec._rt.links.find(pair.prompt_id)
    assert link is not None
    everything = list(range(nb))

    def big_pull() -> Awaitable[None]:
        return dec.cache_manager.pull_blocks(
            pair.key(), dst.cache, everything, everything, timeout=60
        )

    seen = await cancel_in_flight(executor, kind, big_pull)
    if seen.caught:
        assert seen.fired is not None
        assert seen.done - seen.fired < END_BOUND_S, (kind, seen.done - seen.fired)
        assert executor.in_flight == 0 and not link.slot.busy, kind
    s, d = [1, nb - 1, nb // 2], [nb - 2, 0, 3]
    await dec.cache_manager.pull_blocks(pair.key(), dst.cache, s, d, timeout=30)
    assert pair.mismatches(dst, s, d) == []
    return seen.caught


async def _cancel_every_way(pair: RemotePair) -> None:
    dst = pair.decoder_cache()
    nb = pair.spec.num_blocks
    s, d = [1, nb - 1, nb // 2], [nb - 2, 0, 3]
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, s, d, timeout=30)
    assert pair.mismatches(dst, s, d) == []  # warm: the link works before any cancel
    for kind in SCOPE_KINDS:
        for _ in range(CANCEL_ATTEMPTS):
            if await _cancelled_by(pair, dst, kind):
                break
        else:
            pytest.fail(f"{kind}: the big pull ended before its cancel, {CANCEL_ATTEMPTS} times")


def _spec(path: str) -> PromptSpec:
    # 2 x 64 x 4 MiB on one mover thread: a whole-cache pull (512 MiB, tens of ms even with
    # prefaulted memory and streaming stores) is still in flight when the cancel lands.
    return PromptSpec(
        num_tensors=2,
        num_blocks=64,
        block_shape=(4 << 20,),
        dtype="uint8",
        seed=next(_seeds),
        allocate=(path == "shm"),
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_cancel_scopes_across_processes(path: str) -> None:
    async with remote_pair(
        _spec(path), data_path=path, options={"aiodatadist.MoverThreads": "1"}
    ) as pair:
        await _cancel_every_way(pair)


@pytest.mark.parametrize("path", PATHS)
def test_cancel_scopes_across_processes_under_anyio_uvloop(path: str) -> None:
    async def main() -> None:
        async with remote_pair(
            _spec(path), data_path=path, options={"aiodatadist.MoverThreads": "1"}
        ) as pair:
            await _cancel_every_way(pair)

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
