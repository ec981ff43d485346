"""Facade overhead and event-loop health of ``pull_blocks`` (in-process link).

Three measurements, each against a baseline measured in the same run:

1. tiny pull (``small`` workload, 1 block, 1 tensor) through
   ``await cache_manager.pull_blocks(...)`` against the same native job
   (``_native.copy_local`` on the same plan) called directly: the median
   difference is the facade's per-call overhead (goal: <= 30 us);
2. a 1 GiB ``llama8b-fp16`` pull (64 random blocks, all layers) through the
   facade against the native local mover alone (goal: >= 0.95x);
3. event-loop lag during that pull: a 1 ms ticker records how late each tick
   fires (goal: p99 < 2 ms).

Run: ``.venv/bin/python bench/bench_engine.py [--repeats N] [--quick] [--loop uvloop]``
(``--json PATH`` writes the figures).

Every figure comes with its spread (``aiodatadist.cli.stats``): the tiny pull's
latencies are per call (p50/p90/p99 over every timed call), the 1 GiB pull's GB/s
over the ``--repeats`` rounds; a WARNING line follows any figure whose rounds disagree
by more than 20% ((max-min)/median of the round medians). The load average is printed
at start and end. The machine is noisy, so read ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import WORKLOADS, random_blocks

from aiodatadist import _native
from aiodatadist.cli.stats import (
    DISAGREE,
    Summary,
    disagree_warning,
    disagreement,
    fmt,
    fmt_latency,
    fmt_load,
    load_average,
    percentile,
    summarize,
)
from aiodatadist.testing import inproc_pair, make_blocks_cache

NATIVE = "native mover (_native.copy_local, same plan)"
CALLS = 200  # timed calls per round of the tiny pull


def _sum(xs: list[float]) -> Summary:
    s = summarize(xs)
    assert s is not None
    return s


def _figure(xs: list[float], rounds: list[float] | None = None) -> dict[str, Any]:
    """A figure's summary, its round medians and their disagreement, for the JSON."""
    rounds = xs if rounds is None else rounds
    return {
        **_sum(xs).as_json(),
        "round_medians": [round(x, 4) for x in rounds],
        "disagreement": None if (d := disagreement(rounds)) is None else round(d, 4),
    }


async def tiny(pair: Any, repeats: int) -> dict[str, Any]:
    w = WORKLOADS["small"]
    kw = {"num_tensors": w.num_tensors, "num_blocks": 16, "block_shape": w.block_shape}
    src = make_blocks_cache(pair.prompt, model_id=0, seed=1, **kw)
    dst = make_blocks_cache(pair.decoder, **kw)
    cm = pair.decoder.cache_manager
    key = pair.key(0)
    geo = _native.Geometry(w.num_tensors, 16, w.block_bytes)
    plan = _native.Plan.blocks(geo, geo, [3], [5], 0, 0, 1)
    s_addrs, d_addrs = src.cache.tensor_addrs, dst.cache.tensor_addrs
    clock = time.perf_counter_ns
    facade: list[list[float]] = []  # us per call, one list per round
    direct: list[list[float]] = []
    for r in range(repeats + 1):  # round 0 warms up
        f_r, d_r = [], []
        for _ in range(CALLS):
            t0 = clock()
            await cm.pull_blocks(
                key,
                dst.cache,
                [3],
                [5],
                src_layer_range=range(0, 1),
                dst_layer_range=range(0, 1),
                tensor_num_per_layer=1,
            )
            t1 = clock()
            _native.copy_local(plan, s_addrs, d_addrs, _native.Control(), 1)
            t2 = clock()
            f_r.append((t1 - t0) / 1000)
            d_r.append((t2 - t1) / 1000)
        if r:
            facade.append(f_r)
            direct.append(d_r)
    assert np.array_equal(dst.tensors[0][5].view(np.uint8), src.tensors[0][3].view(np.uint8))
    f_med = [statistics.median(x) for x in facade]
    d_med = [statistics.median(x) for x in direct]
    over = [f - d for f, d in zip(f_med, d_med, strict=True)]
    return {
        "bytes": w.block_bytes,
        "calls": CALLS * repeats,
        "facade_us": _figure([x for r in facade for x in r], f_med),
        "native_us": _figure([x for r in direct for x in r], d_med),
        "overhead_us": _figure(over),  # per round: facade median - native median
    }


