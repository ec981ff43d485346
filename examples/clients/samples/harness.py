"""What the HIXL sample ports share: the process launcher, the barrier, the byte patterns.

The upstream samples (``hicann/hixl`` ``examples/python/*_sample.py``) are started by hand,
once per role and host, and meet at ``torch.distributed`` barriers. Here one command runs
the whole flow: :func:`launch` spawns every role as a process (``spawn`` context), hands
each a :data:`dist` whose ``barrier()`` is a ``multiprocessing.Barrier`` (the one
replacement the ports make in their coordination), and prints one ``OK`` line when every
process exited 0 and every expected transfer was verified.

Bytes: a tensor starts as :func:`pattern_tensor` of a seed unique to (sample, side,
transfer), and :func:`expect_blocks` checks every block of a tensor, the ones a transfer
named against the source's pattern and the others against their own (untouched) pattern.
Not part of any port's logic: the upstream samples only log their tensors.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from multiprocessing.synchronize import Barrier
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "BARRIER_TIMEOUT_S",
    "assign_ports",
    "dist",
    "expect_blocks",
    "expected_portal_loop",
    "free_port",
    "launch",
    "pattern_tensor",
    "port",
    "refill",
    "running_loop_kind",
    "sample_parser",
    "seed",
    "verified",
]

BARRIER_TIMEOUT_S = 30.0
"""The samples' ``init_process_group(timeout=30 s)``: a peer gone for longer breaks the barrier."""

RUN_TIMEOUT_S = 40.0
"""The whole flow, every process; a run past it is killed and fails."""

Src = tuple[int, int, int]
"""``(seed, tensor, block)``: where a block's bytes come from (see :func:`block_bytes`)."""


# ------------------------------------------------------------------------------ patterns


def seed(*parts: object) -> int:
    """A seed unique to ``parts`` (e.g. ``("push_blocks", "D", "initial")``)."""
    return zlib.crc32(repr(parts).encode())


