"""NIXL and Mooncake driven directly: the baselines of ``bench_tiny.py`` and ``bench_engines.py``.

Each engine runs as two processes of its own, started from here: an *initiator* (the
pulling side, ``python bench/engines.py initiator ENGINE ...``) that starts its
*target* (``python bench/engines.py target ENGINE ...``), links the two the way the
engine's own examples do, and then serves the bench's commands on stdin:

========================  ==============================================================
``run K [PULL [MODE]]``   K pulls, each timed on its own (``time.perf_counter_ns``)
``arun K [PULL]``         (NIXL) the same, polled from an asyncio event loop
                          (``await asyncio.sleep(0)`` between two ``check_xfer_state``)
``zero [PULL]``           clears the pull's destination
``sum [PULL]``            :func:`checksum` of the pull's destination (gathered)
========================  ==============================================================

Each answer is one line that starts with ``@@ `` (both libraries print their own log
lines on stdout). A pull reads ``--segs`` segments of ``--seg-bytes`` bytes each from
the target (segment ``i`` at ``i * --stride`` in its buffer: blocks of different
tensors are not neighbours) into the initiator's contiguous buffer (``PULL`` is then
``default``); or, with ``--layout`` (``bench_engines.py``), both sides hold a KV cache's
tensors and a pull has one descriptor per block per tensor, named pulls of one layout
sharing the two processes (:class:`EngineServer`). Both buffers are
:func:`aiodatadist.testing.caches.host_buffer` memory (anonymous, ``MADV_HUGEPAGE``,
touched), the kind the aiodatadist prompt registers; the target's holds
:func:`pattern_words` (with a layout: ``fill_pattern(tensors, seed)``, the bytes of an
aiodatadist prompt with the same seed).

* ``nixl``: ``nixl_cu12`` (``pip install --no-deps nixl-cu12``), one agent per side,
  UCX backend (its defaults: on one host UCX reads through CMA), ``DRAM`` descriptors,
  one ``READ`` transfer handle made once and posted again for every pull
  (``transfer`` then ``check_xfer_state`` until ``DONE``); mode ``fresh``: the
  descriptor lists and handle made for each pull, released after it (:data:`NIXL_MODES`).
* ``mooncake``: ``mooncake-transfer-engine-non-cuda`` (needs Debian's
  ``libibverbs1``), ``TransferEngine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp",
  "")`` on both sides (no metadata server), ``transfer_sync_read`` (one segment) or
  ``batch_transfer_sync_read`` (several, at most ``--mc-batch`` per batch, chunks one
  after the other); mode ``window``: a request per descriptor, ``--mc-window`` in
  flight (:data:`MOONCAKE_MODES`).

:class:`EngineServer` is the bench's side; when an engine cannot be imported or set up,
its constructor raises :class:`EngineUnavailable` with the reason, which the bench
prints in place of the row. Not installed (the package never imports ``bench/``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

# The direct side runs NIXL as aiodatadist does: its progress thread paced (the wrapper's
# default spins a whole core per agent) and UCX's EFA module left out (a crash at exit).
from aiodatadist.transports.nixl import UCX_MODULES_DEFAULT
from aiodatadist.transports.nixl import _paced_agent as _paced_agent

os.environ.setdefault("UCX_MODULES", UCX_MODULES_DEFAULT)

__all__ = [
    "ENGINES",
    "EngineServer",
    "EngineUnavailable",
    "MOONCAKE_MODES",
    "NIXL_MODES",
    "checksum",
    "gathered_checksum",
    "layout_expected",
    "layout_segments",
    "pattern_words",
    "read_reply",
]

ENGINES = ("nixl", "mooncake")
_PREFIX = "@@ "
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_EXC_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:")


class EngineUnavailable(RuntimeError):
    """The engine could not be imported, set up or run here (the message says why)."""


def pattern_words(nbytes: int, first_word: int = 0) -> npt.NDArray[np.uint8]:
    """Bytes whose 64-bit words ``i`` hold ``i * 0x9E3779B97F4A7C15 + 1`` (``i`` counted
    from ``first_word``): the source of the C ``tiny tcp`` server and of the targets here."""
    idx = np.arange(first_word, first_word + nbytes // 8, dtype=np.uint64)
    out: npt.NDArray[np.uint8] = (idx * _GOLDEN + np.uint64(1)).view(np.uint8)
    return out


def checksum(buf: Any, first_word: int = 0) -> int:
    """Sum over the 64-bit words ``w[i]`` of ``buf`` of ``w[i] * (2i + 1)`` mod 2^64
    (what ``tiny`` answers to ``sum``), ``i`` counted from ``first_word``: the checksums
    of consecutive pieces, each given the word count before it, add up (mod 2^64) to
    the checksum of their concatenation."""
    raw = np.asarray(buf).reshape(-1).view(np.uint8)
    words = raw[: raw.size // 8 * 8].view(np.uint64)
    idx = np.arange(first_word, first_word + words.size, dtype=np.uint64)
    weights = idx * np.uint64(2) + np.uint64(1)
    return int((words * weights).sum(dtype=np.uint64))


def read_reply(stdout: Any, what: str, log: Callable[[], str] | None = None) -> str:
    """The next ``@@ `` line of a server's stdout, without the prefix (other lines skipped).

    Raises:
        EngineUnavailable: the server closed its stdout (it died); ``log()`` says why.
    """
    while True:
        line = stdout.readline()
        if not line:
            why = log() if log is not None else ""
            raise EngineUnavailable(f"{what} exited{': ' + why if why else ''}")
        if line.startswith(_PREFIX):
            return str(line[len(_PREFIX) :].rstrip("\n"))


def _reply(text: str) -> None:
    sys.stdout.write(_PREFIX + text + "\n")
    sys.stdout.flush()


def _buffer(nbytes: int) -> npt.NDArray[np.uint8]:
    from aiodatadist.testing.caches import host_buffer

    buf: npt.NDArray[np.uint8] = host_buffer(nbytes, np.uint8)
    return buf


# ------------------------------------------------------------------------ the layouts


def rotation(layout: dict[str, Any], pull: str) -> list[tuple[int, int]]:
    """The ``(src block, dst block)`` pairs a *rotating* pull (``"rotate": seed`` in its
    spec) takes in turn, one per pull: every pair of two different blocks of the pool,
    shuffled by the seed, starting with the pull's own ``src[0]``, ``dst[0]`` (what
    :func:`layout_segments` and the checks see: a check pulls that pair). A pull without
    ``rotate`` has none."""
    p = layout["pulls"][pull]
    if "rotate" not in p:
        return []
    pool = int(layout["pool"])
    first = (int(p["src"][0]), int(p["dst"][0]))
    pairs = [(s, d) for s in range(pool) for d in range(pool) if s != d and (s, d) != first]
    order = np.random.default_rng(int(p["rotate"])).permutation(len(pairs))
    return [first, *(pairs[i] for i in order)]


def layout_segments(layout: dict[str, Any], pull: str) -> list[tuple[int, int, int]]:
    """``(tensor, src_block, dst_block)`` of each segment of a layout's pull, in the order
    the descriptors are listed (tensor after tensor; within one, the pull's block pairs)."""
    p = layout["pulls"][pull]
    t0, n = p["tensors"]
    pairs = list(zip(p["src"], p["dst"], strict=True))
    return [(t, s, d) for t in range(t0, t0 + n) for s, d in pairs]


def layout_expected(layout: dict[str, Any], pull: str) -> int:
    """The :func:`checksum` of a pull's destination blocks, gathered in descriptor order,
    once they hold the source's :func:`aiodatadist.testing.patterns.fill_pattern` bytes
    (the pattern of the target here and of an aiodatadist prompt with the same seed)."""
    from aiodatadist.testing.patterns import pattern_blocks

    p = layout["pulls"][pull]
    bb, seed = int(layout["block_bytes"]), int(layout["seed"])
    t0, n = p["tensors"]
    total, words = 0, 0
    for t in range(t0, t0 + n):
        blocks = pattern_blocks(seed, t, p["src"], bb)
        total += checksum(blocks, words)
        words += blocks.size // 8
    return total % (1 << 64)


def gathered_checksum(views: list[Any]) -> int:
    """The :func:`checksum` of ``views`` (byte arrays) as if concatenated."""
    total, words = 0, 0
    for v in views:
        total += checksum(v, words)
        words += np.asarray(v).nbytes // 8
    return total % (1 << 64)


def _layout_tensors(layout: dict[str, Any]) -> npt.NDArray[np.uint8]:
    """``[tensors, pool, block_bytes]`` bytes on one huge-page-advised mapping: how an
    aiodatadist prompt (``make_blocks_cache(..., huge_pages=True)``) holds its cache."""
    from aiodatadist.testing.caches import host_buffer

    shape = (int(layout["tensors"]), int(layout["pool"]), int(layout["block_bytes"]))
    buf: npt.NDArray[np.uint8] = host_buffer(shape, np.uint8)
    return buf


# ----------------------------------------------------------------- the target process


def _target(engine: str, nbytes: int, layout: dict[str, Any] | None = None) -> None:
    """Holds pattern-filled memory registered with ``engine``; prints how to reach it.

    Without ``layout``: one buffer of ``nbytes`` holding :func:`pattern_words`; with it,
    the layout's tensors, filled with ``fill_pattern(tensors, seed)`` and registered one
    region per tensor (as aiodatadist registers a cache).
    """
    if layout is None:
        buf = _buffer(nbytes)
        buf[:] = pattern_words(nbytes)
        regions = [(int(buf.ctypes.data), nbytes)]
    else:
        from aiodatadist.testing.patterns import fill_pattern

        buf = _layout_tensors(layout)
        fill_pattern(list(buf), int(layout["seed"]))
        regions = [(int(t.ctypes.data), t.nbytes) for t in buf]
    keep: Any
    info: dict[str, Any] = {"addr": regions[0][0], "addrs": [a for a, _ in regions]}
    if engine == "nixl":
        from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found,unused-ignore]

        # Paced like aiodatadist's own agent (its progress thread otherwise spins a core).
        agent = _paced_agent(nixl_agent, "target", nixl_agent_config(backends=["UCX"]))
        agent.register_memory(agent.get_reg_descs([(a, n, 0, "") for a, n in regions], "DRAM"))
        info["md"] = agent.get_agent_metadata().hex()
        keep = agent
    else:
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped,unused-ignore]

        te = TransferEngine()
        rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize returned {rc}")
        rc = te.batch_register_memory([a for a, _ in regions], [n for _, n in regions])
        if rc != 0:
            raise RuntimeError(f"TransferEngine.batch_register_memory returned {rc}")
        info["port"] = te.get_rpc_port()
        keep = te
    _reply(json.dumps(info))
    sys.stdin.read()  # the initiator closes our stdin when it is done (or dies)
    del keep