async def big(pair: Any, repeats: int, num_blocks: int, count: int) -> dict[str, Any]:
    w = WORKLOADS["llama8b-fp16"]
    kw = {"num_tensors": w.num_tensors, "num_blocks": num_blocks, "block_shape": w.block_shape}
    src = make_blocks_cache(pair.prompt, model_id=1, seed=2, allocate=True, **kw)
    dst = make_blocks_cache(pair.decoder, **kw)
    sb, db = random_blocks(num_blocks, num_blocks, count)
    nbytes = count * w.block_bytes * w.num_tensors
    geo = _native.Geometry(w.num_tensors, num_blocks, w.block_bytes)
    plan = _native.Plan.blocks(geo, geo, sb, db, 0, 0, w.num_tensors)
    threads = pair.decoder.options.mover_threads
    cm = pair.decoder.cache_manager
    facade: list[float] = []
    native: list[float] = []
    lags: list[float] = []

    async def ticker(stop: asyncio.Event) -> None:
        while not stop.is_set():  # perf_counter: uvloop's loop.time() ticks in whole ms
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append((time.perf_counter() - t - 0.001) * 1000)

    for i in range(repeats + 1):
        t0 = time.perf_counter()
        _native.copy_local(
            plan, src.cache.tensor_addrs, dst.cache.tensor_addrs, _native.Control(), threads
        )
        t1 = time.perf_counter()
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        await asyncio.sleep(0.005)
        t2 = time.perf_counter()
        await cm.pull_blocks(pair.key(1), dst.cache, sb, db, timeout=30)
        t3 = time.perf_counter()
        stop.set()
        await tick
        if i:  # the first round warms caches and page tables
            native.append(nbytes / (t1 - t0) / 1e9)
            facade.append(nbytes / (t3 - t2) / 1e9)
    ok = all(
        np.array_equal(dst.tensors[t][d].view(np.uint8), src.tensors[t][s].view(np.uint8))
        for t in (0, w.num_tensors - 1)
        for s, d in zip(sb, db, strict=True)
    )
    paired = [f / n for f, n in zip(facade, native, strict=True)]
    return {
        "bytes": nbytes,
        "facade_gbps": _figure(facade),
        "native_gbps": _figure(native),
        "ratio": statistics.median(facade) / statistics.median(native),
        "paired_ratio": _figure(paired),
        "lag_ms": _sum(lags).as_json(),
        "lag_p50_ms": percentile(lags, 0.5),
        "lag_p99_ms": percentile(lags, 0.99),
        "lag_max_ms": max(lags),
        "verified": ok,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    num_blocks, count = (64, 16) if args.quick else (128, 64)
    if args.blocks:
        num_blocks, count = max(8, 2 * args.blocks), args.blocks
    async with inproc_pair() as pair:
        out = {
            "tiny": await tiny(pair, args.repeats),
            "big": await big(pair, args.repeats, num_blocks, count),
        }
    return out


def cli() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="256 MiB instead of 1 GiB")
    ap.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    ap.add_argument("--blocks", type=int, help="blocks of the big pull (a smoke run: 1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    load_start = load_average()
    print(fmt_load("start", load_start), flush=True)
    if args.loop == "uvloop":
        import uvloop

        res = uvloop.run(main(args))
    else:
        res = asyncio.run(main(args))
    load_end = load_average()
    t, b = res["tiny"], res["big"]
    warnings = [
        w
        for name, fig, unit in (
            ("tiny pull, facade", t["facade_us"], "us"),
            (f"tiny pull, {NATIVE}", t["native_us"], "us"),
            ("big pull, facade", b["facade_gbps"], "GB/s"),
            (f"big pull, {NATIVE}", b["native_gbps"], "GB/s"),
        )
        if (w := disagree_warning(name, fig["round_medians"], unit))
    ]
    print(
        f"loop: {args.loop}; {args.repeats} rounds after a warm-up round; spreads: p10-p90 "
        f"over >= 10 samples, else min-max"
    )
    print(
        f"tiny pull (small, 1 block, 1 tensor, {t['bytes'] // 1024} KiB), every call timed "
        f"({t['calls']} per side), the two alternated call by call:"
    )
    for name, key in (("facade, await pull_blocks(...)", "facade_us"), (NATIVE, "native_us")):
        print(f"  {name + ':':<48} {fmt_latency(_load(t[key]))}")
    print(
        f"  overhead (facade - native median, per round): "
        f"{fmt(_load(t['overhead_us']), 'us')} (goal <= 30)"
    )
    print(
        f"{b['bytes'] / 2**30:.2f} GiB llama8b-fp16 pull, {args.repeats} rounds: "
        f"facade {fmt(_load(b['facade_gbps']), 'GB/s')}, {NATIVE} "
        f"{fmt(_load(b['native_gbps']), 'GB/s')};\n  ratio of medians {b['ratio']:.3f}, "
        f"paired {fmt(_load(b['paired_ratio']))} (goal >= 0.95), verified {b['verified']}"
    )
    lag = _load(b["lag_ms"])
    print(
        f"event-loop lag during the pull (1 ms ticker, {lag.n} ticks): p50 {lag.p50:.3f} ms, "
        f"p90 {lag.p90:.3f} ms, p99 {lag.p99:.3f} ms (goal < 2), max {lag.max:.3f} ms"
    )
    print(fmt_load("end", load_end))
    for w in warnings:
        print(w)
    if args.json:
        meta = {
            "loop": args.loop,
            "repeats": args.repeats,
            "loadavg_start": load_start,
            "loadavg_end": load_end,
            "disagree_threshold": DISAGREE,
            "baseline": NATIVE,
        }
        doc = {**meta, **res, "warnings": warnings}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


def _load(fig: dict[str, Any]) -> Summary:
    """The :class:`Summary` back from a figure's JSON."""
    return Summary(*(fig[k] for k in ("n", "min", "p10", "p50", "p90", "p99", "max")))


if __name__ == "__main__":
    cli()
