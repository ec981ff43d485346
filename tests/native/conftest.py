"""Fixtures for the native-core tests (plain synchronous pytest, no asyncio)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from aiodatadist import _native
from tests.native._helpers import Worker


def pytest_report_header(config: pytest.Config) -> str:
    # Says which build runs: the sanitizer script checks that it is not the editable one.
    return f"aiodatadist._native: {_native.__file__}"


@pytest.fixture(scope="module")
def shared_worker() -> Iterator[Worker]:
    """One worker process for a whole module's two-process tests that leave it healthy."""
    w = Worker()
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def worker() -> Iterator[Worker]:
    """A fresh worker process (for tests that kill it)."""
    w = Worker()
    try:
        yield w
    finally:
        w.close()
