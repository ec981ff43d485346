"""The suite's own guards: it cannot hang (issue 9, finding 11), and its conventions hold
(issue 10: one import style, one timeout setting; at the end of this file).

Each hang case runs a small test file in a child pytest with this suite's conftest and
pytest settings, under a bound; main hung in both:

* a test leaving a server and a connection open on uvloop: uvloop's ``close()`` warned
  about them from inside a libuv callback, the warning was an error there, the handle
  stayed open and ``close()`` waited for it forever (pytest-timeout could not end it);
* a test whose main thread no signal reaches: the watchdog ends the run with every
  thread's stack.
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LEAKY = '''
import asyncio
import pytest

@pytest.mark.asyncio
async def test_leaves_a_server_and_a_connection_open():
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    await asyncio.open_connection(host, port)
    await asyncio.sleep(0.05)
'''

STUCK = '''
import signal
import time
import pytest

@pytest.mark.timeout(1)
def test_no_signal_reaches_it():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(120)
'''


def _run(tmp_path: Path, source: str, bound: float, **env: str) -> tuple[int, str, float]:
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_child.py").write_text(source)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
            str(tmp_path / "test_child.py")]
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                              timeout=bound, env={**os.environ, **env})
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"the child run hung past {bound} s:\n{out[-3000:]}")
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.mark.slow  # a child pytest run
def test_a_leak_on_uvloop_fails_the_test_instead_of_hanging_the_run(tmp_path: Path) -> None:
    rc, out, _ = _run(tmp_path, LEAKY, 60)
    assert "2 passed" in out or "error" in out.lower(), out[-3000:]
    # The leak is still reported (warnings are errors in this suite) on uvloop.
    assert "unclosed resource" in out, out[-3000:]
    assert rc != 0


@pytest.mark.slow  # a child pytest run
def test_the_watchdog_ends_a_run_no_signal_can_stop(tmp_path: Path) -> None:
    rc, out, elapsed = _run(tmp_path, STUCK, 60, AIODATADIST_WATCHDOG_GRACE_S="2")
    assert rc == 70, out[-3000:]
    assert "watchdog" in out and "test_no_signal_reaches_it" in out, out[-3000:]
    assert elapsed < 30


# ------------------------------------------------------------------ the suite's conventions
# (issue 10) One import style: every directory of tests/ is a package, and test helpers are
# imported absolutely from it (``from tests.xproc.xproc_harness import Harness``), never
# relatively, never by a bare name that needs a sys.path entry. One timeout: pyproject's.

TESTS = ROOT / "tests"
# bench/ is a directory of scripts that import each other by name (not a package): its
# test imports them as those scripts run, with bench/ on sys.path for the import only.
SYS_PATH_ALLOWED = {"tests/frontdoor/test_bench_paths.py"}
# In long mode an adversity scenario runs for minutes: its bound grows with its budget.
TIMEOUT_ALLOWED = {"tests/adversity/conftest.py"}


@functools.cache
def _sources() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_every_test_directory_is_a_package() -> None:
    dirs = {p.parent for p in _sources()}
    missing = sorted(_rel(d) for d in dirs if not (d / "__init__.py").is_file())
    assert not missing, f"directories of tests/ without __init__.py: {missing}"


def test_test_helpers_are_imported_absolutely() -> None:
    local = {p.stem for p in _sources()} | {p.parent.name for p in _sources()}
    local -= {"__init__", "conftest", "tests"}
    bad = []
    for path in _sources():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
                if node.level:
                    bad.append(f"{_rel(path)}:{node.lineno}: relative import")
                    continue
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.partition(".")[0] in local:
                    bad.append(f"{_rel(path)}:{node.lineno}: {name} (write tests.<dir>.{name})")
    assert not bad, "\n".join(bad)


def _edits_sys_path(node: ast.AST) -> bool:
    """``sys.path.insert(...)`` and the like, ``sys.path = ...``, ``syspath_prepend``."""

    def is_sys_path(n: ast.AST) -> bool:
        return (
            isinstance(n, ast.Attribute)
            and n.attr == "path"
            and isinstance(n.value, ast.Name)
            and n.value.id == "sys"
        )

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "syspath_prepend" or (
            is_sys_path(node.func.value) and node.func.attr not in ("index", "count", "copy")
        ):
            return True
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            if is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)):
                return True
    return False


def test_no_test_edits_sys_path() -> None:
    bad = [
        f"{_rel(path)}:{node.lineno}"
        for path in _sources()
        if _rel(path) not in SYS_PATH_ALLOWED
        for node in ast.walk(_tree(path))
        if _edits_sys_path(node)
    ]
    assert not bad, f"sys.path edited (children get PYTHONPATH or cwd instead): {bad}"


def test_one_timeout_setting() -> None:
    """pyproject's ``timeout`` bounds every test; nothing sets another one."""
    bad = []
    for path in _sources():
        if _rel(path) in TIMEOUT_ALLOWED:
            continue
        for node in ast.walk(_tree(path)):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "timeout"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "mark"
            ):
                bad.append(f"{_rel(path)}:{node.lineno}")
    assert not bad, f"a test sets its own pytest timeout: {bad}"
