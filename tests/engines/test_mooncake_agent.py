"""``MooncakeAgent`` / ``MooncakeConn`` driven directly: two real Mooncake engines.

In-process pairs (two ``TransferEngine`` instances talk over loopback TCP like two
processes) check what the module docstring of ``aiodatadist.transports.mooncake``
promises: exact bytes for plans far above Mooncake's per-peer queue, several transfers
to one peer at once, refusals (outside the peer's memory, overlapping or device
memory), aborts that return at once, the local cache fenced until the requests in
flight ended and nothing landing after. A target in a child process checks that a
transfer waiting on a stopped peer sleeps instead of spinning, that an abort with the
peer stopped returns at once (fenced until Mooncake failed the requests), and that a
killed peer fails the transfer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiodatadist import LLMException, _native
from aiodatadist import LLMStatusCode as S
from aiodatadist._caches import CacheEntry
from aiodatadist.testing import engine_unavailable
from tests._procs import stop_now

pytestmark = [pytest.mark.slow]


@pytest.fixture(autouse=True)
def _need_mooncake() -> None:
    why = engine_unavailable("mooncake")
    if why is not None:
        pytest.skip(why)


def entry(cache_id: int, bufs: list[np.ndarray], num_blocks: int) -> CacheEntry:
    return CacheEntry(
        cache_id=cache_id,
        num_tensors=len(bufs),
        num_blocks=num_blocks,
        block_bytes=bufs[0].nbytes // num_blocks,
        is_blocks=True,
        addrs=[int(b.ctypes.data) for b in bufs],
    )


def filled(n: int, tensors: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, n, dtype=np.uint8) for _ in range(tensors)]


class Pair:
    """Agent ``a`` (initiator) with cache ``dst``; agent ``b`` (target) with cache ``src``."""

    def __init__(self, num_blocks: int, block_bytes: int, tensors: int = 2) -> None:
        from aiodatadist.transports.mooncake import MooncakeAgent

        self.a = MooncakeAgent("test-a", "127.0.0.1")
        self.b = MooncakeAgent("test-b", "127.0.0.1")
        self.nb, self.bb = num_blocks, block_bytes
        self.src = filled(num_blocks * block_bytes, tensors, 1)
        self.dst = [np.zeros(num_blocks * block_bytes, np.uint8) for _ in range(tensors)]
        self.es = entry(1, self.src, num_blocks)
        self.ed = entry(2, self.dst, num_blocks)
        self.b.register(self.es)
        self.a.register(self.ed)
        self.conn = self.a.connect(self.b.info())

    def plan(self, src_blocks: Any, dst_blocks: Any) -> _native.Plan:
        g = self.es.geometry
        return _native.Plan.blocks(g, g, src_blocks, dst_blocks, 0, 0, self.es.num_tensors)

    def rows(self, bufs: list[np.ndarray]) -> list[np.ndarray]:
        return [b.reshape(self.nb, self.bb) for b in bufs]

    def close(self) -> None:
        self.conn.close()
        self.a.deregister(self.ed)
        self.b.deregister(self.es)
        self.a.close()
        self.b.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair(2048, 16 * 1024)  # 2 tensors x 2048 blocks: 4096 descriptors, 64 MiB
    try:
        yield p
    finally:
        p.close()


def test_info_is_the_segment_and_import_is_lazy() -> None:
    code = (
        "import sys, aiodatadist\n"
        "assert 'mooncake' not in sys.modules and 'mooncake.engine' not in sys.modules\n"
        "from aiodatadist.transports.mooncake import MooncakeAgent\n"
        "assert 'mooncake.engine' not in sys.modules\n"
        "a = MooncakeAgent('x', '127.0.0.1')\n"
        "assert 'mooncake.engine' in sys.modules\n"
        "print(a.info()); a.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    info = eval(out.stdout.strip().splitlines()[-1])  # a dict literal we printed
    host, port = info["segment"].rsplit(":", 1)
    assert set(info) == {"segment"} and host == "127.0.0.1" and int(port) > 0


def test_wildcard_host_advertises_a_reachable_address() -> None:
    """An engine started for every interface (``0.0.0.0``) advertises a concrete address
    (its default route's, else an interface's), and a peer moves exact bytes through it."""
    from aiodatadist.transports.mooncake import MooncakeAgent

    a = MooncakeAgent("wild-a", "127.0.0.1")
    b = MooncakeAgent("wild-b", "0.0.0.0")
    src = filled(1 << 16, 1, 5)
    dst = [np.zeros(1 << 16, np.uint8)]
    es, ed = entry(1, src, 4), entry(2, dst, 4)
    try:
        host = b.info()["segment"].rsplit(":", 1)[0]
        assert host not in ("0.0.0.0", ""), host
        b.register(es)
        a.register(ed)
        g = es.geometry
        a.connect(b.info()).read(
            _native.Plan.blocks(g, g, [0, 1, 2, 3], [3, 2, 1, 0], 0, 0, 1),
            es,
            ed,
            _native.Control(),
        )
        assert np.array_equal(dst[0].reshape(4, -1), src[0].reshape(4, -1)[::-1])
    finally:
        a.deregister(ed)
        b.deregister(es)
        a.close()
        b.close()


def test_4096_descriptors_exact_bytes_beyond_the_peer_queue(pair: Pair) -> None:
    """One plan of 4096 requests: Mooncake queues at most 1024 per peer (a single batch
    of them fails); the window makes it exact, read and write."""
    perm = np.random.default_rng(2).permutation(pair.nb)
    plan = pair.plan(perm, np.arange(pair.nb))
    assert plan.num_segments > 2048
    pair.conn.read(plan, pair.es, pair.ed, _native.Control())
    for got, src in zip(pair.rows(pair.dst), pair.rows(pair.src), strict=True):
        assert np.array_equal(got, src[perm])
    # Write back permuted the other way into the target's cache.
    for b in pair.dst:
        b[:] = np.random.default_rng(7).integers(0, 256, b.size, dtype=np.uint8)
    wplan = pair.plan(np.arange(pair.nb), perm)  # src = local (dst bufs) -> remote
    pair.conn.write(wplan, pair.ed, pair.es, _native.Control())
    for got, mine in zip(pair.rows(pair.src), pair.rows(pair.dst), strict=True):
        assert np.array_equal(got[perm], mine)


def test_concurrent_transfers_to_one_peer(pair: Pair) -> None:
    """Eight threads, each a 4096-request plan of its own part of the cache, at once:
    the agent's per-peer bound keeps Mooncake's queue from overflowing."""
    conns = [pair.a.connect(pair.b.info()) for _ in range(8)]
    errors: list[BaseException] = []
    per = pair.nb // 8

    def run(i: int) -> None:
        try:
            blocks = np.arange(i * per, (i + 1) * per)
            for _ in range(4):
                conns[i].read(pair.plan(blocks, blocks), pair.es, pair.ed, _native.Control())
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for got, src in zip(pair.dst, pair.src, strict=True):
        assert np.array_equal(got, src)


def test_address_outside_the_peers_memory_is_refused(pair: Pair) -> None:
    beyond = CacheEntry(
        cache_id=1,
        num_tensors=2,
        num_blocks=pair.nb,
        block_bytes=pair.bb,
        is_blocks=True,
        # Block 0 starts half a block before the end of each registered tensor: it
        # straddles that end (the peer checks a request lies within one of its buffers).
        addrs=[a + pair.nb * pair.bb - pair.bb // 2 for a in pair.es.addrs],
        local=False,
    )
    with pytest.raises(LLMException) as ei:
        pair.conn.read(pair.plan([0], [1]), beyond, pair.ed, _native.Control())
    assert ei.value.status_code == S.LLM_FAILED
    assert not any(b.any() for b in pair.dst)
    # The connection still works.
    pair.conn.read(pair.plan([3], [4]), pair.es, pair.ed, _native.Control())
    assert all(
        np.array_equal(d[4], s[3])
        for d, s in zip(pair.rows(pair.dst), pair.rows(pair.src), strict=True)
    )


def test_overlapping_and_device_registrations_are_refused(pair: Pair) -> None:
    half = entry(9, [b[: b.size // 2] for b in pair.dst], 8)
    with pytest.raises(LLMException) as ei:
        pair.a.register(half)
    assert ei.value.status_code == S.LLM_PARAM_INVALID and "overlap" in str(ei.value)
    other = filled(1 << 16, 2, 3)
    dev = entry(10, other, 4)
    dev.device_id = 0  # type: ignore[attr-defined]  # how a device cache is marked
    with pytest.raises(LLMException) as ei:
        pair.a.register(dev)
    assert ei.value.status_code == S.LLM_PARAM_INVALID and "NIXL" in str(ei.value)
    # A refused registration changed nothing: a fresh cache of the same memory registers.
    ok = entry(11, other, 4)
    pair.a.register(ok)
    pair.a.deregister(ok)
    pair.conn.read(pair.plan([0], [0]), pair.es, pair.ed, _native.Control())


def _unfenced(entry: CacheEntry, bound: float) -> bool:
    end = time.monotonic() + bound
    while entry.late_writes and time.monotonic() < end:
        time.sleep(0.005)
    return not entry.late_writes


def test_abort_returns_at_once_fenced_until_nothing_more_lands() -> None:
    p = Pair(256, 1 << 20)  # 2 x 256 MiB
    try:
        plan = p.plan(np.arange(p.nb), np.arange(p.nb))
        aborted = 0
        for delay in (0.005, 0.02, 0.05):
            for b in p.dst:
                b[:] = 0
            ctl = _native.Control()
            timer = threading.Timer(delay, ctl.abort)
            timer.start()
            try:
                p.conn.read(plan, p.es, p.ed, ctl)
            except _native.NativeError as e:
                assert e.status == _native.Status.ABORTED
                aborted += 1
            timer.join()
            # What was in flight may land until the reaper saw it end: fenced till then.
            assert _unfenced(p.ed, 30)
            landed = [int(np.count_nonzero(b)) for b in p.dst]
            time.sleep(0.3)
            assert [int(np.count_nonzero(b)) for b in p.dst] == landed, "bytes landed late"
        assert aborted, "512 MiB always moved within 50 ms: nothing was aborted"
        p.conn.read(plan, p.es, p.ed, _native.Control())
        assert all(np.array_equal(d, s) for d, s in zip(p.dst, p.src, strict=True))
    finally:
        p.close()


TARGET = """
import json, sys
import numpy as np
from aiodatadist._caches import CacheEntry
from aiodatadist.transports.mooncake import MooncakeAgent
n = int(sys.argv[1])
a = MooncakeAgent("child", "127.0.0.1")
buf = np.full(n, 0x3C, np.uint8)
e = CacheEntry(cache_id=1, num_tensors=1, num_blocks=n // (1 << 20), block_bytes=1 << 20,
               is_blocks=True, addrs=[int(buf.ctypes.data)])
