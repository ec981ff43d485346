"""aiodatadist._engine_env: what it says about the engines and fabrics of this very host.

The engines are real here when installed (CI installs them: ``scripts/setup_engines.sh``);
"not installed" is a child interpreter whose ``sys.path`` no longer holds them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiodatadist import _engine_env
from aiodatadist._engine_env import (
    ENGINES,
    engine_problem,
    engine_spec,
    engine_version,
    fabric_report,
    install_hint,
)
from tests._engines import require_engine_installed

ENGINE_MODULES = ("nixl_cu12", "mooncake", "torch")


def _child(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )


@pytest.mark.parametrize("name", ENGINES)
def test_installed_engine_imports_and_is_reported_usable(name: str) -> None:
    require_engine_installed(name)
    assert engine_problem(name) is None
    version = engine_version(name)
    assert version is not None and version[0].isdigit()
    # The verdict is the truth: the module does import in a fresh interpreter.
    proc = _child(f"import {engine_spec(name).module}")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", ENGINES)
def test_hidden_engine_is_not_installed_with_its_pip_command(name: str) -> None:
    # The child drops every site-packages directory from sys.path after importing us:
    # the engine's package can no longer be found, as on a host that lacks it.
    proc = _child(
        f"""
        import json, sys
        from aiodatadist import _engine_env
        sys.path[:] = [p for p in sys.path if "site-packages" not in p]
        print(json.dumps([_engine_env.engine_problem({name!r}),
                          _engine_env.engine_version({name!r}),
                          _engine_env.install_hint({name!r})]))
        """
    )
    assert proc.returncode == 0, proc.stderr
    problem, version, hint = json.loads(proc.stdout)
    assert version is None
    assert problem == f"{engine_spec(name).distribution} is not installed: {hint}"
    if name == "mooncake":
        assert hint == "pip install 'aiodatadist[mooncake]'"
    elif fabric_report()["gpus"]["devices"]:
        assert hint == "pip install 'aiodatadist[nixl]'"
    else:  # the CPU route: nixl-cu12's metadata would pull a CUDA torch
        assert hint == "pip install --no-deps 'nixl-cu12>=1.5,<2'"


@pytest.mark.parametrize("name", ENGINES)
def test_a_blocked_module_reads_as_not_installed(name: str) -> None:
    # sys.modules[name] = None is how a process opts out of a module: import fails there.
    module = engine_spec(name).module
    proc = _child(
        f"""
        import sys
        sys.modules[{module!r}] = None
        from aiodatadist._engine_env import engine_problem
        print(engine_problem({name!r}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(f"{engine_spec(name).distribution} is not installed: ")


def test_checks_leave_the_engines_out_of_this_process() -> None:
    proc = _child(
        f"""
        import sys
        import aiodatadist
        from aiodatadist._engine_env import ENGINES, engine_problem, fabric_report
        for name in ENGINES:
            engine_problem(name)
        fabric_report()
        loaded = [m for m in sys.modules if m.split(".")[0] in {ENGINE_MODULES!r}]
        print(",".join(loaded))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_import_aiodatadist_imports_no_engine_nor_torch() -> None:
    proc = _child(
        f"""
        import importlib.util, sys
        import aiodatadist
        import aiodatadist.transports
        if importlib.util.find_spec("aiodatadist.transports.engine") is not None:
            import aiodatadist.transports.engine
        loaded = [m for m in sys.modules if m.split(".")[0] in {ENGINE_MODULES!r}]
        print(",".join(loaded))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_a_missing_system_library_names_the_apt_package(monkeypatch: pytest.MonkeyPatch) -> None:
    require_engine_installed("mooncake")
    spec = engine_spec("mooncake")
    missing = dataclasses.replace(
        spec,
        system_libraries=(*spec.system_libraries, ("libaiodd-absent.so.7", "libaiodd-absent7")),
    )
    monkeypatch.setitem(_engine_env._SPECS, "mooncake", missing)
    # (an engine test earlier in this process may have imported it: that short-cuts the check)
    monkeypatch.delitem(sys.modules, spec.module, raising=False)
    assert engine_problem("mooncake") == (
        "mooncake-transfer-engine-non-cuda is installed but libaiodd-absent.so.7 cannot be "
        "loaded (Debian/Ubuntu: apt-get install libaiodd-absent7)"
    )


def test_mooncake_system_libraries_are_what_its_engine_links() -> None:
    # The list is what a host must provide: each entry is a DT_NEEDED of engine.so that
    # the wheel does not bundle, and libibverbs.so.1 (apt: libibverbs1) is among them.
    spec = engine_spec("mooncake")
    assert ("libibverbs.so.1", "libibverbs1") in spec.system_libraries
    found = _engine_env._find_spec("mooncake")
    if found is None or not found.submodule_search_locations:
        pytest.skip("mooncake-transfer-engine-non-cuda is not installed")
    readelf = shutil.which("readelf") or shutil.which("objdump")
    if readelf is None:
        pytest.skip("neither readelf nor objdump is installed")
    engine_so = Path(next(iter(found.submodule_search_locations))) / "engine.so"
    flags = ["-d"] if readelf.endswith("readelf") else ["-p"]
    dump = subprocess.run(
        [readelf, *flags, str(engine_so)], capture_output=True, text=True, check=True
    ).stdout
    for soname, _ in spec.system_libraries:
        assert soname in dump, soname


def test_a_failing_import_says_why() -> None:
    problem = _engine_env._import_problem("aiodatadist_no_such_engine_module")
    assert problem is not None
    assert problem.startswith("importing aiodatadist_no_such_engine_module fails: ")
    assert "ModuleNotFoundError" in problem


def test_unknown_engine_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown engine 'ucx'"):
        engine_problem("ucx")
    with pytest.raises(ValueError, match="unknown engine"):
        install_hint("")


def test_fabric_report_of_this_host() -> None:
    report = fabric_report()
    json.dumps(report)  # what doctor --json prints
    infiniband = Path("/sys/class/infiniband")
    names = sorted(p.name for p in infiniband.iterdir()) if infiniband.is_dir() else []
    assert [d["name"] for d in report["rdma"]] == names
    gpus = sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
    assert report["gpus"]["devices"] == gpus
    npus = sorted(p.name for p in Path("/dev").glob("davinci[0-9]*"))
    assert sorted(report["npus"]["devices"]) == npus
    assert report["libibverbs"] == _engine_env._loadable("libibverbs.so.1")
    assert not _engine_env._loadable("libaiodd-absent.so.7")


def test_fabric_report_reads_sysfs_devfs_procfs(tmp_path: Path) -> None:
    # A copy of the layout a two-port ConnectX (one RoCE port up), two GPUs and two NPUs
    # give: the report is what those files say.
    ib = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0"
    for port, state, layer in (("1", "4: ACTIVE", "Ethernet"), ("2", "1: DOWN", "InfiniBand")):
        (ib / "ports" / port).mkdir(parents=True)
        (ib / "ports" / port / "state").write_text(state + "\n")
        (ib / "ports" / port / "link_layer").write_text(layer + "\n")
        (ib / "ports" / port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (ib / "device" / "net" / "ens1f0np0").mkdir(parents=True)
    dev = tmp_path / "dev"
    dev.mkdir()
    for node in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "davinci0", "davinci10"):
        (dev / node).touch()
    (dev / "davinci_manager").touch()
    proc = tmp_path / "proc" / "driver" / "nvidia"
    (proc / "gpus" / "0000:01:00.0").mkdir(parents=True)
    (proc / "gpus" / "0000:01:00.0" / "information").write_text(
        "Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\n"
    )
    (proc / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54\nGCC\n")
    report = fabric_report(
        sys_root=str(tmp_path / "sys"), dev_root=str(dev), proc_root=str(tmp_path / "proc")
    )
    assert report["rdma"] == [
        {
            "name": "mlx5_0",
            "netdevs": ["ens1f0np0"],
            "ports": [
                {
                    "port": "1",
                    "state": "ACTIVE",
                    "link_layer": "Ethernet",
                    "rate": "200 Gb/sec (4X HDR)",
                },
                {
                    "port": "2",
                    "state": "DOWN",
                    "link_layer": "InfiniBand",
                    "rate": "200 Gb/sec (4X HDR)",
                },
            ],
        }
    ]
    assert report["gpus"]["devices"] == ["nvidia0", "nvidia1"]
    assert report["gpus"]["models"] == ["NVIDIA H200"]
    assert report["gpus"]["driver"] == "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54"
    assert report["npus"]["devices"] == ["davinci0", "davinci10"]


@pytest.mark.parametrize(("required", "outcome"), [("", "3 skipped"), ("1", "2 failed, 1 skipped")])
def test_ci_turns_an_engine_skip_into_a_failure(
    tmp_path: Path, required: str, outcome: str
) -> None:
    # A test gated on an engine this child process blocks: it skips, saying why, unless
    # AIODATADIST_REQUIRE_ENGINES=1 (CI, after scripts/setup_engines.sh) makes it fail.
    (tmp_path / "test_gated.py").write_text(
        textwrap.dedent(
            """
            import sys
            sys.modules["nixl_cu12"] = None
            import pytest
            from aiodatadist._engine_env import engine_problem
            from tests._engines import require_engine_installed

            def test_gated():
                require_engine_installed("nixl")

            def test_skips_by_itself():  # the suite's hook (tests/conftest.py) sees it too
                pytest.skip(engine_problem("nixl"))

            def test_skips_for_another_reason():
                pytest.skip("not on this host")
            """
        )
    )
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "AIODATADIST_REQUIRE_ENGINES": required}
    argv = [sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [*argv, "-p", "tests.conftest", "test_gated.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.stdout.strip().splitlines()[-1].startswith(outcome), proc.stdout + proc.stderr
    assert "nixl-cu12 is not installed: pip install " in proc.stdout, proc.stdout
