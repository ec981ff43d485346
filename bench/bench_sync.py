"""What the blocking API (``aiodatadist.sync``) costs over the async one, per tiny pull.

An in-process prompt/decoder pair twice in one run: once on a plain asyncio loop in
this thread (``await cm.pull_blocks(...)``), once through ``aiodatadist.sync`` (both
instances on the portal loop, this thread blocking on each call). Each pull is the
tiny shape of DESIGN.md (``small`` workload, 1 block x 1 tensor); the bytes of the last
pull of each side are checked. Rounds alternate async / sync so that drift on a noisy
machine hits both alike; every call is timed on its own.

Also measured, for the record: the bare hand-off to the portal and back (a no-op
coroutine) by the portal's own path against ``asyncio.run_coroutine_threadsafe``.

Goal: the sync median at most 50 us above the async median (same run).

Every figure is printed with its spread (``aiodatadist.cli.stats``): latencies as
p50/p90/p99 over every timed call and the p10-p90 band; the delta and the hand-offs
over the rounds (p10-p90 from 10 rounds up, else min-max). A WARNING follows any
figure whose round medians disagree by more than 20% ((max-min)/median); the load
average is printed at start and end.

Run: ``.venv/bin/python bench/bench_sync.py [--repeats 2000] [--rounds 7]
[--loop asyncio|uvloop] [--portal asyncio|uvloop] [--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import WORKLOADS

import aiodatadist
import aiodatadist.sync as llm_datadist
from aiodatadist._portal import portal
from aiodatadist.cli.stats import (
    DISAGREE,
    Summary,
    disagree_warning,
    disagreement,
    fmt,
    fmt_latency,
    fmt_load,
    load_average,
    summarize,
)
from aiodatadist.testing import cluster_info, make_blocks_cache

GOAL_US = 50.0

_W = WORKLOADS["small"]
_KW: dict[str, Any] = {
    "num_tensors": _W.num_tensors,
    "num_blocks": 16,
    "block_shape": _W.block_shape,
}
_PULL_KW: dict[str, Any] = {
    "src_layer_range": range(0, 1),
    "dst_layer_range": range(0, 1),
    "tensor_num_per_layer": 1,
}


def _sum(xs: list[float]) -> Summary:
    s = summarize(xs)
    assert s is not None
    return s


def _figure(s: Summary, rounds: list[float]) -> dict[str, Any]:
    """A figure for the JSON: its summary, round medians and their disagreement."""
    d = disagreement(rounds)
    return {
        **s.as_json(),
        "median_us": round(s.p50, 4),
        "round_medians_us": [round(x, 4) for x in rounds],
        "disagreement": None if d is None else round(d, 4),
    }


def _check(dst: Any, src_seed: int) -> None:
    from aiodatadist.testing import pattern_mismatches

    bad = pattern_mismatches(dst.tensors, [3], [5], src_seed, tensors=[(0, 0)])
    if bad:
        raise SystemExit(f"wrong bytes after the pulls: {bad[0]}")
    if np.any(dst.tensors[1].view(np.uint8)):
        raise SystemExit("a 1-tensor pull touched tensor 1")


# --------------------------------------------------------------------------- async side


class AsyncSide:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.prompt = aiodatadist.LLMDataDist(aiodatadist.LLMRole.PROMPT, 11)
        self.decoder = aiodatadist.LLMDataDist(aiodatadist.LLMRole.DECODER, 12)

    async def _setup(self) -> None:
        await self.prompt.init({})
        await self.decoder.init({})
        make_blocks_cache(self.prompt, model_id=0, seed=5, pattern=True, **_KW)
        self.dst = make_blocks_cache(self.decoder, **_KW)
        status, _ = await self.decoder.link_clusters([cluster_info(11)])
        assert status == aiodatadist.LLMStatusCode.LLM_SUCCESS, status

    def setup(self) -> None:
        self.loop.run_until_complete(self._setup())

    async def _round(self, n: int) -> list[float]:
        cm, key, cache = (
            self.decoder.cache_manager,
            aiodatadist.BlocksCacheKey(11, 0),
            self.dst.cache,
        )
        out = []
        clock = time.perf_counter_ns
        for _ in range(n):
            t0 = clock()
            await cm.pull_blocks(key, cache, [3], [5], **_PULL_KW)
            out.append((clock() - t0) / 1000)
        return out

    def round(self, n: int) -> list[float]:
        return self.loop.run_until_complete(self._round(n))

    def close(self) -> None:
        _check(self.dst, 5)
        self.loop.run_until_complete(self.decoder.finalize())
        self.loop.run_until_complete(self.prompt.finalize())


# ---------------------------------------------------------------------------- sync side


class SyncSide:
    def setup(self) -> None:
        self.prompt = llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, 21)
        self.decoder = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, 22)
        self.prompt.init({})
        self.decoder.init({})
        make_blocks_cache(self.prompt, model_id=0, seed=6, pattern=True, **_KW)
        self.dst = make_blocks_cache(self.decoder, **_KW)
        status, _ = self.decoder.link_clusters([cluster_info(21)], timeout=3000)
        assert status == llm_datadist.LLMStatusCode.LLM_SUCCESS, status

    def round(self, n: int) -> list[float]:
        cm, key, cache = (
            self.decoder.cache_manager,
            llm_datadist.BlocksCacheKey(21, 0),
            self.dst.cache,
        )
        out = []
        clock = time.perf_counter_ns
        for _ in range(n):
            t0 = clock()
            cm.pull_blocks(key, cache, [3], [5], **_PULL_KW)
            out.append((clock() - t0) / 1000)
        return out

    def close(self) -> None:
        _check(self.dst, 6)
        self.decoder.finalize()
        self.prompt.finalize()


# ------------------------------------------------------------------------------ hand-off


async def _noop() -> None:
    return None


def handoff_round(n: int) -> tuple[list[float], list[float], list[float]]:
    """Per-call µs of a no-op coroutine on the portal (our path, run_coroutine_threadsafe),
    and of a bare two-lock ping-pong with another thread: the floor of any design that
    hands a call to another thread on this machine."""
    loop = portal.loop()
    ours, std, floor = [], [], []
    clock = time.perf_counter_ns
    ping, pong = threading.Lock(), threading.Lock()
    ping.acquire()
    pong.acquire()

    def echo() -> None:
        for _ in range(n):
            ping.acquire()
            pong.release()

    peer = threading.Thread(target=echo, daemon=True)
    peer.start()
    for _ in range(n):
        t0 = clock()
        portal.call(_noop)
        t1 = clock()
        asyncio.run_coroutine_threadsafe(_noop(), loop).result()
        t2 = clock()
        ping.release()
        pong.acquire()
        t3 = clock()
        ours.append((t1 - t0) / 1000)
        std.append((t2 - t1) / 1000)
        floor.append((t3 - t2) / 1000)
    peer.join()
    return ours, std, floor


# ---------------------------------------------------------------------------------- main


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2000, help="pulls per round (default 2000)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--portal", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if args.repeats < 4 or args.rounds < 1:
        ap.error("--repeats must be >= 4 and --rounds >= 1")
    load_start = load_average()
    print(fmt_load("start", load_start), flush=True)

    llm_datadist.set_portal_loop(args.portal)
    loop = _new_loop(args.loop)
    a, s = AsyncSide(loop), SyncSide()
    a.setup()
    s.setup()
    warm = max(50, args.repeats // 10)
    a.round(warm)
    s.round(warm)
    handoff_round(warm)

    per: dict[str, list[list[float]]] = {"async": [], "sync": []}  # us per call, per round
    hand: dict[str, list[float]] = {  # round medians, us
        "portal.call (our hand-off)": [],
        "asyncio.run_coroutine_threadsafe": [],
        "two-lock thread ping-pong (floor)": [],
    }
    for r in range(args.rounds):
        # Alternate which side goes first: drift hits both alike.
        runs: list[tuple[str, Callable[[int], list[float]]]] = [
            ("async", a.round),
            ("sync", s.round),
        ]
        if r % 2:
            runs.reverse()
        got = {name: fn(args.repeats) for name, fn in runs}
        for name in ("async", "sync"):
            per[name].append(got[name])
        for name, xs in zip(hand, handoff_round(args.repeats // 4), strict=True):
            hand[name].append(statistics.median(xs))
    a.close()
    s.close()
    loop.close()

    load_end = load_average()

    print(
        f"tiny pull (small, 1 block x 1 tensor), {args.rounds} rounds x {args.repeats} pulls, "
        f"every call timed, async loop={args.loop}, portal={args.portal}"
    )
    warnings: list[str | None] = []
    figures: dict[str, Any] = {
        "repeats": args.repeats,
        "rounds": args.rounds,
        "loop": args.loop,
        "portal": args.portal,
        "loadavg_start": load_start,
        "loadavg_end": load_end,
        "disagree_threshold": DISAGREE,
    }
    meds: dict[str, list[float]] = {}
    labels = {"async": "async, await pull_blocks", "sync": "sync, aiodatadist.sync pull_blocks"}
    for name in ("async", "sync"):
        summ = _sum([x for r in per[name] for x in r])
        meds[name] = [statistics.median(r) for r in per[name]]
        print(f"  {labels[name] + ':':<36} {fmt(summ, 'us')}   {fmt_latency(summ)}")
        figures[name] = _figure(summ, meds[name])
        warnings.append(disagree_warning(labels[name], meds[name], "us"))
    deltas = [y - x for x, y in zip(meds["async"], meds["sync"], strict=True)]
    delta_s = _sum(deltas)
    delta = delta_s.p50
    verdict = "OK" if delta <= GOAL_US else "OVER GOAL"
    print(
        f"  {'delta, sync - async median per round:':<36} {fmt(delta_s, 'us')} "
        f"(goal <= {GOAL_US:.0f} us): {verdict}"
    )
    print("hand-off to another thread and back, a no-op (median over the rounds, spread):")
    for name, xs in hand.items():
        print(f"  {name + ':':<36} {fmt(_sum(xs), 'us')}")
        warnings.append(disagree_warning(name, xs, "us"))
    floor = statistics.median(hand["two-lock thread ping-pong (floor)"])
    print(f"  delta above the floor: {delta - floor:7.1f} us")
    print(fmt_load("end", load_end))
    figures["delta_us"] = delta
    figures["delta"] = _figure(delta_s, deltas)
    figures["handoff_us"] = {k: statistics.median(v) for k, v in hand.items()}
    figures["handoff"] = {k: _figure(_sum(v), v) for k, v in hand.items()}
    figures["warnings"] = [w for w in warnings if w]
    for w in figures["warnings"]:
        print(w)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
