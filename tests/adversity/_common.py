"""Shared pieces of the adversity suite: actor processes, figures, budgets, the ledger,
and the byte checks every transfer goes through.

Two modes, one code path:

* CI (default): every scenario runs for a few seconds (``ci=`` of its
  ``@pytest.mark.adversity`` marker) so that the whole directory stays within 90 s.
* long (``AIODATADIST_ADVERSITY_SECONDS=N``, set by ``scripts/adversity.sh``): the N
  seconds are shared among the collected scenarios by their ``weight=``, hypothesis
  runs many more examples, and every scenario appends its figures to the JSON-lines
  file ``AIODATADIST_ADVERSITY_REPORT`` (the script prints the totals).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import itertools
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aiodatadist import LLMException, LLMRole, LLMStatusCode
from aiodatadist.testing import PeerControl, PeerProcess, pattern_blocks
from tests._child_env import CHILD_PATH

HERE = Path(__file__).resolve().parent
ACTOR = HERE / "actor.py"
START_TIMEOUT = 30.0
REPLY_TIMEOUT = 20.0

SECONDS_ENV = "AIODATADIST_ADVERSITY_SECONDS"
REPORT_ENV = "AIODATADIST_ADVERSITY_REPORT"


def long_seconds() -> float:
    """The long mode's total seconds, or 0 in CI mode."""
    try:
        return max(0.0, float(os.environ.get(SECONDS_ENV, "0")))
    except ValueError:
        return 0.0


LONG = long_seconds() > 0

_ids = itertools.count(300)


def new_cluster_id() -> int:
    """A cluster id no other instance of this test process uses."""
    return next(_ids)


# ------------------------------------------------------------------ figures


@dataclass
class Figures:
    """What one scenario did: verified pulls, bytes, corrupt bytes, errors, faults."""

    name: str
    pulls: int = 0
    bytes: int = 0
    corrupt: int = 0
    corrupt_pulls: list[str] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    faults: int = 0
    late_faults: list[str] = field(default_factory=list)
    other: dict[str, Any] = field(default_factory=dict)

    def error(self, e: BaseException) -> None:
        if isinstance(e, LLMException):
            code = e.status_code
            self.errors[code.name if isinstance(code, LLMStatusCode) else str(code)] += 1
        else:
            self.errors[type(e).__name__] += 1

    def bad(self, what: str, count: int) -> None:
        self.corrupt += count
        if len(self.corrupt_pulls) < 20:
            self.corrupt_pulls.append(what)

    def late(self, what: str) -> None:
        if len(self.late_faults) < 20:
            self.late_faults.append(what)

    def record(self) -> None:
        path = os.environ.get(REPORT_ENV)
        if not path:
            return
        rec = {
            "kind": "figures",
            "name": self.name,
            "pulls": self.pulls,
            "bytes": self.bytes,
            "corrupt": self.corrupt,
            "corrupt_pulls": self.corrupt_pulls,
            "errors": dict(self.errors),
            "faults": self.faults,
            "late_faults": self.late_faults,
            "other": self.other,
        }
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def check(self) -> None:
        """Records the figures, then fails on any corruption or late fault."""
        self.record()
        assert self.corrupt == 0, (
            f"{self.name}: {self.corrupt} corrupt byte(s) in {len(self.corrupt_pulls)}+ "
            f"pull(s) of {self.pulls}: {self.corrupt_pulls[:5]}"
        )
        assert not self.late_faults, f"{self.name}: faults not ended in time: {self.late_faults}"


def record_ledger(module: str, before: dict[str, int], after: dict[str, int]) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(
                json.dumps({"kind": "ledger", "name": module, "before": before, "after": after})
            )
            f.write("\n")


# ------------------------------------------------------------------ ledger


def shm_entries(prefix: str = "aiodd-") -> list[str]:
    with contextlib.suppress(OSError):
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    return []


def ledger() -> dict[str, int]:
    """fds, threads, mappings (all, and those of shared memory) and /dev/shm aiodd-* now."""
    gc.collect()
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "mappings": len(maps),
        "shm_mappings": sum(1 for m in maps if "aiodd" in m or "/dev/shm/" in m),
        "dev_shm": len(shm_entries()),
    }


# Growth allowed over a module: a few descriptors and threads that the interpreter
# or the event loop policy keep (resolver threads, a logging handler), and mappings
# that the allocator keeps (malloc arenas). Shared memory gets no tolerance.
TOLERANCE = {
    "fds": 4,
    "threads": 1,
    "os_threads": 2,
    "mappings": 256,
    "shm_mappings": 0,
    "dev_shm": 0,
}


def ledger_growth(before: dict[str, int], after: dict[str, int]) -> dict[str, tuple[int, int]]:
    return {
        k: (before[k], after[k])
        for k in before
        if after.get(k, 0) - before[k] > TOLERANCE.get(k, 0)
    }


async def settle_ledger(before: dict[str, int], timeout: float = 5.0) -> dict[str, int]:
    """The ledger once it is back within tolerance of ``before`` (or after ``timeout``):
    threads and descriptors of finished work go away a moment after the work."""
    end = time.monotonic() + timeout
    while True:
        now = ledger()
        if not ledger_growth(before, now) or time.monotonic() > end:
            return now
        await asyncio.sleep(0.05)


