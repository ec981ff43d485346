"""``bench/bench_engines.py`` (the engine paths against the engines driven directly) and the
layout mode of ``bench/engines.py``, run as a user runs them: every side printed, the
JSON complete, every side's bytes checked.

Nothing here asserts on speed (DESIGN.md, "Rules of the house"). An engine that cannot
run here skips its tests with the reason (``tests._engines.require_engine``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodatadist.config import DataPath
from aiodatadist.testing import host_buffer
from aiodatadist.testing.patterns import fill_pattern
from tests._engines import require_engine
from tests.frontdoor.test_bench_paths import BENCH, REPO, bench_module


def _layout() -> dict[str, object]:
    return {
        "tensors": 3, "pool": 5, "block_bytes": 4096, "seed": 77,
        "pulls": {
            "big": {"src": [4, 0, 2], "dst": [1, 3, 0], "tensors": [0, 3]},
            "tiny": {"src": [1], "dst": [2], "tensors": [1, 1]},
        },
    }  # fmt: skip


def test_layout_checksum_is_the_checksum_of_the_pulled_blocks() -> None:
    """``layout_expected`` (from the pattern) equals the checksum of a destination that
    really holds the source's blocks, in descriptor order, and a flipped byte shows."""
    engines = bench_module("engines")
    lay = _layout()
    src = host_buffer((3, 5, 4096), np.uint8)
    fill_pattern(list(src), 77)
    dst = np.zeros_like(src)
    for name in ("big", "tiny"):
        segs = engines.layout_segments(lay, name)
        for t, s, d in segs:
            dst[t, d] = src[t, s]
        views = [dst[t, d] for t, _, d in segs]
        assert engines.gathered_checksum(views) == engines.layout_expected(lay, name)
        # the same as the checksum of the concatenation
        assert engines.gathered_checksum(views) == engines.checksum(np.concatenate(views))
    assert [(t, s, d) for t, s, d in engines.layout_segments(lay, "big")][:4] == [
        (0, 4, 1), (0, 0, 3), (0, 2, 0), (1, 4, 1),
    ]  # fmt: skip
    dst[2, 0, 100] ^= 1
    views = [dst[t, d] for t, _, d in engines.layout_segments(lay, "big")]
    assert engines.gathered_checksum(views) != engines.layout_expected(lay, "big")


def test_report_judges_both_goals_against_every_direct_mode() -> None:
    b = bench_module("bench_engines")
    lay = b.make_layout(8, 4, 1)
    nbytes = b.pull_bytes(lay, b.BIG)
    assert nbytes == 4 * 64 * 256 * 1024

    def us_at(gbps: float) -> float:
        return float(nbytes / (gbps * 1e3))

    a = b.Side("aiodatadist", "aiodatadist nixl", verified={"big": [True, True]})
    a.samples = {"big": [[us_at(9.6)], [us_at(9.6)]], "tiny": [[11.0, 12.0], [12.0, 11.0]]}
    a.verified["tiny"] = [True, True]
    fresh = b.Side("direct-fresh", "NIXL direct, fresh", verified={"big": [True, True]})
    fresh.samples = {"big": [[us_at(10.0)], [us_at(10.0)]], "tiny": [[10.0, 10.0], [10.0, 10.0]]}
    fresh.verified["tiny"] = [True, False]
    reuse = b.Side("direct-reuse", "NIXL direct, reuse", why="unavailable: no NIXL here")
    text, js = b.report("nixl", lay, [a, fresh, reuse], b.BIG)
    out = "\n".join(text)
    assert "GOAL NIXL big" in out and "0.96x met" in out  # 9.6 / 10 >= 0.95
    assert "no NIXL here" in out
    assert js["comparisons"][0]["met"] is True and js["comparisons"][0]["ratio"] == 0.96
    text, js = b.report("nixl", lay, [a, fresh, reuse], b.TINY)
    out = "\n".join(text)
    assert "1.15x met" in out  # p50 11.5 / 10 <= 1.2
    assert "DATA MISMATCH" in out  # the direct side failed one check
    a.samples["tiny"] = [[20.0, 20.0], [20.0, 60.0]]
    text, js = b.report("nixl", lay, [a, fresh], b.TINY)
    out = "\n".join(text)
    assert "2.00x MISSED" in out and "WARNING" in out  # rounds 20 and 40: they disagree
    assert js["comparisons"][0]["met"] is False
    json.dumps(js)


def _run_quick(tmp_path: Path, engine: str, path: str) -> dict[str, Any]:
    js_path = tmp_path / f"{engine}.json"
    argv = [
        sys.executable, str(BENCH / "bench_engines.py"), "--quick", "--engines", engine,
        "--blocks", "4", "--repeats", "2", "--tiny-repeats", "6", "--tiny-rounds", "2",
        "--warmup", "2", "--aiodatadist-path", path, "--json", str(js_path),
        "--breakdown", "5", "--nixl-modes", "fresh,reuse,chunked", "--nixl-chunk", "7",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280, cwd=REPO)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "load average at start" in out and "load average at end" in out
    assert f"GOAL {bench_module('bench_engines').ENGINE_NAMES[engine]} big" in out
    result: dict[str, Any] = json.loads(js_path.read_text())
    (eng,) = result["engines"]
    assert eng["aiodatadist_path"] == path
    for pull in eng["pulls"]:
        for side in pull["sides"]:
            # it ran: every round's pulls timed, its bytes checked after warm-up and at the end
            assert side["why"] is None, side
            assert side["verified"] == [True, True], side
            assert len(side["round_figures"]) == 2, side
        assert len(pull["comparisons"]) == len(pull["sides"]) - 1
    # --breakdown: 5 tiny pulls and 2 big ones timed inside the decoder
    assert "where aiodatadist's time goes" in out
    bd = eng["breakdown"]
    assert len(bd["tiny"]["us"]) == 5 and len(bd["big"]["us"]) == 2
    buckets = bd["tiny"]["buckets"]
    # Each timed tiny pull took the engine: its path (a small read begun on the loop, or
    # inline) or, once the connection's small posts complete inline, its fast lane.
    took = [buckets.get(b) for b in ("engine path pull", "engine lane pull")]
    if path == engine:
        assert sum(b[1] for b in took if b is not None) == 5, bd
    else:
        assert took == [None, None], bd
    return result


@pytest.mark.slow  # a benchmark run: four processes
@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_bench_engines_quick_round_against_the_cma_path(tmp_path: Path, engine: str) -> None:
    """The direct side and the aiodatadist side (over cma: no engine path needed)."""
    require_engine(engine)
    _run_quick(tmp_path, engine, "cma")


@pytest.mark.slow  # a benchmark run: four processes
@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_bench_engines_quick_round_on_the_engine_path(tmp_path: Path, engine: str) -> None:
    require_engine(engine)
    if engine not in {p.value for p in DataPath}:
        pytest.skip(f"aiodatadist has no DataPath {engine!r} yet")
    _run_quick(tmp_path, engine, engine)
