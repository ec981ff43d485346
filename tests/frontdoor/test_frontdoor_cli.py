"""The ``aiodatadist`` command line, run as a user runs it (subprocesses), and its parts."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aiodatadist import _cli_bench, _cli_doctor
from aiodatadist.cli import Progress, build_parser
from aiodatadist.testing import fill_pattern, pattern_blocks, pattern_mismatches

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("aiodatadist")


def run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``python -m aiodatadist ARGS`` (bounded: killed by subprocess.run on timeout).

    Its output is echoed, so a failure's report shows all of it."""
    proc = subprocess.run(
        [sys.executable, "-m", "aiodatadist", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    print(proc.stdout)
    print(proc.stderr, file=sys.stderr)
    return proc


# --------------------------------------------------------------------------- demo


def test_demo_small_verifies_every_path() -> None:
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "aiodatadist"]
    proc = subprocess.run(
        [*cmd, "demo", "--small"], capture_output=True, text=True, timeout=90, cwd=REPO
    )
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "verified: every pulled byte matches the prompt's on" in out
    for path in ("shm", "cma", "tcp"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(path + " "))
        assert "GB/s" in line and "OK (" in line, line
    # two OS processes: the prompt's pid is not ours
    prompt_pid = int(out.split("prompt   pid ")[1].split(",")[0])
    decoder_pid = int(out.split("decoder  pid ")[1].split(" ")[0])
    assert prompt_pid != decoder_pid


def test_demo_detects_a_corrupted_byte() -> None:
    proc = run("demo", "--small", "--corrupt-one-byte", "--paths", "tcp,shm", "--rounds", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MISMATCH on tcp: " in proc.stdout and "MISMATCH on shm: " in proc.stdout
    assert "1 byte(s) differ" in proc.stdout
    assert "verified:" not in proc.stdout


def test_demo_layer_by_layer_sizes_follow_flags() -> None:
    proc = run("demo", "--layers", "3", "--blocks", "6", "--request-blocks", "4",
               "--block-tokens", "8", "--heads", "1", "--head-dim", "32", "--paths", "cma",
               "--rounds", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 pulls x 2 tensors x 4 blocks" in proc.stdout
    assert "[6, 8, 1, 32] fp16" in proc.stdout


# --------------------------------------------------------------------------- bench


def test_bench_quick_json_and_plot(tmp_path: Path) -> None:
    js, png = tmp_path / "out" / "bench.json", tmp_path / "bench.png"
    proc = run("bench", "--quick", "--json", str(js), "--plot", str(png), timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(js.read_text())
    assert doc["meta"]["quick"] is True
    assert doc["baseline_kind"] in ("c", "native")
    paths = set(doc["paths"])
    assert {"inproc", "tcp"} <= paths  # inproc always; loopback tcp on any test machine
    for path in paths:
        assert doc["summary"][path]["ratio_geomean"] > 0
    assert {r["workload"] for r in doc["results"]} == {"llama8b-fp16", "small", "mla-like"}
    for r in doc["results"]:
        assert r["verified"] is True
        assert r["ratio"] is not None and r["ratio"] > 0
        assert r["median_gbps"] > 0 and r["baseline_median_gbps"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ratio = engine median / baseline median" in proc.stdout
    for path in paths:
        assert f" {path} " in proc.stdout


def test_bench_native_baseline_states_it(tmp_path: Path) -> None:
    js = tmp_path / "b.json"
    proc = run("bench", "--quick", "--baseline", "native", "--workload", "small",
               "--paths", "inproc,shm", "--json", str(js))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "baseline: the native local mover alone" in proc.stdout
    doc = json.loads(js.read_text())
    assert doc["baseline_kind"] == "native"
    assert {r["baseline"] for r in doc["results"]} == {"native copy_local"}


def test_block_lists_match_bench_workloads() -> None:
    """The CLI's copy of the standard workloads and block draws is bench/workloads.py's."""
    src = REPO / "bench" / "workloads.py"
    if not src.exists():
        pytest.skip("bench/workloads.py is not in this checkout")
    sys.path.insert(0, str(src.parent))
    try:
        import workloads  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(src.parent))
    for name, w in _cli_bench.WORKLOADS.items():
        ref = workloads.WORKLOADS[name]
        assert (w.num_tensors, w.block_bytes, w.tensors_per_layer) == (
            ref.num_tensors, ref.block_bytes, ref.tensors_per_layer,
        )  # fmt: skip
    for pool, n, seed in ((64, 64, 20240601), (64, 16, 1), (8, 1, 3), (5, 4, 9)):
        assert _cli_bench.random_blocks(pool, pool, n, seed) == workloads.random_blocks(
            pool, pool, n, seed
        )
        s, d = _cli_bench.random_blocks(pool, pool, n, seed)
        assert _cli_bench.blocks_hash(s, d) == workloads.blocks_hash(s, d)


def test_c_baselines_build_on_demand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = REPO / "bench" / "c" / "baselines.c"
    if not src.exists() or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C baseline sources or no compiler")
    copy = tmp_path / "bench" / "c" / "baselines.c"
    copy.parent.mkdir(parents=True)
    shutil.copy(src, copy)
    monkeypatch.setattr(_cli_bench, "_baselines_source", lambda: copy)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    exe, why = _cli_bench.find_c_baselines()
    assert exe is not None and exe.parent == tmp_path / "cache" / "aiodatadist", why
    assert "built now" in why
    assert _cli_bench.find_c_baselines() == (exe, str(exe))  # cached
    server = _cli_bench.CServer(exe, "memcpy", _cli_bench.WORKLOADS["small"], 8, 4, 5, 1)
    try:
        assert server.sample(3) > 0
    finally:
        server.close()  # checks the hash of its blocks and its destination


# --------------------------------------------------------------------------- doctor


def test_doctor_lists_every_path(tmp_path: Path) -> None:
    js = tmp_path / "doctor.json"
    proc = run("doctor", "--json", str(js))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for path in ("inproc", "shm", "cma", "tcp"):
        assert any(ln.strip().startswith(path + " ") for ln in proc.stdout.splitlines()), path
    for key in ("aiodatadist", "native", "python", "numpy", "uvloop", "kernel"):
        assert key in proc.stdout
    for key in ("IOV_MAX", "/dev/shm", "RLIMIT_MEMLOCK", "open files", "ptrace_scope"):
        assert key in proc.stdout
    doc = json.loads(js.read_text())
    assert set(doc["paths"]) == {"inproc", "shm", "cma", "tcp"}
    assert doc["paths"]["tcp"]["works"] is True
    assert doc["paths"]["tcp"]["pull"] == "pulled and verified"
    assert doc["cross_process_paths"]


@pytest.mark.parametrize(
    ("scope", "child", "sibling", "works", "words"),
    [
        (None, (True, 0), (True, 0), True, "between unrelated processes"),
        ("1", (True, 0), (False, errno.EPERM), True, "only toward descendants"),
        ("2", (False, errno.EPERM), (False, errno.EPERM), False, "ptrace_scope=2"),
        (None, (False, errno.EPERM), (False, errno.EPERM), False, "seccomp"),
        (None, (False, errno.ENOSYS), (False, errno.ENOSYS), False, "lacks process_vm_readv"),
    ],
)
def test_doctor_cma_verdict_says_why(
    scope: str | None,
    child: tuple[bool, int],
    sibling: tuple[bool, int],
    works: bool,
    words: str,
) -> None:
    rep = _cli_doctor.cma_verdict(scope, child, sibling)
    assert rep.works is works
    assert words in rep.detail + " ".join(rep.notes)


def test_doctor_exit_status_without_cross_process_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    down = _cli_doctor.PathReport
    monkeypatch.setattr(_cli_doctor, "probe_shm", lambda: down("shm", False, "no /dev/shm"))
    monkeypatch.setattr(_cli_doctor, "probe_cma", lambda: down("cma", False, "EPERM"))
    monkeypatch.setattr(_cli_doctor, "probe_tcp", lambda: down("tcp", False, "no loopback"))
    args = build_parser().parse_args(["doctor", "--no-pull"])
    assert asyncio.run(_cli_doctor.run_doctor(args)) == 1


# --------------------------------------------------------------------------- parts


def test_progress_bar_draws_only_when_enabled() -> None:
    out = io.StringIO()
    with Progress("work", 4, enabled=True, stream=out) as bar:
        for i in range(4):
            bar.update(i + 1)
    assert "[" + "#" * Progress.WIDTH + "] 100.0% 4/4" in out.getvalue()
    quiet = io.StringIO()
    with Progress("work", 4, stream=quiet) as bar:  # StringIO is not a terminal
        bar.update(4)
    assert quiet.getvalue() == ""


def test_pattern_catches_flips_and_misplaced_blocks() -> None:
    tensors = [np.zeros((6, 4, 3, 8), dtype=np.float16) for _ in range(3)]
    fill_pattern(tensors, seed=9)
    bb = tensors[0][0].nbytes
    assert np.array_equal(tensors[2][4].view(np.uint8).ravel(), pattern_blocks(9, 2, [4], bb)[0])
    assert not pattern_mismatches(tensors, range(6), range(6), 9)
    # every (tensor, block) differs from every other
    rows = {pattern_blocks(9, t, [b], bb)[0].tobytes() for t in range(3) for b in range(6)}
    assert len(rows) == 18
    tensors[1].view(np.uint8).reshape(6, -1)[3, 17] ^= 1
    (m,) = pattern_mismatches(tensors, range(6), range(6), 9)
    assert (m.src_tensor, m.src_block, m.offset, m.count) == (1, 3, 17, 1)
    assert pattern_mismatches(tensors, [0, 1], [1, 0], 9, [(0, 0)])  # swapped blocks


def test_demo_report_exit_status() -> None:
    from aiodatadist._cli_demo import PathResult, _report

    ok = PathResult("tcp", "ok", nbytes=10, rounds=[0.1], pull_seconds=[0.1])
    gone = PathResult("cma", "unavailable", "process_vm_readv refused: errno EPERM")
    assert _report([ok, gone], 10) == 0  # a path that does not work here is no failure
    assert _report([gone], 10) == 1  # ... but some path must work
    assert _report([ok, PathResult("shm", "error", "LLMTimeoutError: ...")], 10) == 1
