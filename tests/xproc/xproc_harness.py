"""Test-side helpers: bounded subprocess peers, in-process instances, a raw control client.

Every wait is bounded. A :class:`Harness` (``async with``) owns the processes and
instances of one test and ends them all on exit (quit, then SIGKILL); the pids
are also recorded in :data:`LIVE_PIDS`, which ``conftest.py`` reaps after every
test whatever happened, so no run leaves an orphan.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from aiodatadist import BlocksCacheKey, LLMDataDist, LLMRole, _native, _wire
from aiodatadist.testing import PeerProcess, cluster_info
from tests._child_env import CHILD_PATH
from tests.xproc import xproc_common as xc

HERE = Path(__file__).resolve().parent
PEER_MAIN = HERE / "peer_main.py"
# A peer that runs an engine starts it (and registers its caches with it) before it is ready;
# under two CPU burners one such start once took longer than 30 s.
START_TIMEOUT = 60.0
REPLY_TIMEOUT = 20.0
STOP_TIMEOUT = 5.0

LIVE_PIDS: set[int] = set()
"""Pids of peer processes not yet reaped (the conftest finalizer kills what is left)."""


def leftover_segments(pid: int | None = None) -> list[str]:
    """Names in /dev/shm of ``pid``'s segments (any aiodatadist process's with None).

    Check only: segments are nameless memfds, so there must never be any; a test that
    finds one fails rather than cleaning up after the library.
    """
    pattern = "aiodd-*" if pid is None else f"aiodd-{pid}-*"
    return sorted(f.name for f in Path("/dev/shm").glob(pattern))


class PeerProc:
    """One peer process (``aiodatadist.testing``'s, with the commands of ``peer_main.py``)
    and its JSON-lines conversation; every wait bounded, every failure an AssertionError
    that carries the process's stderr."""

    def __init__(self, peer: PeerProcess, log: Any, name: str) -> None:
        self.peer = peer
        self.log = log
        self.name = name

    @property
    def ready(self) -> dict[str, Any]:
        return self.peer.ready

    @property
    def pid(self) -> int:
        return self.peer.pid

    @property
    def returncode(self) -> int | None:
        return self.peer.returncode

    @property
    def port(self) -> int:
        return int(self.ready["port"])

    @property
    def host(self) -> str:
        return str(self.ready["host"])

    def cache_id(self, name: str) -> int:
        return int(self.ready["caches"][name]["cache_id"])

    def addrs(self, name: str) -> list[int]:
        return [int(a) for a in self.ready["caches"][name]["addrs"]]

    def stderr_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            self.log.flush()
            self.log.seek(0)
            return str(self.log.read()[-n:])
        return ""

    @classmethod
    async def start(
        cls,
        *,
        cluster_id: int,
        role: str = "prompt",
        listen: str | None = "127.0.0.1:0",
        data_path: str = "auto",
        secret: str | None = None,
        tcp_streams: int = 0,
        seed: int = 1,
        big_mib: int = 0,
        sync_ms: int = 5000,
        env: dict[str, str] | None = None,
        netns: str | None = None,
        options: dict[str, str] | None = None,
    ) -> PeerProc:
        opts = {"aiodatadist.DataPath": data_path, "llm.SyncKvCacheWaitTime": str(sync_ms)}
        if secret is not None:
            opts["aiodatadist.SharedSecret"] = secret
        if tcp_streams:
            opts["aiodatadist.TcpStreams"] = str(tcp_streams)
        opts.update(options or {})
        log = tempfile.TemporaryFile("w+")
        peer = PeerProcess(
            cluster_id=cluster_id,
            role=LLMRole.PROMPT if role == "prompt" else LLMRole.DECODER,
            host=listen.rpartition(":")[0] if listen else None,
            options=opts,
            env={**CHILD_PATH, **(env or {})},
            start_timeout=START_TIMEOUT,
            serve_cache=False,
            plugin=str(PEER_MAIN),
            plugin_config={"seed": seed if role == "prompt" else None, "big_mib": big_mib},
            stderr=log,
            prefix=() if netns is None else ("ip", "netns", "exec", netns),
            new_session=True,
            drop_env=("AIODATADIST_SECRET",),
        )
        proc = cls(peer, log, f"{role}:{cluster_id}")
        try:
            await peer.start()
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{proc.name}: {e}; stderr:\n{proc.stderr_tail()}") from None
        finally:
            if peer.pid:
                LIVE_PIDS.add(peer.pid)
            if peer.returncode is not None:
                LIVE_PIDS.discard(peer.pid)
                log.close()
        return proc

    async def send(self, cmd: str, **kw: Any) -> None:
        await asyncio.wait_for(self.peer.send(cmd, **kw), REPLY_TIMEOUT)

    async def reply(self, timeout: float = REPLY_TIMEOUT) -> dict[str, Any]:
        try:
            return await self.peer.reply(timeout)
        except TimeoutError:
            raise AssertionError(
                f"{self.name}: no reply within {timeout} s; stderr:\n{self.stderr_tail()}"
            ) from None
        except RuntimeError:
            raise AssertionError(
                f"{self.name} exited (rc={self.returncode}); stderr:\n{self.stderr_tail()}"
            ) from None

    async def call(self, cmd: str, *, timeout: float = REPLY_TIMEOUT, **kw: Any) -> dict[str, Any]:
        """Sends one command and returns its reply (commands are answered in order)."""
        await self.send(cmd, **kw)
        return await self.reply(timeout)

    async def ok(self, cmd: str, **kw: Any) -> dict[str, Any]:
        r = await self.call(cmd, **kw)
        assert r.get("ok"), f"{self.name} {cmd}: {r}"
        return r

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    async def wait_dead(self, timeout: float = STOP_TIMEOUT) -> int:
        rc = await self.peer.wait_exit(timeout)
        LIVE_PIDS.discard(self.pid)
        return rc

    async def stop(self) -> None:
        """Asks the process to quit (closing stdin), then kills it; always reaps it."""
        try:
            await self.peer.stop(STOP_TIMEOUT)
        finally:
            if self.returncode is not None:
                LIVE_PIDS.discard(self.pid)
            with contextlib.suppress(Exception):
                self.log.close()


def decoder_options(data_path: str = "auto", **extra: str) -> dict[str, str]:
    return {"aiodatadist.DataPath": data_path, "llm.SyncKvCacheWaitTime": "5000", **extra}


class Harness:
    """The processes and in-process instances of one test; all ended on exit."""

    def __init__(self) -> None:
        self.procs: list[PeerProc] = []
        self.dds: list[LLMDataDist] = []

    async def __aenter__(self) -> Harness:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # The peers are asked to quit first, so they finalize in their own processes while
        # ours finalize here (a transfer engine's teardown takes ~1 s on each side).
        stops = [asyncio.ensure_future(p.stop()) for p in self.procs]
        try:
            await asyncio.sleep(0)  # (each stop has written its "quit")
            for dd in reversed(self.dds):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(dd.finalize(), 15)
        finally:
            # (Cancelled here: the stops are cancelled too, which kills and reaps.)
            await asyncio.gather(*stops, return_exceptions=True)

    async def peer(self, **kw: Any) -> PeerProc:
        p = await PeerProc.start(**kw)
        self.procs.append(p)
        return p

    async def local(
        self,
        cluster_id: int,
        options: dict[str, str] | None = None,
        *,
        role: LLMRole = LLMRole.DECODER,
        seed: int | None = None,
        big_mib: int = 0,
    ) -> tuple[LLMDataDist, dict[str, xc.Local]]:
        """An initialized instance in this process with the standard caches."""
        dd = LLMDataDist(role, cluster_id)
        await dd.init(options if options is not None else decoder_options())
        self.dds.append(dd)
        return dd, xc.make_caches(dd, seed, cluster_id, big_mib)


async def link(dd: LLMDataDist, peer: PeerProc, cluster_id: int, timeout: int = 5000) -> None:
    status, statuses = await dd.link_clusters(
        [cluster_info(cluster_id, peer.host, peer.port)], timeout
    )
    assert status == 0 and list(statuses) == [0], (status, statuses, peer.stderr_tail())


def path_of(dd: LLMDataDist, cluster_id: int, model_id: int) -> str:
    """The data path the link to ``cluster_id`` uses for that peer's blocks cache ``model_id``."""
    lk = dd._rt.links.find(cluster_id)
    assert lk is not None, f"no link to {cluster_id}"
    remote = lk.path.remote_table.blocks(model_id)
    assert remote is not None, f"cluster {cluster_id} has no blocks cache {model_id}"
    return str(lk.path.path_for(remote).kinds[0])


async def pull_and_check(
    dd: LLMDataDist,
    local: xc.Local,
    prompt_id: int,
    prompt_seed: int,
    src_name: str,
    src_blocks: list[int],
    dst_blocks: list[int],
    *,
    src_layers: tuple[int, int] | None = None,
    dst_layers: tuple[int, int] | None = None,
    tpl: int = 2,
    timeout: float = 5.0,
) -> None:
    """``pull_blocks`` from the prompt's ``src_name`` into ``local`` and compares every byte
    of ``local`` with the numpy reference."""
    before = local.matrix()
    spec = xc.SPECS[src_name]
    assert spec.model_id is not None
    await dd.cache_manager.pull_blocks(
        BlocksCacheKey(prompt_id, spec.model_id),
        local.cache,
        src_blocks,
        dst_blocks,
        src_layer_range=xc.layer_range(src_layers),
        dst_layer_range=xc.layer_range(dst_layers),
        tensor_num_per_layer=tpl,
        timeout=timeout,
    )
    span = xc.tensor_span(spec.num_tensors, src_layers, dst_layers, tpl)
    want = xc.expect_blocks(
        before, xc.reference(prompt_seed, src_name), spec.unit, src_blocks, dst_blocks, span
    )
    got = local.matrix()
    assert_same(got, want)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    if not np.array_equal(got, want):
        idx = np.argwhere(got != want)
        raise AssertionError(f"{len(idx)} bytes differ, first at {idx[:5].tolist()}")
    assert xc.digests(got) == xc.digests(want)


async def until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Waits (bounded) until ``pred()`` holds, yielding to the loop between checks."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.005)


# ------------------------------------------------------------------ raw control client


class RawClient:
    """A hand-driven control connection: the handshake and requests, frame by frame."""

    def __init__(self, host: str, port: int, *, rcvbuf: int | None = None) -> None:
        self.host = host
        self.port = port
        self.rcvbuf = rcvbuf  # a small receive buffer: a peer that stops reading fills fast
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.welcome: dict[str, Any] | None = None
        self.streams: list[socket.socket] = []

    async def __aenter__(self) -> RawClient:
        if self.rcvbuf is None:
            connect = asyncio.open_connection(self.host, self.port)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            sock.setblocking(False)
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(sock, (self.host, self.port)),
                REPLY_TIMEOUT,
            )
            connect = asyncio.open_connection(sock=sock)
        self.reader, self.writer = await asyncio.wait_for(connect, REPLY_TIMEOUT)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for s in self.streams:
            s.close()
        if self.writer is not None:
            self.writer.close()
            try:
                await asyncio.wait_for(self.writer.wait_closed(), 2)
            except Exception:
                # Bytes a peer never read keep a closing transport (and its socket) open
                # past the test, to be collected during a later one (an "unclosed
                # transport" warning failed it): drop them. Only then: a transport whose
                # connection was lost has no loop left to abort on (asyncio raises
                # AttributeError), and it may have been lost while the wait unwound.
                with contextlib.suppress(AttributeError):
                    self.writer.transport.abort()

    async def write(self, t: _wire.MsgType, body: dict[str, Any], binary: bytes = b"") -> None:
        assert self.writer is not None
        await asyncio.wait_for(_wire.write_message(self.writer, t, body, binary), REPLY_TIMEOUT)

    async def read(self, timeout: float = REPLY_TIMEOUT) -> _wire.Message:
        assert self.reader is not None
        return await _wire.read_message(self.reader, timeout=timeout)

    async def hello(self, cluster_id: int, *, want_auth: bool = False) -> tuple[str, _wire.Message]:
        nonce = _wire.new_nonce()
        await self.write(
            _wire.MsgType.HELLO,
            {
                "version": _wire.PROTOCOL_VERSION,
                "cluster_id": cluster_id,
                "host_id": "raw-test-client",
                "pid": os.getpid(),
                "role": int(LLMRole.DECODER),
                "nonce": nonce,
                "want_auth": want_auth,
            },
        )
        return nonce, await self.read()

    async def handshake(self, cluster_id: int) -> dict[str, Any]:
        """HELLO, AUTH without a secret, WELCOME, our (empty) TABLE: returns WELCOME."""
        _, challenge = await self.hello(cluster_id)
        assert challenge.type == _wire.MsgType.CHALLENGE, challenge
        await self.write(_wire.MsgType.AUTH, {"mac": ""})
        welcome = await self.read()
        assert welcome.type == _wire.MsgType.WELCOME, welcome
        await self.write(_wire.MsgType.TABLE, {"version": 0, "table": []})
        self.welcome = welcome.body
        return welcome.body

    async def open_stream(
        self, index: int, epoch: int = 1, rcvbuf: int | None = None
    ) -> socket.socket:
        """A data stream (DATA_HELLO + ACK) of ``epoch``, as a non-blocking socket
        (``rcvbuf``: its receive buffer, set before it connects)."""
        assert self.welcome is not None
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.streams.append(sock)
        sock.setblocking(False)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        await asyncio.wait_for(loop.sock_connect(sock, (self.host, self.port)), REPLY_TIMEOUT)
        frame = _wire.encode(
            _wire.MsgType.DATA_HELLO,
            {"link_token": self.welcome["link_token"], "stream": index, "epoch": epoch},
        )
        await loop.sock_sendall(sock, frame)
        ack = await asyncio.wait_for(loop.sock_recv(sock, 1), REPLY_TIMEOUT)
        assert ack == b"\x01", ack
        return sock

    async def pull(
        self,
        req: int,
        cache_id: int,
        segments: list[tuple[int, int, int, int, int]],
        *,
        dst_geometry: tuple[int, int, int] = (4, 8, 4096),
        deadline_ms: int = 2000,
        streams: int = 1,
        epoch: int = 1,
    ) -> None:
        await self.write(
            _wire.MsgType.PULL,
            {
                "req": req,
                "cache_id": cache_id,
                "dst_geometry": list(dst_geometry),
                "deadline_ms": deadline_ms,
                "streams": streams,
                "epoch": epoch,
            },
            _wire.segments_to_bytes(np.array(segments, dtype=np.uint64).reshape(-1, 5)),
        )

    async def done(self, timeout: float = REPLY_TIMEOUT) -> dict[str, Any]:
        """The next DONE (skipping TABLE/PING traffic; PINGs are answered)."""
        end = time.monotonic() + timeout
        while True:
            msg = await self.read(max(0.05, end - time.monotonic()))
            if msg.type == _wire.MsgType.DONE:
                return msg.body
            if msg.type == _wire.MsgType.PING:
                await self.write(_wire.MsgType.PONG, {"t": msg.body["t"]})
                continue
            assert msg.type == _wire.MsgType.TABLE, msg


