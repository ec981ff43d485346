"""The standard workloads over every data path against the plain-C baselines, with plots.

    .venv/bin/python bench/bench_workloads.py [--quick] [--json PATH] [--plot PATH]

The run of ``aiodatadist bench`` (the same machinery: ``aiodatadist.cli.measure``), with
the development baselines instead of the native mover: for each workload and each count
of blocks per pull, every data path that works here is measured against the C program
of ``bench/c/baselines.c`` doing the same copy of the same segments (same block lists,
checked by hash) on the same kind of memory (``cbaselines.py``):

* inproc: ``memcpy`` between huge-page-advised buffers;
* shm: ``memcpy --src-shm``, from a POSIX shared-memory source into a huge-page-advised
  destination;
* cma: ``process_vm_readv`` between huge-page-advised buffers;
* tcp: ``writev``/``readv`` over loopback, huge-page-advised buffers.

The table adds each path's memory kind and how much of the engine's and the baseline's
buffers the kernel really backed with huge pages (``/proc/PID/smaps``,
``memory_accounting.py``); ``--plot`` draws the report (``plot.py``). Where the C
baselines cannot be built (no compiler), ``--baseline native`` measures against the
native mover, as ``aiodatadist bench`` does, with the same accounting.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import sys
import time
from pathlib import Path
from typing import Any

from cbaselines import baseline_spec, c_baselines, find_c_baselines
from memory_accounting import host_meta, memory_note, observe

from aiodatadist.cli.bench import (
    band_cell,
    geomean_text,
    latency_cell,
    legend,
    size_text,
    warning_lines,
)
from aiodatadist.cli.measure import ALL_PATHS, NATIVE_BASELINE, Point, run_workload, summarize
from aiodatadist.cli.progress import Progress
from aiodatadist.cli.stats import (
    DISAGREE,
    MIN_FOR_PERCENTILES,
    SMALL_PULL_BYTES,
    fmt_load,
    load_average,
)
from aiodatadist.cli.workloads import DEFAULT_SEED, WORKLOADS


def _fmt_ratio(r: float | None) -> str:
    if r is None:
        return "-"
    return f"{r:.2f}" if r >= 0.1 else f"{r:.3f}" if r >= 0.01 else f"{r:.2g}"


def _fmt_share(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


# What each C baseline is (the labels are cbaselines.py's); printed under the table.
BASELINE_WHAT = {
    "C memcpy": "plain-C memcpy gather of the same segments, 2 threads, huge-page-advised buffers",
    "C memcpy (shm source)": "plain-C memcpy gather, 2 threads, from a POSIX shared-memory source",
    "C process_vm_readv": "plain-C process_vm_readv gather from a child process, 2 threads",
    "C writev/readv": "plain-C writev/readv over 2 loopback TCP streams, IOV_MAX iovecs per call",
}


def table(points: list[Point]) -> str:
    hdr = (f"{'workload':<13} {'path':<6} {'blocks':>6} {'bytes':>10} {'memory':<11} "
           f"{'engine GB/s':>20}  {'baseline':<22} {'GB/s':>20} {'ratio':>7} {'paired':>23}  "
           f"{'engine us p50/90/99':>20} {'baseline us':>16}  {'huge e/b':<9}  check")  # fmt: skip
    lines = [hdr, "-" * len(hdr)]
    for p in points:
        check = "ok" if p.verified else "MISMATCH"
        x = p.extra
        huge = "/".join(_fmt_share(x.get(k)) for k in ("huge_pages_engine", "huge_pages_baseline"))
        lat = latency_cell(p.latency)
        blat = latency_cell(p.baseline_latency, p.baseline_latency_kind)
        lines.append(
            f"{p.workload:<13} {p.path:<6} {p.blocks:>6} {size_text(p.bytes):>10} "
            f"{x.get('memory', ''):<11} {band_cell(p.spread):>20}  {p.baseline or '-':<22} "
            f"{band_cell(p.baseline_spread):>20} {_fmt_ratio(p.ratio):>7} "
            f"{band_cell(p.paired_spread, True):>23}  {lat:>20} {blat:>16}  {huge:<9}  {check}"
            + (f"  ({p.note})" if p.note else "")
        )  # fmt: skip
    return "\n".join(lines)


def baseline_legend(points: list[Point]) -> list[str]:
    """One line per baseline of the table: what it is."""
    names = dict.fromkeys(p.baseline for p in points if p.baseline)
    return [f"  {n}: {BASELINE_WHAT.get(n, n)}" for n in names]


def _csv(choices: tuple[str, ...] | None = None, cast: Any = str) -> Any:
    def parse(text: str) -> list[Any]:
        out = [cast(x.strip()) for x in text.split(",") if x.strip()]
        if not out or (choices and any(x not in choices for x in out)):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return out

    return parse


async def measure(args: argparse.Namespace, factory: Any) -> tuple[list[Point], dict[str, str]]:
    """Every point of the run; the paths skipped and why."""
    skipped: dict[str, str] = {}
    points: list[Point] = []
    total = len(args.workload) * len(args.blocks_per_pull) * len(args.paths)
    with Progress("bench", total, enabled=args.progress) as bar:
        for wname in args.workload:
            points += await run_workload(
                WORKLOADS[wname], args.pool, args.blocks_per_pull, args.paths, args, bar,
                skipped, baseline=factory, observe=observe,
            )  # fmt: skip
    order: dict[str, int] = {name: i for i, name in enumerate(ALL_PATHS)}
    points.sort(key=lambda p: (args.workload.index(p.workload), order[p.path], p.blocks))
    return points, skipped


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a small, fast run")
    ap.add_argument("--workload", type=_csv(tuple(WORKLOADS)), default=list(WORKLOADS),
                    help="comma-separated workloads (default all)")  # fmt: skip
    ap.add_argument("--paths", type=_csv(tuple(ALL_PATHS)), default=list(ALL_PATHS),
                    help="comma-separated data paths (default inproc,shm,cma,tcp)")  # fmt: skip
    ap.add_argument(
        "--blocks-per-pull",
        type=_csv(cast=int),
        default=None,
        help="comma-separated blocks per pull (default 1,4,16,64; --quick 1,4)",
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed samples (default 5)")
    ap.add_argument("--baseline", choices=["c", "native"], default="c")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    ap.add_argument("--plot", type=Path, help="write a PNG plot (needs matplotlib)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    args = ap.parse_args()
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install 'aiodatadist[bench]'")
    args.blocks_per_pull = args.blocks_per_pull or ([1, 4] if args.quick else [1, 4, 16, 64])
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.timeout = 120.0
    args.pool = max(max(args.blocks_per_pull), 8 if args.quick else 64)

    if args.baseline == "c":
        exe, why = find_c_baselines()
        if exe is None:
            ap.error(f"no C baselines: {why} (--baseline native measures without)")
        factory = c_baselines(exe)
        kind = f"plain-C movers of bench/c ({why}), 2 threads / 2 streams"
    else:
        factory, kind = None, NATIVE_BASELINE
    load_start = load_average()
    print(
        f"bench_workloads{' --quick' if args.quick else ''}: pull_blocks of N random "
        f"non-contiguous blocks, all layers, pool of {args.pool} blocks per tensor;\n"
        f"  GB/s = 1e9 B/s, median of {args.repeats} samples after a warm-up; every pull "
        f"checked byte for byte\n  baseline: {kind}, same segments, same kind of memory, "
        f"measured in this run\n{fmt_load('start', load_start)}",
        flush=True,
    )
    t0 = time.perf_counter()
    points, skipped = asyncio.run(measure(args, factory))
    elapsed = time.perf_counter() - t0
    load_end = load_average()
    print()
    print(table(points))
    summary = summarize(points)
    warnings = warning_lines(points)
    print()
    print("baselines:")
    print("\n".join(baseline_legend(points)))
    print(memory_note())
    print(legend(args.repeats))
    print(
        "per path, geometric mean of the ratios over the points: "
        + ", ".join(f"{k} {geomean_text(v)}" for k, v in summary.items())
    )
    for path, reason in skipped.items():
        print(f"skipped {path}: {reason}")
    print(fmt_load("end", load_end))
    for w in warnings:
        print(w)
    print(f"({elapsed:.0f} s, {len(warnings)} warning{'s' * (len(warnings) != 1)})")
    doc = {
        "meta": {
            "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["bench/bench_workloads.py", *sys.argv[1:]]),
            **host_meta(),
            "quick": args.quick,
            "pool_blocks": args.pool,
            "blocks_per_pull": args.blocks_per_pull,
            "repeats": args.repeats,
            "seed": args.seed,
            "unit": "GB/s = 1e9 bytes/s; median of the samples",
            "elapsed_s": round(elapsed, 1),
            "loadavg_start": load_start,
            "loadavg_end": load_end,
            "band": "p10-p90" if args.repeats >= MIN_FOR_PERCENTILES else "min-max",
            "disagree_threshold": DISAGREE,
            "small_pull_bytes": SMALL_PULL_BYTES,
        },
        "baseline_kind": args.baseline,
        "baseline": kind,
        "baselines": {
            p: baseline_spec(p).label if args.baseline == "c" else NATIVE_BASELINE
            for p in args.paths
        },
        "memory_note": memory_note(),
        "workloads": {
            n: WORKLOADS[n].__dict__ | {"block_bytes": WORKLOADS[n].block_bytes}
            for n in args.workload
        },
        "paths": [p for p in args.paths if p not in skipped],
        "skipped": skipped,
        "results": [p.as_json() for p in points],
        "summary": summary,
        "baseline_descriptions": {
            n: BASELINE_WHAT.get(n, n)
            for n in dict.fromkeys(p.baseline for p in points if p.baseline)
        },
        "warnings": warnings,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from plot import plot

        plot(doc, args.plot)
        print(f"wrote {args.plot}")
    if not all(p.verified for p in points):
        raise SystemExit("a destination check failed")


if __name__ == "__main__":
    main()
