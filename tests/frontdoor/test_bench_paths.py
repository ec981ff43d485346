"""The benchmarks' memory helpers and ``bench/bench_paths.py``, run as a user runs them.

Nothing here asserts on speed (DESIGN.md, "Rules of the house").
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aiodatadist import _cli_bench
from aiodatadist.testing import HUGE_PAGE_BYTES, host_buffer, inproc_pair, make_blocks_cache

REPO = Path(__file__).resolve().parents[2]


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
    share = _cli_bench.huge_share_of_ranges([(a.ctypes.data, a.nbytes)])
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


def test_bench_workloads_reexport_the_cli_generator() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import workloads  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert workloads.random_blocks is _cli_bench.random_blocks
    assert workloads.blocks_hash is _cli_bench.blocks_hash
    assert workloads.SplitMix64 is _cli_bench.SplitMix64
    assert workloads.DEFAULT_SEED == _cli_bench.DEFAULT_SEED == 20240601
    pull = workloads.make_pull("llama8b-fp16", "64-random-blocks-all-layers")
    assert pull.hash() == "b6fa625bff927c25"  # what the C baselines print for the default


def test_bench_paths_small_run(tmp_path: Path) -> None:
    exe, why = _cli_bench.find_c_baselines()
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
    assert set(doc["summary"]) == {p["path"] for p in points}
