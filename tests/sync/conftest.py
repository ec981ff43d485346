"""Fixtures of the sync API tests: the portal's loop kind and linked sync pairs.

The portal is process-wide: ``portal_kind`` restarts it when a test asks for the other
kind (legal only with no sync instance initialized, which every fixture here ensures).
The uvloop runs are marked ``slow``, like the async suite's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

import aiodatadist.sync as sd
from aiodatadist._portal import portal
from tests.sync._util import SyncPair, open_pair

PORTAL_KINDS = [pytest.param("asyncio"), pytest.param("uvloop", marks=pytest.mark.slow)]

_ids = itertools.count(7001, 2)


@pytest.fixture(params=PORTAL_KINDS)
def portal_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """The portal runs ``asyncio`` or ``uvloop`` for this test."""
    kind: str = request.param
    if portal.started:
        if portal.kind != kind:
            sd._restart_portal_for_tests(kind)
    else:
        portal.set_kind(kind)
    yield kind
    assert portal.kind == kind


@pytest.fixture
def cluster_ids() -> tuple[int, int]:
    """Two fresh cluster ids (prompt, decoder) for this test."""
    first = next(_ids)
    return first, first + 1


@pytest.fixture
def pair(portal_kind: str, cluster_ids: tuple[int, int]) -> Iterator[SyncPair]:
    """A sync PROMPT and DECODER in this process, linked in-process; finalized after."""
    with open_pair(*cluster_ids) as p:
        yield p
