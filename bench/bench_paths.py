"""The data paths between two processes against plain-C baselines, measured in the same run.

    .venv/bin/python bench/bench_paths.py [--repeats 9] [--runs 3] [--json PATH]

The cross-process issue's measurement (item 6): a 1 GiB ``llama8b-fp16`` pull
(64 random non-contiguous blocks of all 64 tensors, 4096 segments of 256 KiB)
through the engine (``await cache_manager.pull_blocks(...)``) from a prompt in
another process, on each data path:

========  =========================================  ===========================================
path      engine                                     baseline (``bench/c/baselines.c``)
========  =========================================  ===========================================
``shm``   the prompt's cache allocated in POSIX      ``memcpy --src-shm``, 2 threads: the same
          shared memory; the decoder maps it and     gather from a POSIX shared-memory source
          copies (``MoverThreads`` = 2)
``cma``   the prompt's cache registered (anonymous,  ``cma``: ``process_vm_readv`` from a forked
          ``MADV_HUGEPAGE``); ``process_vm_readv``   child, 2 threads
``tcp``   the same cache; ``sendmsg`` / ``readv``    ``tcp``: ``writev`` / ``readv`` over 2
          over ``TcpStreams`` = 2 loopback streams   loopback streams (``--tcp-batch-bytes``: a
                                                     cap per call, e.g. the mover's 4 MiB)
========  =========================================  ===========================================

Every buffer of both sides is of the same kind as its counterpart's: the decoder's
destination (and every C destination) is anonymous memory advised with
``MADV_HUGEPAGE``, as are the registered prompt cache and the C sources of ``cma``
and ``tcp``; the ``shm`` path and its baseline read from POSIX shared memory, which
gets huge pages only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
allows it. The ``huge e/b`` column says how much of each side's memory the kernel
really backed with huge pages (``/proc/PID/smaps``).

The engine's and the baseline's transfers alternate (ABBA) after one warm-up each;
``--repeats`` samples each (>= 7). ``ratio`` = engine median / baseline median;
``paired`` = median of the per-sample ratios, which the goal (>= 0.9x) is judged on.
``--runs N`` repeats the whole measurement (fresh processes) and summarizes the
paired ratios over the runs. The machinery is ``aiodatadist bench``'s
(``aiodatadist.cli.measure.run_workload``), with the C baselines of ``cbaselines.py`` and
the memory accounting of ``memory_accounting.py``; every pull is checked byte for byte,
every baseline by the hash of its blocks and its destination.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from cbaselines import baseline_spec, c_baselines, find_c_baselines
from memory_accounting import host_meta, memory_note, observe

from aiodatadist import _native
from aiodatadist.cli import measure as measure_mod
from aiodatadist.cli.bench import band_cell, warning_lines
from aiodatadist.cli.measure import Point, run_workload
from aiodatadist.cli.stats import DISAGREE, disagree_warning, fmt_load, load_average, summarize
from aiodatadist.cli.workloads import DEFAULT_SEED, WORKLOADS

GOAL = 0.9
PATHS = ("shm", "cma", "tcp")
GOAL_TEXT = {
    "shm": "shm >= 0.9x the 2-thread C memcpy gather",
    "cma": "cma >= 0.9x the 2-thread C process_vm_readv gather",
    "tcp": "tcp >= 0.9x 2-stream C loopback TCP",
}


# The decoder's destination: ``aligned``, run_workload's own (one 2 MiB-aligned mapping,
# MADV_HUGEPAGE); ``numpy``, one ``np.empty`` per tensor as numpy allocates it (16 bytes
# into a page: relatively misaligned to the page-aligned source), touched.
DSTS = ("aligned", "numpy")
DST_TEXT = {"numpy": " (into numpy arrays, 16 bytes into a page)"}


def _dst(p: Point) -> str:
    return str(p.extra.get("dst", "aligned"))


def _numpy_dst(shape: tuple[int, ...], dtype: Any) -> list[Any]:
    """run_workload's destination as numpy allocates it: one array per tensor, touched."""
    import numpy as np

    out = [np.empty(shape[1:], dtype=dtype) for _ in range(shape[0])]
    for t in out:
        t.view(np.uint8).fill(0)
    return out


