"""The ``aiodatadist`` command line, run as a user runs it (subprocesses), and its parts."""

from __future__ import annotations

import errno
import io
import itertools
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aiodatadist._engine_env import engine_problem, engine_version
from aiodatadist.cli import Progress, build_parser, doctor_engines
from aiodatadist.cli import doctor as cli_doctor
from aiodatadist.cli.measure import NATIVE_BASELINE
from aiodatadist.cli.workloads import DEFAULT_SEED, WORKLOADS, blocks_hash, random_blocks
from aiodatadist.testing import fill_pattern, pattern_blocks, pattern_mismatches
from tests._engines import require_engine_installed

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


@pytest.mark.slow  # a demo run per size
def test_demo_layer_by_layer_sizes_follow_flags() -> None:
    proc = run("demo", "--layers", "3", "--blocks", "6", "--request-blocks", "4",
               "--block-tokens", "8", "--heads", "1", "--head-dim", "32", "--paths", "cma",
               "--rounds", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 pulls x 2 tensors x 4 blocks" in proc.stdout
    assert "[6, 8, 1, 32] fp16" in proc.stdout


# --------------------------------------------------------------------------- bench


@pytest.mark.slow  # a benchmark run
def test_bench_quick_json_and_plot(tmp_path: Path) -> None:
    js, png = tmp_path / "out" / "bench.json", tmp_path / "bench.png"
    proc = run("bench", "--quick", "--json", str(js), timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(js.read_text())
    assert doc["meta"]["quick"] is True
    assert doc["baseline_kind"] == "native"
    paths = set(doc["paths"])
    assert {"inproc", "tcp"} <= paths  # inproc always; loopback tcp on any test machine
    for path in paths:
        assert doc["summary"][path]["ratio_geomean"] > 0
    assert {r["workload"] for r in doc["results"]} == {"llama8b-fp16", "small", "mla-like"}
    for r in doc["results"]:
        assert r["verified"] is True
        assert r["ratio"] is not None and r["ratio"] > 0
        assert r["median_gbps"] > 0 and r["baseline_median_gbps"] > 0
        assert r["baseline"] == NATIVE_BASELINE  # what it is, never "memcpy"
    assert "ratio = engine median / baseline median" in proc.stdout
    for path in paths:
        assert f" {path} " in proc.stdout
    # The plot is bench/'s (not installed): it draws this report.
    plot = subprocess.run(
        [sys.executable, str(REPO / "bench" / "plot.py"), str(js), str(png)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert plot.returncode == 0, plot.stdout + plot.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a benchmark run
def test_bench_native_baseline_states_it(tmp_path: Path) -> None:
    js = tmp_path / "b.json"
    proc = run("bench", "--quick", "--baseline", "native", "--workload", "small",
               "--paths", "inproc,shm", "--json", str(js))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "baseline: the native local mover alone" in proc.stdout
    assert "aiodatadist._native.copy_local on the same plan" in proc.stdout
    doc = json.loads(js.read_text())
    assert doc["baseline_kind"] == "native"
    assert {r["baseline"] for r in doc["results"]} == {NATIVE_BASELINE}
    assert "_native.copy_local" in NATIVE_BASELINE and "memcpy" not in NATIVE_BASELINE


def test_bench_has_no_c_baselines_or_plots() -> None:
    """The installed bench compares with the native mover only (C baselines: bench/)."""
    proc = run("bench", "--baseline", "c", "--quick")
    assert proc.returncode == 2 and "invalid choice: 'c'" in proc.stderr
    assert run("bench", "--plot", "x.png").returncode == 2


def test_standard_workloads_are_the_designs() -> None:
    """DESIGN.md "Standard workloads", in the one definition (``aiodatadist.cli.workloads``)."""
    assert list(WORKLOADS) == ["llama8b-fp16", "small", "mla-like"]
    llama, small, mla = WORKLOADS.values()
    # 32 layers x K,V = 64 tensors, each [num_blocks, 128 tokens, 8 heads, 128 dim] fp16:
    # 256 KiB per block per tensor, 16 MiB per block across tensors
    assert (llama.num_layers, llama.tensors_per_layer, llama.num_tensors) == (32, 2, 64)
    assert (llama.block_shape, llama.dtype) == ((128, 8, 128), "fp16")
    assert llama.block_bytes == 256 * 1024 and llama.block_bytes_all_tensors == 16 * 2**20
    assert 64 * llama.block_bytes_all_tensors == 2**30  # 64 random blocks, all layers: 1 GiB
    # 4 layers x K,V, [num_blocks, 16, 2, 64] fp16: 4 KiB per block per tensor
    assert (small.num_layers, small.tensors_per_layer, small.num_tensors) == (4, 2, 8)
    assert (small.block_shape, small.dtype, small.block_bytes) == ((16, 2, 64), "fp16", 4096)
    # 61 layers, tensor_num_per_layer=1, [num_blocks, 128, 1, 576] bf16
    assert (mla.num_layers, mla.tensors_per_layer, mla.num_tensors) == (61, 1, 61)
    assert (mla.block_shape, mla.dtype, mla.block_bytes) == ((128, 1, 576), "bf16", 147456)
    assert np.dtype(mla.np_dtype()).itemsize == 2  # bf16 held as raw 16-bit words


@pytest.mark.parametrize(
    ("pool", "n", "seed"), [(64, 64, 20240601), (64, 16, 1), (8, 1, 3), (5, 4, 9)]
)
def test_random_blocks_are_distinct_non_contiguous_and_seeded(pool: int, n: int, seed: int) -> None:
    src, dst = random_blocks(pool, pool, n, seed)
    assert (src, dst) == random_blocks(pool, pool, n, seed)  # deterministic in the seed
    for blocks in (src, dst):
        assert len(set(blocks)) == n and all(0 <= b < pool for b in blocks)
        if n > 1 and pool >= 3:  # every block is its own segment
            assert not any(b == a + 1 for a, b in itertools.pairwise(blocks))
    # what the C baselines print for the default 1 GiB pull (bench/c/baselines.c)
    assert blocks_hash(*random_blocks(64, 64, 64, DEFAULT_SEED)) == "b6fa625bff927c25"
    with pytest.raises(ValueError):
        random_blocks(4, 4, 5)


def test_cli_modules_import_one_way() -> None:
    """main imports the commands, the commands never import main; nothing in the
    package builds C, reads /proc memory accounting or draws (that is bench/)."""
    import ast

    pkg = REPO / "aiodatadist" / "cli"
    for mod in sorted(pkg.glob("*.py")):
        text = mod.read_text()
        for word in ("smaps", "import matplotlib", "shutil.which"):
            assert word not in text, (mod.name, word)
        if mod.name in ("main.py", "__init__.py"):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):  # not `from . import`: __init__ imports main
                assert not (node.level == 1 and node.module in (None, "main")), mod.name
                assert node.module not in ("aiodatadist.cli", "aiodatadist.cli.main"), mod.name


# --------------------------------------------------------------------------- doctor


@pytest.mark.slow  # probes every data path in processes
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
    # The engines section: each engine's verdict is what the environment check says.
    assert "\nengines (" in proc.stdout and "\nfabric\n" in proc.stdout
    assert set(doc["engines"]) == {"nixl", "mooncake"}
    for name, rep in doc["engines"].items():
        problem = engine_problem(name)
        assert (problem is None) or (rep["works"] is False and rep["detail"] == problem)
        if rep["works"]:
            assert "tcp" in rep["transports"], rep
    assert set(doc["fabric"]) == {"rdma", "gpus", "npus", "libibverbs"}


@pytest.mark.parametrize("name", ["nixl", "mooncake"])
def test_doctor_engine_probe_starts_the_engine(name: str) -> None:
    require_engine_installed(name)
    rep = doctor_engines.probe_engine(name)
    assert rep.works, rep
    assert rep.version == engine_version(name)
    assert "tcp" in rep.transports
    if name == "nixl":
        assert rep.detail.startswith("the UCX backend starts (memory: DRAM_SEG")
        assert any(n.startswith("plugins: ") and "UCX" in n for n in rep.notes), rep.notes
        assert any(n.startswith("UCX modules in the wheel: ") and "cma" in n for n in rep.notes)
    else:
        assert rep.detail.startswith("TransferEngine starts (tcp")


def test_doctor_engine_not_installed_says_how_to_install() -> None:
    # A child where the engine modules are blocked (as on a host without them).
    code = """
import json, sys
sys.modules["nixl_cu12"] = None
sys.modules["mooncake.engine"] = None
from dataclasses import asdict
from aiodatadist.cli import doctor_engines
print(json.dumps([asdict(doctor_engines.probe_engine(n)) for n in ("nixl", "mooncake")]))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    nixl, mooncake = json.loads(proc.stdout)
    assert nixl["works"] is False and mooncake["works"] is False
    assert nixl["detail"].startswith("nixl-cu12 is not installed: pip install ")
    assert mooncake["detail"] == (
        "mooncake-transfer-engine-non-cuda is not installed: pip install 'aiodatadist[mooncake]'"
    )
    assert nixl["transports"] == mooncake["transports"] == []


def test_doctor_survives_an_engine_probe_that_crashes() -> None:
    found, why = doctor_engines._run_probe("import os; print('partial'); os.abort()")
    assert found is None
    assert why.startswith(f"the probe process died of signal {signal.SIGABRT.value}")
    # A result, then death at exit (NIXL 1.5.1 beside the system libibverbs): both told.
    found, why = doctor_engines._run_probe(
        "import os; print('AIODD-DOCTOR {\"ok\": 1}', flush=True); os.abort()"
    )
    assert found == {"ok": 1}
    assert why == f"signal {signal.SIGABRT.value}"
    found, why = doctor_engines._run_probe("raise SystemExit('no engine today')")
    assert found is None
    assert why == "the probe process failed (exit 1): no engine today"


def test_doctor_fabric_lines_name_what_is_there() -> None:
    fabric = {
        "rdma": [
            {
                "name": "mlx5_0",
                "netdevs": ["ens1f0np0"],
                "ports": [{"port": "1", "state": "ACTIVE", "link_layer": "Ethernet", "rate": None}],
            }
        ],
        "gpus": {
            "devices": ["nvidia0"],
            "models": ["NVIDIA H200"],
            "driver": "NVRM 550",
            "libcuda": "libcuda.so.1",
        },
        "npus": {"devices": ["davinci0"]},
        "libibverbs": False,
    }
    assert doctor_engines._fabric_lines(fabric) == [
        "RDMA NIC mlx5_0 (ens1f0np0): port 1 ACTIVE Ethernet",
        "NVIDIA GPUs: nvidia0 (NVIDIA H200)",
        "NVIDIA driver: NVRM 550; libcuda: libcuda.so.1",
        "Ascend NPUs: davinci0",
        "libibverbs.so.1: missing (apt-get install libibverbs1)",
    ]
    assert doctor_engines._ucx_usable(["cma", "cuda", "ib"], fabric) == [
        "tcp",
        "shm",
        "self",
        "cma",
        "ib (rdma)",
        "cuda",
    ]


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
    rep = cli_doctor.cma_verdict(scope, child, sibling)
    assert rep.works is works
    assert words in rep.detail + " ".join(rep.notes)


def test_doctor_exit_status_without_cross_process_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    down = cli_doctor.PathReport
    monkeypatch.setattr(cli_doctor, "probe_shm", lambda: down("shm", False, "no /dev/shm"))
    monkeypatch.setattr(cli_doctor, "probe_cma", lambda: down("cma", False, "EPERM"))
    monkeypatch.setattr(cli_doctor, "probe_tcp", lambda: down("tcp", False, "no loopback"))
    args = build_parser().parse_args(["doctor", "--no-pull"])
    assert asyncio.run(cli_doctor.run_doctor(args)) == 1


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
    from aiodatadist.cli.demo import PathResult, _report

    ok = PathResult("tcp", "ok", nbytes=10, rounds=[0.1], pull_seconds=[0.1])
    gone = PathResult("cma", "unavailable", "process_vm_readv refused: errno EPERM")
    assert _report([ok, gone], 10) == 0  # a path that does not work here is no failure
    assert _report([gone], 10) == 1  # ... but some path must work
    assert _report([ok, PathResult("shm", "error", "LLMTimeoutError: ...")], 10) == 1
