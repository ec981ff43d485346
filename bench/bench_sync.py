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
from aiodatadist.testing import cluster_info, make_blocks_cache

GOAL_US = 50.0
DISAGREE = 0.20  # rounds whose medians differ by more than this get a WARNING

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


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _summary(samples: list[float]) -> tuple[float, float, float]:
    return statistics.median(samples), _pct(samples, 0.10), _pct(samples, 0.90)


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


def _rounds_line(name: str, medians: list[float]) -> str | None:
    lo, hi = min(medians), max(medians)
    if lo > 0 and (hi - lo) / lo > DISAGREE:
        return (
            f"WARNING: {name} round medians disagree by {100 * (hi - lo) / lo:.0f}% "
            f"({', '.join(f'{m:.1f}' for m in medians)} us): a noisy machine, read with care"
        )
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2000, help="pulls per round (default 2000)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--portal", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()

    llm_datadist.set_portal_loop(args.portal)
    loop = _new_loop(args.loop)
    a, s = AsyncSide(loop), SyncSide()
    a.setup()
    s.setup()
    warm = max(50, args.repeats // 10)
    a.round(warm)
    s.round(warm)
    handoff_round(warm)

    per: dict[str, list[tuple[float, float, float]]] = {"async": [], "sync": [], "delta": []}
    hand: dict[str, list[float]] = {
        "portal.call": [],
        "run_coroutine_threadsafe": [],
        "thread ping-pong (floor)": [],
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
            per[name].append(_summary(got[name]))
        per["delta"].append((per["sync"][-1][0] - per["async"][-1][0], 0.0, 0.0))
        for name, xs in zip(hand, handoff_round(args.repeats // 4), strict=True):
            hand[name].append(statistics.median(xs))
    a.close()
    s.close()
    loop.close()

    print(
        f"tiny pull (small, 1 block x 1 tensor), {args.rounds} rounds x {args.repeats} pulls, "
        f"async loop={args.loop}, portal={args.portal}"
    )
    warnings: list[str] = []
    figures: dict[str, Any] = {
        "repeats": args.repeats,
        "rounds": args.rounds,
        "loop": args.loop,
        "portal": args.portal,
    }
    for name in ("async", "sync"):
        med = statistics.median(m for m, _, _ in per[name])
        p10 = statistics.median(p for _, p, _ in per[name])
        p90 = statistics.median(p for _, _, p in per[name])
        print(f"  {name:5s}  median {med:7.1f} us   p10-p90 {p10:7.1f} - {p90:7.1f} us")
        figures[name] = {
            "median_us": med,
            "p10_us": p10,
            "p90_us": p90,
            "round_medians_us": [m for m, _, _ in per[name]],
        }
        w = _rounds_line(name, [m for m, _, _ in per[name]])
        if w:
            warnings.append(w)
    delta = statistics.median(d for d, _, _ in per["delta"])
    verdict = "OK" if delta <= GOAL_US else "OVER GOAL"
    print(f"  delta  median {delta:7.1f} us (sync - async; goal <= {GOAL_US:.0f} us): {verdict}")
    print("hand-off to another thread and back (median of round medians):")
    for name, meds in hand.items():
        print(f"  {name:26s} {statistics.median(meds):7.1f} us")
    floor = statistics.median(hand["thread ping-pong (floor)"])
    print(f"  delta above the floor: {delta - floor:7.1f} us")
    figures["delta_us"] = delta
    figures["handoff_us"] = {k: statistics.median(v) for k, v in hand.items()}
    for w in warnings:
        print(w)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
