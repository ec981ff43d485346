"""NIXL and the Mooncake Transfer Engine driven directly: baselines of ``bench_tiny.py``.

Each engine runs as two processes of its own, started from here: an *initiator* (the
pulling side, ``python bench/engines.py initiator ENGINE ...``) that starts its
*target* (``python bench/engines.py target ENGINE ...``), links the two the way the
engine's own examples do, and then serves the bench's commands on stdin:

========================  ==============================================================
``run K``                 K pulls, each timed on its own (``time.perf_counter_ns``)
``arun K``                (NIXL) the same, polled from an asyncio event loop
                          (``await asyncio.sleep(0)`` between two ``check_xfer_state``)
``zero``                  clears the local buffer
``sum``                   :func:`checksum` of the local buffer
========================  ==============================================================

Each answer is one line that starts with ``@@ `` (both libraries print their own log
lines on stdout). A pull reads ``--segs`` segments of ``--seg-bytes`` bytes each from
the target (segment ``i`` at ``i * --stride`` in its buffer: blocks of different
tensors are not neighbours) into the initiator's contiguous buffer. Both buffers are
:func:`aiodatadist.testing.caches.host_buffer` memory (anonymous, ``MADV_HUGEPAGE``,
touched), the kind the aiodatadist prompt registers; the target's holds
:func:`pattern_words`.

* ``nixl``: ``nixl_cu12`` (``pip install --no-deps nixl-cu12``), one agent per side,
  UCX backend (its defaults: on one host UCX reads through CMA), ``DRAM`` descriptors,
  one ``READ`` transfer handle made once and posted again for every pull
  (``transfer`` then ``check_xfer_state`` until ``DONE``).
* ``mooncake``: ``mooncake-transfer-engine-non-cuda`` (needs Debian's
  ``libibverbs1``), ``TransferEngine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp",
  "")`` on both sides (no metadata server), ``transfer_sync_read`` (one segment) or
  ``batch_transfer_sync_read`` (several).

:class:`EngineServer` is the bench's side; when an engine cannot be imported or set up,
its constructor raises :class:`EngineUnavailable` with the reason, which the bench
prints in place of the row. Not installed (the package never imports ``bench/``).
"""

from __future__ import annotations

import argparse
import asyncio
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

__all__ = [
    "ENGINES",
    "EngineServer",
    "EngineUnavailable",
    "checksum",
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


def checksum(buf: Any) -> int:
    """Sum over the 64-bit words ``w[i]`` of ``buf`` of ``w[i] * (2i + 1)`` mod 2^64
    (what ``tiny`` answers to ``sum``)."""
    raw = np.asarray(buf).reshape(-1).view(np.uint8)
    words = raw[: raw.size // 8 * 8].view(np.uint64)
    weights = np.arange(words.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
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


# ----------------------------------------------------------------- the target process


def _target(engine: str, nbytes: int) -> None:
    """Holds a pattern-filled buffer registered with ``engine``; prints how to reach it."""
    buf = _buffer(nbytes)
    buf[:] = pattern_words(nbytes)
    addr = int(buf.ctypes.data)
    keep: Any
    if engine == "nixl":
        from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found,unused-ignore]

        agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
        agent.register_memory(agent.get_reg_descs([(addr, nbytes, 0, "")], "DRAM"))
        descs = agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM")
        info = {
            "md": agent.get_agent_metadata().hex(),
            "descs": agent.get_serialized_descs(descs).hex(),
            "addr": addr,
        }
        keep = agent
    else:
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped,unused-ignore]

        te = TransferEngine()
        rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize returned {rc}")
        rc = te.register_memory(addr, nbytes)
        if rc != 0:
            raise RuntimeError(f"TransferEngine.register_memory returned {rc}")
        info = {"port": te.get_rpc_port(), "addr": addr}
        keep = te
    _reply(json.dumps(info))
    sys.stdin.read()  # the initiator closes our stdin when it is done (or dies)
    del keep


# -------------------------------------------------------------- the initiator process


class _Initiator:
    """The pulling side of one engine: ``pull()`` moves every segment once."""

    def __init__(
        self, engine: str, seg_bytes: int, segs: int, stride: int, info: dict[str, Any]
    ) -> None:
        self.nbytes = seg_bytes * segs
        self.buf = _buffer(self.nbytes)
        local = int(self.buf.ctypes.data)
        remote = int(info["addr"])
        self.local = [local + i * seg_bytes for i in range(segs)]
        self.remote = [remote + i * stride for i in range(segs)]
        self.lens = [seg_bytes] * segs
        self.engine = engine
        self.pull: Callable[[], None]
        if engine == "nixl":
            from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found,unused-ignore]

            self.agent = agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
            agent.register_memory(agent.get_reg_descs([(local, self.nbytes, 0, "")], "DRAM"))
            name = agent.add_remote_agent(bytes.fromhex(info["md"]))
            # The target registered its whole buffer; the transfer names sub-ranges of it.
            remote_descs = agent.get_xfer_descs(
                [(a, n, 0) for a, n in zip(self.remote, self.lens, strict=True)], "DRAM"
            )
            local_descs = agent.get_xfer_descs(
                [(a, n, 0) for a, n in zip(self.local, self.lens, strict=True)], "DRAM"
            )
            self.handle = agent.initialize_xfer("READ", local_descs, remote_descs, name)
            self.pull = self._nixl_pull
        else:
            from mooncake.engine import TransferEngine  # type: ignore[import-untyped,unused-ignore]

            self.te = te = TransferEngine()
            rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            if rc != 0:
                raise RuntimeError(f"TransferEngine.initialize returned {rc}")
            rc = te.register_memory(local, self.nbytes)
            if rc != 0:
                raise RuntimeError(f"TransferEngine.register_memory returned {rc}")
            self.target = f"127.0.0.1:{info['port']}"
            self.pull = self._mc_pull if segs == 1 else self._mc_batch_pull

    def _nixl_pull(self) -> None:
        agent, h = self.agent, self.handle
        state = agent.transfer(h)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed (ERR)")
            state = agent.check_xfer_state(h)

    async def _nixl_apull(self) -> None:
        agent, h = self.agent, self.handle
        state = agent.transfer(h)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed (ERR)")
            await asyncio.sleep(0)
            state = agent.check_xfer_state(h)

    def _mc_pull(self) -> None:
        rc = self.te.transfer_sync_read(self.target, self.local[0], self.remote[0], self.lens[0])
        if rc != 0:
            raise RuntimeError(f"transfer_sync_read returned {rc}")

    def _mc_batch_pull(self) -> None:
        rc = self.te.batch_transfer_sync_read(self.target, self.local, self.remote, self.lens)
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_read returned {rc}")

    def run(self, k: int) -> list[int]:
        out = [0] * k
        pull = self.pull
        clock = time.perf_counter_ns
        for j in range(k):
            t0 = clock()
            pull()
            out[j] = clock() - t0
        return out

    def arun(self, k: int) -> list[int]:
        if self.engine != "nixl":
            raise RuntimeError("arun: NIXL only")

        async def go() -> list[int]:
            out = [0] * k
            clock = time.perf_counter_ns
            for j in range(k):
                t0 = clock()
                await self._nixl_apull()
                out[j] = clock() - t0
            return out

        return asyncio.run(go())