# -------------------------------------------------------------- the initiator process

NIXL_MODES = ("reuse", "fresh", "chunked")
"""NIXL pulls: ``reuse`` posts one READ handle, made once, again and again (only a pull
that repeats itself can); ``fresh`` makes the descriptor lists and the handle for each
pull (``get_xfer_descs`` + ``initialize_xfer``), posts it and releases it after;
``chunked`` posts one handle per ``--nixl-chunk`` descriptors (made once), one after the
other (what the aiodatadist NIXL path does to bound an abort's wait)."""
MOONCAKE_MODES = ("sync", "window")
"""Mooncake pulls: ``sync``, ``transfer_sync_read`` (one descriptor) or one
``batch_transfer_sync_read`` per chunk of at most ``--mc-batch`` descriptors, one after
the other (its TCP transport queues at most 1024 requests per peer: a batch of 4096
fails); ``window``, each descriptor a batch of its own (``batch_transfer_async_read``),
at most ``--mc-window`` in flight, the oldest polled with ``transfer_check_status``
(spin, then sleeps with backoff; ``get_batch_transfer_status`` over 4096 x 256 KiB
returned -1 here)."""


class _Pull:
    """One pull's descriptors (local and remote address and length of each segment) and
    the local bytes they land in (``views``, in descriptor order)."""

    def __init__(self, local: list[int], remote: list[int], lens: list[int], views: list[Any]):
        self.local, self.remote, self.lens, self.views = local, remote, lens, views
        self.handle: Any = None  # NIXL, mode reuse: made on its first pull
        self.chunks: list[Any] = []  # NIXL, mode chunked: made on its first pull
        self.turns: list[_Pull] = []  # a rotating pull: the pulls it takes in turn
        self.turn = 0