async def recv_exact(sock: socket.socket, n: int, timeout: float = REPLY_TIMEOUT) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray()
    async with asyncio.timeout(timeout):
        while len(buf) < n:
            chunk = await loop.sock_recv(sock, n - len(buf))
            if not chunk:
                raise AssertionError(f"stream closed after {len(buf)} of {n} bytes")
            buf += chunk
    return bytes(buf)


async def recv_payload(
    sock: socket.socket, req: int, n: int, timeout: float = REPLY_TIMEOUT
) -> bytes:
    """One stream's share of transfer ``req``: its header (checked) and ``n`` payload bytes."""
    head = await recv_exact(sock, _native.SOCK_HEADER_BYTES, timeout)
    assert head == _native.sock_header(req, n), (head, req, n)
    return await recv_exact(sock, n, timeout)


async def nothing_arrives(sock: socket.socket, wait: float = 0.2) -> int:
    """Bytes that arrived on ``sock`` within ``wait`` seconds (0 expected)."""
    await asyncio.sleep(wait)
    try:
        data = sock.recv(1 << 20, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0
    return len(data) if data else 0


def stop_when_bytes_land(view: np.ndarray, pid: int, out: dict[str, float]) -> None:
    """Stops ``pid`` (SIGSTOP) the moment the first pulled byte lands in ``view``.

    Runs on a watcher thread: it spins (bounded, 5 s) so the stop comes mid-transfer.
    """
    end = time.monotonic() + 5
    while view[0] == 0 and time.monotonic() < end:
        pass
    os.kill(pid, signal.SIGSTOP)
    out["stopped"] = time.monotonic()
