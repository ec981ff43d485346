"""Installing and starting: the version, plain help, a source tree without its compiled core,
children that import their parent's installation, ``doctor --clean``.

The shadowing cases are built for real: a copy of the package without its core in the
current directory, and (for the children) a venv with a non-editable copy of the package
and its built core, as a user who ran ``pip install`` and then works in the checkout has.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import uuid
from pathlib import Path

import pytest

import aiodatadist
from aiodatadist import _native

REPO = Path(__file__).resolve().parents[2]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so
SITE = sysconfig.get_path("purelib")


def run(
    *args: str, cwd: Path = REPO, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )
    print(proc.stdout)
    print(proc.stderr, file=sys.stderr)
    return proc


def _copy_package(dst: Path, *, core: bool) -> Path:
    """The package's Python files (and, with ``core``, its built native core) under ``dst``."""
    pkg = dst / "aiodatadist"
    shutil.copytree(
        REPO / "aiodatadist", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so")
    )
    shutil.copy(REPO / "_aiodatadist_pytest.py", dst / "_aiodatadist_pytest.py")
    if core:
        assert _native.__file__ is not None
        shutil.copy(_native.__file__, pkg / Path(_native.__file__).name)
    return pkg


# --------------------------------------------------------------------------- version, help


def test_version_is_single_sourced() -> None:
    proc = run(sys.executable, "-m", "aiodatadist", "--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"aiodatadist {aiodatadist.__version__}"
    # one number: the package, its metadata (pyproject reads _version.py) and the core
    assert importlib.metadata.version("aiodatadist") == aiodatadist.__version__
    assert _native.__version__ == aiodatadist.__version__


@pytest.mark.parametrize("command", [[], ["demo"], ["bench"], ["doctor"]])
def test_help_is_plain_text(command: list[str]) -> None:
    proc = run(sys.executable, "-m", "aiodatadist", *command, "--help")
    assert proc.returncode == 0
    for markup in ("``", ":class:", ":func:", ":data:", ":mod:"):
        assert markup not in proc.stdout, markup
    if not command:
        assert "--version" in proc.stdout and "doctor" in proc.stdout


def test_license_ships_with_the_metadata() -> None:
    dist = importlib.metadata.distribution("aiodatadist")
    assert dist.metadata["License-Expression"] == "Apache-2.0"
    assert dist.metadata.get_all("License-File") == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert any(str(f).endswith("licenses/LICENSE") for f in dist.files or [])
    assert "Typing :: Typed" in (dist.metadata.get_all("Classifier") or [])


# --------------------------------------------------------------------------- no core


def test_import_from_a_source_tree_without_core_says_what_to_do(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _copy_package(src, core=False)
    # -S: no site (so no editable-install finder): the current directory's copy is imported.
    proc = run(sys.executable, "-S", "-c", "import aiodatadist", cwd=src)
    assert proc.returncode == 1
    assert "circular import" not in proc.stderr
    assert "source tree without the compiled native core" in proc.stderr
    assert "pip install aiodatadist" in proc.stderr
    assert "\nImportError: aiodatadist cannot be imported from" in proc.stderr
    assert "During handling" not in proc.stderr  # one error, not Python's chained one

    # An installed copy elsewhere on sys.path, shadowed by the current directory.
    inst = tmp_path / "inst" / "aiodatadist"
    inst.mkdir(parents=True)
    (inst / f"_native{SUFFIX}").write_bytes(b"")
    env = {**os.environ, "PYTHONPATH": str(inst.parent)}
    proc = run(sys.executable, "-S", "-c", "import aiodatadist", cwd=src, env=env)
    assert proc.returncode == 1
    assert f"An installed aiodatadist ({inst}) is shadowed by it" in proc.stderr
    assert "python -P" in proc.stderr


def test_import_with_a_core_that_does_not_load_quotes_the_loader(tmp_path: Path) -> None:
    pkg = _copy_package(tmp_path, core=False)
    (pkg / f"_native{SUFFIX}").write_bytes(b"not an ELF file")
    proc = run(sys.executable, "-S", "-c", "import aiodatadist", cwd=tmp_path)
    assert proc.returncode == 1
    assert "the compiled core in" in proc.stderr and "does not load" in proc.stderr
    assert "circular import" not in proc.stderr


@pytest.mark.slow  # a child pytest run
def test_pytest_plugin_off_does_not_break_unrelated_tests(tmp_path: Path) -> None:
    """pytest started in a source tree without its core: unrelated tests run; the plugin's
    fixtures fail with the reason; the old entry point (the package itself) ended the run."""
    src = tmp_path / "src"
    _copy_package(src, core=False)
    (src / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\n")
    (src / "test_user.py").write_text(
        textwrap.dedent(
            """
            import pytest

            def test_unrelated():
                assert sum([1, 2]) == 3

            @pytest.mark.datadist(data_path="tcp")
            def test_needs_a_pair(datadist_pair):
                pass
            """
        )
    )
    # Site-packages by PYTHONPATH (no .pth: no editable finder), the copy in the cwd first:
    # as a non-editable install with the checkout as the current directory.
    env = {**os.environ, "PYTHONPATH": SITE}
    proc = run(
        sys.executable, "-S", "-m", "pytest", "-p", "no:cacheprovider", "-rE",
        "test_user.py", cwd=src, env=env, timeout=50,
    )  # fmt: skip
    assert "1 passed, 1 error" in proc.stdout, proc.stdout + proc.stderr
    assert "aiodatadist: pytest plugin off" in proc.stdout
    assert "fixture datadist_pair is unavailable" in proc.stdout
    assert "source tree without the compiled native core" in proc.stdout


# --------------------------------------------------------------------------- children


@pytest.fixture
def installed_venv(tmp_path: Path) -> Path:
    """A venv whose site-packages holds a non-editable copy of the package and its core
    (and sees this venv's packages through a .pth line); returns its python."""
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    _copy_package(Path(site), core=True)
    (Path(site) / "dev-venv.pth").write_text(SITE + "\n")
    return python


@pytest.mark.slow  # child interpreters
def test_children_import_their_parents_installation(
    tmp_path: Path, installed_venv: Path
) -> None:
    """From a checkout's root (a source tree without core in the cwd), the prompt process
    the demo starts and the doctor's probes import the installation their parent runs."""
    src = tmp_path / "src"
    _copy_package(src, core=False)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    py = str(installed_venv)
    # -P: the parent itself imports the installed copy (as the console script does).
    demo = run(
        py, "-P", "-m", "aiodatadist", "demo", "--small", "--paths", "tcp,shm",
        "--rounds", "1", "--no-progress", cwd=src, env=env, timeout=50,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "verified: every pulled byte matches the prompt's on tcp, shm" in demo.stdout
    doctor = run(
        py, "-P", "-m", "aiodatadist", "doctor", "--no-pull", "--json", "-",
        cwd=src, env=env, timeout=50,
    )  # fmt: skip
    doc = json.loads(doctor.stdout[doctor.stdout.index("{") :])
    assert doc["paths"]["shm"]["works"] is True, doc["paths"]["shm"]
    assert "probe failed" not in doc["paths"]["cma"]["detail"], doc["paths"]["cma"]


# --------------------------------------------------------------------------- doctor --clean


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    return proc.pid


@pytest.mark.slow  # child processes
def test_doctor_clean_removes_only_segments_of_dead_processes() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    tag = uuid.uuid4().hex[:12]
    dead = Path(f"/dev/shm/aiodd-{_dead_pid()}-frontdoor-{tag}")
    live = Path(f"/dev/shm/aiodd-{os.getpid()}-frontdoor-{tag}")
    dead.write_bytes(b"d" * 4096)
    live.write_bytes(b"l" * 4096)
    try:
        plain = run(sys.executable, "-m", "aiodatadist", "doctor", "--no-pull")
        assert "`aiodatadist doctor --clean` removes them" in plain.stdout
        assert dead.exists() and live.exists()  # the plain doctor only reports

        clean = run(
            sys.executable, "-m", "aiodatadist", "doctor", "--no-pull", "--clean", "--json", "-"
        )
        assert not dead.exists()
        assert live.exists() and live.read_bytes() == b"l" * 4096
        assert str(dead) in clean.stdout and "removed" in clean.stdout
        doc = json.loads(clean.stdout[clean.stdout.index("{\n") :])
        assert str(dead) in doc["clean"]["removed"]
        assert str(live) not in doc["clean"]["removed"]
    finally:
        for path in (dead, live):
            path.unlink(missing_ok=True)
