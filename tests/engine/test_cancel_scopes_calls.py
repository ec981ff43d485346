"""Cancel scopes absorb their own cancellation on the other transferring calls too.

``test_cancel_scopes.py`` cancels ``pull_blocks``; here the calls with their own way
through the library: ``push_blocks`` (the runner's push, the peer's cache written),
``pull_blocks_layerwise`` (an iteration whose ``__anext__`` waits for layers and drains
its own transfer) and ``copy_blocks`` (a local copy: no link, no slot). Each is cancelled
in flight by ``asyncio.timeout``, ``task.cancel()``, ``anyio.move_on_after``,
``anyio.fail_after`` and an anyio task-group cancel (FastAPI and Starlette run on
anyio), on the suite's loops and under ``anyio.run``: the scope must absorb its own
cancel, the call end within a generous bound with its native job returned and the link's
slot free, and the link must move exact bytes after.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

from tests.engine._util import CANCEL_ATTEMPTS, SCOPE_KINDS, cancel_in_flight
from tests.engine.test_cancel_scopes import ALL, BLOCKS, END_BOUND_S, Rig, rig

PATHS = ["inproc", "shm", "tcp"]
CALLS = ["push_blocks", "pull_blocks_layerwise", "copy_blocks"]
HALF = BLOCKS // 2


def _call(r: Rig, name: str) -> Callable[[], Awaitable[object]]:
    cm = r.pair.decoder.cache_manager
    if name == "push_blocks":  # the decoder's cache into the prompt's (256 MiB)
        return lambda: cm.push_blocks(r.key, r.dst.cache, ALL, ALL, timeout=60)
    if name == "pull_blocks_layerwise":

        async def layers() -> None:
            stream = cm.pull_blocks_layerwise(
                r.key, r.dst.cache, ALL, ALL, tensor_num_per_layer=1, timeout=60
            )
            async for _ in stream:
                pass

        return layers
    if name == "copy_blocks":  # half the decoder's cache onto the other half (128 MiB)
        return lambda: cm.copy_blocks(r.dst.cache, {b: [b + HALF] for b in range(HALF)})
    raise AssertionError(name)


async def _all(path: str) -> None:
    async with rig(path) as r:
        for name in CALLS:
            call = _call(r, name)
            for kind in SCOPE_KINDS:
                for _ in range(CANCEL_ATTEMPTS):
                    seen = await cancel_in_flight(r.executor, kind, call)
                    if seen.caught:
                        assert seen.fired is not None
                        took = seen.done - seen.fired
                        assert took < END_BOUND_S, f"{name}, {kind}: {took:.2f} s"
                        r.quiet()
                    await r.verify_link()
                    if seen.caught:
                        break
                else:
                    pytest.fail(f"{name}, {kind}: ended before its cancel {CANCEL_ATTEMPTS} times")


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.slow  # big transfers, every scope on every call
async def test_every_cancel_scope_absorbs_its_cancel_on_every_call(path: str) -> None:
    await _all(path)


@pytest.mark.parametrize("path", ["inproc", "tcp"])
@pytest.mark.slow
def test_under_anyio_run(path: str) -> None:
    anyio.run(_all, path, backend="asyncio")
