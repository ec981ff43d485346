"""Helpers for the native-core tests: tensors, numpy references, a worker process.

Tensors are the rows of one C-contiguous ``uint8`` array of shape
``(num_tensors, tensor_bytes)``; the base address of tensor ``t`` is
``arr.ctypes.data + t * tensor_bytes``.  Contents come from a seed, so two
processes can build the same tensor without sending it.

Run as a script (``python _helpers.py worker``) this module is the other process
of the two-process tests: it reads one JSON request per line on stdin and
answers one JSON line on stdout.  The parent side is :class:`Worker`, whose every
read is bounded by a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodatadist import _native as n
from aiodatadist.testing import apply_segments, block_segments, layer_span, reference_pull

HERE = Path(__file__).resolve()
WORKER_START_TIMEOUT = 60.0  # a cold start under the sanitizer build is slow
REPLY_TIMEOUT = 30.0


# ---------------------------------------------------------------- tensors


def pattern(num_tensors: int, tensor_bytes: int, seed: int | None) -> np.ndarray:
    """A ``(num_tensors, tensor_bytes)`` uint8 array: seeded random bytes, or zeros for ``None``."""
    if seed is None:
        return np.zeros((num_tensors, tensor_bytes), dtype=np.uint8)
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(num_tensors, tensor_bytes), dtype=np.uint8)


def bases(arr: np.ndarray) -> list[int]:
    """Per-tensor base addresses of a ``(num_tensors, tensor_bytes)`` array."""
    assert arr.flags.c_contiguous and arr.ndim == 2
    return [arr.ctypes.data + t * arr.shape[1] for t in range(arr.shape[0])]


def geometry_of(arr: np.ndarray, block_bytes: int) -> n.Geometry:
    assert arr.shape[1] % block_bytes == 0
    return n.Geometry(arr.shape[0], arr.shape[1] // block_bytes, block_bytes)


# ---------------------------------------------------------------- references


# The model is aiodatadist.testing's (one for every suite); these keep the argument
# order of the native API the tests mirror.


def expected_block_segments(
    block_bytes: int,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    src_tensor_start: int,
    dst_tensor_start: int,
    tensor_count: int,
) -> list[tuple[int, int, int, int, int]]:
    """Segments a block plan must hold: :func:`aiodatadist.testing.block_segments`."""
    span = (src_tensor_start, dst_tensor_start, tensor_count)
    return block_segments(block_bytes, src_blocks, dst_blocks, span)


def reference_blocks(
    src: np.ndarray,
    dst: np.ndarray,
    block_bytes: int,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    src_tensor_start: int,
    dst_tensor_start: int,
    tensor_count: int,
) -> np.ndarray:
    """What ``dst`` must hold after a block plan: :func:`aiodatadist.testing.reference_pull`."""
    span = (src_tensor_start, dst_tensor_start, tensor_count)
    return reference_pull(src, dst, block_bytes, src_blocks, dst_blocks, span)


reference_segments = apply_segments
"""What ``dst`` must hold after copying ``segments`` (rows of st, so, dt, do, nbytes)."""


def layer_range_args(
    tensor_num_per_layer: int, src_layers: tuple[int, int], dst_layers: tuple[int, int]
) -> tuple[int, int, int]:
    """(src_tensor_start, dst_tensor_start, tensor_count) for layer ranges [a, b):
    :func:`aiodatadist.testing.layer_span`, both ranges of one length."""
    t = tensor_num_per_layer
    assert (src_layers[1] - src_layers[0]) * t == (dst_layers[1] - dst_layers[0]) * t
    return layer_span(0, src_layers, dst_layers, t)


def plan_to_json(plan: n.Plan) -> dict[str, Any]:
    g = plan.src, plan.dst
    return {
        "src": [g[0].num_tensors, g[0].num_blocks, g[0].block_bytes],
        "dst": [g[1].num_tensors, g[1].num_blocks, g[1].block_bytes],
        "segments": plan.segments().tolist(),
    }


def plan_from_json(d: dict[str, Any]) -> n.Plan:
    return n.Plan.from_segments(
        n.Geometry(*d["src"]), n.Geometry(*d["dst"]), np.array(d["segments"], dtype=np.uint64)
    )


def differing(a: np.ndarray, b: np.ndarray) -> str:
    """A short description of where two arrays differ (for assertion messages)."""
    idx = np.argwhere(a != b)
    return f"{len(idx)} bytes differ, first at {idx[:5].tolist()}"


def unique_shm_name(tag: str) -> str:
    return f"/aiodd-test-{os.getpid()}-{tag}-{os.urandom(4).hex()}"


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=WORKER_START_TIMEOUT)
    return p.pid


@contextlib.contextmanager
def raises(status: n.Status, *words: str) -> Iterator[pytest.ExceptionInfo[n.NativeError]]:
    """Like ``pytest.raises(NativeError)``, also checking ``.status`` and that the
    message names every one of ``words``."""
    with pytest.raises(n.NativeError) as info:
        yield info
    err = info.value
    assert err.status == status, f"{err.status} != {status}: {err}"
    for w in words:
        assert w in str(err), f"{w!r} not in {str(err)!r}"


# ---------------------------------------------------------------- threads


class Background:
    """Runs ``fn(*args)`` on a thread; :meth:`join` waits (bounded) and re-raises its error."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.error: BaseException | None = None
        self.result: Any = None
        self.finished_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn: Any, *args: Any) -> None:
        try:
            self.result = fn(*args)
        except BaseException as e:
            self.error = e
        finally:
            self.finished_at = time.monotonic()

    def join(self, timeout: float = REPLY_TIMEOUT) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"background call still running after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result

    def join_error(self, timeout: float = REPLY_TIMEOUT) -> BaseException | None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"background call still running after {timeout} s")
        return self.error


