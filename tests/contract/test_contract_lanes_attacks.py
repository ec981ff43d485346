"""Outside-in attacks on the fast lanes (aiodatadist._lanes): each test here states a
promise of the public API that a lane pull must keep exactly as the whole path does.

Written by a tester who did not build the lanes; five of them failed on the first version
(a key taken over during the first pull, FIFO by call order, layer ranges compared by
value, lanes keeping links and caches alive, the in-flight count after a racing free).
They run on the paths that keep lanes (``inproc``, ``shm``, ``cma``); the contract suite's
``test_contract_lanes.py`` runs the basics on every path."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey
from tests._procs import dead_now
from tests.contract.contract_side import PROMPT, Side
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import assert_same

pytestmark = pytest.mark.asyncio

LANED = {"inproc", "shm", "cma", "tcp"}


@pytest.fixture(
    params=[pytest.param(p, marks=() if p == "inproc" else pytest.mark.slow) for p in sorted(LANED)]
)
def path(request: pytest.FixtureRequest) -> str:
    """The paths that keep lanes (overrides the contract suite's six)."""
    return str(request.param)


def _key(side: Side) -> tuple[str, BlocksCacheKey]:
    src = side.src()
    model = xc.SPECS[src].model_id
    assert model is not None
    return src, BlocksCacheKey(PROMPT, model)


def _expect(side: Side, src: str, before: np.ndarray, sb: list[int], db: list[int]) -> Any:
    spec = xc.SPECS[src]
    span = xc.tensor_span(spec.num_tensors, None, None, 2)
    return xc.expect_blocks(before, side.ref(src), spec.unit, sb, db, span)


async def _due() -> None:
    """Lets the lanes' once-a-millisecond yield fall due (INLINE_YIELD_S)."""
    await asyncio.sleep(0.005)


async def test_two_pulls_into_one_block_land_in_call_order(side: Side) -> None:
    """ "transfers on one link run one at a time, in the order they were called": pull A
    (source block 3 -> block 5) is called before pull B (source block 4 -> block 5), so
    block 5 ends holding source block 4, as it does on the whole path."""
    cm = side.dd.cache_manager
    src, key = _key(side)
    await side.pull("reg", src, [1], [2])  # the lane is made (on the one-sided paths)
    dst = side.local["reg"]
    for _ in range(3):
        before = side.prefill(dst)
        await _due()
        a = asyncio.ensure_future(cm.pull_blocks(key, dst.cache, [3], [5], timeout=10))
        b = asyncio.ensure_future(cm.pull_blocks(key, dst.cache, [4], [5], timeout=10))
        await asyncio.gather(a, b)
        assert_same(dst.matrix(), _expect(side, src, before, [4], [5]))


async def test_a_small_pull_called_after_a_big_one_never_overtakes_it(side: Side) -> None:
    """A big pull is called first, a small one right after: the small one waits for the
    big one (FIFO by call), also when the big one had not reached the slot yet."""
    cm = side.dd.cache_manager
    src, key = _key(side)
    await side.pull("reg", src, [1], [2])
    big, model = await side.big()
    n = big.spec.shape[0]
    # (the big cache known here first: a pull whose key is not in the peer's table yet
    # waits for a refresh before it queues, on every path)
    await cm.pull_blocks(BlocksCacheKey(PROMPT, model), big.cache, [0], [0], timeout=10)
    await _due()
    bulk = asyncio.ensure_future(
        cm.pull_blocks(
            BlocksCacheKey(PROMPT, model), big.cache, list(range(n)), list(range(n)), timeout=60
        )
    )  # (an order test: generous deadlines, a loaded machine took > 5 s for 256 MiB once)
    small = asyncio.ensure_future(
        cm.pull_blocks(key, side.local["reg"].cache, [3], [0], timeout=60)
    )
    await asyncio.wait([bulk, small], return_when=asyncio.FIRST_COMPLETED)
    done_first = "bulk" if bulk.done() else "small"
    await asyncio.gather(bulk, small)
    assert done_first == "bulk", "the small pull called after the big one finished first"


class _LooksEqual:
    """A layer range that claims to equal anything (it is not a ``range``)."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize(
    "learned, bad, exc",
    [
        # range equality is sequence equality: range(1, 2, 7) == range(1, 2) == [1]
        (range(1, 2), range(1, 2, 7), ValueError),
        (None, _LooksEqual(), TypeError),
    ],
    ids=["step-7-range", "eq-object"],
)
async def test_a_bad_layer_range_fails_as_on_the_whole_path(
    side: Side, learned: range | None, bad: object, exc: type[BaseException]
) -> None:
    """A ``src_layer_range`` the whole path refuses (step 7; not a range) is refused after
    a lane exists too, and moves nothing."""
    cm = side.dd.cache_manager
    src, key = _key(side)
    dst = side.local["reg"]
    pair = None if learned is None else (learned.start, learned.stop)
    await side.pull("reg", src, [1], [2], src_layers=pair, dst_layers=pair)  # lane made
    for _ in range(2):  # (the second after one that went the whole way, as the first)
        before = side.prefill(dst)
        with pytest.raises(exc, match="src_layer_range"):
            await cm.pull_blocks(
                key,
                dst.cache,
                [3],
                [4],
                src_layer_range=bad,  # type: ignore[arg-type]
                dst_layer_range=learned,
            )
        assert np.array_equal(dst.matrix(), before), "a refused pull moved bytes"


async def test_a_new_peer_at_the_same_cluster_id_gives_its_own_bytes(side: Side) -> None:
    """Unlinked, the old prompt still alive, a new prompt (other bytes) linked under the same
    cluster id: pulls give the new prompt's bytes, never the old one's through its lane."""
    from aiodatadist.testing import cluster_info

    src, _ = _key(side)
    await side.pull("reg", src, [1], [2])
    await side.pull("reg", src, [3], [4])  # (through the lane)
    status, _ = await side.dd.unlink_clusters([cluster_info(PROMPT)], 5000)
    assert status == 0
    if side.path == "inproc":
        await side.prompt.commands.dd.finalize()  # type: ignore[union-attr]
    side.prompt = await side.start_prompt(side.seed + 7777)
    await side.link_prompt()
    for s, d in ((3, 4), (3, 4), (5, 6)):
        await side.pull("reg", src, [s], [d])  # checked against the new prompt's bytes


async def test_more_caches_than_lanes_all_land_their_own_bytes(side: Side) -> None:
    """70 destination caches (more than the 64 lanes kept), pulled into in turn, twice."""
    src, _ = _key(side)
    spec = xc.Spec("many", True, False, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE))
    for i in range(70):
        side.local[f"m{i}"] = xc.make_cache(side.dd, spec, None, side.dd.cluster_id)
    for round_ in range(2):
        for i in range(70):
            s, d = (i + round_) % xc.NUM_BLOCKS, (3 * i + 1) % xc.NUM_BLOCKS
            await side.pull(f"m{i}", src, [s], [d])


def _maps_and_fds() -> tuple[int, int]:
    import os

    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if "memfd:" in line)
    return maps, len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("how", ["unlink", "finalize"])
async def test_an_ended_link_is_not_kept_alive_by_its_lane(side: Side, how: str) -> None:
    """Once the link is unlinked (or the instance finalized), the Link object (its path,
    fd channel, the peer's table) is freed, as it is without a lane (tcp)."""
    import gc
    import weakref

    from aiodatadist.testing import cluster_info

    src, _ = _key(side)
    await side.pull("reg", src, [1], [2])
    await side.pull("reg", src, [3], [4])
    link = weakref.ref(side.link())
    if how == "unlink":
        status, _ = await side.dd.unlink_clusters([cluster_info(PROMPT)], 5000)
        assert status == 0
    else:
        await side.dd.finalize()
    await asyncio.sleep(0.05)
    gc.collect()
    assert link() is None, "the ended link is still alive: " + repr(
        [type(r).__name__ for r in gc.get_referrers(link())]
    )


async def test_an_unregistered_cache_is_not_kept_alive_by_a_lane(side: Side) -> None:
    """Our destination cache unregistered and dropped (no pull after it): its KvCache
    object is freed, as it is without a lane (tcp)."""
    import gc
    import weakref

    src, _ = _key(side)
    await side.pull("reg", src, [1], [2])
    await side.pull("reg", src, [3], [4])
    dst = side.local.pop("reg")
    gone = weakref.ref(dst.cache)
    side.dd.cache_manager.unregister_cache(dst.cache.cache_id)
    del dst
    gc.collect()
    assert gone() is None, "an unregistered cache object is kept alive: " + repr(
        [type(r).__name__ for r in gc.get_referrers(gone())]
    )


async def test_pulls_while_the_peer_cycles_its_cache_land_whole_registrations(
    side: Side,
) -> None:
    """The prompt frees its cache, scribbles over the freed memory and registers a new one
    (new bytes) under the same key, 150 times, while we pull from it back to back: every
    pull that succeeds holds, in every tensor, the bytes of one registration; the others
    fail with an LLMException. Never the scribble, never a mix."""
    from aiodatadist import LLMException

    cm = side.dd.cache_manager
    src, key = _key(side)
    spec = xc.SPECS[src]
    shm = side.path == "shm"
    seeds = [side.seed * 8 + 1000 + i for i in range(150)]
    again = xc.Spec(src, True, shm, spec.shape, model_id=spec.model_id)
    refs = [side.ref(src)] + [xc.pattern(s, again) for s in seeds]
    span = xc.tensor_span(spec.num_tensors, None, None, 2)
    dst = side.local["reg"]
    await side.pull("reg", src, [1], [2])  # the lane is made
    cycling = asyncio.ensure_future(
        side.prompt.ok(
            "cycle",
            name=src,
            model_id=spec.model_id,
            allocate=shm,
            seeds=seeds,
            fill=0xEE,
            pause_ms=1,
        )
    )
    ok = failed = i = 0
    while not cycling.done() or ok < 5:
        i += 1
        s, d = i % xc.NUM_BLOCKS, (i * 3 + 1) % xc.NUM_BLOCKS
        before = side.prefill(dst)
        try:
            await cm.pull_blocks(key, dst.cache, [s], [d], timeout=5)
        except LLMException:
            failed += 1
            await asyncio.sleep(0.0005)
            continue
        ok += 1
        got = dst.matrix()
        if not any(
            np.array_equal(got, xc.expect_blocks(before, ref, spec.unit, [s], [d], span))
            for ref in refs
        ):
            raise AssertionError(f"pull {i} ({s}->{d}) succeeded with bytes of no registration")
        if i > 100_000:
            break
    await cycling
    assert ok > 0, (ok, failed)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["shm", "cma"], indirect=True)
async def test_a_pull_from_a_killed_peer_fails(side: Side) -> None:
    """The prompt killed (SIGKILL) and reaped, the loop given time to see it: a pull from it
    fails (its shared memory may still be mapped here, its bytes are gone with it)."""
    from aiodatadist import LLMException

    cm = side.dd.cache_manager
    src, key = _key(side)
    await side.pull("reg", src, [1], [2])
    await side.pull("reg", src, [3], [4])
    assert isinstance(side.prompt.pid, int)
    side.prompt.kill()  # type: ignore[union-attr]
    await side.prompt.wait_dead()  # type: ignore[union-attr]
    await asyncio.sleep(0.3)
    dst = side.local["reg"]
    for _ in range(3):
        with pytest.raises(LLMException):
            await cm.pull_blocks(key, dst.cache, [5], [6], timeout=2)


async def test_our_cache_unregistered_from_another_thread_during_lane_pulls(
    side: Side,
) -> None:
    """A thread unregisters our destination cache (the registration calls may come from any
    thread) while the loop pulls into it back to back: once unregister returned, nothing
    is written into that memory any more, every pull either landed or raised an
    LLMException, and the link counts no transfer in flight afterwards."""
    import random
    import sys
    import threading

    from aiodatadist import LLMException, LLMStatusCode

    cm = side.dd.cache_manager
    src, key = _key(side)
    spec = xc.Spec("victim", True, False, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE))
    rng = random.Random(side.seed)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(250):
            local = xc.make_cache(side.dd, spec, None, side.dd.cluster_id)
            side.local["victim"] = local
            await side.pull("victim", src, [1], [2])  # the lane is made
            freed = threading.Event()

            def free(local: xc.Local = local, freed: threading.Event = freed) -> None:
                for _ in range(rng.randrange(0, 400)):
                    pass
                while True:
                    try:
                        cm.unregister_cache(local.cache.cache_id)
                        break
                    except LLMException as e:
                        assert e.status_code == LLMStatusCode.LLM_LINK_BUSY, e
                for v in local.views:
                    v.fill(0xC3)  # the memory reused by its owner
                freed.set()

            t = threading.Thread(target=free)
            t.start()
            try:
                for i in range(10_000):
                    try:
                        await cm.pull_blocks(key, local.cache, [i % 8], [(i + 3) % 8], timeout=5)
                    except LLMException:
                        if freed.is_set():
                            break
            finally:
                t.join(10)
            for v in local.views:
                assert (v == 0xC3).all(), "a pull wrote into memory unregistered before it"
            del side.local["victim"]
    finally:
        sys.setswitchinterval(old)
    assert side.link().metrics.in_flight() == 0, "a lane pull was counted as started, never ended"


