"""Fixtures for the engine tests: linked in-process prompt/decoder pairs."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from aiodatadist.testing import Pair, inproc_pair
from tests.engine._util import SLOW_OPTIONS


@pytest.fixture(autouse=True)
def _collect_earlier_caches() -> Iterator[None]:
    """Frees what earlier tests left to the garbage collector before this one starts.

    Their caches can be GiB of shared memory: unmapping them is real work for the kernel,
    and a collection that lands inside a timed window (a 10 ms deadline honoured within a
    bound) on a loaded machine made that window look a second long.
    """
    gc.collect()
    yield


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[Pair]:
    """A PROMPT (cluster 1) and a DECODER (cluster 2), linked, finalized afterwards."""
    async with inproc_pair() as p:
        yield p


@pytest_asyncio.fixture
async def slow_pair() -> AsyncIterator[Pair]:
    """As ``pair``, with one mover thread: big transfers take long enough to interrupt."""
    async with inproc_pair(options=dict(SLOW_OPTIONS)) as p:
        yield p
