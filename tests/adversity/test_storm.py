"""Cancel/timeout storm with canary blocks, over every data path.

Each attempt re-fills the source blocks it names with a pattern unique to it, then
pulls under one of: the ``timeout=`` argument, ``asyncio.timeout``, ``task.cancel()``
at a random moment, ``anyio.move_on_after``, ``anyio.fail_after``, an anyio task-group
cancel, or nothing. After a failed pull every destination byte it did not name
(the canaries) must be untouched; after a successful one every byte is exact; a
cancel scope never lets a bare ``CancelledError`` out (issue 9, finding 6); every
attempt ends within its deadline plus a generous slack. On ``tcp`` a second decoder
*process*, paused and resumed at random (SIGSTOP/SIGCONT), keeps the prompt's serving
side busy: a cancelled pull must not be delivered into the next one (finding 1).
The link stays usable: a final verified pull.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

from aiodatadist import LLMException
from tests.adversity._common import (
    BUSY_MODEL,
    BUSY_SEED,
    BUSY_SHAPE,
    NUM_BLOCKS,
    ActorProc,
    Figures,
    check_pull,
    new_cluster_id,
    random_blocks,
    snapshot,
    start_prompt,
)
from tests.adversity._rig import Rig, rig

pytestmark = pytest.mark.slow  # actor processes under load for seconds: the full run's

PATHS = ["inproc", "shm", "cma", "tcp"]
MODES = ["param", "asyncio_timeout", "task_cancel", "move_on", "fail_after", "tg_cancel", "plain"]
SLACK = 3.0  # seconds past its deadline an interrupted pull may take (a loaded 2-core box)


@pytest.fixture(scope="module")
def prompt() -> Iterator[ActorProc]:
    a = start_prompt()
    yield a
    a.stop()


class Escaped(Exception):
    """A CancelledError came out of a cancel scope that should have caught it."""


async def attempt(r: Rig, mode: str, x: float, src: list[int], dst: list[int]) -> bool:
    """One pull under ``mode``; True when it completed. Raises what the pull raised."""
    cm = r.decoder.cache_manager

    def pull(timeout: float = 10.0) -> Any:
        return cm.pull_blocks(r.key, r.dst.cache, src, dst, timeout=timeout)

    if mode == "param":
        await pull(timeout=x)
        return True
    if mode == "plain":
        await pull()
        return True
    if mode == "asyncio_timeout":
        async with asyncio.timeout(x):
            await pull()
        return True
    if mode == "task_cancel":
        task = asyncio.ensure_future(pull())
        await asyncio.sleep(x)
        task.cancel()
        await task  # CancelledError when the cancel came in time
        return True
    me = asyncio.current_task()
    assert me is not None
    try:
        if mode == "move_on":
            with anyio.move_on_after(x) as scope:
                await pull()
            return not scope.cancelled_caught
        if mode == "fail_after":
            with anyio.fail_after(x):
                await pull()
            return True
        if mode == "tg_cancel":
            done = False

            async def body() -> None:
                nonlocal done
                await pull()
                done = True

            async with anyio.create_task_group() as tg:
                tg.start_soon(body)
                await anyio.sleep(x)
                tg.cancel_scope.cancel()
            return done
    except asyncio.CancelledError as e:
        # Nobody cancels this task from outside: the scope should have caught it.
        while me.cancelling():
            me.uncancel()
        raise Escaped(f"{mode}: a CancelledError escaped the cancel scope") from e
    raise AssertionError(mode)


@pytest.mark.adversity(ci=0.8, weight=3.0)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.asyncio
async def test_cancel_timeout_storm(path: str, prompt: ActorProc, budget: float) -> None:
    fig = Figures(f"storm[{path}]")
    rng = np.random.default_rng(random.randrange(1 << 32))
    base = int(rng.integers(1 << 40))
    # tcp: two decoder processes keep the prompt's serving threads busy; they are paused
    # and resumed at random (a paused one stops reading mid-pull).
    busy: list[ActorProc] = []
    stopped = False
    n = 0
    try:
        if path == "tcp":
            host, port = prompt.address
            for _ in range(2):
                b = ActorProc.start(
                    cluster_id=new_cluster_id(), role="decoder", listen=False, data_path="tcp"
                )
                busy.append(b)
                await b.ok(
                    "cache",
                    name="dst",
                    num_tensors=8,
                    num_blocks=NUM_BLOCKS,
                    block_shape=BUSY_SHAPE,
                    allocate=False,
                )
                r0 = await b.ok("link", cluster_id=prompt.cluster_id, host=host, port=port)
                assert r0["status"] == 0, r0
                await b.ok(
                    "pull_loop",
                    cluster_id=prompt.cluster_id,
                    model_id=BUSY_MODEL,
                    dst="dst",
                    blocks=list(range(NUM_BLOCKS)),
                    timeout=2.0,
                    seed=BUSY_SEED,
                )
        async with rig(path, prompt) as r:
            end = time.monotonic() + budget
            while time.monotonic() < end:
                n += 1
                seed = base + n
                if busy and rng.random() < 0.2:
                    for b in busy:
                        os.kill(b.pid, signal.SIGCONT if stopped else signal.SIGSTOP)
                    stopped = not stopped
                src, dst = random_blocks(rng, NUM_BLOCKS, NUM_BLOCKS, 16)
                await r.fill(seed, src)
                mode = MODES[int(rng.integers(len(MODES)))]
                x = float(rng.uniform(0.0001, 0.006))
                before = snapshot(r.dst.tensors)
                t0 = time.monotonic()
                completed = False
                try:
                    completed = await attempt(r, mode, x, src, dst)
                except Escaped as e:
                    fig.faults += 1
                    fig.late(str(e))
                except (LLMException, TimeoutError, asyncio.CancelledError) as e:
                    fig.faults += 1
                    fig.error(e)
                took = time.monotonic() - t0
                limit = (10.0 if mode == "plain" else x) + SLACK
                if took > limit:
                    fig.late(f"attempt {n} ({mode}, {x * 1000:.1f} ms) took {took:.2f} s")
                bad, canary = check_pull(
                    r.dst.tensors, before, src, dst, seed if completed else None
                )
                if completed:
                    fig.pulls += 1
                    fig.bytes += len(src) * r.block_bytes * 8
                if bad or canary:
                    fig.bad(
                        f"attempt {n} ({path}, {mode}, {'ok' if completed else 'failed'}): "
                        f"{bad} named + {canary} canary bytes wrong",
                        bad + canary,
                    )
            if stopped:
                for b in busy:
                    os.kill(b.pid, signal.SIGCONT)
                stopped = False
            # The link is usable: a final verified pull (a few tries while the busy decoder
            # still holds the serving side it was paused on).
            seed = base + n + 1
            src = list(range(NUM_BLOCKS))
            await r.fill(seed, src)
            before = snapshot(r.dst.tensors)
            await r.decoder.cache_manager.pull_blocks(r.key, r.dst.cache, src, src, timeout=10.0)
            bad, _ = check_pull(r.dst.tensors, before, src, src, seed)
            fig.pulls += 1
            if bad:
                fig.bad(f"final pull: {bad} bytes wrong", bad)
        for b in busy:
            st = await b.ok("loop_stats")
            fig.other["busy_pulls"] = fig.other.get("busy_pulls", 0) + st["done"]
            if st.get("mismatches"):
                fig.bad(
                    f"the busy decoder's pulls: {st['mismatches']} bytes wrong",
                    int(st["mismatches"]),
                )
    finally:
        for b in busy:
            if stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(b.pid, signal.SIGCONT)
            b.stop(timeout=5)
    fig.other["attempts"] = n
    fig.check()


@pytest.mark.adversity(ci=0.5, weight=1.0)
@pytest.mark.asyncio
async def test_tcp_cancelled_pull_never_lands_in_the_next(prompt: ActorProc, budget: float) -> None:
    """tcp, finding 1 targeted: two other decoder processes are paused mid-pull (the
    prompt's serving threads are stuck sending to them); our pull is cancelled (or times
    out) while it waits behind them; they resume; our next pull, of other blocks with
    another pattern, must bring its own bytes, never the cancelled pull's."""
    fig = Figures("tcp-cancel-then-pull")
    rng = np.random.default_rng(random.randrange(1 << 32))
    base = int(rng.integers(1 << 40))
    busy: list[ActorProc] = []
    stopped = False
    n = 0
    try:
        host, port = prompt.address
        for _ in range(2):
            b = ActorProc.start(
                cluster_id=new_cluster_id(), role="decoder", listen=False, data_path="tcp"
            )
            busy.append(b)
            await b.ok(
                "cache",
                name="dst",
                num_tensors=8,
                num_blocks=NUM_BLOCKS,
                block_shape=BUSY_SHAPE,
                allocate=False,
            )
            r0 = await b.ok("link", cluster_id=prompt.cluster_id, host=host, port=port)
            assert r0["status"] == 0, r0
            await b.ok(
                "pull_loop",
                cluster_id=prompt.cluster_id,
                model_id=BUSY_MODEL,
                dst="dst",
                blocks=list(range(NUM_BLOCKS)),
                timeout=30.0,
                seed=BUSY_SEED,
            )
        async with rig("tcp", prompt) as r:
            cm = r.decoder.cache_manager
            end = time.monotonic() + budget
            while n < 3 or time.monotonic() < end:
                n += 1
                await asyncio.sleep(float(rng.uniform(0.005, 0.03)))  # mid-pull, theirs
                for b in busy:
                    os.kill(b.pid, signal.SIGSTOP)
                stopped = True
                # The pull to give up: cancelled or timed out while queued.
                src_a, dst_a = random_blocks(rng, NUM_BLOCKS, NUM_BLOCKS, 16)
                await r.fill(base + 2 * n, src_a)
                before = snapshot(r.dst.tensors)
                mode = ("task_cancel", "param", "asyncio_timeout")[n % 3]
                x = float(rng.uniform(0.02, 0.15))
                fig.faults += 1
                try:
                    completed = await attempt(r, mode, x, src_a, dst_a)
                except (LLMException, TimeoutError, asyncio.CancelledError) as e:
                    fig.error(e)
                    completed = False
                bad, canary = check_pull(
                    r.dst.tensors, before, src_a, dst_a, base + 2 * n if completed else None
                )
                if bad or canary:
                    fig.bad(f"round {n} given-up pull: {bad} + {canary}", bad + canary)
                await asyncio.sleep(float(rng.uniform(0.0, 0.1)))
                for b in busy:
                    os.kill(b.pid, signal.SIGCONT)
                stopped = False
                # The next pull: its own bytes, whatever the serving side still had queued.
                for k in range(2):
                    seed = base + 2 * n + 1 + (k << 30)
                    src_b, dst_b = random_blocks(rng, NUM_BLOCKS, NUM_BLOCKS, 16)
                    await r.fill(seed, src_b)
                    before = snapshot(r.dst.tensors)
                    try:
                        await cm.pull_blocks(r.key, r.dst.cache, src_b, dst_b, timeout=10.0)
                    except LLMException as e:
                        fig.error(e)
                        fig.late(f"round {n}: the pull after the given-up one failed: {e}"[:200])
                        continue
                    bad, canary = check_pull(r.dst.tensors, before, src_b, dst_b, seed)
                    fig.pulls += 1
                    fig.bytes += len(src_b) * r.block_bytes * 8
                    if bad or canary:
                        fig.bad(
                            f"round {n} ({mode}, {x * 1000:.0f} ms): the next pull {k} "
                            f"got {bad} + {canary} wrong bytes",
                            bad + canary,
                        )
        for b in busy:
            st = await b.ok("loop_stats")
            if st.get("mismatches"):
                fig.bad(f"a busy decoder's pulls: {st['mismatches']} wrong", int(st["mismatches"]))
    finally:
        for b in busy:
            if stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(b.pid, signal.SIGCONT)
            b.stop(timeout=5)
    fig.other["rounds"] = n
    fig.check()
