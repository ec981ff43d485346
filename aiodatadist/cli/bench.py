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
from .stats import (
    DISAGREE,
    MIN_FOR_PERCENTILES,
    SMALL_PULL_BYTES,
    Summary,
    fmt_load,
    fmt_num,
    load_average,
)
from .workloads import WORKLOADS

__all__ = [
    "band_cell",
    "geomean_text",
    "host_meta",
    "latency_cell",
    "legend",
    "run_bench",
    "size_text",
    "warning_lines",
]


# --------------------------------------------------------------------------- output


def _fmt_ratio(r: float | None) -> str:
    if r is None:
        return "-"
    return f"{r:.2f}" if r >= 0.1 else f"{r:.3f}" if r >= 0.01 else f"{r:.2g}"


def size_text(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.0f} KiB"


def band_cell(s: Summary | None, ratio: bool = False) -> str:
    """``"12.31 (11.90-12.80)"``: the median and the band the legend names; ``"-"``: none."""
    if s is None:
        return "-"
    f = _fmt_ratio if ratio else fmt_num
    _, lo, hi = s.band
    return f"{f(s.p50)} ({f(lo)}-{f(hi)})" if s.n > 1 else f(s.p50)


def latency_cell(s: Summary | None, kind: str | None = "per transfer") -> str:
    """``"16.2/19.2/58.3"`` (p50/p90/p99 us); ``"mean 1.10"`` where only round means exist."""
    if s is None:
        return "-"
    if kind == "mean per round":
        return f"mean {fmt_num(s.p50)}"
    return f"{fmt_num(s.p50)}/{fmt_num(s.p90)}/{fmt_num(s.p99)}"


def legend(repeats: int) -> str:
    """What the table's figures are: the band, the latency, the warning rule."""
    band = "p10-p90" if repeats >= MIN_FOR_PERCENTILES else "min-max"  # as Summary.band
    return (
        f"figures: median ({band} over the {repeats} rounds; p10-p90 from "
        f"{MIN_FOR_PERCENTILES} rounds up); ratio = engine median / baseline median, "
        f"paired = per-round engine / baseline\n  (engine and baseline alternated round by "
        f"round); latency p50/p90/p99 us: pulls of at most {SMALL_PULL_BYTES >> 20} MiB, each "
        f'timed on its own ("mean": a baseline\n  that times only batches, its median '
        f"round mean); a WARNING when the rounds of one figure disagree: "
        f"(max-min)/median of the round medians > {100 * DISAGREE:.0f}%"
    )


def geomean_text(v: dict[str, Any]) -> str:
    """A path's geometric mean of the ratios, with their min-max over its points."""
    text = f"{v['ratio_geomean']:.2f}"
    if v["points"] > 1:
        text += f" (min-max {v['ratio_min']:.2f}-{v['ratio_max']:.2f} over {v['points']} points)"
    return text


def warning_lines(points: list[Point]) -> list[str]:
    return [w for p in points for w in p.warnings]


def _table(points: list[Point], baseline: str = "native mover") -> str:
    hdr = (f"{'workload':<13} {'path':<6} {'blocks':>6} {'bytes':>10} {'engine GB/s':>20}  "
           f"{baseline + ' GB/s':>20} {'ratio':>7} {'paired':>23}  "
           f"{'engine us p50/90/99':>20} {'baseline us':>16}  check")  # fmt: skip
    lines = [hdr, "-" * len(hdr)]
    for p in points:
        check = "ok" if p.verified else "MISMATCH"
        lat = latency_cell(p.latency)
        blat = latency_cell(p.baseline_latency, p.baseline_latency_kind)
        lines.append(
            f"{p.workload:<13} {p.path:<6} {p.blocks:>6} {size_text(p.bytes):>10} "
            f"{band_cell(p.spread):>20}  {band_cell(p.baseline_spread):>20} "
            f"{_fmt_ratio(p.ratio):>7} {band_cell(p.paired_spread, True):>23}  {lat:>20} "
            f"{blat:>16}  {check}" + (f"  ({p.note})" if p.note else "")
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
    load_start = load_average()
    print(
        f"aiodatadist bench{' --quick' if quick else ''}: pull_blocks of N random non-contiguous "
        f"blocks, all layers, pool of {pool} blocks per tensor;\n"
        f"  GB/s = 1e9 B/s, median of {args.repeats} samples after a warm-up; every pull "
        f"checked byte for byte\n  baseline: {kind},\n  measured in this run, alternated "
        f"with the engine\n{fmt_load('start', load_start)}"
    )
    skipped: dict[str, str] = {}
    points: list[Point] = []
    total = len(workloads) * len(counts) * len(paths)
    t_start = time.perf_counter()
    with Progress("bench", total, enabled=args.progress) as bar:
        for wname in workloads:
            points += await run_workload(WORKLOADS[wname], pool, counts, paths, args, bar, skipped)
    elapsed = time.perf_counter() - t_start
    load_end = load_average()
    order: dict[str, int] = {name: i for i, name in enumerate(ALL_PATHS)}
    points.sort(key=lambda p: (workloads.index(p.workload), order[p.path], p.blocks))
    print()
    print(_table(points))
    summary = summarize(points)
    warnings = warning_lines(points)
    print()
    print(legend(args.repeats))
    print(
        "per path, geometric mean of the ratios over the points: "
        + ", ".join(f"{k} {geomean_text(v)}" for k, v in summary.items())
    )
    print(
        "(plain-C baselines, huge-page accounting and plots: bench/ in the source tree, "
        "bench/README.md)"
    )
    for path, reason in skipped.items():
        print(f"skipped {path}: {reason}")
    print(fmt_load("end", load_end))
    for w in warnings:
        print(w)
    print(f"({elapsed:.0f} s, {len(warnings)} warning{'s' * (len(warnings) != 1)})")

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
                "loadavg_start": load_start,
                "loadavg_end": load_end,
                "band": "p10-p90" if args.repeats >= MIN_FOR_PERCENTILES else "min-max",
                "disagree_threshold": DISAGREE,
                "small_pull_bytes": SMALL_PULL_BYTES,
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
            "warnings": warnings,
        }
        _write(args.json, json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(p.verified for p in points) else 1
