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
Medians of repeated runs; the machine is noisy, so read ratios, not absolutes.
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
from aiodatadist.testing import inproc_pair, make_blocks_cache


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def tiny(pair: Any, repeats: int) -> dict[str, float]:
    w = WORKLOADS["small"]
    kw = {"num_tensors": w.num_tensors, "num_blocks": 16, "block_shape": w.block_shape}
    src = make_blocks_cache(pair.prompt, model_id=0, seed=1, **kw)
    dst = make_blocks_cache(pair.decoder, **kw)
    cm = pair.decoder.cache_manager
    key = pair.key(0)
    geo = _native.Geometry(w.num_tensors, 16, w.block_bytes)
    plan = _native.Plan.blocks(geo, geo, [3], [5], 0, 0, 1)
    s_addrs, d_addrs = src.cache.tensor_addrs, dst.cache.tensor_addrs
    facade, direct = [], []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(200):
            await cm.pull_blocks(
                key,
                dst.cache,
                [3],
                [5],
                src_layer_range=range(0, 1),
                dst_layer_range=range(0, 1),
                tensor_num_per_layer=1,
            )
        t1 = time.perf_counter_ns()
        for _ in range(200):
            _native.copy_local(plan, s_addrs, d_addrs, _native.Control(), 1)
        t2 = time.perf_counter_ns()
        facade.append((t1 - t0) / 200 / 1000)
        direct.append((t2 - t1) / 200 / 1000)
    assert np.array_equal(dst.tensors[0][5].view(np.uint8), src.tensors[0][3].view(np.uint8))
    f, d = statistics.median(facade), statistics.median(direct)
    return {"facade_us": f, "native_us": d, "overhead_us": f - d}


async def big(pair: Any, repeats: int, num_blocks: int, count: int) -> dict[str, float]:
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
    loop = asyncio.get_running_loop()
    facade, native, lags = [], [], []

    async def ticker(stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = loop.time()
            await asyncio.sleep(0.001)
            lags.append((loop.time() - t - 0.001) * 1000)

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
    f, n = statistics.median(facade), statistics.median(native)
    return {
        "bytes": nbytes,
        "facade_gbps": f,
        "native_gbps": n,
        "ratio": f / n,
        "lag_p50_ms": _pct(lags, 0.5),
        "lag_p99_ms": _pct(lags, 0.99),
        "lag_max_ms": max(lags),
        "verified": ok,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    num_blocks, count = (64, 16) if args.quick else (128, 64)
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
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.loop == "uvloop":
        import uvloop

        res = uvloop.run(main(args))
    else:
        res = asyncio.run(main(args))
    t, b = res["tiny"], res["big"]
    print(f"loop: {args.loop}, medians of {args.repeats} runs")
    print(
        f"tiny pull (small, 1 block, 1 tensor): facade {t['facade_us']:.1f} us, "
        f"native {t['native_us']:.1f} us, overhead {t['overhead_us']:.1f} us (goal <= 30)"
    )
    print(
        f"{b['bytes'] / 2**30:.2f} GiB llama8b-fp16 pull: facade {b['facade_gbps']:.2f} GB/s, "
        f"native mover {b['native_gbps']:.2f} GB/s, ratio {b['ratio']:.3f} (goal >= 0.95), "
        f"verified {b['verified']}"
    )
    print(
        f"event-loop lag during the pull (1 ms ticker): p50 {b['lag_p50_ms']:.3f} ms, "
        f"p99 {b['lag_p99_ms']:.3f} ms (goal < 2), max {b['lag_max_ms']:.3f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps({"loop": args.loop, **res}, indent=2))


if __name__ == "__main__":
    cli()