async def test_a_pull_after_a_push_of_the_same_block_reads_what_was_pushed(side: Side) -> None:
    """push_blocks (our random bytes into the prompt's block 5) is called, then pull_blocks of
    that block back: the pull, queued after the push, lands exactly the pushed bytes."""
    cm = side.dd.cache_manager
    src, key = _key(side)
    await side.pull("reg", src, [1], [2])  # the lane is made
    spec = xc.SPECS[src]
    span = xc.tensor_span(spec.num_tensors, None, None, 2)
    mine = xc.make_cache(side.dd, xc.Spec("mine", True, False, spec.shape), None, 82)
    side.local["mine"] = mine
    dst = side.local["reg"]
    for r in range(4):
        pushed = side.randomize(mine)
        before = side.prefill(dst)
        await _due()
        push = asyncio.ensure_future(cm.push_blocks(key, mine.cache, [r], [5], timeout=10))
        pull = asyncio.ensure_future(cm.pull_blocks(key, dst.cache, [5], [6], timeout=10))
        await asyncio.gather(push, pull)
        want = xc.expect_blocks(
            before,
            xc.expect_blocks(side.ref(src), pushed, spec.unit, [r], [5], span),
            spec.unit,
            [5],
            [6],
            span,
        )
        assert_same(dst.matrix(), want)


