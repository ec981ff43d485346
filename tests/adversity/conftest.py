"""The adversity suite's fixtures: time budgets, the per-module ledger, actor reaping.

``@pytest.mark.adversity(ci=SECONDS, weight=W)`` gives a scenario its time: ``ci``
seconds in CI mode; in long mode (``AIODATADIST_ADVERSITY_SECONDS``) a share of the
total proportional to ``W``. The ``budget`` fixture returns it. In long mode the
scenario's pytest timeout is set from it; in CI mode the suite's one timeout applies
(every wait is bounded: a hang is a failure).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvloop

from tests.adversity._common import (
    LIVE,
    ledger,
    ledger_growth,
    long_seconds,
    reap_all,
    record_ledger,
    settle_ledger_sync,
)

HERE = Path(__file__).resolve().parent

MARKER = "adversity"
_BUDGET_KEY = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(ci=2.0, weight=1.0): an adversity scenario and its time budget"
    )


def _mine(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(HERE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [it for it in items if _mine(it)]
    total_w = 0.0
    for it in mine:
        m = it.get_closest_marker(MARKER)
        total_w += float(m.kwargs.get("weight", 1.0)) if m is not None else 0.0
    total = long_seconds()
    for it in mine:
        m = it.get_closest_marker(MARKER)
        ci = float(m.kwargs.get("ci", 2.0)) if m is not None else 0.0
        w = float(m.kwargs.get("weight", 1.0)) if m is not None else 0.0
        budget = total * w / total_w if total and total_w else ci
        it.stash[_BUDGET_KEY] = budget
        if total:
            # Long mode only: a scenario runs for minutes, and its bound (set-up, the
            # budget, bounded tear-down) grows with it. In CI mode its budget is a second
            # or less and the suite's one timeout (pyproject.toml) bounds it.
            it.add_marker(pytest.mark.timeout(int(budget * 1.5) + 90), append=False)


@pytest.fixture
def budget(request: pytest.FixtureRequest) -> float:
    """Seconds this scenario runs its loop for."""
    return float(request.node.stash.get(_BUDGET_KEY, 2.0))


@pytest.fixture(scope="module", autouse=True)
def _module_ledger(request: pytest.FixtureRequest) -> Iterator[None]:
    """fds, threads, mappings and /dev/shm before and after each module: no growth."""
    before = ledger()
    yield
    reap_all()
    after = settle_ledger_sync(before)
    name = request.module.__name__
    record_ledger(name, before, after)
    grown = ledger_growth(before, after)
    assert not grown, f"{name} leaked (before, after): {grown}"


@pytest.fixture(scope="session", autouse=True)
def _session_setup() -> None:
    # uvloop resolves addresses on libuv's thread pool, whose threads live as long as
    # the process: start them before the first ledger so that they do not count.
    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(loop.getaddrinfo("127.0.0.1", 0))
    finally:
        loop.close()


@pytest.fixture(autouse=True)
def _reap_actors() -> Iterator[None]:
    """Actors a test started and did not stop itself: the module's fixtures own the
    long-lived ones, which are in ``LIVE`` before the test starts."""
    before = set(LIVE)
    yield
    for pid in set(LIVE) - before:
        a = LIVE.get(pid)
        if a is not None:
            with contextlib.suppress(Exception):
                a.stop(timeout=5)
