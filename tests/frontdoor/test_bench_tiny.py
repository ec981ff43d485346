"""``bench/bench_tiny.py`` and its baselines (``bench/engines.py``, ``bench/c/tiny.c``), run
as a user runs them: every row printed, the JSON complete, every pulled byte checked.

Nothing here asserts on speed (DESIGN.md, "Rules of the house"). NIXL and Mooncake need
not be installed: their rows then say why, which is checked too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# bench/ is scripts, not a package: the one helper allowed to put it on sys.path imports them.
from tests.frontdoor.test_bench_paths import BENCH, REPO, bench_module


def test_checksum_and_pattern_words_are_what_tiny_c_computes() -> None:
    """The word pattern and the weighted checksum, against a plain loop over the words."""
    engines = bench_module("engines")
    data = engines.pattern_words(64, first_word=5)
    words = [int.from_bytes(bytes(data[i : i + 8]), "little") for i in range(0, 64, 8)]
    assert words == [((5 + i) * 0x9E3779B97F4A7C15 + 1) % 2**64 for i in range(8)]
    expect = sum(w * (2 * i + 1) for i, w in enumerate(words)) % 2**64
    assert engines.checksum(data) == expect
    flipped = data.copy()
    flipped[17] ^= 1
    assert engines.checksum(flipped) != expect


def test_report_flags_disagreeing_rounds_missing_goals_and_unavailable_rows() -> None:
    tiny = bench_module("bench_tiny")
    case = tiny.CASES[0]
    cma = tiny.Row("cma", rounds=[[30.0, 31.0], [60.0, 61.0]], verified=[True, True])
    nixl = tiny.Row("nixl", rounds=[[20.0, 21.0], [20.0, 21.0]], verified=[True, True])
    c = tiny.Row("c-readv", rounds=[[5.0, 5.0], [5.0, 5.0]], verified=[True, False])
    moon = tiny.Row("mooncake", why="unavailable: No module named 'mooncake'")
    text, js = tiny.report(case, [cma, nixl, c, moon])
    assert "WARNING" in text and "aiodatadist cma" in text.split("WARNING")[1]
    assert "DATA MISMATCH" in text  # the C row failed one of its checks
    assert "No module named 'mooncake'" in text
    comps = {(x["path"], x["baseline"]): x for x in js["comparisons"]}
    assert comps[("cma", "nixl")]["goal_at_most"] == 0.8
    assert comps[("cma", "nixl")]["met"] is False and "MISSED" in text
    paired = (30.5 / 20.5 + 60.5 / 20.5) / 2  # median of the 2 rounds' ratios
    assert comps[("cma", "nixl")]["paired"] == pytest.approx(paired, abs=1e-4)
    assert comps[("cma", "nixl")]["round_ratios"] == pytest.approx(
        [30.5 / 20.5, 60.5 / 20.5], abs=1e-4
    )
    assert [r["key"] for r in js["rows"]] == ["cma", "nixl", "c-readv", "mooncake"]
    assert js["rows"][3]["why"].startswith("unavailable")
    json.dumps(js)


@pytest.mark.slow  # starts an engine's processes
def test_an_engine_that_cannot_be_imported_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "nixl_cu12"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('nixl broken on purpose')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    engines = bench_module("engines")
    with pytest.raises(engines.EngineUnavailable, match="nixl broken on purpose"):
        engines.EngineServer("nixl", 4096, 1, 0, start_timeout=60)


@pytest.mark.slow  # a benchmark run: several processes
def test_bench_tiny_smoke_run(tmp_path: Path) -> None:
    tiny = bench_module("bench_tiny")
    js_path = tmp_path / "tiny.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_tiny.py"), "--repeats", "6", "--warmup", "2",
         "--rounds", "2", "--json", str(js_path)],
        capture_output=True, text=True, timeout=280, cwd=REPO,
    )  # fmt: skip
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "load average at start" in out and "load average at end" in out
    sections = out.split("\n== ")[1:]
    assert [s.split(":")[0] for s in sections] == [c.name for c in tiny.CASES]
    for section in sections:
        for name in tiny.ROW_NAMES.values():
            assert f"\n{name} " in section, (name, section)
    result = json.loads(js_path.read_text())
    assert result["load_start"] and result["load_end"]
    assert [c["case"] for c in result["cases"]] == [c.name for c in tiny.CASES]
    for case in result["cases"]:
        rows = {r["key"]: r for r in case["rows"]}
        assert list(rows) == list(tiny.ROW_NAMES)
        for key, row in rows.items():
            if row["why"] is None:
                # it ran: 6 timed pulls, its bytes checked after warm-up and at the end
                assert len(row["samples_us"]) == 6 and row["summary_us"]["n"] == 6, key
                assert row["verified"] == [True, True], key
                assert len(row["round_medians_us"]) == 2
            else:
                assert row["why"].startswith(("unavailable", "failed")), row
        # the library's rows always run here, and so do the plain-C ones given a compiler
        has_cc = shutil.which(os.environ.get("CC", "cc")) is not None
        for key in ("shm", "cma", "tcp", *(("c-readv", "c-tcp") if has_cc else ())):
            assert rows[key]["why"] is None, rows[key]
        paths = {c["path"] for c in case["comparisons"]}
        assert {"shm", "cma", "tcp"} <= paths
    assert np.isfinite(result["seconds"])
