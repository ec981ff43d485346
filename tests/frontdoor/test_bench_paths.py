"""The source tree's ``bench/``: its memory accounting, C baselines and
``bench/bench_paths.py``, run as a user runs them.

Nothing here asserts on speed (DESIGN.md, "Rules of the house").
"""

from __future__ import annotations

import importlib
import json
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from aiodatadist.cli import workloads as cli_workloads
from aiodatadist.testing import HUGE_PAGE_BYTES, host_buffer, inproc_pair, make_blocks_cache

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def bench_module(name: str) -> ModuleType:
    """A module of bench/ (not a package: its scripts import each other by name)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("huge_pages", [True, False])
def test_host_buffer_is_a_zeroed_writable_array(huge_pages: bool) -> None:
    a = host_buffer((4, 128, 8, 128), np.float16, huge_pages=huge_pages)  # 1 MiB
    b = host_buffer((2, 1 << 20), "uint16", huge_pages=huge_pages)  # 4 MiB
    for arr in (a, b):
        assert arr.flags["C_CONTIGUOUS"] and arr.flags["WRITEABLE"]
        assert not arr.view(np.uint8).any()
        arr.view(np.uint8)[-1] = 7
    assert a.shape == (4, 128, 8, 128) and a.dtype == np.float16
    assert b.shape == (2, 1 << 20) and b.dtype == np.uint16
    if huge_pages:
        assert b.ctypes.data % HUGE_PAGE_BYTES == 0  # every whole 2 MiB can be a huge page
    assert host_buffer(5, np.uint8).shape == (5,)
    assert host_buffer((0, 3), np.float32).shape == (0, 3)


def test_huge_share_of_ranges_reads_this_process() -> None:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE here")
    a = host_buffer((8 << 20,), np.uint8, huge_pages=False)
    share = bench_module("memory_accounting").huge_share_of_ranges([(a.ctypes.data, a.nbytes)])
    assert share is None or share == 0.0  # MADV_NOHUGEPAGE: never huge pages


@pytest.mark.asyncio
async def test_make_blocks_cache_on_huge_pages_pulls_the_same_bytes() -> None:
    kw = {"num_tensors": 4, "num_blocks": 8, "block_shape": (128, 8, 16)}  # 32 KiB blocks
    async with inproc_pair() as pair:
        src = make_blocks_cache(pair.prompt, model_id=0, seed=3, huge_pages=True, **kw)
        dst = make_blocks_cache(pair.decoder, huge_pages=True, **kw)
        plain = make_blocks_cache(pair.decoder, **kw)  # the default: plain numpy memory
        assert isinstance(plain.tensors[0], np.ndarray)
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1, 6], [4, 0])
        for t in range(4):
            assert np.array_equal(
                dst.tensors[t][4].view(np.uint8), src.tensors[t][1].view(np.uint8)
            )
            assert np.array_equal(
                dst.tensors[t][0].view(np.uint8), src.tensors[t][6].view(np.uint8)
            )
        assert not dst.tensors[0][2].view(np.uint8).any()


def test_bench_workloads_are_the_packages() -> None:
    """One definition: bench/workloads.py re-exports aiodatadist.cli.workloads."""
    workloads = bench_module("workloads")
    for name in ("Workload", "WORKLOADS", "random_blocks", "blocks_hash", "SplitMix64"):
        assert getattr(workloads, name) is getattr(cli_workloads, name), name
    assert workloads.DEFAULT_SEED == cli_workloads.DEFAULT_SEED == 20240601
    pull = workloads.make_pull("llama8b-fp16", "64-random-blocks-all-layers")
    assert pull.hash() == "b6fa625bff927c25"  # what the C baselines print for the default
    assert pull.total_bytes == 2**30 and pull.num_segments == 64 * 64


def test_c_baselines_build_on_demand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = BENCH / "c" / "baselines.c"
    if not src.exists() or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C baseline sources or no compiler")
    cbaselines = bench_module("cbaselines")
    copy = tmp_path / "bench" / "c" / "baselines.c"
    copy.parent.mkdir(parents=True)
    shutil.copy(src, copy)
    monkeypatch.setattr(cbaselines, "_baselines_source", lambda: copy)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    exe, why = cbaselines.find_c_baselines()
    assert exe is not None and exe.parent == tmp_path / "cache" / "aiodatadist", why
    assert "built now" in why
    assert cbaselines.find_c_baselines() == (exe, str(exe))  # cached
    server = cbaselines.CServer(exe, "memcpy", cli_workloads.WORKLOADS["small"], 8, 4, 5, 1)
    try:
        assert server.sample(3) > 0
    finally:
        server.close()  # checks the hash of its blocks and its destination


@pytest.mark.slow  # a benchmark run
def test_bench_paths_small_run(tmp_path: Path) -> None:
    exe, why = bench_module("cbaselines").find_c_baselines()
    if exe is None:
        pytest.skip(why)
    js = tmp_path / "paths.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_paths.py"), "--blocks", "2", "--pool", "4",
         "--repeats", "7", "--json", str(js)],
        capture_output=True, text=True, timeout=110, cwd=REPO,
    )  # fmt: skip
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Goals (paired ratio" in proc.stdout
    doc = json.loads(js.read_text())
    assert doc["meta"]["repeats"] == 7 and doc["meta"]["bytes_per_pull"] == 2 * 64 * 256 * 1024
    points = doc["runs"][0]
    assert "tcp" in {p["path"] for p in points}  # loopback tcp works on any test machine
    for p in points:
        assert p["verified"] is True
        assert len(p["samples_gbps"]) == len(p["baseline_samples_gbps"]) == 7
        assert p["paired_ratio"] > 0 and p["memory"]
        assert p["baseline"].startswith("C ")
    # Summary keys: the path, or "path/destination kind" (e.g. "shm/numpy": numpy arrays).
    assert {k.split("/")[0] for k in doc["summary"]} == {p["path"] for p in points}
    assert isinstance(doc["warnings"], list) and len(doc["meta"]["loadavg_end"]) == 3


@pytest.mark.slow  # a benchmark run
def test_bench_workloads_c_baselines_json_and_plot(tmp_path: Path) -> None:
    """bench/bench_workloads.py: the engine against the C baselines, memory accounted, drawn."""
    exe, why = bench_module("cbaselines").find_c_baselines()
    if exe is None:
        pytest.skip(why)
    js, png = tmp_path / "w.json", tmp_path / "w.png"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_workloads.py"), "--quick", "--workload", "small",
         "--paths", "inproc,shm,tcp", "--json", str(js), "--plot", str(png)],
        capture_output=True, text=True, timeout=150, cwd=REPO,
    )  # fmt: skip
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(js.read_text())
    assert doc["baseline_kind"] == "c" and "thp_enabled" in doc["meta"]
    assert {"inproc", "tcp"} <= set(doc["paths"])
    labels = {"inproc": "C memcpy", "shm": "C memcpy (shm source)", "tcp": "C writev/readv"}
    for r in doc["results"]:
        assert r["verified"] is True and r["ratio"] > 0
        assert r["baseline"] == labels[r["path"]]
        assert r["memory"] and "huge_pages_engine" in r and "huge_pages_baseline" in r
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "huge e/b" in proc.stdout and "memory = source->destination" in proc.stdout
    # Trustworthy output (issue 13 item 5): spreads, latency, named baselines, load, warnings.
    assert len(doc["meta"]["loadavg_start"]) == 3 and "load average at end" in proc.stdout
    assert doc["meta"]["band"] == "min-max" and isinstance(doc["warnings"], list)
    assert set(doc["baseline_descriptions"]) == {r["baseline"] for r in doc["results"]}
    assert "plain-C memcpy gather" in doc["baseline_descriptions"]["C memcpy"]
    for r in doc["results"]:
        assert r["spread_gbps"]["n"] == r["baseline_spread_gbps"]["n"] == 3
        assert r["latency_us"]["n"] > 3  # small pulls: every engine pull timed
        assert r["baseline_latency_kind"] == "mean per round"  # the C servers time batches
    for w in doc["warnings"]:
        assert w in proc.stdout
