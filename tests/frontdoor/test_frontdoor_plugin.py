"""The pytest plugin's fixtures, used as a user would: real bytes, real faults.

Every async test here runs on asyncio and on uvloop (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

from aiodatadist import LLMException, LLMLinkError, LLMTimeoutError
from aiodatadist.testing import FaultInjector, Pair, PromptSpec, RemotePair

pytest_plugins = ["pytester"]

SPEC = PromptSpec(num_tensors=4, num_blocks=16, block_shape=(16, 2, 64), seed=5)


def _same(a: Any, b: Any) -> bool:
    return bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


async def _pull_inproc_pair(pair: Pair) -> None:
    src = pair.prompt_cache(num_tensors=4, num_blocks=8, allocate=True, seed=3)
    dst = pair.decoder_cache(num_tensors=4, num_blocks=8)
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1, 6], [4, 0], timeout=5)
    for t in range(4):
        assert _same(dst.tensors[t][4], src.tensors[t][1])
        assert _same(dst.tensors[t][0], src.tensors[t][6])
    assert not dst.tensors[0][2].view(np.uint8).any()  # untouched blocks stay zero


async def _pull_remote(pair: RemotePair, src: list[int], dst_ids: list[int], timeout: float = 5):
    dst = pair.decoder_cache()
    await pair.decoder.cache_manager.pull_blocks(
        pair.key(), dst.cache, src, dst_ids, timeout=timeout
    )
    assert pair.mismatches(dst, src, dst_ids) == []
    return dst


# --------------------------------------------------------------------------- pairs


@pytest.mark.asyncio
async def test_datadist_pair_default_is_inproc(datadist_pair: Pair) -> None:
    assert [link.data_path for link in datadist_pair.decoder.links] == ["inproc"]
    await _pull_inproc_pair(datadist_pair)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "datadist_pair", [{"data_path": p} for p in ("shm", "cma", "tcp")], indirect=True
)
async def test_datadist_pair_in_one_process_over_a_real_link(datadist_pair: Pair) -> None:
    (link,) = datadist_pair.decoder.links
    assert link.data_path == datadist_pair.decoder.options.data_path
    await _pull_inproc_pair(datadist_pair)


@pytest.mark.asyncio
@pytest.mark.datadist(data_path="tcp", cross_process=True, spec=SPEC)
async def test_datadist_pair_cross_process_marker(datadist_pair: RemotePair) -> None:
    assert isinstance(datadist_pair, RemotePair)
    assert datadist_pair.prompt.pid > 0 and datadist_pair.prompt.returncode is None
    assert [link.data_path for link in datadist_pair.decoder.links] == ["tcp"]
    await _pull_remote(datadist_pair, [3, 9, 15], [0, 1, 2])


@pytest.mark.asyncio
@pytest.mark.datadist(spec=SPEC)
async def test_datadist_remote_pair_auto_path(datadist_remote_pair: RemotePair) -> None:
    pair = datadist_remote_pair
    assert pair.faults is not None and pair.faults.connections >= 1
    assert pair.decoder.links[0].data_path in ("shm+cma", "shm", "cma", "tcp")
    dst = await _pull_remote(pair, [2, 11], [5, 6])
    # The expected bytes are computable here: the prompt filled its cache with the pattern.
    raw = dst.tensors[3].view(np.uint8).reshape(16, -1)
    assert np.array_equal(raw[6], pair.expected(3, 11))


@pytest.mark.asyncio
async def test_datadist_pair_factory_makes_independent_pairs(datadist_pair_factory: Any) -> None:
    a = await datadist_pair_factory()
    b = await datadist_pair_factory(data_path="tcp")
    assert a.prompt.cluster_id != b.prompt.cluster_id
    await _pull_inproc_pair(a)
    await _pull_inproc_pair(b)
    with pytest.raises(TypeError, match="unknown keyword"):
        await datadist_pair_factory(bogus=1)


# --------------------------------------------------------------------------- faults


@pytest.mark.asyncio
@pytest.mark.datadist(data_path="tcp", spec=SPEC)
@pytest.mark.slow  # a peer process and waits out a timeout
async def test_pause_times_out_then_works_after_resume(
    datadist_remote_pair: RemotePair, datadist_faults: FaultInjector
) -> None:
    pair, faults = datadist_remote_pair, datadist_faults
    await _pull_remote(pair, [1], [1])  # the data streams are up
    faults.pause()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(LLMTimeoutError):
        await _pull_remote(pair, [4, 7], [2, 3], timeout=0.3)
    assert loop.time() - t0 < 3  # bounded by the deadline, not by the stall
    faults.resume()
    await _pull_remote(pair, [4, 7], [2, 3])  # the link stays usable


@pytest.mark.asyncio
@pytest.mark.datadist(data_path="tcp", spec=SPEC)
@pytest.mark.slow  # a peer process and waits out a delay
async def test_delay_lifts_by_itself(datadist_remote_pair: RemotePair) -> None:
    pair = datadist_remote_pair
    assert pair.faults is not None
    await _pull_remote(pair, [1], [1])
    pair.faults.delay(0.5)
    assert pair.faults.paused
    with pytest.raises(LLMTimeoutError):
        await _pull_remote(pair, [8], [8], timeout=0.2)
    # Started while still stalled: completes once the delay has passed.
    await _pull_remote(pair, [8, 9], [8, 9], timeout=10)
    assert not pair.faults.paused


@pytest.mark.asyncio
@pytest.mark.datadist(data_path="tcp", spec=SPEC)
@pytest.mark.slow  # a peer process
async def test_drop_fails_a_pull_in_flight_fast(datadist_remote_pair: RemotePair) -> None:
    pair = datadist_remote_pair
    assert pair.faults is not None
    dst = pair.decoder_cache()
    cm = pair.decoder.cache_manager
    await cm.pull_blocks(pair.key(), dst.cache, [0], [0], timeout=5)
    pair.faults.pause()  # the next pull waits on the wire ...
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    task = asyncio.ensure_future(cm.pull_blocks(pair.key(), dst.cache, [5], [5], timeout=20))
    await asyncio.sleep(0.2)
    assert not task.done()
    assert await pair.faults.drop() >= 1  # ... when the connections break
    with pytest.raises(LLMException):
        await asyncio.wait_for(task, 10)
    assert loop.time() - t0 < 10  # the break ends it, not the 20 s deadline
    # The link is gone: a new pull says so at once; a relink works again.
    with pytest.raises(LLMLinkError):
        await cm.pull_blocks(pair.key(), dst.cache, [5], [5], timeout=5)
    pair.faults.resume()
    assert await pair.relink() == 0
    await _pull_remote(pair, [5], [5])


@pytest.mark.asyncio
# cma needs a direct link: through the injector's proxy the peer's pid does not hold the
# connection, and the one-sided paths are refused (only tcp carries transfers there).
@pytest.mark.parametrize("datadist_remote_pair",
                         [{"data_path": "tcp"}, {"data_path": "cma", "faults": False}],
                         indirect=True)  # fmt: skip
@pytest.mark.slow  # peer processes, killed
async def test_kill_peer_raises_within_the_deadline(datadist_remote_pair: RemotePair) -> None:
    pair = datadist_remote_pair
    await _pull_remote(pair, [3], [3])
    if pair.faults is not None:
        pair.faults.kill_peer()
    else:
        pair.prompt.kill()
    assert await pair.prompt.wait_exit(10) == -9
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    dst = pair.decoder_cache()
    with pytest.raises(LLMException):
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [3], [3], timeout=3)
    assert loop.time() - t0 < 3.5


@pytest.mark.asyncio
async def test_fault_injector_without_pytest_fixtures() -> None:
    from aiodatadist.testing import remote_pair

    async with remote_pair(SPEC, data_path="tcp", faults=False, prompt_id=7, decoder_id=8) as pair:
        assert pair.faults is None
        await _pull_remote(pair, [0, 15], [15, 0])
    assert pair.prompt.returncode == 0  # stopped cleanly, not killed


# --------------------------------------------------------------------------- registration


@pytest.mark.slow  # a child pytest run
def test_plugin_registered_by_entry_point(pytester: pytest.Pytester) -> None:
    """A user's test file, with no conftest and no pytest_plugins, gets the fixtures."""
    pytester.makeini(
        textwrap.dedent(
            """
            [pytest]
            asyncio_mode = strict
            asyncio_default_fixture_loop_scope = function
            addopts = --strict-markers
            """
        )
    )
    pytester.makepyfile(
        test_user=textwrap.dedent(
            """
            import numpy as np
            import pytest

            from aiodatadist.testing import PromptSpec

            @pytest.mark.asyncio
            async def test_inproc(datadist_pair):
                src = datadist_pair.prompt_cache(num_tensors=2, num_blocks=4, seed=1)
                dst = datadist_pair.decoder_cache(num_tensors=2, num_blocks=4)
                await datadist_pair.decoder.cache_manager.pull_blocks(
                    datadist_pair.key(), dst.cache, [2], [0], timeout=5)
                assert np.array_equal(dst.tensors[1][0].view("u1"), src.tensors[1][2].view("u1"))

            @pytest.mark.asyncio
            @pytest.mark.datadist(data_path="tcp", spec=PromptSpec(num_tensors=2, num_blocks=4))
            async def test_remote(datadist_remote_pair, datadist_faults):
                pair = datadist_remote_pair
                dst = pair.decoder_cache()
                await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [3], [1],
                                                             timeout=5)
                assert pair.mismatches(dst, [3], [1]) == []
                assert datadist_faults is pair.faults

            @pytest.mark.asyncio
            @pytest.mark.datadist(bogus=1)
            async def test_bad_keyword(datadist_pair):
                pass
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*UsageError*unknown keyword(s)*bogus*"])


def test_plugin_loads_without_pytest_asyncio() -> None:
    """Without pytest-asyncio the plugin still imports (and registers its marker), no fixtures."""
    code = (
        "import sys; sys.modules['pytest_asyncio'] = None\n"
        "import aiodatadist.pytest_plugin as p\n"
        "assert not p.HAVE_PYTEST_ASYNCIO and not hasattr(p, 'datadist_pair')\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.asyncio
async def test_peer_process_reports_a_bad_start() -> None:
    from aiodatadist.testing import PeerProcess

    bad = PeerProcess(SPEC, options={"aiodatadist.DataPath": "nonsense"}, start_timeout=30)
    with pytest.raises(RuntimeError, match="the peer process failed"):
        await bad.start()
    assert bad.returncode is not None  # reaped, not left running
