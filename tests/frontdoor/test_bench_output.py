"""Bench output people can trust (issue 13 item 5): spreads, the disagreement warning,
latency for small pulls, named baselines, the load, the same fields in JSON.

The helper (``aiodatadist.cli.stats``) table-driven; then real (small) runs of
``aiodatadist bench`` and of ``bench/*.py`` whose output must carry those fields.
Nothing here asserts on speed (DESIGN.md, "Rules of the house").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aiodatadist.cli.bench import run_bench
from aiodatadist.cli.measure import NATIVE_BASELINE, Point
from aiodatadist.cli.stats import (
    DISAGREE,
    MIN_FOR_PERCENTILES,
    SMALL_PULL_BYTES,
    Summary,
    disagree_warning,
    disagreement,
    fmt,
    fmt_latency,
    fmt_load,
    fmt_num,
    load_average,
    percentile,
    summarize,
)
from aiodatadist.cli.workloads import DEFAULT_SEED

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"

# --------------------------------------------------------------------------- the helper


@pytest.mark.parametrize(
    ("xs", "q", "expected"),
    [
        ([7.0], 0.0, 7.0),
        ([7.0], 0.5, 7.0),
        ([7.0], 0.99, 7.0),
        ([1, 2], 0.5, 1.5),
        ([1, 2], 0.1, 1.1),
        ([1, 2], 0.9, 1.9),
        ([5, 1, 4, 2, 3], 0.0, 1.0),  # unsorted input
        ([5, 1, 4, 2, 3], 0.1, 1.4),
        ([5, 1, 4, 2, 3], 0.5, 3.0),
        ([5, 1, 4, 2, 3], 0.9, 4.6),
        ([5, 1, 4, 2, 3], 0.99, 4.96),
        ([5, 1, 4, 2, 3], 1.0, 5.0),
        (list(range(101)), 0.99, 99.0),
        (list(range(11)), 0.1, 1.0),
        ([3, 3, 3, 9], 0.5, 3.0),
    ],
)
def test_percentile_interpolates_between_order_statistics(
    xs: list[float], q: float, expected: float
) -> None:
    assert percentile(xs, q) == pytest.approx(expected)
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, 100 * q)))  # numpy's


@pytest.mark.parametrize(("xs", "q"), [([], 0.5), ([1.0], -0.1), ([1.0], 1.01), ([1.0], math.nan)])
def test_percentile_rejects_no_samples_and_bad_quantiles(xs: list[float], q: float) -> None:
    with pytest.raises(ValueError):
        percentile(xs, q)


@pytest.mark.parametrize(
    ("n", "band"),
    [(1, "min-max"), (2, "min-max"), (MIN_FOR_PERCENTILES - 1, "min-max"),
     (MIN_FOR_PERCENTILES, "p10-p90"), (1000, "p10-p90")],
)  # fmt: skip
def test_summary_band_is_min_max_below_ten_samples(n: int, band: str) -> None:
    xs = [float(i) for i in range(n)]
    s = summarize(reversed(xs))
    assert s is not None and s.n == n
    assert (s.min, s.max, s.median) == (0.0, n - 1.0, percentile(xs, 0.5))
    assert s.min <= s.p10 <= s.p50 <= s.p90 <= s.p99 <= s.max
    kind, lo, hi = s.band
    assert kind == band
    assert (lo, hi) == ((s.p10, s.p90) if band == "p10-p90" else (s.min, s.max))
    js = s.as_json()
    assert js["band"] == band and js["n"] == n
    assert {"min", "p10", "p50", "p90", "p99", "max", "band_lo", "band_hi"} <= set(js)
    assert summarize([]) is None


@pytest.mark.parametrize(
    ("medians", "expected"),
    [
        ([], None),
        ([10.0], None),  # one round: nothing to disagree with
        ([10.0, 10.0], 0.0),
        ([90.0, 100.0, 110.0], 0.2),
        ([8.0, 10.0, 12.0], 0.4),
        ([12.0, 8.0, 10.0, 10.0], 0.4),  # order does not matter; median of 4 = 10
        ([1.0, 1.0, 1.0, 5.0], 4.0),
        ([0.0, 0.0], None),  # no median to divide by
    ],
)
def test_disagreement_is_range_over_median_of_round_medians(
    medians: list[float], expected: float | None
) -> None:
    got = disagreement(medians)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    ("medians", "warns"),
    [
        ([100.0, 100.0, 100.0], False),
        ([90.0, 100.0, 110.0], False),  # exactly 20%: not more than 20%
        ([90.0, 100.0, 110.5], True),  # 20.5%
        ([10.0, 13.0], True),  # 2 rounds: (13-10)/11.5 = 26%
        ([10.0, 12.0], False),  # 2/11 = 18%
        ([50.0], False),
        ([], False),
    ],
)
def test_disagree_warning_rule(medians: list[float], warns: bool) -> None:
    w = disagree_warning("small shm 1 block, engine latency", medians, "us")
    assert (w is not None) == warns
    if w is not None:
        pct = round(100 * (max(medians) - min(medians)) / float(np.median(medians)))
        assert w.startswith("WARNING: small shm 1 block, engine latency: ")
        assert f"disagree by {pct}%" in w and f"> {100 * DISAGREE:.0f}%" in w
        assert w.endswith(" us") and fmt_num(medians[0]) in w  # the round medians are shown


@pytest.mark.parametrize(
    ("s", "unit", "text"),
    [
        (Summary(50, 13.5, 13.9, 14.2, 15.1, 18.0, 40.0), "us", "14.2 us (p10-p90 13.9-15.1)"),
        (Summary(5, 1.234, 1.3, 1.43, 1.6, 1.7, 1.71), "GB/s", "1.43 GB/s (min-max 1.23-1.71)"),
        (Summary(3, 0.5, 0.51, 0.512, 0.52, 0.53, 0.53), "", "0.512 (min-max 0.500-0.530)"),
        (Summary(1, 549.0, 549.0, 549.0, 549.0, 549.0, 549.0), "us", "549 us"),
        (None, "us", "-"),
    ],
)
def test_fmt_writes_median_and_named_band(s: Summary | None, unit: str, text: str) -> None:
    assert fmt(s, unit) == text


def test_fmt_latency_and_load() -> None:
    s = Summary(1000, 10.0, 12.0, 14.2, 15.1, 18.04, 400.0)
    assert fmt_latency(s) == "p50 14.2 / p90 15.1 / p99 18.0 us"
    assert fmt_latency(None) == "-"
    load = load_average()
    assert load is None or (len(load) == 3 and all(x >= 0 for x in load))
    line = fmt_load("start", [1.5, 0.25, 2.0])
    assert line.startswith("load average at start (1/5/15 min): 1.50 0.25 2.00 on ")
    assert fmt_load("end", None) == "load average at end: unknown"


def test_point_reports_spreads_latency_and_warnings() -> None:
    """The figures a Point carries into the table and the JSON (made from given samples)."""
    lats = [[30.0, 31.0, 90.0], [30.0, 32.0, 33.0], [29.0, 30.0, 31.0]]
    small = Point("small", "shm", 1, 32 << 10, 64, samples=[1.0, 1.1, 1.6], verified=True,
                  baseline=NATIVE_BASELINE, baseline_samples=[20.0, 21.0, 22.0],
                  latencies_us=lats)  # fmt: skip
    assert small.small and small.bytes <= SMALL_PULL_BYTES
    assert small.latency is not None and small.latency.n == 9 and small.latency.p50 == 31.0
    assert small.latency_round_medians == [31.0, 32.0, 30.0]  # 6.5%: no latency warning
    base_lat = small.baseline_latency  # mean us per transfer, one per round
    assert base_lat is not None and base_lat.p50 == pytest.approx((32 << 10) / 21e3)
    assert small.baseline_latency_kind == "mean per round"
    assert small.paired_spread is not None and small.paired_spread.n == 3
    (w,) = small.warnings  # engine GB/s: (1.6-1.0)/1.1 = 55%; the baseline's 9.5%: none
    assert w.startswith("WARNING: small shm 1 block, engine GB/s: its 3 rounds disagree by 55%")
    js = json.loads(json.dumps(small.as_json()))
    assert js["spread_gbps"]["band"] == "min-max" and js["spread_gbps"]["p50"] == 1.1
    assert js["baseline_spread_gbps"]["max"] == 22.0
    p99 = percentile([x for r in lats for x in r], 0.99)
    assert js["latency_us"]["p99"] == pytest.approx(p99, abs=1e-4)
    assert js["disagreement"]["engine"] == pytest.approx(0.5455, abs=1e-4)
    assert js["disagreement"]["engine_latency"] == pytest.approx(2 / 31, abs=1e-4)
    assert js["warnings"] == [w] and js["baseline"] == NATIVE_BASELINE

    small.baseline_latencies_us = [[1.0, 1.5], [2.0, 9.0], [1.2, 1.1]]  # timed one by one
    assert small.baseline_latency_kind == "per transfer"
    assert small.baseline_latency == summarize([1.0, 1.5, 2.0, 9.0, 1.2, 1.1])

    big = Point("llama8b-fp16", "cma", 64, 1 << 30, 4096, samples=[15.0, 16.0], verified=True)
    assert not big.small and big.latency is None and big.baseline_latency is None
    assert big.baseline_latency_kind is None
    assert big.warnings == [] and big.as_json()["latency_us"] is None


# --------------------------------------------------------------------------- real runs


def _bench_args(json_path: Path) -> argparse.Namespace:
    return argparse.Namespace(
        quick=True, workload=["small"], paths=["inproc"], blocks_per_pull=[1, 2],
        repeats=3, seed=DEFAULT_SEED, json=str(json_path), progress=False,
    )  # fmt: skip


@pytest.mark.asyncio
async def test_aiodatadist_bench_prints_spreads_latency_load_and_names_the_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The smallest ``aiodatadist bench`` (in-process path): every output field present."""
    js = tmp_path / "bench.json"
    assert await run_bench(_bench_args(js)) == 0
    out = capsys.readouterr().out
    assert "load average at start (1/5/15 min): " in out
    assert "load average at end (1/5/15 min): " in out
    assert "native mover GB/s" in out and "engine us p50/90/99" in out and "baseline us" in out
    assert "min-max over the 3 rounds" in out and "> 20%" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("small ")]
    assert len(rows) == 2
    for row in rows:
        assert re.search(r"\d \([\d.]+-[\d.]+\)", row), row  # median (low-high)
        # engine and native mover latency: p50/p90/p99 us, each pull timed on its own
        # (figures may touch: "14.0/15.4/27.6 0.971/0.992/1.12" shares its one space)
        assert len(re.findall(r"(?<!\S)[\d.]+/[\d.]+/[\d.]+(?!\S)", row)) == 2, row
    doc = json.loads(js.read_text())
    meta = doc["meta"]
    assert len(meta["loadavg_start"]) == len(meta["loadavg_end"]) == 3
    assert meta["band"] == "min-max" and meta["disagree_threshold"] == DISAGREE
    assert isinstance(doc["warnings"], list)
    assert sum(ln.startswith("WARNING: ") for ln in out.splitlines()) == len(doc["warnings"])
    for r in doc["results"]:
        assert r["verified"] is True and r["baseline"] == NATIVE_BASELINE
        assert r["spread_gbps"]["n"] == r["baseline_spread_gbps"]["n"] == 3
        assert r["paired_ratio_spread"]["n"] == 3
        lat = r["latency_us"]  # every pull timed: 3 rounds of many pulls
        assert lat["n"] == sum(len(x) for x in r["latency_rounds_us"]) > 3
        assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
        base = r["baseline_latency_us"]  # the native mover times each transfer too
        assert r["baseline_latency_kind"] == "per transfer" and base["n"] == lat["n"]
        assert set(r["disagreement"]) == {"engine", "engine_latency", "baseline"}
        assert set(r["warnings"]) <= set(doc["warnings"])


