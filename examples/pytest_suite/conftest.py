"""Fixtures of the example suite, over the aiodatadist pytest plugin's.

The plugin (installed with aiodatadist, nothing to enable) provides
``datadist_remote_pair`` (a prefill process linked to a decoder here), ``datadist_faults``
(the fault injector on that link) and ``datadist_pair`` (both in this process).
"""

from __future__ import annotations

import pytest_asyncio
from decode_worker import DecodeWorker

from aiodatadist.testing import FilledCache, RemotePair


# Async fixtures: caches are registered on the decoder's event loop, which announces them
# to the linked prefill process.
@pytest_asyncio.fixture
async def decoder_cache(datadist_remote_pair: RemotePair) -> FilledCache:
    """A zeroed decoder cache shaped like the prefill process's."""
    return datadist_remote_pair.decoder_cache()


@pytest_asyncio.fixture
async def worker(datadist_remote_pair: RemotePair, decoder_cache: FilledCache) -> DecodeWorker:
    """The worker under test, with a short pull budget (tests never wait long)."""
    return DecodeWorker(datadist_remote_pair.decoder, decoder_cache.cache, pull_timeout=0.5)