def as_mover(fn: Any) -> Any:
    """``fn`` run at the transfer workers' priority (nice 5, as the engine's movers run).

    A threaded mover's pool threads take the priority of the thread that submits them:
    at nice 5 they cannot starve a test thread that watches the copy (``abort_after``)
    on a machine with fewer free cores than movers.
    """

    def run(*args: Any) -> Any:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)
        return fn(*args)

    return run


def abort_after(ctl: n.Control, at_least: int, timeout: float = REPLY_TIMEOUT) -> int:
    """Spins until ``ctl.bytes_done >= at_least``, aborts, and returns ``bytes_done`` as read
    right after the abort. From then on a mover may finish only the chunk each of its
    threads is in: the final count is at most this plus one chunk per thread, however
    late this thread was scheduled."""
    deadline = time.monotonic() + timeout
    while ctl.bytes_done < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"no progress within {timeout} s: {ctl!r}")
    ctl.abort()
    return ctl.bytes_done


# ---------------------------------------------------------------- parent side


class WorkerError(AssertionError):
    pass


class Worker:
    """A child Python process running :func:`worker_main`; every wait is bounded."""

    def __init__(self) -> None:
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(HERE), "worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            close_fds=True,
        )
        self._buf = b""
        hello = self.recv(WORKER_START_TIMEOUT)
        self.pid: int = hello["pid"]
        assert self.pid == self.proc.pid

    def stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def send(self, **req: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req).encode() + b"\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = REPLY_TIMEOUT) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"worker sent no reply within {timeout} s\n{self.stderr_text()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    code = self.proc.wait(timeout=5)
                    raise WorkerError(
                        f"worker exited ({code}) without a reply\n{self.stderr_text()}"
                    )
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        if "traceback" in reply:
            raise WorkerError("worker failed:\n" + reply["traceback"])
        return reply

    def call(self, timeout: float = REPLY_TIMEOUT, **req: Any) -> dict[str, Any]:
        self.send(**req)
        return self.recv(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(OSError):
                    self.send(op="exit")
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.kill()
        finally:
            self.kill()
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
            self._stderr.close()


@contextlib.contextmanager
def worker() -> Iterator[Worker]:
    w = Worker()
    try:
        yield w
    finally:
        w.close()


def accept_streams(
    listener: socket.socket, count: int, timeout: float = REPLY_TIMEOUT
) -> list[socket.socket]:
    """Accepts ``count`` connections, ordered by the stream index byte each sends first."""
    listener.settimeout(timeout)
    got: dict[int, socket.socket] = {}
    try:
        for _ in range(count):
            conn, _ = listener.accept()
            conn.settimeout(timeout)
            idx = conn.recv(1)
            if len(idx) != 1:
                conn.close()
                raise WorkerError("stream closed before its index byte")
            got[idx[0]] = conn
            conn.settimeout(None)
    except BaseException:
        for c in got.values():
            c.close()
        raise
    assert sorted(got) == list(range(count)), sorted(got)
    return [got[i] for i in range(count)]


def tcp_listener() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


# ---------------------------------------------------------------- child side


def _connect_streams(port: int, count: int) -> list[socket.socket]:
    socks = []
    for i in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=REPLY_TIMEOUT)
        s.sendall(bytes([i]))
        s.settimeout(None)
        socks.append(s)
    return socks


def _native_error(e: n.NativeError) -> dict[str, Any]:
    return {"ok": False, "status": int(e.status), "errno": e.errno, "message": str(e)}


def worker_main() -> None:
    arrays: dict[str, np.ndarray] = {}
    shms: dict[str, n.ShmSegment] = {}
    held: list[socket.socket] = []
    out = sys.stdout.buffer

    def reply(**kw: Any) -> None:
        out.write(json.dumps(kw).encode() + b"\n")
        out.flush()

    reply(pid=os.getpid())
    for raw in sys.stdin.buffer:
        req = json.loads(raw)
        op = req["op"]
        try:
            if op == "exit":
                break
            if op == "alloc":
                # rows x cols uint8 with a seeded pattern; replies with the tensor bases.
                a = pattern(req["rows"], req["cols"], req.get("seed"))
                arrays[req["name"]] = a
                reply(ok=True, bases=bases(a))
            elif op == "dump":
                np.save(req["path"], arrays[req["name"]])
                reply(ok=True)
            elif op == "sock":
                # Connect `streams` sockets to the parent and send / receive a plan over them.
                socks = _connect_streams(req["port"], req["streams"])
                try:
                    plan = plan_from_json(req["plan"])
                    ctl = n.Control()
                    fds = [s.fileno() for s in socks]
                    a = arrays[req["name"]]
                    try:
                        tag = int(req.get("tag", 7))
                        if req["dir"] == "send":
                            n.sock_send(fds, plan, bases(a), ctl, tag=tag)
                        else:
                            n.sock_recv(fds, plan, bases(a), ctl, tag=tag)
                    except n.NativeError as e:
                        reply(**_native_error(e))
                    else:
                        reply(ok=True, bytes_done=ctl.bytes_done, total=ctl.total)
                finally:
                    for s in socks:
                        s.close()
            elif op == "send_raw":
                # Connect one stream, send `nbytes` bytes of array `name` (after a
                # stream header when `header` = [tag, nbytes] is given), keep it open.
                (s,) = _connect_streams(req["port"], 1)
                held.append(s)
                head = n.sock_header(*req["header"]) if req.get("header") else b""
                s.sendall(head + arrays[req["name"]].reshape(-1)[: req["nbytes"]].tobytes())
                reply(ok=True)
            elif op == "connect_idle":
                # Connect one stream and never read from it.
                held.extend(_connect_streams(req["port"], 1))
                reply(ok=True)
            elif op == "drop_privileges":
                # Become `nobody`: the parent (root) is then out of reach of CMA (EPERM).
                os.setgroups([])
                os.setgid(req["uid"])
                os.setuid(req["uid"])
                reply(ok=True, uid=os.getuid())
            elif op == "cma_probe":
                allowed, err = n.cma_probe(req["pid"])
                reply(ok=True, allowed=allowed, errno=err)
            elif op == "cma_read":
                # Read a plan from process `pid` into array `name`.
                ctl = n.Control()
                n.cma_read(
                    req["pid"],
                    plan_from_json(req["plan"]),
                    req["remote"],
                    bases(arrays[req["name"]]),
                    ctl,
                )
                reply(ok=True, bytes_done=ctl.bytes_done)
            elif op == "shm_create":
                seg = n.ShmSegment.create(req["shm"], req["size"])
                shms[req["shm"]] = seg
                np.frombuffer(seg, dtype=np.uint8)[:] = req["fill"]
                # The parent reopens the memfd through /proc/<pid>/fd/<fd> (same user).
                reply(ok=True, addr=seg.addr, fd=seg.fd)
            elif op == "shm_open":
                # Maps a segment the parent made, reopened through its /proc fd link (the
                # library passes fds over a Unix socket instead; the mapping is the same).
                fd = os.open(req["fd_path"], os.O_RDWR | os.O_CLOEXEC)
                try:
                    seg = n.ShmSegment.from_fd(fd, req["size"], req["writable"], req["shm"])
                finally:
                    os.close(fd)
                shms[req["shm"]] = seg
                reply(ok=True, addr=seg.addr, owner=seg.owner)
            elif op == "shm_truncate":
                # What a hostile owner would try on a segment its peer maps.
                try:
                    os.ftruncate(shms[req["shm"]].fd, req["size"])
                    reply(ok=True)
                except OSError as e:
                    reply(ok=False, errno=e.errno)
            elif op == "shm_copy":
                # copy_local between a mapped shm segment (tensors laid end to end) and an array.
                seg = shms[req["shm"]]
                plan = plan_from_json(req["plan"])
                a = arrays[req["name"]]
                tb = req["tensor_bytes"]
                shm_bases = [seg.addr + t * tb for t in range(req["shm_tensors"])]
                ctl = n.Control()
                if req["dir"] == "from_shm":
                    n.copy_local(plan, shm_bases, bases(a), ctl)
                else:
                    n.copy_local(plan, bases(a), shm_bases, ctl)
                reply(ok=True, bytes_done=ctl.bytes_done)
            elif op == "shm_close":
                shms.pop(req["shm"]).close()
                reply(ok=True)
            else:
                reply(traceback=f"unknown op {op!r}")
        except n.NativeError as e:
            reply(**_native_error(e))
        except Exception:
            reply(traceback=traceback.format_exc())
    for s in held:
        s.close()
    for seg in shms.values():
        seg.close()


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    # A parent that dies must not leave us blocked on a socket: stdin EOF ends the loop,
    # and SIGPIPE keeps its default so a write to a dead parent ends us too.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    worker_main()