class _Initiator:
    """The pulling side of one engine: ``pull(name, mode)`` moves every segment once."""

    def __init__(
        self,
        engine: str,
        regions: list[tuple[int, int]],
        pulls: dict[str, _Pull],
        info: dict[str, Any],
        mc_batch: int = 1024,
        mc_window: int = 64,
        nixl_chunk: int = 32,
    ) -> None:
        self.engine = engine
        self.pulls = pulls
        self.mc_batch = mc_batch
        self.mc_window = mc_window
        self.nixl_chunk = nixl_chunk
        if engine == "nixl":
            from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found,unused-ignore]

            self.agent = agent = _paced_agent(
                nixl_agent, "initiator", nixl_agent_config(backends=["UCX"])
            )
            agent.register_memory(agent.get_reg_descs([(a, n, 0, "") for a, n in regions], "DRAM"))
            self.peer = agent.add_remote_agent(bytes.fromhex(info["md"]))
        else:
            from mooncake.engine import TransferEngine  # type: ignore[import-untyped,unused-ignore]

            self.te = te = TransferEngine()
            rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            if rc != 0:
                raise RuntimeError(f"TransferEngine.initialize returned {rc}")
            rc = te.batch_register_memory([a for a, _ in regions], [n for _, n in regions])
            if rc != 0:
                raise RuntimeError(f"TransferEngine.batch_register_memory returned {rc}")
            self.target = f"127.0.0.1:{info['port']}"

    def _nixl_handle(self, p: _Pull, first: int = 0, end: int | None = None) -> Any:
        """A READ handle of ``p``'s descriptors ``first:end`` (the target registered whole
        tensors; the descriptors name pieces of them)."""
        agent = self.agent
        sl = slice(first, end)
        lens = p.lens[sl]
        zeros = [0] * len(lens)
        local = np.array([p.local[sl], lens, zeros], dtype=np.uint64).T.copy()
        remote = np.array([p.remote[sl], lens, zeros], dtype=np.uint64).T.copy()
        return agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local, "DRAM"),
            agent.get_xfer_descs(remote, "DRAM"),
            self.peer,
        )

    def _nixl_wait(self, h: Any, state: str) -> None:
        check = self.agent.check_xfer_state
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed (ERR)")
            state = check(h)

    def pull(self, name: str, mode: str) -> None:
        p = self.pulls[name]
        if p.turns:  # a rotating pull: new blocks every time
            if mode in ("reuse", "chunked"):
                raise RuntimeError(f"mode {mode!r} keeps its handles: not for new blocks")
            p.turn = (p.turn + 1) % len(p.turns)
            p = p.turns[p.turn]
        if self.engine == "nixl":
            if mode == "reuse":
                if p.handle is None:
                    p.handle = self._nixl_handle(p)
                self._nixl_wait(p.handle, self.agent.transfer(p.handle))
            elif mode == "fresh":
                h = self._nixl_handle(p)
                try:
                    self._nixl_wait(h, self.agent.transfer(h))
                finally:
                    self.agent.release_xfer_handle(h)
            elif mode == "chunked":
                if not p.chunks:
                    step = self.nixl_chunk
                    p.chunks = [
                        self._nixl_handle(p, i, i + step) for i in range(0, len(p.lens), step)
                    ]
                for h in p.chunks:
                    self._nixl_wait(h, self.agent.transfer(h))
            else:
                raise RuntimeError(f"NIXL mode must be one of {NIXL_MODES}, got {mode!r}")
            return
        te, n, step = self.te, len(p.lens), self.mc_batch
        if mode == "sync" and n == 1:
            rc = te.transfer_sync_read(self.target, p.local[0], p.remote[0], p.lens[0])
            if rc != 0:
                raise RuntimeError(f"transfer_sync_read returned {rc}")
        elif mode == "sync":
            for i in range(0, n, step):
                j = i + step
                rc = te.batch_transfer_sync_read(
                    self.target, p.local[i:j], p.remote[i:j], p.lens[i:j]
                )
                if rc != 0:
                    raise RuntimeError(f"batch_transfer_sync_read returned {rc}")
        elif mode == "window":
            self._mc_window(p)
        else:
            raise RuntimeError(f"Mooncake mode must be one of {MOONCAKE_MODES}, got {mode!r}")

    def _mc_window(self, p: _Pull) -> None:
        """Every descriptor its own batch, at most ``mc_window`` in flight, the oldest
        polled (``transfer_check_status``: 0 in flight, 1 done, < 0 failed): spinning
        for up to 500 us after progress, then sleeping 20 us doubling to 1 ms (a tight
        loop would take a core from the engine's own threads on a small machine)."""
        te, target, n = self.te, self.target, len(p.lens)
        submit, check = te.batch_transfer_async_read, te.transfer_check_status
        flight: collections.deque[int] = collections.deque()
        nxt = 0
        failed = 0
        clock = time.perf_counter
        spin_until, delay = clock() + 500e-6, 20e-6
        while nxt < n or flight:
            progressed = False
            while nxt < n and len(flight) < self.mc_window and not failed:
                bid = submit(target, [p.local[nxt]], [p.remote[nxt]], [p.lens[nxt]])
                if not bid:
                    raise RuntimeError("batch_transfer_async_read returned 0")
                flight.append(bid)
                nxt += 1
                progressed = True
            while flight:
                st = check(flight[0])
                if st == 0:
                    break
                flight.popleft()
                progressed = True
                if st != 1:
                    failed = failed or st
            if failed and not flight:
                raise RuntimeError(f"transfer_check_status returned {failed}")
            if progressed:
                spin_until, delay = clock() + 500e-6, 20e-6
            elif clock() >= spin_until:
                time.sleep(delay)
                delay = min(2 * delay, 1e-3)

    async def _nixl_apull(self, name: str) -> None:
        p = self.pulls[name]
        if p.handle is None:
            p.handle = self._nixl_handle(p)
        agent, h = self.agent, p.handle
        state = agent.transfer(h)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed (ERR)")
            await asyncio.sleep(0)
            state = agent.check_xfer_state(h)

    def run(self, k: int, name: str, mode: str) -> list[int]:
        out = [0] * k
        clock = time.perf_counter_ns
        for j in range(k):
            t0 = clock()
            self.pull(name, mode)
            out[j] = clock() - t0
        return out

    def arun(self, k: int, name: str) -> list[int]:
        if self.engine != "nixl":
            raise RuntimeError("arun: NIXL only")

        async def go() -> list[int]:
            out = [0] * k
            clock = time.perf_counter_ns
            for j in range(k):
                t0 = clock()
                await self._nixl_apull(name)
                out[j] = clock() - t0
            return out

        return asyncio.run(go())

    def zero(self, name: str) -> None:
        """Clears the pull's destination (a rotating pull: its first pair's, which its next
        pull then takes: what ``sum`` checks)."""
        p = self.pulls[name]
        p.turn = len(p.turns) - 1 if p.turns else 0
        for v in p.views:
            v[...] = 0

    def sum(self, name: str) -> int:
        return gathered_checksum(self.pulls[name].views)