def block_bytes(seed_: int, tensor: int, block: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """The bytes block ``block`` of tensor ``tensor`` holds under ``seed_``."""
    return np.random.default_rng([seed_, tensor, block]).integers(0, 256, nbytes, dtype=np.uint8)


def _rows(arr: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
    """``arr`` as ``(blocks, bytes per block)`` raw bytes (a view: writes go to ``arr``)."""
    assert arr.flags.c_contiguous
    return arr.reshape(arr.shape[0], -1).view(np.uint8)


def refill(arr: npt.NDArray[Any], seed_: int, tensor: int) -> None:
    """Writes the pattern of (``seed_``, ``tensor``) into every block of ``arr``, in place."""
    rows = _rows(arr)
    for b in range(rows.shape[0]):
        rows[b] = block_bytes(seed_, tensor, b, rows.shape[1])


def pattern_tensor(
    seed_: int, tensor: int, shape: Sequence[int], dtype: npt.DTypeLike = np.float32
) -> npt.NDArray[Any]:
    """A new array of ``shape`` holding the pattern (stands in for ``torch.ones(...).npu()``)."""
    arr = np.empty(tuple(shape), dtype)
    refill(arr, seed_, tensor)
    return arr


def expect_blocks(what: str, arr: npt.NDArray[Any], want: Sequence[Src]) -> None:
    """Checks every block of ``arr``: block ``i`` must hold the bytes of ``want[i]``.

    Raises:
        RuntimeError: naming the first block whose bytes differ.
    """
    rows = _rows(arr)
    if len(want) != rows.shape[0]:
        raise RuntimeError(f"{what}: {rows.shape[0]} blocks, {len(want)} expected")
    for i, (s, t, b) in enumerate(want):
        if not np.array_equal(rows[i], block_bytes(s, t, b, rows.shape[1])):
            raise RuntimeError(
                f"{what}: block {i} does not hold block {b} of tensor {t} of seed {s}"
            )


# ------------------------------------------------------------- torch.distributed stand-in


class Dist:
    """The part of ``torch.distributed`` the samples use, over ``multiprocessing``.

    ``barrier()`` blocks (the sync ports call it from their main thread; the library's
    portal thread goes on serving peers meanwhile). ``abarrier()`` is the same barrier
    for the async ports: waited on in a thread so the event loop, which serves the peer's
    link handshake and transfers, keeps running.
    """

    def __init__(self) -> None:
        self._barrier: Barrier | None = None
        self._channel: Any = None
        self._results: Any = None
        self.rank = -1
        self.role = "?"

    def attach(self, rank: int, role: str, barrier: Barrier, channel: Any, results: Any) -> None:
        self.rank, self.role = rank, role
        self._barrier, self._channel, self._results = barrier, channel, results

    def barrier(self) -> None:
        assert self._barrier is not None, "dist.barrier() outside a launched process"
        self._barrier.wait()

    async def abarrier(self) -> None:
        await asyncio.to_thread(self.barrier)

    def send(self, obj: object) -> None:
        """Hands ``obj`` to the peer that calls :meth:`recv` (the samples' side channel)."""
        self._channel.put(obj)

    def recv(self) -> Any:
        return self._channel.get(timeout=BARRIER_TIMEOUT_S)

    async def arecv(self) -> Any:
        return await asyncio.to_thread(self.recv)

    def report(self, text: str, kind: str | None) -> None:
        self._results.put((self.rank, self.role, text, kind))


dist = Dist()
"""This process's barrier and side channel (set by :func:`launch` in each child)."""


def verified(text: str) -> None:
    """Records one verified transfer (the launcher counts them, and checks the loop kind)."""
    kind = running_loop_kind()
    print(f"[{dist.role}] verified: {text} (loop: {kind})", flush=True)
    dist.report(text, kind)


def running_loop_kind() -> str | None:
    """``uvloop`` or ``asyncio``: the kind of the event loop running in this process.

    An async port: the loop of this thread. A sync port has none in its own threads but
    the library's portal loop, found among the live objects (looked at from outside: no
    private API).
    """
    try:
        loop: object = asyncio.get_running_loop()
    except RuntimeError:
        running = [
            o
            for o in gc.get_objects()
            if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()
        ]
        if len(running) != 1:
            return None
        loop = running[0]
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def expected_portal_loop() -> str:
    """The portal loop kind a sync port's processes will run: ``AIODATADIST_PORTAL_LOOP``."""
    return os.environ.get("AIODATADIST_PORTAL_LOOP") or "asyncio"


# ---------------------------------------------------------------------------- launching


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (the samples' fixed 26000/26001 would collide)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PORT_ENV = "AIODATADIST_SAMPLE_{}"


def port(name: str, default: int) -> int:
    """The port the samples hard-code as ``default``; :func:`assign_ports` picked it here."""
    return int(os.environ.get(_PORT_ENV.format(name), default))


def assign_ports(*names: str) -> None:
    """Picks a free port for each of ``names``; the processes :func:`launch` starts inherit them."""
    for name in names:
        os.environ[_PORT_ENV.format(name)] = str(free_port())


def sample_parser(doc: str | None, *, sync: bool) -> argparse.ArgumentParser:
    """The command line every port takes: ``--loop``."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    if sync:
        parser.add_argument(
            "--loop",
            choices=("asyncio", "uvloop"),
            default=None,
            help="the library's portal loop (sets AIODATADIST_PORTAL_LOOP; default: as set)",
        )
    else:
        parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    return parser


def _run_child(
    fn: Callable[[argparse.Namespace], Any],
    args: argparse.Namespace,
    rank: int,
    role: str,
    barrier: Barrier,
    channel: Any,
    results: Any,
) -> None:
    logging.basicConfig(format=f"%(asctime)s [{role}] %(message)s", level=logging.INFO)
    dist.attach(rank, role, barrier, channel, results)
    try:
        if inspect.iscoroutinefunction(fn):
            if args.loop == "uvloop":
                import uvloop

                uvloop.run(fn(args))
            else:
                asyncio.run(fn(args))
        else:
            fn(args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # a failed role must not wait for threads a peer will never release


def launch(
    name: str,
    roles: Sequence[tuple[str, Callable[[argparse.Namespace], Any], argparse.Namespace]],
    *,
    expect_verified: int,
    loop: str,
    timeout: float = RUN_TIMEOUT_S,
) -> int:
    """Runs every role in its own spawned process; prints ``OK ...`` and returns 0 on success.

    Args:
        name: the port's name, for the OK line.
        roles: ``(role label, entry function, its args)``; an ``async def`` entry runs on
            ``args.loop`` (``asyncio.run`` or ``uvloop.run``).
        expect_verified: how many :func:`verified` calls a correct run makes, in all.
        loop: the loop kind every process must have run its transfers on (the async
            ports' ``--loop``; the sync ports' portal loop, :func:`expected_portal_loop`).
        timeout: the bound of the whole run.
    """
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(roles), timeout=BARRIER_TIMEOUT_S)
    channel = ctx.Queue()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_run_child,
            args=(fn, args, rank, role, barrier, channel, results),
            name=f"{name}:{role}",
        )
        for rank, (role, fn, args) in enumerate(roles)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed: list[str] = []
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        for p in procs:
            if p.exitcode not in (None, 0) and p.name not in failed:
                failed.append(p.name)
                barrier.abort()  # its peers stop waiting for it
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            failed.append(f"{p.name} (ran past {timeout} s)")
            p.kill()
        p.join()
        if p.exitcode != 0 and p.name not in failed:
            failed.append(f"{p.name} (exit {p.exitcode})")
    reports: list[tuple[int, str, str, str | None]] = []
    while True:
        try:
            reports.append(results.get(timeout=0.2))
        except queue_mod.Empty:
            break
    if not failed and len(reports) != expect_verified:
        failed.append(f"{len(reports)} transfers verified, {expect_verified} expected")
    wrong_loop = {str(r[3]) for r in reports if r[3] != loop}
    if wrong_loop:
        failed.append(f"transfers ran on {sorted(wrong_loop)}, not {loop}")
    if failed:
        print(f"FAILED {name}: {', '.join(failed)}", flush=True)
        return 1
    print(
        f"OK {name}: {len(procs)} processes, {len(reports)} transfers verified ({loop})", flush=True
    )
    return 0
