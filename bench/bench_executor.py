"""The transfer executor's round trip against asyncio's ``run_in_executor``, same run.

    .venv/bin/python bench/bench_executor.py [--calls 5000] [--rounds 7] [--loop asyncio|uvloop]

What every transfer that leaves the loop thread pays on top of its bytes: queue a job,
wake a worker thread, run it, wake the awaiting task. Both sides run an empty job
(``lambda control: None``) on 2 threads, ``--calls`` awaited one after the other per
sample; the sides alternate (ABBA) ``--rounds`` times. Baseline: ``loop.run_in_executor``
on a ``concurrent.futures.ThreadPoolExecutor(2)``, the standard library's way of the
same handoff (it has no deadline, no abort token and no quiescence on cancel). Printed:
microseconds per call, median with its band, and the ratio of medians.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable

from aiodatadist._executor import TransferExecutor
from aiodatadist.cli.stats import disagree_warning, fmt, fmt_load, load_average, summarize


async def _sample(call: Callable[[], Awaitable[object]], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        await call()
    return (time.perf_counter() - t0) / n * 1e6


async def measure(calls: int, rounds: int) -> None:
    loop = asyncio.get_running_loop()
    ours = TransferExecutor(2, name="bench")
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def job(_control: object = None) -> None:
        return None

    sides: dict[str, Callable[[], Awaitable[object]]] = {
        "TransferExecutor.run": lambda: ours.run(job, deadline=None),
        "loop.run_in_executor": lambda: loop.run_in_executor(pool, job),
    }
    for call in sides.values():  # warm-up
        await _sample(call, calls // 10 or 1)
    got: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            got[name].append(await _sample(sides[name], calls))
    ours.shutdown()
    pool.shutdown()
    for name, xs in got.items():
        print(f"{name:22s} {fmt(summarize(xs), 'us per call')}")
        warning = disagree_warning(name, xs, "us")
        if warning:
            print(warning)
    a, b = (summarize(got[name]) for name in order)
    assert a is not None and b is not None
    print(f"ratio (TransferExecutor / run_in_executor, medians): {a.p50 / b.p50:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5000, help="awaited calls per sample")
    ap.add_argument("--rounds", type=int, default=7, help="samples per side (alternated)")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    args = ap.parse_args()
    print(fmt_load("start", load_average()))
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(measure(args.calls, args.rounds))
    else:
        asyncio.run(measure(args.calls, args.rounds))
    print(fmt_load("end", load_average()))


if __name__ == "__main__":
    main()