class FaultCounter:
    """Minor page faults of this process (the decoder) per ``pull_blocks``, per measurement.

    ``observe`` (run after each measurement) takes the counts since the last one: the
    first is the warm-up pull (it maps a peer's memory), the rest are warm pulls.
    """

    def __init__(self) -> None:
        self.counts: list[int] = []

    def install(self) -> None:
        import resource

        from aiodatadist.cache_manager import CacheManager

        orig = CacheManager.pull_blocks
        counts = self.counts

        async def pull_blocks(cm: Any, *a: Any, **kw: Any) -> Any:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            try:
                return await orig(cm, *a, **kw)
            finally:
                counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

        CacheManager.pull_blocks = pull_blocks  # type: ignore[method-assign]

    def observe(self, dst: str) -> Any:
        def hook(point: Point, engine: Any, base: Any, mem: list[Any]) -> None:
            observe(point, engine, base, mem)
            point.extra["dst"] = dst
            if dst != "aligned":
                point.extra["memory"] = f"{point.extra.get('memory', '')}/{dst}"
            warm = sorted(self.counts[1:])
            point.extra["faults_per_pull"] = {
                "first": self.counts[0] if self.counts else None,
                "warm_median": statistics.median(warm) if warm else None,
                "warm_max": warm[-1] if warm else None,
            }
            self.counts.clear()

        return hook


def _faults(p: Point) -> str:
    f = p.extra.get("faults_per_pull") or {}
    return "-" if f.get("warm_median") is None else f"{f['warm_median']:.0f}/{f['warm_max']}"


def _span(xs: list[float]) -> str:
    """The band of the samples: p10..p90 from 10 up, else min..max (aiodatadist.cli.stats)."""
    s = summarize(xs)
    return f"{s.band[1]:.2f}..{s.band[2]:.2f}" if s else "-"


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _verdict(p: Point) -> str:
    r = p.paired_ratio
    if r is None:
        return "-"
    return f">= {GOAL}x {'met' if r >= GOAL else 'MISSED'}"


def table(points: list[Point]) -> str:
    hdr = (
        f"{'path':<5} {'memory':<17} {'engine GB/s':>11} {'spread':>12}  {'baseline':<24} "
        f"{'GB/s':>6} {'spread':>12} {'ratio':>6} {'paired (spread)':>17}  {'huge e/b':<9}  "
        f"{'faults':>7}  goal"
    )
    lines = [hdr, "-" * (len(hdr) + 16)]
    for p in points:
        huge = "/".join(
            "?" if x is None else f"{100 * x:.0f}%"
            for x in (p.extra.get("huge_pages_engine"), p.extra.get("huge_pages_baseline"))
        )
        flag = "" if p.verified else "  DATA MISMATCH"
        memory = p.extra.get("memory", "")
        lines.append(
            f"{p.path:<5} {memory:<17} {_f(p.median, '.2f'):>11} {_span(p.samples):>12}  "
            f"{p.baseline or '-':<24} {_f(p.baseline_median, '.2f'):>6} "
            f"{_span(p.baseline_samples):>12} {_f(p.ratio):>6} "
            f"{band_cell(p.paired_spread, True):>17}  {huge:<9}  {_faults(p):>7}  "
            f"{_verdict(p)}{flag}" + (f"  ({p.note})" if p.note else "")
        )
    return "\n".join(lines)


