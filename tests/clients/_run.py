"""Runs a client port of ``examples/clients/`` as a user would, under one event loop kind.

Each port is a script that spawns its own peer processes, checks every byte and prints an
``OK`` line. Here it runs in its own session (process group) with a bound well under the
test timeout: a hang kills the script and everything it started, and a clean exit must not
leave any process of it behind.

Loop kinds: a ``*_sync.py`` port runs the library's portal loop on the kind named by
``AIODATADIST_PORTAL_LOOP``; any other port takes ``--loop asyncio|uvloop``. Both get a
private rendezvous directory for two-sided links (``AIODATADIST_RUNDIR``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._procs import session_alive

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "examples" / "clients"
LOOPS = ("asyncio", "uvloop")
RUN_TIMEOUT_S = 40.0
"""One run's bound: under the 60 s test timeout, far above a run's few seconds."""
LEFTOVER_GRACE_S = 3.0


def run_client(
    script: str, loop: str, tmp_path: Path, *, timeout: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Runs ``examples/clients/<script>`` on ``loop``; fails the test on a timeout or leftovers."""
    rundir = tmp_path / "rundir"
    rundir.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "AIODATADIST_RUNDIR": str(rundir)}
    args = [sys.executable, str(CLIENTS / script)]
    if script.endswith("_sync.py"):
        env["AIODATADIST_PORTAL_LOOP"] = loop
    else:
        args += ["--loop", loop]
    proc = subprocess.Popen(
        args,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} ({loop}) ran past {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    # multiprocessing's resource tracker ends on its own once the script has exited (it
    # reads EOF): give the session a moment to empty, then kill what is left.
    end = time.monotonic() + LEFTOVER_GRACE_S
    while session_alive(proc.pid) and time.monotonic() < end:
        time.sleep(0.02)
    leftovers = session_alive(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything still in the script's session
    assert not leftovers, f"{script} ({loop}) left processes running\nstdout:\n{out}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_client_ok(result: subprocess.CompletedProcess[str], script: str, loop: str) -> list[str]:
    """Exit 0, the port's ``OK`` line (naming the loop for async ports), no traceback.

    Returns:
        The stdout lines, for the caller's own checks.
    """
    report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, f"{script} ({loop}): exit {result.returncode}\n{report}"
    name = script.rsplit("/", 1)[-1].removesuffix(".py")
    lines = result.stdout.splitlines()
    ok = [ln for ln in lines if ln.startswith(f"OK {name}")]
    assert ok, f"{script} ({loop}): no 'OK {name}' line\n{report}"
    if not script.endswith("_sync.py"):
        assert f"({loop})" in ok[0], f"{script}: ran on the wrong loop: {ok[0]}"
    assert "Traceback" not in result.stderr, report
    return lines
