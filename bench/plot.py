"""Draws the bandwidth per data path of a benchmark's JSON report as a PNG.

    .venv/bin/aiodatadist bench --json bench.json
    .venv/bin/python bench/plot.py bench.json bench.png

Reads the JSON of ``aiodatadist bench --json`` (or of ``bench/bench_paths.py --json``):
one panel per workload, the engine's median GB/s per data path against the blocks per
pull (solid), and each path's baseline (dashed, labelled as the report names it).
Needs matplotlib (``pip install 'aiodatadist[bench]'``); the package itself draws
nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PATHS = ("inproc", "shm", "cma", "tcp")
COLORS = {"inproc": "tab:blue", "shm": "tab:green", "cma": "tab:orange", "tcp": "tab:red"}


def results_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The points of a report: ``results`` (``aiodatadist bench``) or every run's
    (``bench_paths.py``)."""
    if "results" in doc:
        return list(doc["results"])
    return [p for run in doc.get("runs", []) for p in run]


def plot(doc: dict[str, Any], out: Path) -> None:
    """Writes ``out`` (PNG) from a report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = results_of(doc)
    workloads = list(dict.fromkeys(p["workload"] for p in points))
    if not workloads:
        raise SystemExit("no results to plot")
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4.2), squeeze=False)
    for ax, wname in zip(axes[0], workloads, strict=True):
        mine = [p for p in points if p["workload"] == wname]
        for path in PATHS:
            pts = sorted(
                (p for p in mine if p["path"] == path and p["median_gbps"]),
                key=lambda p: p["blocks_per_pull"],
            )
            if not pts:
                continue
            memory = f" ({pts[0]['memory']})" if pts[0].get("memory") else ""
            xs = [p["blocks_per_pull"] for p in pts]
            ax.plot(xs, [p["median_gbps"] for p in pts], "o-", color=COLORS[path],
                    label=f"{path}{memory}")  # fmt: skip
            base = [p for p in pts if p.get("baseline_median_gbps")]
            if base:
                ax.plot([p["blocks_per_pull"] for p in base],
                        [p["baseline_median_gbps"] for p in base], "--",
                        color=COLORS[path], alpha=0.5,
                        label=f"baseline of {path}: {base[0]['baseline']}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_title(wname)
        ax.set_xlabel("blocks per pull (all layers)")
        ax.set_ylabel("GB/s (1e9 B/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    kind = doc.get("baseline_kind", "c")
    fig.suptitle(f"aiodatadist pull_blocks bandwidth per data path (baseline: {kind})",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("report", type=Path, help="a benchmark's JSON report")
    ap.add_argument("png", type=Path, help="the PNG to write")
    args = ap.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "bench/plot.py needs matplotlib: pip install 'aiodatadist[bench]'"
        ) from None
    plot(json.loads(args.report.read_text()), args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