async def test_lanes_after_switch_role(side: Side) -> None:
    """Lane pulls, unlink, switch_role (upstream v2: needs no link), link the same prompt
    again: pulls land right (no lane of the old link is used)."""
    from aiodatadist import LLMRole
    from aiodatadist.testing import cluster_info

    src, _ = _key(side)
    await side.pull("reg", src, [1], [2])
    await side.pull("reg", src, [3], [4])
    status, _ = await side.dd.unlink_clusters([cluster_info(PROMPT)], 5000)
    assert status == 0
    await side.dd.switch_role(LLMRole.PROMPT)
    await side.link_prompt()
    for s, d in ((5, 6), (7, 0), (2, 1)):
        await side.pull("reg", src, [s], [d])


@pytest.mark.parametrize("path", ["inproc"], indirect=True)
async def test_inproc_peer_cycles_its_cache_from_another_thread(side: Side) -> None:
    """The in-process prompt's cache is unregistered, scribbled over, refilled and registered
    again (same memory) by another thread, 200 times, while the loop pulls from it back to
    back: every pull that succeeds holds one registration's bytes, in every tensor."""
    import sys
    import threading
    import time

    from aiodatadist import LLMException, LLMStatusCode

    cm = side.dd.cache_manager
    src, key = _key(side)
    spec = xc.SPECS[src]
    prompt = side.prompt.commands  # type: ignore[union-attr]
    pcm = prompt.dd.cache_manager
    seeds = [side.seed * 8 + 5000 + i for i in range(200)]
    refs = [side.ref(src)] + [xc.pattern(s, spec) for s in seeds]
    span = xc.tensor_span(spec.num_tensors, None, None, 2)
    dst = side.local["reg"]
    await side.pull("reg", src, [1], [2])
    done = threading.Event()
    errors: list[BaseException] = []

    def cycle() -> None:
        try:
            local = prompt.caches[src]
            for seed in seeds:
                while True:
                    try:
                        pcm.unregister_cache(local.cache.cache_id)
                        break
                    except LLMException as e:
                        assert e.status_code == LLMStatusCode.LLM_LINK_BUSY, e
                ref = xc.pattern(seed, spec)
                for t, v in enumerate(local.views):
                    v.fill(0xEE)
                    v[...] = ref[t]
                cache = pcm.register_blocks_cache(spec.desc(), local.keep, key)
                local = xc.Local(spec, cache, local.views, local.keep)
                time.sleep(0.002)  # (registered most of the time: lanes get made)
        except BaseException as e:  # (reported by the test)
            errors.append(e)
        finally:
            done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    t = threading.Thread(target=cycle)
    t.start()
    ok = i = 0
    try:
        while not done.is_set():
            i += 1
            s, d = i % xc.NUM_BLOCKS, (i * 3 + 1) % xc.NUM_BLOCKS
            before = side.prefill(dst)
            try:
                await cm.pull_blocks(key, dst.cache, [s], [d], timeout=5)
            except LLMException:
                await asyncio.sleep(0)
                continue
            ok += 1
            got = dst.matrix()
            assert any(
                np.array_equal(got, xc.expect_blocks(before, r, spec.unit, [s], [d], span))
                for r in refs
            ), f"pull {i} ({s}->{d}) succeeded with bytes of no registration"
    finally:
        t.join(30)
        sys.setswitchinterval(old)
    assert not errors, errors
    assert ok > 0


