"""Tests of "my decode worker's error handling", with real bytes and real faults.

Each test gets a prefill instance in a subprocess (its cache filled with a seeded
pattern) linked to a decoder in this process, through a fault injector. Run from the
repository root:

    .venv/bin/python -m pytest examples/pytest_suite -q

Needs pytest-asyncio (the plugin's fixtures are async).
"""

from __future__ import annotations

import asyncio

import pytest
from decode_worker import DecodeWorker, Outcome

from aiodatadist.testing import FaultInjector, FilledCache, Pair, RemotePair

pytestmark = pytest.mark.asyncio

# The prefill cache: 8 tensors (4 layers x K,V) of 16 blocks; the pattern is seeded.
SPEC = {"num_tensors": 8, "num_blocks": 16, "block_shape": (16, 2, 64), "seed": 7}


@pytest.mark.datadist(spec=SPEC)  # data path "auto": shm on one host
async def test_load_pulls_the_right_bytes(
    datadist_remote_pair: RemotePair, worker: DecodeWorker, decoder_cache: FilledCache
) -> None:
    pair = datadist_remote_pair
    outcome = await worker.load(pair.key(), [3, 9, 15], [0, 1, 2])
    assert outcome == Outcome(True)
    # Every byte of every tensor, checked against the pattern the prefill process wrote.
    assert pair.mismatches(decoder_cache, [3, 9, 15], [0, 1, 2]) == []


@pytest.mark.datadist(spec=SPEC, data_path="tcp")  # bytes on sockets: the injector can stall them
async def test_a_stalled_link_times_out_and_the_retry_works(
    datadist_remote_pair: RemotePair,
    datadist_faults: FaultInjector,
    worker: DecodeWorker,
    decoder_cache: FilledCache,
) -> None:
    pair = datadist_remote_pair
    datadist_faults.delay(1.5)  # every byte of the link waits 1.5 s: longer than the budget
    loop = asyncio.get_running_loop()
    start = loop.time()
    outcome = await worker.load(pair.key(), [4, 5], [6, 7])
    assert outcome == Outcome(False, "LLM_TIMEOUT", "retry")
    assert loop.time() - start < 1.4  # ended by the worker's deadline, not by the stall

    await asyncio.sleep(1.5)  # the stall is over
    assert await worker.load(pair.key(), [4, 5], [6, 7]) == Outcome(True)  # same link
    assert pair.mismatches(decoder_cache, [4, 5], [6, 7]) == []


@pytest.mark.datadist(spec=SPEC)
async def test_a_killed_prefill_means_reroute_not_a_hang(
    datadist_remote_pair: RemotePair, datadist_faults: FaultInjector, worker: DecodeWorker
) -> None:
    pair = datadist_remote_pair
    assert (await worker.load(pair.key(), [1], [1])).ok

    datadist_faults.kill_peer()  # SIGKILL the prefill process
    await pair.prompt.wait_exit(timeout=10)
    outcome = await worker.load(pair.key(), [2], [2])
    assert not outcome.ok
    assert outcome.action == "reroute", outcome  # LLM_NOT_YET_LINK or LLM_LINK_FAILED


async def test_a_bad_request_fails_without_touching_the_link(datadist_pair: Pair) -> None:
    # Both ends in this process: enough for argument errors, and fast.
    src = datadist_pair.prompt_cache(num_tensors=8, num_blocks=16, seed=3)
    dst = datadist_pair.decoder_cache(num_tensors=8, num_blocks=16)
    worker = DecodeWorker(datadist_pair.decoder, dst.cache, pull_timeout=0.5)
    outcome = await worker.load(datadist_pair.key(), [99], [0])  # no block 99
    assert outcome == Outcome(False, "LLM_PARAM_INVALID", "fail")
    assert (await worker.load(datadist_pair.key(), [0], [0])).ok
    assert dst.tensors[5][0].tobytes() == src.tensors[5][0].tobytes()