def _start_target(
    engine: str, nbytes: int, log: Any
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "target", engine, "--bytes", str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    assert proc.stdout is not None
    info = json.loads(read_reply(proc.stdout, f"the {engine} target"))
    return proc, info


def _initiator(args: argparse.Namespace) -> None:
    target_bytes = (args.segs - 1) * args.stride + args.seg_bytes
    target, info = _start_target(args.engine, target_bytes, sys.stderr)
    try:
        ini = _Initiator(args.engine, args.seg_bytes, args.segs, args.stride, info)
        ini.run(1)  # connects (both engines link on the first transfer)
        _reply(f"ready {target.pid}")
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "run":
                _reply(" ".join(map(str, ini.run(int(arg)))))
            elif cmd == "arun":
                _reply(" ".join(map(str, ini.arun(int(arg)))))
            elif cmd == "zero":
                ini.buf[:] = 0
                _reply("ok")
            elif cmd == "sum":
                _reply(str(checksum(ini.buf)))
            else:
                _reply(f"error unknown command {cmd!r}")
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

    Raises (constructor):
        EngineUnavailable: the engine cannot be imported, set up or run here.
    """

    def __init__(
        self, engine: str, seg_bytes: int, segs: int, stride: int, start_timeout: float = 120.0
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.engine = engine
        self.nbytes = seg_bytes * segs
        self.expected = checksum(
            np.concatenate([pattern_words(seg_bytes, i * stride // 8) for i in range(segs)])
        )
        self._log = tempfile.TemporaryFile(mode="w+")
        self.expired = False
        self.paused = False
        self.target_pid = 0
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "initiator",
            engine,
            "--seg-bytes",
            str(seg_bytes),
            "--segs",
            str(segs),
            "--stride",
            str(stride),
        ]
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

    def run(self, k: int, polled_from_asyncio: bool = False) -> list[float]:
        """``k`` pulls; their latencies in microseconds."""
        out = self._ask(f"{'arun' if polled_from_asyncio else 'run'} {k}", 60.0 + 0.1 * k)
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
                self.run(rewarm)

    def verify(self) -> bool:
        """Clears the destination, pulls once and checks every byte's checksum."""
        self._ask("zero", 60.0)
        self.run(1)
        return int(self._ask("sum", 60.0)) == self.expected

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
    i = sub.add_parser("initiator")
    i.add_argument("engine", choices=ENGINES)
    i.add_argument("--seg-bytes", type=int, required=True)
    i.add_argument("--segs", type=int, default=1)
    i.add_argument("--stride", type=int, default=0)
    args = ap.parse_args(argv)
    if args.role == "target":
        _target(args.engine, args.bytes)
    else:
        if args.segs > 1 and args.stride < args.seg_bytes:
            ap.error("--stride must be at least --seg-bytes with several segments")
        _initiator(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