@pytest.mark.slow
@pytest.mark.parametrize("path", ["cma", "shm"], indirect=True)
async def test_a_pull_right_after_the_peer_died_fails_cleanly_or_lands_its_bytes(
    side: Side,
) -> None:
    """The prompt killed and dead (a zombie) before the loop could see it: the next pull
    (no await in between) either lands the dead prompt's bytes exactly (shm: its memory is
    still mapped here) or raises an LLMException naming pull_blocks; the one after the
    loop saw the death fails."""

    from aiodatadist import LLMException

    cm = side.dd.cache_manager
    src, key = _key(side)
    await side.pull("reg", src, [1], [2])
    await side.pull("reg", src, [3], [4])
    pid = side.prompt.pid
    assert isinstance(pid, int)
    side.prompt.kill()  # type: ignore[union-attr]
    dead_now(pid)  # (no await: the loop does not run, the link cannot notice)
    dst = side.local["reg"]
    before = side.prefill(dst)
    try:
        await cm.pull_blocks(key, dst.cache, [5], [6], timeout=2)
    except LLMException as e:
        assert "pull_blocks" in str(e), e
    else:
        assert_same(dst.matrix(), _expect(side, src, before, [5], [6]))
    await side.prompt.wait_dead()  # type: ignore[union-attr]
    await asyncio.sleep(0.3)
    with pytest.raises(LLMException):
        await cm.pull_blocks(key, dst.cache, [5], [6], timeout=2)


