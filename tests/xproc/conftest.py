"""Fixtures of the cross-process tests: no peer process outlives its test."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest

from tests.xproc.xproc_harness import LIVE_PIDS, leftover_segments


@pytest.fixture(autouse=True)
def _reap_peers() -> Iterator[None]:
    """Kills and reaps any peer process a test left behind (the harness normally does)."""
    yield
    for pid in list(LIVE_PIDS):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
        LIVE_PIDS.discard(pid)
        # Nameless segments: a killed peer leaves nothing in /dev/shm to clean up.
        assert not leftover_segments(pid), leftover_segments(pid)