def settle_ledger_sync(before: dict[str, int], timeout: float = 5.0) -> dict[str, int]:
    end = time.monotonic() + timeout
    while True:
        now = ledger()
        if not ledger_growth(before, now) or time.monotonic() > end:
            return now
        time.sleep(0.05)


# ------------------------------------------------------------------ byte checks


def snapshot(tensors: Sequence[Any]) -> np.ndarray:
    """All bytes of a cache's tensors: ``[tensor, block, byte]``."""
    return np.stack([t.view(np.uint8).reshape(t.shape[0], -1) for t in tensors]).copy()


def fill_blocks(tensors: Sequence[Any], seed: int, blocks: Sequence[int]) -> None:
    """Writes the pattern of ``seed`` into ``blocks`` of every tensor."""
    for t, tensor in enumerate(tensors):
        raw = tensor.view(np.uint8).reshape(tensor.shape[0], -1)
        raw[list(blocks)] = pattern_blocks(seed, t, list(blocks), raw.shape[1])


def check_pull(
    dst_tensors: Sequence[Any],
    before: np.ndarray,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int] | None,
    seed: int | None,
    tensors: Sequence[int] | None = None,
) -> tuple[int, int]:
    """Checks a destination after a pull; returns ``(corrupt named bytes, touched canaries)``.

    ``seed`` None: the pull failed; the named blocks may hold anything, only the
    canaries (every byte not named) are checked. ``dst_blocks`` None: nothing was named.
    """
    after = snapshot(dst_tensors)
    if seed is None and np.array_equal(after, before):
        return 0, 0  # (the common case, cheaply)
    nt, nb, bb = after.shape
    named = np.zeros((nt, nb), dtype=bool)
    span = list(range(nt)) if tensors is None else list(tensors)
    if dst_blocks is not None:
        for t in span:
            named[t, list(dst_blocks)] = True
    canary_bytes = int((after[~named] != before[~named]).sum())
    bad = 0
    if seed is not None and dst_blocks is not None:
        for t in span:
            want = pattern_blocks(seed, t, list(src_blocks), bb)
            bad += int((after[t, list(dst_blocks)] != want).sum())
    return bad, canary_bytes


def random_blocks(
    rng: np.random.Generator, num_src: int, num_dst: int, most: int
) -> tuple[list[int], list[int]]:
    """A random pull: ``n`` distinct source blocks and ``n`` distinct destination blocks."""
    n = int(rng.integers(1, most + 1))
    src = rng.choice(num_src, size=n, replace=False).tolist()
    dst = rng.choice(num_dst, size=n, replace=False).tolist()
    return [int(b) for b in src], [int(b) for b in dst]


# ------------------------------------------------------------------ actor processes

LIVE: dict[int, ActorProc] = {}


class ActorProc:
    """One peer process with the commands of ``actor.py`` (a plugin of the one harness,
    :class:`aiodatadist.testing.PeerProcess`). Started and reaped without an event loop
    (so that it can outlive one test's loop); commands go over its control port from any
    loop."""

    def __init__(self, peer: PeerProcess, log: Any) -> None:
        self.peer = peer
        self.log = log
        self.cluster_id = peer.cluster_id

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.peer.popen is not None
        return self.peer.popen

    @property
    def ready(self) -> dict[str, Any]:
        return self.peer.ready

    @property
    def killed(self) -> bool:
        return self.peer.killed

    @property
    def pid(self) -> int:
        return self.peer.pid

    @property
    def address(self) -> tuple[str, int]:
        return str(self.ready["host"]), int(self.ready["port"])

    @property
    def control(self) -> int:
        return int(self.ready["control"])

    def stderr_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError, ValueError):
            self.log.flush()
            self.log.seek(0)
            return str(self.log.read()[-n:])
        return ""

    @classmethod
    def start(
        cls,
        *,
        cluster_id: int,
        role: str = "prompt",
        listen: bool = True,
        data_path: str = "auto",
        secret: str | None = None,
        options: dict[str, str] | None = None,
    ) -> ActorProc:
        opts = {"aiodatadist.DataPath": data_path, "llm.SyncKvCacheWaitTime": "5000"}
        if secret is not None:
            opts["aiodatadist.SharedSecret"] = secret
        opts.update(options or {})
        log = tempfile.TemporaryFile("w+")
        peer = PeerProcess(
            cluster_id=cluster_id,
            role=LLMRole.PROMPT if role == "prompt" else LLMRole.DECODER,
            host="127.0.0.1" if listen else None,
            options=opts,
            env=CHILD_PATH,
            start_timeout=START_TIMEOUT,
            serve_cache=False,
            plugin=str(ACTOR),
            control=True,
            stderr=log,
            new_session=True,
            drop_env=("AIODATADIST_SECRET",),
        )
        a = cls(peer, log)
        try:
            peer.start_blocking()
        except BaseException as e:
            tail = a.stderr_tail()
            a.stop()
            raise AssertionError(f"actor failed to start: {e}; stderr:\n{tail}") from e
        LIVE[a.pid] = a
        return a

    async def call(self, cmd: str, *, timeout: float = REPLY_TIMEOUT, **kw: Any) -> dict[str, Any]:
        """Sends one command on a fresh control connection; returns the reply."""
        async with self.session(timeout) as s:
            return await s.call(cmd, timeout=timeout, **kw)

    async def ok(self, cmd: str, **kw: Any) -> dict[str, Any]:
        r = await self.call(cmd, **kw)
        assert r.get("ok"), f"actor {self.pid} {cmd}: {r}; stderr:\n{self.stderr_tail()}"
        return r

    @contextlib.asynccontextmanager
    async def session(self, timeout: float = REPLY_TIMEOUT) -> AsyncIterator[Session]:
        async with self.peer.connect(timeout) as control:
            yield Session(self, control)

    def kill(self) -> None:
        """SIGKILL (a crash: no finalize, no unlink)."""
        self.peer.kill()

    async def wait_dead(self, timeout: float = 5.0) -> int:
        try:
            rc = await self.peer.wait_exit(timeout)
        except TimeoutError:
            raise AssertionError(f"actor {self.pid} still alive after {timeout} s") from None
        LIVE.pop(self.pid, None)
        return rc

    def stop(self, timeout: float = 10.0) -> int | None:
        """Closes its lifeline (it finalizes and exits); SIGKILL if it does not in time."""
        try:
            return self.peer.stop_blocking(timeout)
        finally:
            with contextlib.suppress(OSError):
                self.log.close()
            LIVE.pop(self.pid, None)


