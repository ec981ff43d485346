"""Link liveness: ``aiodatadist.HeartbeatTimeout`` against a real prompt process.

* a frozen prompt (SIGSTOP: its kernel still answers TCP, so only the application
  notices) and a cut network (the fault injector stalls every byte, no reset) lose the
  decoder's link within the heartbeat timeout and a third, saying why in an INFO line;
  what waited on the link fails then, not at its own deadline; once the prompt runs (or
  the network flows) again, a new link pulls exact bytes;
* an idle link to a live prompt stays up through many timeouts: the pings keep it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator

import pytest

from aiodatadist import LLMException, LLMStatusCode
from aiodatadist.testing import PromptSpec, RemotePair, remote_pair

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]  # a prompt process per test

HB_MS = 600
BOUND_S = 6.0  # generous: the link is lost well within it (HB_MS and a third, on a loaded host)
LOGGER = "aiodatadist.control"


def _spec(seed: int) -> PromptSpec:
    return PromptSpec(num_tensors=2, num_blocks=8, block_shape=(4096,), dtype="uint8", seed=seed)


async def _lost(pair: RemotePair) -> float:
    """Seconds until the decoder's link to the prompt is gone."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while pair.decoder._rt.links.find(pair.prompt_id) is not None:
        assert loop.time() - start < BOUND_S, "the link was never lost"
        await asyncio.sleep(0.005)
    return loop.time() - start


async def _pull_exact(pair: RemotePair, src: list[int], dst: list[int]) -> None:
    cache = pair.decoder_cache()
    await pair.decoder.cache_manager.pull_blocks(pair.key(), cache.cache, src, dst, timeout=10)
    assert pair.mismatches(cache, src, dst) == []


async def _relink(pair: RemotePair) -> None:
    # The prompt drops its end of the old link once it runs again and reads the close:
    # until then it refuses a second link from us (LLM_ALREADY_LINK).
    loop = asyncio.get_running_loop()
    start = loop.time()
    while (status := await pair.relink()) != LLMStatusCode.LLM_SUCCESS:
        assert loop.time() - start < BOUND_S, f"relink: {status!r}"
        await asyncio.sleep(0.05)


def _lost_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.INFO and "lost" in r.getMessage()
    ]


@pytest.fixture
def stopped() -> Iterator[list[int]]:
    """Pids the test SIGSTOPped: resumed whatever happens (the pair then stops them)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("path", ["cma", "tcp"])
async def test_a_frozen_prompt_is_lost_within_the_heartbeat(
    path: str, caplog: pytest.LogCaptureFixture, stopped: list[int]
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    opts = {"aiodatadist.HeartbeatTimeout": str(HB_MS)}
    async with remote_pair(_spec(0x4EA7_0001), data_path=path, options=opts) as pair:
        await _pull_exact(pair, [1, 6], [6, 1])
        stopped.append(pair.prompt.pid)
        os.kill(pair.prompt.pid, signal.SIGSTOP)
        took = await _lost(pair)
        # Not before a whole timeout of silence (half of it is the test's lower edge).
        assert took >= HB_MS / 1000 / 2, took
        lines = _lost_lines(caplog)
        assert any("HeartbeatTimeout" in line for line in lines), lines
        # A pull now fails at once, saying the link is gone (not at its 10 s deadline).
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(LLMException) as ei:
            await _pull_exact(pair, [2], [3])
        assert ei.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK, ei.value
        assert loop.time() - start < 1.0
        os.kill(pair.prompt.pid, signal.SIGCONT)
        await _relink(pair)
        await _pull_exact(pair, [4, 0, 7], [0, 7, 4])


async def test_a_cut_network_is_lost_and_fails_the_pull_waiting_on_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    opts = {"aiodatadist.HeartbeatTimeout": str(HB_MS)}
    async with remote_pair(_spec(0x4EA7_0002), data_path="tcp", faults=True, options=opts) as pair:
        assert pair.faults is not None
        await _pull_exact(pair, [0, 5], [5, 0])
        pair.faults.pause()  # every byte stalls, both ways; no reset: a cut cable
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(LLMException) as ei:
            cache = pair.decoder_cache()
            await pair.decoder.cache_manager.pull_blocks(
                pair.key(), cache.cache, [3, 4], [4, 3], timeout=60
            )
        took = loop.time() - start
        # Failed by the lost link, well before its own 60 s deadline.
        assert ei.value.status_code == LLMStatusCode.LLM_LINK_FAILED, ei.value
        assert took < BOUND_S, took
        await _lost(pair)
        assert any("HeartbeatTimeout" in line for line in _lost_lines(caplog))
        pair.faults.resume()
        await _relink(pair)
        await _pull_exact(pair, [7, 2], [2, 7])


async def test_an_idle_link_to_a_live_prompt_stays_up() -> None:
    # Both sides with a short timeout, idle for five of them: their pings keep the link.
    opts = {"aiodatadist.HeartbeatTimeout": "300"}
    async with remote_pair(
        _spec(0x4EA7_0003), data_path="tcp", options=opts, prompt_options=opts
    ) as pair:
        await _pull_exact(pair, [1], [2])
        link = pair.decoder._rt.links.find(pair.prompt_id)
        await asyncio.sleep(1.5)
        assert pair.decoder._rt.links.find(pair.prompt_id) is link
        await _pull_exact(pair, [3, 0], [0, 3])