async def test_a_pull_awaited_from_another_loop_lands_its_bytes(side: Side) -> None:
    """A pull awaited from another thread's loop (the bridge) lands exactly its bytes, and
    lane pulls on the home loop around it keep working."""
    cm = side.dd.cache_manager
    src, key = _key(side)
    await side.pull("reg", src, [1], [2])
    dst = side.local["reg"]
    for s, d in ((3, 4), (5, 6), (7, 0)):
        before = side.prefill(dst)

        def pull_there(s: int = s, d: int = d) -> None:
            asyncio.run(cm.pull_blocks(key, dst.cache, [s], [d], timeout=10))

        await asyncio.to_thread(pull_there)
        assert_same(dst.matrix(), _expect(side, src, before, [s], [d]))
        await side.pull("reg", src, [d], [s])


@pytest.mark.parametrize(
    "sb, db, kw",
    [
        ([2**63], [0], {}),
        ([2**64 + 1], [0], {}),
        ([-(2**63) - 1], [0], {}),
        ([0], [-1], {}),
        ([0], [1], {"timeout": 10**400}),
        ([0], [1], {"timeout": -0.5}),
        ([0], [1], {"timeout": float("inf")}),
        ([0], [1], {"tensor_num_per_layer": 2**40}),
    ],
)
async def test_odd_values_after_a_lane_fail_as_on_the_whole_path(
    side: Side, sb: list[int], db: list[int], kw: dict[str, Any]
) -> None:
    """Ids beyond int64, negative ids, absurd timeouts and tensor counts: LLMParamError
    naming pull_blocks, after a lane exists as before, and nothing moves."""
    from aiodatadist import LLMParamError

    cm = side.dd.cache_manager
    src, key = _key(side)
    await side.pull("reg", src, [1], [2])
    dst = side.local["reg"]
    before = side.prefill(dst)
    with pytest.raises(LLMParamError, match="pull_blocks"):
        await cm.pull_blocks(key, dst.cache, sb, db, **kw)
    assert np.array_equal(dst.matrix(), before)