def summary(runs: list[list[Point]], tcp_batch_bytes: int = 0) -> dict[str, dict[str, Any]]:
    """Per path, over the runs: the medians and the paired ratios, and the verdict."""
    out: dict[str, dict[str, Any]] = {}
    for path, dst in [(p, d) for p in PATHS for d in DSTS]:
        pts = [p for run in runs for p in run if p.path == path and _dst(p) == dst]
        paired = [p.paired_ratio for p in pts if p.paired_ratio is not None]
        if not paired:
            continue
        med = statistics.median(paired)
        out[path if dst == "aligned" else f"{path}/{dst}"] = {
            "goal": GOAL_TEXT[path]
            + (
                " (capped calls: stronger than the plain one)"
                if path == "tcp" and tcp_batch_bytes
                else ""
            )
            + (DST_TEXT[dst] if dst != "aligned" else ""),
            "dst": dst,
            "faults_per_pull": [p.extra.get("faults_per_pull") for p in pts],
            "baseline": pts[0].baseline,
            "memory": pts[0].extra.get("memory", ""),
            "runs": len(pts),
            "engine_median_gbps": [round(p.median or 0, 4) for p in pts],
            "baseline_median_gbps": [round(p.baseline_median or 0, 4) for p in pts],
            "paired_ratios": [round(r, 4) for r in paired],
            "paired_ratio_median": round(med, 4),
            "paired_ratio_min": round(min(paired), 4),
            "paired_ratio_max": round(max(paired), 4),
            "goal_met": med >= GOAL,
        }
    return out