def _run(script: str, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _check_load(text: str, doc: dict[str, object]) -> None:
    assert "load average at start" in text and "load average at end" in text
    assert isinstance(doc["warnings"], list)
    for w in doc["warnings"]:  # type: ignore[attr-defined]
        assert w.startswith("WARNING: ") and w in text


@pytest.mark.slow  # a benchmark run
def test_bench_engine_small_run_prints_latency_percentiles(tmp_path: Path) -> None:
    js = tmp_path / "e.json"
    proc = _run("bench_engine.py", "--blocks", "1", "--repeats", "2", "--json", str(js))
    out = proc.stdout
    doc = json.loads(js.read_text())
    _check_load(out, doc)
    assert len(doc["loadavg_start"]) == 3 and doc["baseline"] == NATIVE_BASELINE
    assert re.search(r"pull_blocks\(\.\.\.\): +p50 [\d.]+ / p90 [\d.]+ / p99 [\d.]+ us", out)
    assert f"{NATIVE_BASELINE}:" in out and "(min-max " in out
    tiny, big = doc["tiny"], doc["big"]
    assert tiny["facade_us"]["n"] == tiny["native_us"]["n"] == tiny["calls"] == 400
    assert len(tiny["overhead_us"]["round_medians"]) == 2
    for fig in (big["facade_gbps"], big["native_gbps"], big["paired_ratio"]):
        assert fig["n"] == 2 and fig["band"] == "min-max" and "disagreement" in fig
    assert big["verified"] is True and big["lag_ms"]["n"] > 0


@pytest.mark.slow  # a benchmark run
def test_bench_sync_small_run_prints_spreads(tmp_path: Path) -> None:
    js = tmp_path / "s.json"
    proc = _run("bench_sync.py", "--repeats", "40", "--rounds", "2", "--json", str(js))
    doc = json.loads(js.read_text())
    _check_load(proc.stdout, doc)
    assert "us (p10-p90 " in proc.stdout and " / p99 " in proc.stdout
    assert "two-lock thread ping-pong (floor)" in proc.stdout
    for side in ("async", "sync"):
        assert doc[side]["n"] == 80 and len(doc[side]["round_medians_us"]) == 2
    assert doc["delta"]["band"] == "min-max" and doc["disagree_threshold"] == DISAGREE


@pytest.mark.slow  # a benchmark run (builds the C baselines when missing)
def test_bench_movers_small_run_names_baselines_and_spreads(tmp_path: Path) -> None:
    if not os.access(BENCH / "build.sh", os.X_OK):
        pytest.skip("no bench/build.sh")
    js = tmp_path / "m.json"
    proc = _run("bench_movers.py", "--quick", "--blocks", "1", "--repeats", "2",
                "--only", "memcpy", "--no-numpy", "--json", str(js))  # fmt: skip
    doc = json.loads(js.read_text())
    _check_load(proc.stdout + proc.stderr, doc["meta"])
    assert "plain-C memcpy gather" in proc.stdout and "spread = min-max" in proc.stdout
    rows = doc["results"]
    assert {r["mover"] for r in rows} == {"plain-C memcpy gather", "native copy_local"}
    for r in rows:
        assert r["spread_gbps"]["n"] == 2 and "disagreement" in r and "warning" in r
        if r["mover"] == "native copy_local":
            assert r["baseline"] == "plain-C memcpy gather"
            assert r["paired_ratio_spread"]["n"] == 2