a.register(e)
print("@@ " + json.dumps({"info": a.info(), "addr": e.addrs[0]}), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", TARGET, str(256 << 20)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        while True:
            line = proc.stdout.readline()
            assert line, "the target process died"
            if line.startswith("@@ "):
                yield proc, json.loads(line[3:])
                break
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _child_pair(info: dict[str, Any]) -> tuple[Any, Any, CacheEntry, CacheEntry, list[Any]]:
    from aiodatadist.transports.mooncake import MooncakeAgent

    agent = MooncakeAgent("parent", "127.0.0.1")
    nb = 256
    dst = [np.zeros(nb << 20, np.uint8)]
    local = entry(2, dst, nb)
    remote = CacheEntry(
        cache_id=1,
        num_tensors=1,
        num_blocks=nb,
        block_bytes=1 << 20,
        is_blocks=True,
        addrs=[info["addr"]],
        local=False,
    )
    agent.register(local)
    return agent, agent.connect(info["info"]), local, remote, dst


def test_waiting_on_a_stopped_peer_sleeps(
    child: tuple[subprocess.Popen[str], dict[str, Any]],
) -> None:
    """A transfer to a stopped peer: the polling thread sleeps (backoff to 1 ms) instead
    of burning a core; once the peer runs again every byte lands."""
    proc, info = child
    agent, conn, local, remote, dst = _child_pair(info)
    try:
        g = local.geometry
        plan = _native.Plan.blocks(g, g, np.arange(256), np.arange(256), 0, 0, 1)
        conn.read(_native.Plan.blocks(g, g, [0], [0], 0, 0, 1), remote, local, _native.Control())
        os.kill(proc.pid, signal.SIGSTOP)
        cpu: dict[str, float] = {}

        def run() -> None:
            t0 = time.thread_time()
            conn.read(plan, remote, local, _native.Control())
            cpu["s"] = time.thread_time() - t0

        t = threading.Thread(target=run)
        t.start()
        time.sleep(1.5)
        os.kill(proc.pid, signal.SIGCONT)
        t.join(60)
        assert not t.is_alive()
        assert cpu["s"] < 0.5, f"the poller used {cpu['s']:.2f} s of CPU in ~1.5 s"
        assert bool((dst[0] == 0x3C).all())
    finally:
        agent.deregister(local)
        agent.close()


def test_killed_peer_fails_the_transfer_and_nothing_lands_after(
    child: tuple[subprocess.Popen[str], dict[str, Any]],
) -> None:
    proc, info = child
    agent, conn, local, remote, dst = _child_pair(info)
    try:
        g = local.geometry
        plan = _native.Plan.blocks(g, g, np.arange(256), np.arange(256), 0, 0, 1)
        killer = threading.Timer(0.02, os.kill, (proc.pid, signal.SIGKILL))
        t0 = time.monotonic()
        killer.start()
        with pytest.raises(LLMException) as ei:
            for _ in range(100):
                conn.read(plan, remote, local, _native.Control())
        assert ei.value.status_code == S.LLM_FAILED
        assert time.monotonic() - t0 < 15
        landed = dst[0].copy()
        time.sleep(0.3)
        assert np.array_equal(landed, dst[0]), "bytes landed after the failure"
    finally:
        killer.cancel()
        agent.deregister(local)
        agent.close()


def test_abort_with_a_frozen_peer_returns_at_once_fenced_until_the_engine_gave_up(
    child: tuple[subprocess.Popen[str], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No cancel in Mooncake: an abort while the peer is frozen (SIGSTOP) raises ABORTED
    at once; the requests in flight go to a reaper and the local cache stays fenced until
    Mooncake failed them (its progress / status-frame timeouts, shortened here to 2 s);
    nothing lands afterwards."""
    from aiodatadist.transports import mooncake

    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "2")
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "2")
    monkeypatch.setattr(mooncake, "WINDOW", 4)
    proc, info = child
    agent, conn, local, remote, dst = _child_pair(info)
    try:
        g = local.geometry
        plan = _native.Plan.blocks(g, g, np.arange(256), np.arange(256), 0, 0, 1)
        conn.read(_native.Plan.blocks(g, g, [0], [0], 0, 0, 1), remote, local, _native.Control())
        dst[0][:] = 0
        stop_now(proc.pid)  # (every thread of it stopped before the pull starts)
        ctl = _native.Control()
        aborted: list[float] = []
        queue = conn._queue  # the peer's request slots: one taken per request in flight

        def abort_in_flight() -> None:
            # Once requests are out (a loaded machine may take a while to submit the
            # first), and a little later: the peer is frozen, none of them can end.
            end = time.monotonic() + 10
            while queue._value == queue._initial_value and time.monotonic() < end:  # type: ignore[attr-defined]
                time.sleep(1e-3)
            time.sleep(0.05)
            aborted.append(time.monotonic())
            ctl.abort()

        aborter = threading.Thread(target=abort_in_flight, daemon=True)
        t0 = time.monotonic()
        aborter.start()
        with pytest.raises(_native.NativeError) as ei:
            conn.read(plan, remote, local, ctl)
        aborter.join(10)
        assert aborted, "the call ended before it was aborted"
        took = time.monotonic() - aborted[0]
        assert ei.value.status == _native.Status.ABORTED
        assert took < 1.0, took  # the abort held: the call returned at once
        assert local.late_writes == 1  # requests still in flight: fenced
        assert _unfenced(local, 30)  # Mooncake's timeouts failed them
        assert time.monotonic() - t0 > 1.5, "fence lifted before the engine gave up"
        landed = dst[0].copy()
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.5)
        assert np.array_equal(landed, dst[0]), "bytes landed after the fence lifted"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        agent.deregister(local)
        agent.close()


def test_an_ipv6_host_makes_the_engine_unavailable() -> None:
    """Mooncake's handshake resolves IPv4 only: refused at setup, saying so."""
    from aiodatadist.transports.engine import EngineUnavailable
    from aiodatadist.transports.mooncake import MooncakeAgent

    with pytest.raises(EngineUnavailable, match="IPv4"):
        MooncakeAgent("v6", "::1")
