"""The contract, part 3: deadlines, cancels and a killed peer, on every data path
(issue 12, item 5).

A whole-cache pull of ``BIG_MIB`` (the prompt's big cache, in shared memory for shm) is
interrupted by a deadline it cannot meet, by ``task.cancel()``, by an anyio cancel
scope, and by SIGKILL of the prompt process; each time the call ends within a generous
bound, nothing of the decoder stays busy, and the next pull is exact (after a kill: from
a new prompt the decoder links to). Each runs on ``inproc``, ``shm``, ``cma``, ``tcp``,
``nixl`` and ``mooncake``, on asyncio and uvloop (the kill not on ``inproc``: there is
no peer process).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, LLMException, LLMStatusCode, LLMTimeoutError
from tests.contract.contract_side import BOUND_S, PROMPT, Side
from tests.engine._util import CANCEL_ATTEMPTS, cancel_in_flight
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import PeerProc, stop_when_bytes_land, until

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]  # 256 MiB caches on both ends

ONE_SIDED = ("shm", "cma", "nixl")
"""Paths where the decoder reads the peer's memory without the peer's process taking part
(a mapping, ``process_vm_readv``, a NIXL READ): a pull may still complete, exactly, when
the kill lands as its last bytes are read. Everywhere else the pull must fail."""


def _only_fill_or_zero(big: xc.Local) -> None:
    """What an interrupted pull left: whole bytes of the source (0x5A) or untouched zeros."""
    for v in big.views:
        assert np.isin(v[::4093], (0, xc.BIG_FILL)).all()


async def test_deadline_then_cancels(side: Side) -> None:
    """A deadline that cannot be met, then cancels (``task.cancel()``, an anyio scope), on one
    link: each ends the big pull within the bound and the next pull is exact."""
    big, model = await side.big()
    await _deadline(side, big, model)
    await _cancels(side, big, model)


async def _deadline(side: Side, big: xc.Local, model: int) -> None:
    n = big.spec.shape[0]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(LLMTimeoutError) as ei:
        await side.dd.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT, model), big.cache, list(range(n)), list(range(n)), timeout=0.01
        )
    elapsed = loop.time() - started
    err = ei.value
    assert isinstance(err, TimeoutError) and isinstance(err, LLMException)
    assert err.status_code == LLMStatusCode.LLM_TIMEOUT, err
    assert elapsed < BOUND_S, f"the 10 ms deadline was honoured after {elapsed:.3f} s"
    await side.wait_idle()
    _only_fill_or_zero(big)
    await side.pull("reg", side.src(), [4, 1, 7], [0, 6, 3])


async def _cancels(side: Side, big: xc.Local, model: int) -> None:
    n = big.spec.shape[0]
    everything = list(range(n))
    cm = side.dd.cache_manager
    executor = side.dd._rt.executor
    assert executor is not None

    def big_pull() -> Awaitable[None]:
        return cm.pull_blocks(
            BlocksCacheKey(PROMPT, model), big.cache, everything, everything, timeout=30
        )

    # task.cancel(), then an anyio cancel scope whose deadline comes while the pull runs;
    # a pull that ends before its cancel could land cancels nothing, and is tried again.
    for kind in ("task.cancel", "move_on_after"):
        for _ in range(CANCEL_ATTEMPTS):
            seen = await cancel_in_flight(executor, kind, big_pull)
            if seen.caught:
                assert seen.fired is not None
                assert seen.done - seen.fired < BOUND_S, (kind, seen.done - seen.fired)
                break
        else:
            pytest.fail(f"{kind}: the big pull ended before its cancel, {CANCEL_ATTEMPTS} times")
        await side.wait_idle()
        _only_fill_or_zero(big)
        if kind == "task.cancel":
            await side.pull("reg", side.src(), [2, 7], [7, 2])
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    await side.wait_idle()
    await side.pull("alloc", side.src(), [0, 5, 3], [3, 0, 5])

    # And the big pull, left alone, lands whole.
    for v in big.views:
        v.fill(0)
    await big_pull()
    for v in big.views:
        assert np.all(v == xc.BIG_FILL)
    side.check_path()


async def test_prompt_killed_mid_pull(side: Side) -> None:
    if side.path == "inproc":
        pytest.skip("inproc: the prompt is this process; there is no peer process to kill -9")
    prompt = side.prompt
    assert isinstance(prompt, PeerProc)
    big, model = await side.big()
    n = big.spec.shape[0]
    loop = asyncio.get_running_loop()
    deadline = 10.0
    stamps: dict[str, float] = {}
    # Frozen (SIGSTOP) the moment the first pulled byte lands, so the kill comes mid-way on
    # every path where the prompt takes part in moving the bytes.
    watcher = threading.Thread(
        target=stop_when_bytes_land, args=(big.views[0], prompt.pid, stamps), daemon=True
    )
    watcher.start()
    started = loop.time()
    pull = asyncio.ensure_future(
        side.dd.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT, model),
            big.cache,
            list(range(n)),
            list(range(n)),
            timeout=deadline,
        )
    )
    await asyncio.to_thread(watcher.join, 6)
    prompt.kill(signal.SIGKILL)
    try:
        await asyncio.wait_for(pull, deadline + BOUND_S)
    except LLMException as e:
        error: LLMException | None = e
    else:
        error = None
    ended = loop.time() - started
    assert ended < deadline + BOUND_S, f"the pull ended {ended:.2f} s after it began"
    if error is None:
        # Only a one-sided copy can end well: then every byte is the prompt's.
        assert side.path in ONE_SIDED, "the pull succeeded although its peer was killed"
        for v in big.views:
            assert np.all(v == xc.BIG_FILL)
    else:
        _only_fill_or_zero(big)
    await prompt.wait_dead()
    await until(lambda: side.dd.links == [], 5, "the dead link to be dropped")
    with pytest.raises(LLMException) as ei:
        await side.dd.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT, xc.MODEL_ALLOC), side.local["reg"].cache, [0], [0], timeout=3
        )
    assert ei.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK, ei.value

    # A new prompt under the same cluster id: link, pull exact bytes of its own seed.
    side.prompt = await side.start_prompt(side.seed + 1)
    await side.link_prompt()
    await side.pull("reg", side.src(), [6, 0, 3], [1, 4, 2])
    await side.pull("alloc", side.src(), [7], [7], src_layers=(1, 2), dst_layers=(0, 1))