async def measure(args: argparse.Namespace) -> list[list[Point]]:
    exe, why = find_c_baselines()
    if exe is None:
        raise SystemExit(f"no C baselines: {why}")
    w = WORKLOADS["llama8b-fp16"]
    runs: list[list[Point]] = []
    for i in range(args.runs):
        t0 = time.perf_counter()
        load = os.getloadavg()[0]
        skipped: dict[str, str] = {}
        points = []
        for dst in args.dst:
            # The numpy case: run_workload's destination allocated by numpy instead.
            orig_buffer = measure_mod.host_buffer
            if dst == "numpy":
                measure_mod.host_buffer = _numpy_dst  # type: ignore[assignment]
            try:
                points += await run_workload(
                    w, args.pool, [args.blocks], args.paths, args, None, skipped,
                    baseline=c_baselines(exe, args.tcp_batch_bytes),
                    observe=args.faults.observe(dst),
                )  # fmt: skip
            finally:
                measure_mod.host_buffer = orig_buffer
        order = {p: k for k, p in enumerate(PATHS)}
        points.sort(key=lambda p: (order[p.path], DSTS.index(_dst(p))))
        runs.append(points)
        print(
            f"\nrun {i + 1}/{args.runs} ({time.perf_counter() - t0:.0f} s, load average "
            f"{load:.2f} at the start)",
            flush=True,
        )
        print(table(points), flush=True)
        for path, reason in skipped.items():
            print(f"skipped {path}: {reason}")
        for line in warning_lines(points):
            print(line, flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=9, help="alternated samples (>= 7; default 9)")
    ap.add_argument("--runs", type=int, default=1, help="whole measurements (default 1)")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated (shm,cma,tcp)")
    ap.add_argument("--blocks", type=int, default=64, help="random blocks per pull (64: 1 GiB)")
    ap.add_argument("--pool", type=int, default=64, help="blocks per tensor on each side")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument(
        "--tcp-batch-bytes",
        type=int,
        default=0,
        help="cap the C TCP baseline's calls (0: IOV_MAX iovecs per call, the plain one)",
    )
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an init option of the decoders (e.g. aiodatadist.MoverThreads=2), repeatable",
    )
    ap.add_argument(
        "--dst",
        default=",".join(DSTS),
        help="the decoder's destinations, comma-separated: aligned (one 2 MiB-aligned "
        "mapping), numpy (np.empty per tensor, 16 bytes into a page); default both",
    )
    ap.add_argument(
        "--copy-mode",
        default="auto",
        choices=("auto", "memcpy", "stream"),
        help="the local mover's kernel in the decoder (_native.set_copy_mode; memcpy: as "
        "before issue 13)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    args.paths = [p for p in args.paths.split(",") if p]
    if not args.paths or any(p not in PATHS for p in args.paths):
        ap.error(f"--paths: a comma-separated subset of {','.join(PATHS)}")
    args.dst = [d for d in args.dst.split(",") if d]
    if not args.dst or any(d not in DSTS for d in args.dst):
        ap.error(f"--dst: a comma-separated subset of {','.join(DSTS)}")
    _native.set_copy_mode(args.copy_mode)
    args.faults = FaultCounter()
    args.faults.install()
    if args.repeats < 7:
        ap.error("--repeats must be >= 7")
    if not 1 <= args.blocks <= args.pool:
        ap.error("--blocks must be in [1, --pool]")
    args.timeout = 120.0
    args.decoder_options = dict(o.partition("=")[::2] for o in args.option)

    w = WORKLOADS["llama8b-fp16"]
    nbytes = args.blocks * w.num_tensors * w.block_bytes
    print(
        f"llama8b-fp16: {args.blocks} random blocks x {w.num_tensors} tensors = "
        f"{nbytes / 2**20:.0f} MiB per pull ({args.blocks * w.num_tensors} segments), between "
        f"two processes;\n{args.repeats} alternated samples per side after a warm-up; GB/s = "
        f"1e9 B/s; baselines: "
        + ", ".join(f"{p}: {baseline_spec(p, args.tcp_batch_bytes).label}" for p in args.paths)
        + (f"; decoder options {args.decoder_options}" if args.decoder_options else ""),
        flush=True,
    )
    load_start = load_average()
    print(fmt_load("start", load_start), flush=True)
    t0 = time.perf_counter()
    runs = asyncio.run(measure(args))
    elapsed = time.perf_counter() - t0
    load_end = load_average()
    print()
    print(memory_note())
    print(
        "spread = p10..p90 of the samples from 10 up, else min..max; paired (spread) = median "
        "(band) of the per-sample ratios;\na WARNING when the samples (or runs) of one figure "
        f"disagree: (max-min)/median > {100 * DISAGREE:.0f}%"
    )
    summ = summary(runs, args.tcp_batch_bytes)
    print(f"\nGoals (paired ratio; median over {args.runs} run{'s' * (args.runs > 1)}):")
    for s in summ.values():
        spread = (
            f" (runs: {', '.join(f'{r:.3f}' for r in s['paired_ratios'])})" if args.runs > 1 else ""
        )
        verdict = "met" if s["goal_met"] else "MISSED"
        print(f"  {s['goal']:<52} paired {s['paired_ratio_median']:.3f}{spread}: {verdict}")
    warnings = [w for run in runs for w in warning_lines(run)]
    for s in summ.values():  # across runs: the paired ratios of one path
        line = disagree_warning(f"{s['goal']}, paired ratio over the runs", s["paired_ratios"])
        if line:
            print(line)
            warnings.append(line)
    print(fmt_load("end", load_end))
    print(f"({elapsed:.0f} s, {len(warnings)} warning{'s' * (len(warnings) != 1)})")
    if args.json:
        doc = {
            "meta": {
                "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
                **host_meta(),
                "workload": "llama8b-fp16",
                "blocks": args.blocks,
                "pool": args.pool,
                "bytes_per_pull": nbytes,
                "repeats": args.repeats,
                "runs": args.runs,
                "seed": args.seed,
                "decoder_options": args.decoder_options,
                "tcp_batch_bytes": args.tcp_batch_bytes,
                "dst": args.dst,
                "copy_mode": args.copy_mode,
                "unit": "GB/s = 1e9 bytes/s",
                "elapsed_s": round(elapsed, 1),
                "loadavg_start": load_start,
                "loadavg_end": load_end,
                "disagree_threshold": DISAGREE,
            },
            "memory_note": memory_note(),
            "warnings": warnings,
            "runs": [[p.as_json() for p in run] for run in runs],
            "summary": summ,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    if not all(p.verified for run in runs for p in run):
        raise SystemExit("a destination check failed")


if __name__ == "__main__":
    main()