class Session:
    """One control connection of an actor; a closed connection is an AssertionError that
    carries the actor's stderr."""

    def __init__(self, actor: ActorProc, control: PeerControl) -> None:
        self.actor = actor
        self.control = control

    async def call(self, cmd: str, *, timeout: float = REPLY_TIMEOUT, **kw: Any) -> dict[str, Any]:
        try:
            return await self.control.call(cmd, timeout=timeout, **kw)
        except ConnectionError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.actor.proc.wait(1.0)  # (bounded) so that its exit status is known
            raise AssertionError(
                f"actor {self.actor.pid} closed the control connection "
                f"(rc={self.actor.proc.poll()}); stderr:\n{self.actor.stderr_tail()}"
            ) from None

    async def ok(self, cmd: str, **kw: Any) -> dict[str, Any]:
        r = await self.call(cmd, **kw)
        assert r.get("ok"), f"actor {self.actor.pid} {cmd}: {r}"
        return r


def reap_all() -> None:
    for a in list(LIVE.values()):
        with contextlib.suppress(Exception):
            a.stop(timeout=5)


def remove_segments_of(pid: int) -> list[str]:
    """Unlinks what a dead process left in /dev/shm (after the test noted it); returns names."""
    left = [n for n in shm_entries() if n.startswith(f"aiodd-{pid}-")]
    for n in left:
        with contextlib.suppress(OSError):
            os.unlink("/dev/shm/" + n)
    return left


# The prompt caches the scenarios pull from.
NUM_TENSORS = 8
NUM_BLOCKS = 64
BLOCK_SHAPE = (32, 2, 64)  # fp16: 8 KiB per block per tensor
BLOCK_BYTES = 2 * 32 * 2 * 64


def cache_spec(name: str, model_id: int, allocate: bool) -> dict[str, Any]:
    return {
        "name": name,
        "model_id": model_id,
        "allocate": allocate,
        "num_tensors": NUM_TENSORS,
        "num_blocks": NUM_BLOCKS,
        "block_shape": list(BLOCK_SHAPE),
    }


# shm needs the prompt's cache in shared memory; cma and tcp pull registered memory.
MODEL_FOR_PATH = {"shm": 0, "cma": 1, "tcp": 1, "inproc": 0}
CACHE_FOR_MODEL = {0: "shm", 1: "reg"}


def start_prompt(**kw: Any) -> ActorProc:
    """A prompt actor serving three caches: ``shm`` (model 0, allocated), ``reg`` (model 1,
    registered numpy memory) and ``busy`` (model 2, registered, filled with ``BUSY_SEED``)."""
    a = ActorProc.start(cluster_id=new_cluster_id(), **kw)
    try:
        asyncio.run(_prompt_caches(a))
    except BaseException:
        a.stop()
        raise
    return a


BUSY_MODEL = 2
BUSY_SEED = 777
BUSY_SHAPE = [256, 2, 64]


async def _prompt_caches(a: ActorProc) -> None:
    await a.ok("cache", **cache_spec("shm", 0, True))
    await a.ok("cache", **cache_spec("reg", 1, False))
    # Pulled by a second decoder to keep the serving side busy; never re-filled.
    # 32 MiB: a paused reader blocks the serving side's send (more than socket buffers).
    await a.ok("cache", **{**cache_spec("busy", BUSY_MODEL, False), "block_shape": BUSY_SHAPE})
    await a.ok("fill", name="busy", seed=BUSY_SEED, blocks=list(range(NUM_BLOCKS)))