async def test_a_tiny_timeout_after_a_lane_is_honoured(side: Side) -> None:
    """A timeout far under a millisecond: the call raises LLMTimeoutError (its deadline has
    passed before a byte could move) or lands its bytes; never wrong bytes."""
    from aiodatadist import LLMException, LLMStatusCode

    cm = side.dd.cache_manager
    src, key = _key(side)
    await side.pull("reg", src, [1], [2])
    dst = side.local["reg"]
    for tmo in (1e-9, 1e-6, 0.000999, 0.001):
        before = side.prefill(dst)
        try:
            await cm.pull_blocks(key, dst.cache, [3], [4], timeout=tmo)
        except LLMException as e:
            assert e.status_code == LLMStatusCode.LLM_TIMEOUT, e
        else:
            assert_same(dst.matrix(), _expect(side, src, before, [3], [4]))


async def test_tracing_turned_on_after_a_lane_traces_every_pull(side: Side) -> None:
    """enable_tracing() after lanes exist: each pull from then on has its span (the lane
    steps aside), with the path and the bytes; disable_tracing() and lanes resume."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from aiodatadist.metrics import disable_tracing, enable_tracing

    src, _ = _key(side)
    await side.pull("reg", src, [1], [2])
    await side.pull("reg", src, [3], [4])
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    enable_tracing(provider)
    try:
        for s, d in ((5, 6), (6, 5), (0, 7)):
            await side.pull("reg", src, [s], [d])
    finally:
        disable_tracing()
    spans = [sp for sp in exporter.get_finished_spans() if sp.name == "aiodatadist.pull_blocks"]
    assert len(spans) == 3, [sp.name for sp in exporter.get_finished_spans()]
    for sp in spans:
        assert sp.attributes is not None and sp.attributes["aiodatadist.path"] == side.path
    await side.pull("reg", src, [2], [3])


@pytest.mark.parametrize("path", ["inproc"], indirect=True)
@pytest.mark.parametrize("src", ["alloc", "reg"])
async def test_pull_after_the_inproc_peer_finalized_fails(side: Side, src: str) -> None:
    """The in-process prompt is finalized (no unlink first) and its allocated memory dropped:
    a pull through the kept lane raises an LLMException (no read of unmapped memory)."""
    import gc

    from aiodatadist import LLMException

    cm = side.dd.cache_manager
    model = xc.SPECS[src].model_id
    assert model is not None
    key = BlocksCacheKey(PROMPT, model)
    await side.pull("reg", src, [1], [2])
    await side.pull("reg", src, [3], [4])
    commands = side.prompt.commands  # type: ignore[union-attr]
    await commands.dd.finalize()
    commands.caches.clear()  # the prompt's views of its memory go: allocated memory unmapped
    gc.collect()
    dst = side.local["reg"]
    for _ in range(3):
        with pytest.raises(LLMException):
            await cm.pull_blocks(key, dst.cache, [5], [6], timeout=2)


async def test_a_key_taken_over_during_the_first_pull_is_followed(side: Side) -> None:
    """The prompt registers a second cache under the model id (last wins: the key now names
    it; the first stays registered) while the pull that would make the lane is running:
    the next pulls give the second cache's bytes, as the whole path's plan does."""
    cm = side.dd.cache_manager
    model, seed_a, seed_b = 77, side.seed * 4 + 1, side.seed * 4 + 2
    shm = side.path == "shm"
    nb = 2048  # 32 MiB: the first pull goes to the executor, the loop runs meanwhile
    a = xc.Spec("A", True, shm, (nb, *xc.BLOCK_SHAPE), model_id=model)
    b = xc.Spec("B", True, shm, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE), model_id=model)
    await side.prompt.ok(
        "register", name="A", model_id=model, seed=seed_a, allocate=shm, num_blocks=nb
    )
    local = xc.make_cache(side.dd, xc.Spec("mine", True, False, a.shape), None, 82)
    side.local["mine"] = local
    key = BlocksCacheKey(PROMPT, model)
    executor = side.dd._rt.executor
    assert executor is not None
    first = asyncio.ensure_future(
        cm.pull_blocks(key, local.cache, list(range(nb)), list(range(nb)), timeout=30)
    )
    while not executor.in_flight and not first.done():  # noqa: ASYNC110
        await asyncio.sleep(0)
    version = side.link().path.remote_table.version
    await side.prompt.ok("register", name="B", model_id=model, seed=seed_b, allocate=shm)
    while side.link().path.remote_table.version == version and not first.done():  # noqa: ASYNC110
        await asyncio.sleep(0.0005)
    from aiodatadist import LLMException

    with contextlib.suppress(LLMException):  # (the key moved under it: it may fail)
        await first
    await asyncio.sleep(0.2)  # the table surely current now
    want_b = xc.pattern(seed_b, b)
    for s, d in ((1, 2), (3, 4), (5, 6)):
        before = side.prefill(local)
        await cm.pull_blocks(key, local.cache, [s], [d], timeout=10)
        got = local.matrix()
        # B has 8 blocks of the same size: block s of B, in every tensor
        unit = a.unit
        for t in range(a.num_tensors):
            assert np.array_equal(
                got[t, d * unit : (d + 1) * unit], want_b[t, s * unit : (s + 1) * unit]
            ), f"pull {s}->{d}: tensor {t} is not the key's current cache's block"
        del before