def _start_target(
    engine: str, nbytes: int, log: Any, layout: str | None = None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    argv = [sys.executable, os.path.abspath(__file__), "target", engine, "--bytes", str(nbytes)]
    proc = subprocess.Popen(
        argv + (["--layout", layout] if layout else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    assert proc.stdout is not None
    info = json.loads(read_reply(proc.stdout, f"the {engine} target"))
    return proc, info


def _plain_pulls(args: argparse.Namespace, info: dict[str, Any]) -> tuple[Any, dict[str, _Pull]]:
    """``--segs`` segments at ``--stride`` in the target into one contiguous buffer."""
    seg, segs = args.seg_bytes, args.segs
    buf = _buffer(seg * segs)
    local = int(buf.ctypes.data)
    pull = _Pull(
        [local + i * seg for i in range(segs)],
        [int(info["addr"]) + i * args.stride for i in range(segs)],
        [seg] * segs,
        [buf],
    )
    return buf, {"default": pull}


def _layout_pulls(layout: dict[str, Any], info: dict[str, Any]) -> tuple[Any, dict[str, _Pull]]:
    """The layout's tensors here too; each pull's descriptors as aiodatadist computes
    them: tensor ``t``'s block ``b`` at ``addrs[t] + b * block_bytes`` on either side."""
    bufs = _layout_tensors(layout)
    bb = int(layout["block_bytes"])
    mine = [int(t.ctypes.data) for t in bufs]
    theirs = [int(a) for a in info["addrs"]]
    pulls = {}

    def make(segs: list[tuple[int, int, int]]) -> _Pull:
        return _Pull(
            [mine[t] + d * bb for t, _, d in segs],
            [theirs[t] + s * bb for t, s, _ in segs],
            [bb] * len(segs),
            [bufs[t, d] for t, _, d in segs],
        )

    for name, spec in layout["pulls"].items():
        pulls[name] = make(layout_segments(layout, name))
        t0, n = spec["tensors"]
        tensors = range(t0, t0 + n)
        pulls[name].turns = [make([(t, s, d) for t in tensors]) for s, d in rotation(layout, name)]
    return bufs, pulls


def _initiator(args: argparse.Namespace) -> None:
    layout = json.loads(args.layout) if args.layout else None
    if layout is None:
        target_bytes = (args.segs - 1) * args.stride + args.seg_bytes
    else:
        target_bytes = int(layout["tensors"]) * int(layout["pool"]) * int(layout["block_bytes"])
    target, info = _start_target(args.engine, target_bytes, sys.stderr, args.layout)
    try:
        bufs, pulls = _plain_pulls(args, info) if layout is None else _layout_pulls(layout, info)
        regions = [(int(b.ctypes.data), b.nbytes) for b in (bufs if layout else [bufs])]
        ini = _Initiator(
            args.engine, regions, pulls, info, args.mc_batch, args.mc_window, args.nixl_chunk
        )
        default_mode = "reuse" if args.engine == "nixl" else "sync"
        for name, p in pulls.items():  # connects (both engines link on the first transfer)
            ini.run(1, name, "fresh" if p.turns and args.engine == "nixl" else default_mode)
        _reply(f"ready {target.pid}")
        for line in sys.stdin:
            cmd, *rest = line.split()
            name = rest[1] if len(rest) > 1 else "default"
            mode = rest[2] if len(rest) > 2 else default_mode
            try:
                if cmd == "run":
                    _reply(" ".join(map(str, ini.run(int(rest[0]), name, mode))))
                elif cmd == "arun":
                    _reply(" ".join(map(str, ini.arun(int(rest[0]), name))))
                elif cmd == "zero":
                    ini.zero(rest[0] if rest else "default")
                    _reply("ok")
                elif cmd == "sum":
                    _reply(str(ini.sum(rest[0] if rest else "default")))
                else:
                    _reply(f"error unknown command {cmd!r}")
            except (KeyError, IndexError, ValueError, RuntimeError) as e:
                _reply(f"error {cmd}: {type(e).__name__}: {e}")
    finally:
        assert target.stdin is not None
        target.stdin.close()
        try:
            target.wait(timeout=10)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()


# ---------------------------------------------------------------------- the bench's side


class EngineServer:
    """An engine's initiator process (and its target), driven by the bench.

    Args:
        engine: ``nixl`` or ``mooncake``.
        seg_bytes: bytes of one segment.
        segs: segments per pull.
        stride: distance between two segments in the target's buffer.
        start_timeout: seconds to set up and do a first pull.
        layout: instead of the three above, a cache layout and its named pulls:
            ``{"tensors", "pool", "block_bytes", "seed", "pulls": {name: {"src": [...],
            "dst": [...], "tensors": [first, count]}}}``; both sides then hold
            ``tensors`` tensors of ``pool`` blocks (the target's filled with
            ``fill_pattern(tensors, seed)``), each registered as one region, and a pull
            has one descriptor per block per tensor (:func:`layout_segments`).
        mc_batch: Mooncake: at most this many descriptors per batch (its default
            per-peer queues refuse a batch of 4096 x 256 KiB: bigger pulls are chunked).
        mc_window: Mooncake, mode ``window``: requests in flight.
        nixl_chunk: NIXL, mode ``chunked``: descriptors per handle.

    Raises (constructor):
        EngineUnavailable: the engine cannot be imported, set up or run here.
    """

    def __init__(
        self,
        engine: str,
        seg_bytes: int = 0,
        segs: int = 1,
        stride: int = 0,
        start_timeout: float = 120.0,
        *,
        layout: dict[str, Any] | None = None,
        mc_batch: int = 1024,
        mc_window: int = 64,
        nixl_chunk: int = 32,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.engine = engine
        self.layout = layout
        self.expected: dict[str, int] = {}
        if layout is None:
            self.nbytes = seg_bytes * segs
            self.expected["default"] = checksum(
                np.concatenate([pattern_words(seg_bytes, i * stride // 8) for i in range(segs)])
            )
            shape = ["--seg-bytes", str(seg_bytes), "--segs", str(segs), "--stride", str(stride)]
        else:
            self.nbytes = 0
            for name in layout["pulls"]:
                self.expected[name] = layout_expected(layout, name)
            shape = ["--layout", json.dumps(layout, separators=(",", ":"))]
        # The pull that re-warms after a pause: the smallest.
        self.rewarm_pull = min(
            self.expected, key=lambda n: len(layout_segments(layout, n)) if layout else 0
        )
        self._log = tempfile.TemporaryFile(mode="w+")
        self.expired = False
        self.paused = False
        self.target_pid = 0
        cmd = [sys.executable, os.path.abspath(__file__), "initiator", engine, *shape]
        cmd += ["--mc-batch", str(mc_batch), "--mc-window", str(mc_window)]
        cmd += ["--nixl-chunk", str(nixl_chunk)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        try:
            self.target_pid = int(self._ask(None, start_timeout).split()[1])
        except EngineUnavailable:
            self.close()
            raise

    def _why(self) -> str:
        self._log.seek(0)
        lines = [ln.strip() for ln in self._log.read().splitlines() if ln.strip()]
        # The root cause: the last exception line that is not our own "it exited" (the
        # target's traceback lands in the same log, before the initiator's).
        causes = [ln for ln in lines if _EXC_LINE.match(ln) and "EngineUnavailable" not in ln]
        errs = [ln for ln in lines if "Error" in ln or "error" in ln or ln.startswith("E")]
        return (causes or errs or lines or ["no output"])[-1][:300]

    def _ask(self, cmd: str | None, timeout: float) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if cmd is not None:
            try:
                self.proc.stdin.write(cmd + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                raise EngineUnavailable(
                    f"the {self.engine} initiator died: {self._why()}"
                ) from None
        # A hung engine must not hang the bench: past the deadline it is killed, and its
        # closed stdout makes read_reply raise.
        watchdog = threading.Timer(timeout, self._expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            return read_reply(self.proc.stdout, f"the {self.engine} initiator", self._why)
        except EngineUnavailable as e:
            if self.expired:
                raise EngineUnavailable(f"the {self.engine} initiator hung ({timeout:g} s)") from e
            raise
        finally:
            watchdog.cancel()

    def _expire(self) -> None:
        self.expired = True
        self.proc.kill()

    def run(
        self,
        k: int,
        polled_from_asyncio: bool = False,
        pull: str = "default",
        mode: str | None = None,
    ) -> list[float]:
        """``k`` pulls (of the layout's ``pull``, in ``mode``: :data:`NIXL_MODES`,
        :data:`MOONCAKE_MODES`; None: the first); their latencies in microseconds."""
        verb = "arun" if polled_from_asyncio else "run"
        cmd = f"{verb} {k} {pull}" + (f" {mode}" if mode else "")
        out = self._ask(cmd, 60.0 + 0.1 * k if self.layout is None else 120.0 + 2.0 * k)
        if out.startswith("error"):
            raise EngineUnavailable(f"the {self.engine} initiator: {out}")
        return [int(x) / 1e3 for x in out.split()]

    def pause(self) -> None:
        """Stops both processes (SIGSTOP) until :meth:`resume`: an idle NIXL agent's
        progress thread polls (about a fifth of a core per process here), which would
        slow down the rows measured meanwhile."""
        if not self.paused:
            for pid in (self.proc.pid, self.target_pid or self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            self.paused = True

    def resume(self, rewarm: int = 3) -> None:
        """Continues both processes (SIGCONT), then does ``rewarm`` untimed pulls (the first
        pull after a stop waits for the progress threads to be scheduled again: an
        artifact of the pause, not the engine's latency)."""
        if self.paused:
            for pid in (self.target_pid or self.proc.pid, self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            self.paused = False
            if rewarm:
                self.run(rewarm, pull=self.rewarm_pull)

    def verify(self, pull: str = "default", mode: str | None = None) -> bool:
        """Clears the destination, pulls once and checks every byte's checksum."""
        self._ask(f"zero {pull}", 60.0)
        self.run(1, pull=pull, mode=mode)
        return int(self._ask(f"sum {pull}", 120.0)) == self.expected[pull]

    def close(self) -> None:
        """Stops both processes."""
        with contextlib.suppress(EngineUnavailable):
            self.resume(rewarm=0)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    t = sub.add_parser("target")
    t.add_argument("engine", choices=ENGINES)
    t.add_argument("--bytes", type=int, required=True)
    t.add_argument("--layout", default=None, help="a layout (JSON, see EngineServer)")
    i = sub.add_parser("initiator")
    i.add_argument("engine", choices=ENGINES)
    i.add_argument("--seg-bytes", type=int, default=None)
    i.add_argument("--segs", type=int, default=1)
    i.add_argument("--stride", type=int, default=0)
    i.add_argument("--layout", default=None, help="a layout (JSON, see EngineServer)")
    i.add_argument("--mc-batch", type=int, default=1024, help="Mooncake descriptors per batch")
    i.add_argument("--mc-window", type=int, default=64, help="Mooncake requests in flight")
    i.add_argument("--nixl-chunk", type=int, default=32, help="NIXL descriptors per handle")
    args = ap.parse_args(argv)
    if args.role == "target":
        _target(args.engine, args.bytes, json.loads(args.layout) if args.layout else None)
    else:
        if args.layout is None and args.seg_bytes is None:
            ap.error("--seg-bytes or --layout is required")
        if args.layout is None and args.segs > 1 and args.stride < args.seg_bytes:
            ap.error("--stride must be at least --seg-bytes with several segments")
        _initiator(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
