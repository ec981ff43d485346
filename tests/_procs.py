"""Reading processes' states from ``/proc`` (Linux), for tests that must not yield.

``/proc/PID/stat`` is ``pid (comm) state ppid pgrp session ...``, and ``comm`` may hold
spaces and parentheses: the fields after it are found from the last ``)``.
"""

from __future__ import annotations

import os
import time

__all__ = ["dead_now", "named_threads", "proc_fields", "session_alive", "stop_now"]


def proc_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after ``comm`` (``[state, ppid, pgrp, session,
    ...]``), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # (gone, or going)
        return None
    return stat[stat.rindex(b")") + 2 :].decode("ascii", "replace").split()


def dead_now(pid: int, timeout: float = 5.0) -> None:
    """Waits, without yielding to any loop (so a link cannot notice), until ``pid`` is a
    zombie or gone; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        fields = proc_fields(pid)
        if fields is None or fields[0] in ("Z", "X"):
            return
        time.sleep(0.001)
    raise AssertionError(f"pid {pid} still runs")


def session_alive(sid: int) -> bool:
    """Whether a process of session ``sid`` still runs. A zombie does not count: a child
    nobody waited for is reparented to PID 1 when its parent exits, and waits there
    (seconds, in some containers) to be reaped; it runs nothing any more."""
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            fields = proc_fields(entry.name)
            if fields is not None and int(fields[3]) == sid and fields[0] != "Z":
                return True
    return False


def stop_now(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOPs ``pid`` and waits (without yielding) until every thread of it is stopped:
    ``kill`` only queues the signal, and a thread may still run for a moment after it."""
    import signal

    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return  # (gone)
        states = [proc_fields(f"{pid}/task/{t}") for t in tids]
        if all(f is None or f[0] in ("T", "t", "Z", "X") for f in states):
            return
        time.sleep(0.0005)
    raise AssertionError(f"pid {pid} did not stop")


def named_threads(name: str) -> int:
    """This process's threads named ``name`` (``/proc/self/task/*/comm``): native threads
    too, which ``threading`` never sees."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == name
        except OSError:  # (a thread that just ended)
            pass
    return n
