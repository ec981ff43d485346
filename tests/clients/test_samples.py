"""The HIXL sample ports (``examples/clients/samples``) run as a user would start them.

Each port is one command that spawns every role of the upstream sample (P and D, or 2 P
and 2 D for xPyD) as a process, moves real bytes between them and checks every block
(those a transfer named against the source's pattern, the others untouched); it prints
``OK <name>: <n> processes, <m> transfers verified (<loop>)`` only when every process
exited 0, every expected transfer was verified and each ran on the loop asked for.

Twice per sample: on ``aiodatadist.sync`` (the upstream code with only the import
changed; the portal loop chosen by ``AIODATADIST_PORTAL_LOOP``) and awaited on the async
API (``--loop``); each on asyncio and on uvloop.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clients._run import CLIENTS, LOOPS, assert_client_ok, run_client

# sample -> (processes, transfers verified)
SAMPLES = {
    "pull_blocks": (2, 1),
    "pull_blocks_xpyd": (4, 4),
    "push_blocks": (2, 1),
    "push_cache": (2, 1),
    "transfer_cache_async": (2, 1),
    "switch_role": (2, 2),
}


def test_every_sample_has_both_ports() -> None:
    found = {p.stem for p in (CLIENTS / "samples").glob("*_sync.py")} | {
        p.stem for p in (CLIENTS / "samples").glob("*_async.py")
    }
    assert found == {f"{s}_{v}" for s in SAMPLES for v in ("sync", "async")}


@pytest.mark.slow  # 2 to 4 processes per run
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("variant", ["sync", "async"])
@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_sample_port_runs(sample: str, variant: str, loop: str, tmp_path: Path) -> None:
    script = f"samples/{sample}_{variant}.py"
    lines = assert_client_ok(run_client(script, loop, tmp_path), script, loop)
    processes, transfers = SAMPLES[sample]
    ok = f"OK {sample}_{variant}: {processes} processes, {transfers} transfers verified ({loop})"
    assert ok in lines, lines
