"""Shared fixtures. Every async test runs twice: on the default asyncio loop and on uvloop.

The quick loop (``pytest -m "not slow"``) runs each async test once, on asyncio: the
uvloop runs are marked ``slow`` here, with the long tests the modules mark themselves
(multi-process, large transfers, soak, fuzz). The full run (CI) runs everything.

Nothing here may hang a run:

* pytest-timeout (``timeout`` in pyproject.toml, the one setting) fails a test that
  runs too long, by a signal, and the run goes on;
* a signal cannot interrupt a main thread stuck in C (an event loop's ``epoll_wait``),
  so a watchdog thread gives every test that bound plus ``WATCHDOG_GRACE_S``, then dumps
  every thread's stack and ends the process;
* uvloop's ``close()`` warns about each transport left open from inside a libuv
  callback; with warnings as errors that warning raised there and left the handle open,
  and ``close()`` then waited for it forever. Our uvloop loops close with
  ResourceWarnings recorded, and report them once the loop is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import os
import sys
import threading
import warnings
from collections.abc import Callable, Generator, Mapping

import pytest
import uvloop

WATCHDOG_GRACE_S = float(os.environ.get("AIODATADIST_WATCHDOG_GRACE_S", "30"))
"""How far past its pytest-timeout a test may run before the watchdog ends the run."""


class _UvLoop(uvloop.Loop):  # type: ignore[misc]
    def close(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            super().close()
        # Outside libuv's callbacks: an error here (warnings are errors in this suite)
        # fails the test's teardown instead of hanging it.
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": _UvLoop}


def pytest_report_header(config: pytest.Config) -> list[str]:
    # Where engine tests must not skip (CI): each engine's state heads the log.
    from tests._engines import engine_reason, engines_required

    if not engines_required():
        return []
    return [f"engine {n}: {engine_reason(n) or 'available'}" for n in ("nixl", "mooncake")]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, None, None]:
    # Under AIODATADIST_REQUIRE_ENGINES=1 (CI) a skip because an engine cannot run is a
    # failure, however the test skipped (tests/_engines.py, or engine_unavailable itself).
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and isinstance(report.longrepr, tuple)) or hasattr(report, "wasxfail"):
        return
    from tests._engines import REQUIRE_ENGINES_ENV, engines_required, unavailable_engine_in

    reason = str(report.longrepr[2])
    if engines_required() and unavailable_engine_in(reason) is not None:
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_ENGINES_ENV}=1 but this test skipped: {reason}"


def pytest_collection_finish(session: pytest.Session) -> None:
    # What the run holds for its whole length (the modules, the collected items) leaves
    # the collector's view: a gc.collect() between tests (tests/engine does one before
    # each) then scans only what the tests made: ~1 ms instead of ~40 ms per collection.
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("_asyncio_loop_factory") is _UvLoop:
            item.add_marker(pytest.mark.slow)


def _item_timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
        if value is not None:
            return float(value)
    return float(item.config.getini("timeout") or 0)


def _watchdog_fire(config: pytest.Config, nodeid: str, bound: float) -> None:
    # Out of pytest's output capture first (as pytest-timeout's thread method does),
    # or the stacks go to a capture file nobody reads after the exit.
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        with contextlib.suppress(Exception):
            capman.suspend_global_capture(in_=True)
    sys.stderr.write(
        f"\n+++ watchdog: {nodeid} still running {bound:.0f} s after it started "
        "(its timeout did not end it); stacks of every thread follow, then the run ends\n"
    )
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
    os._exit(70)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    timeout = _item_timeout(item)
    timer: threading.Timer | None = None
    if timeout > 0:
        bound = timeout + WATCHDOG_GRACE_S
        timer = threading.Timer(bound, _watchdog_fire, args=(item.config, item.nodeid, bound))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
