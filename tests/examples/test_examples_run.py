"""Every example runs as a user would start it: a subprocess, a bounded time, no leftovers.

Each example runs in its own session (process group), so a hang kills the example and
everything it started, and a clean exit must not leave any process of it behind.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_aiohttp = pytest.mark.skipif(
    importlib.util.find_spec("aiohttp") is None,
    reason="aiohttp is not installed (pip install -e '.[examples]')",
)


def run_example(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Runs ``python *args`` from the repository root; kills its whole session on timeout."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(args)} ran past {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    leftovers = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything still in the example's session
    except ProcessLookupError:
        leftovers = False
    assert not leftovers, f"{' '.join(args)} left processes running"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, (
        f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )


def test_simple_pull() -> None:
    result = run_example("examples/simple_pull.py", timeout=45)
    assert_ok(result)
    assert "pulled blocks [0, 1, 5] -> [3, 4, 9] of layers 1..2" in result.stdout
    assert "verified" in result.stdout


@needs_aiohttp
@pytest.mark.slow  # two HTTP servers in processes
def test_pd_server_run() -> None:
    result = run_example("examples/pd_server/run.py", timeout=50)
    assert_ok(result)
    lines = result.stdout.splitlines()
    expected = [
        "prefill server (PROMPT, cluster 1): http://127.0.0.1:",
        "decode server (DECODER, cluster 2): http://127.0.0.1:",
        'POST /generate {"prompt_id": 1, "n_blocks": 4} -> 200 pulled 4 blocks',
        'POST /generate {"prompt_id": 2, "n_blocks": 16} -> 200 pulled 16 blocks',
        'POST /generate {"prompt_id": 6, "n_blocks": 64, "timeout": 1e-06} -> 504 LLM_TIMEOUT',
        'POST /generate {"prompt_id": 7, "n_blocks": 2, "timeout": -1} -> 400 LLM_PARAM_INVALID',
        'POST /generate {"prompt_id": 8, "n_blocks": 32} -> 200 pulled 32 blocks',
        "done: all requests as expected",
    ]
    for prefix in expected:
        assert any(line.startswith(prefix) for line in lines), (
            f"no line {prefix!r}:\n{result.stdout}"
        )
    concurrent = [ln for ln in lines if '"n_blocks": 8} -> 200 pulled 8 blocks' in ln]
    assert len(concurrent) == 3, result.stdout
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.slow  # a child pytest run
def test_pytest_suite() -> None:
    result = run_example(
        "-m", "pytest", "examples/pytest_suite", "-q", "-p", "no:cacheprovider", timeout=50
    )
    assert_ok(result)
    assert " passed" in result.stdout
