"""``aiodatadist bench``: the engine against the native mover, on the standard workloads.

For each workload (DESIGN.md "Standard workloads") and each count of blocks per pull,
the engine pulls that many random non-contiguous blocks of every layer
(``await pull_blocks(...)``, the whole public path: validation, plan, link slot,
executor, native mover) over each data path that works here: ``inproc`` (prompt and
decoder in this process), ``shm``, ``cma`` and ``tcp`` (the prompt in a subprocess),
one decoder per path with ``aiodatadist.DataPath`` forced (:mod:`.measure`).

The baseline, measured in the same run and alternated with the engine sample by
sample: the native mover alone (``_native.copy_local`` on the same plan, same blocks,
into the same destination), the ceiling of every path. The ratio says what the public
path and the data path cost on top of the copy itself. The plain-C baselines, the
huge-page accounting and the plots are the source tree's ``bench/`` (not installed).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from .measure import ALL_PATHS, NATIVE_BASELINE, Point, run_workload, summarize
from .progress import Progress
from .workloads import WORKLOADS

__all__ = ["host_meta", "run_bench"]


# --------------------------------------------------------------------------- output


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}" if r >= 0.1 else f"{r:.3f}"


def _table(points: list[Point]) -> str:
    hdr = (f"{'workload':<13} {'path':<6} {'blocks':>6} {'bytes':>10} {'engine GB/s':>11}  "
           f"{'baseline GB/s':>13} {'ratio':>6} {'paired':>6}  check")  # fmt: skip
    lines = [hdr, "-" * len(hdr)]
    for p in points:
        size = f"{p.bytes / 2**20:.1f} MiB" if p.bytes >= 2**20 else f"{p.bytes / 1024:.0f} KiB"
        med = "-" if p.median is None else f"{p.median:.2f}"
        bmed = "-" if p.baseline_median is None else f"{p.baseline_median:.2f}"
        check = "ok" if p.verified else "MISMATCH"
        lines.append(
            f"{p.workload:<13} {p.path:<6} {p.blocks:>6} {size:>10} {med:>11}  {bmed:>13} "
            f"{_fmt_ratio(p.ratio):>6} {_fmt_ratio(p.paired_ratio):>6}  {check}"
            + (f"  ({p.note})" if p.note else "")
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- command


def _write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def host_meta() -> dict[str, Any]:
    """Versions and the machine, for a JSON report."""
    from .. import __version__, _native

    return {
        "aiodatadist": __version__,
        "native": _native.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


async def run_bench(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (1 when a pulled byte was wrong).

    Raises:
        LLMException: a pull failed for another reason than its path being unavailable.
        RuntimeError, TimeoutError: a prompt process did not start.

    Timeout: each pull is bounded by 120 s. Cancel (Ctrl-C): decoders are finalized
    and prompt processes stopped before it propagates.
    """
    quick = args.quick
    workloads = args.workload or list(WORKLOADS)
    paths = args.paths or list(ALL_PATHS)
    counts = args.blocks_per_pull or ([1, 4] if quick else [1, 4, 16, 64])
    args.repeats = args.repeats or (3 if quick else 5)
    args.timeout = 120.0
    pool = max(max(counts), 8 if quick else 64)
    kind = (
        "the native local mover alone, aiodatadist._native.copy_local on the same plan "
        "(same blocks, same destination, 2 threads)"
    )
    print(
        f"aiodatadist bench{' --quick' if quick else ''}: pull_blocks of N random non-contiguous "
        f"blocks, all layers, pool of {pool} blocks per tensor;\n"
        f"  GB/s = 1e9 B/s, median of {args.repeats} samples after a warm-up; every pull "
        f"checked byte for byte\n  baseline: {kind},\n  measured in this run, alternated "
        f"with the engine"
    )
    skipped: dict[str, str] = {}
    points: list[Point] = []
    total = len(workloads) * len(counts) * len(paths)
    t_start = time.perf_counter()
    with Progress("bench", total, enabled=args.progress) as bar:
        for wname in workloads:
            points += await run_workload(WORKLOADS[wname], pool, counts, paths, args, bar, skipped)
    elapsed = time.perf_counter() - t_start
    order: dict[str, int] = {name: i for i, name in enumerate(ALL_PATHS)}
    points.sort(key=lambda p: (workloads.index(p.workload), order[p.path], p.blocks))
    print()
    print(_table(points))
    summary = summarize(points)
    print()
    print(
        "ratio = engine median / baseline median, paired = median of per-sample ratios "
        "(engine and baseline alternated);\nper path, geometric mean of the ratios over the "
        "points: " + ", ".join(f"{k} {v['ratio_geomean']:.2f}" for k, v in summary.items())
    )
    print(
        "(plain-C baselines, huge-page accounting and plots: bench/ in the source tree, "
        "bench/README.md)"
    )
    for path, reason in skipped.items():
        print(f"skipped {path}: {reason}")
    print(f"({elapsed:.0f} s)")

    if args.json:
        doc = {
            "meta": {
                "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "command": " ".join(["aiodatadist", *sys.argv[1:]]),
                **host_meta(),
                "quick": quick,
                "pool_blocks": pool,
                "blocks_per_pull": counts,
                "repeats": args.repeats,
                "seed": args.seed,
                "unit": "GB/s = 1e9 bytes/s; median of the samples",
                "elapsed_s": round(elapsed, 1),
            },
            "baseline_kind": "native",
            "baseline": kind,
            "baselines": {p: NATIVE_BASELINE for p in paths},
            "workloads": {
                n: WORKLOADS[n].__dict__ | {"block_bytes": WORKLOADS[n].block_bytes}
                for n in workloads
            },
            "paths": [p for p in paths if p not in skipped],
            "skipped": skipped,
            "results": [p.as_json() for p in points],
            "summary": summary,
        }
        _write(args.json, json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(p.verified for p in points) else 1
