"""Fixtures for the engine tests: linked in-process prompt/decoder pairs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from aiodatadist.testing import Pair, inproc_pair

from ._util import SLOW_OPTIONS


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
