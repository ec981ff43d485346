"""Hand-driven hostile peers: a raw control-plane client (with the shared secret when it
has one) and blocking-socket attackers that run on a thread, off any event loop.

Bodies are built against the *current* wire schemas (``_wire.SCHEMAS``): fields the
schema does not know are left out and required ones we do not set get a neutral value,
so the attacks keep speaking the protocol as it evolves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiodatadist import LLMRole, _wire


def body_for(t: _wire.MsgType, **given: Any) -> dict[str, Any]:
    schema = _wire.SCHEMAS[t]
    out = {k: v for k, v in given.items() if k in schema}
    for k, f in schema.items():
        if k not in out and getattr(f, "required", True):
            out[k] = 1 if int in f.types else ""
    return out


class RawClient:
    """One control connection driven frame by frame (optionally authenticated)."""

    def __init__(
        self, host: str, port: int, *, secret: bytes | None = None, cluster_id: int = 4242
    ) -> None:
        self.host = host
        self.port = port
        self.secret = secret
        self.cluster_id = cluster_id
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.welcome: dict[str, Any] = {}
        self.streams: list[socket.socket] = []
        self.epoch = 1

    async def __aenter__(self) -> RawClient:
        async with asyncio.timeout(10):
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for s in self.streams:
            s.close()
        if self.writer is not None:
            self.writer.transport.abort()

    async def write(self, t: _wire.MsgType, body: dict[str, Any], binary: bytes = b"") -> None:
        assert self.writer is not None
        async with asyncio.timeout(10):
            await _wire.write_message(self.writer, t, body, binary)

    async def read(self, timeout: float = 10.0) -> _wire.Message:
        assert self.reader is not None
        return await _wire.read_message(self.reader, timeout=timeout)

    async def handshake(self, *, mac: str | None = None) -> _wire.Message:
        """HELLO, CHALLENGE, AUTH (our MAC, or ``mac``), then WELCOME or REFUSE: returns it.
        After a WELCOME it sends our (empty) TABLE."""
        nonce = _wire.new_nonce()
        await self.write(
            _wire.MsgType.HELLO,
            body_for(
                _wire.MsgType.HELLO,
                version=_wire.PROTOCOL_VERSION,
                cluster_id=self.cluster_id,
                host_id="adversity-raw-client",
                pid=os.getpid(),
                role=int(LLMRole.DECODER),
                nonce=nonce,
                want_auth=self.secret is not None,
            ),
        )
        ch = await self.read()
        assert ch.type == _wire.MsgType.CHALLENGE, ch
        if mac is None:
            mac = ""
            if self.secret is not None:
                mac = _wire.client_mac(
                    self.secret,
                    nonce,
                    ch.body["nonce"],
                    self.cluster_id,
                    int(ch.body["cluster_id"]),
                )
        await self.write(_wire.MsgType.AUTH, {"mac": mac})
        reply = await self.read()
        if reply.type == _wire.MsgType.WELCOME:
            self.welcome = reply.body
            await self.write(_wire.MsgType.TABLE, {"version": 0, "table": []})
        return reply

    async def open_stream(self, index: int) -> socket.socket:
        """A data stream (DATA_HELLO + its one-byte ACK), non-blocking."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.streams.append(sock)
        sock.setblocking(False)
        # A small receive buffer: a peer that stops reading fills it sooner.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        async with asyncio.timeout(10):
            await loop.sock_connect(sock, (self.host, self.port))
            frame = _wire.encode(
                _wire.MsgType.DATA_HELLO,
                body_for(
                    _wire.MsgType.DATA_HELLO,
                    link_token=self.welcome["link_token"],
                    stream=index,
                    epoch=self.epoch,
                ),
            )
            await loop.sock_sendall(sock, frame)
            ack = await loop.sock_recv(sock, 1)
        assert ack, "the server closed the data stream"
        return sock

    async def pull(
        self,
        req: int,
        cache_id: int,
        segments: Any,
        *,
        dst_geometry: tuple[int, int, int],
        deadline_ms: int = 2000,
        streams: int = 1,
    ) -> None:
        segs = np.asarray(segments, dtype=np.uint64).reshape(-1, 5)
        await self.write(
            _wire.MsgType.PULL,
            body_for(
                _wire.MsgType.PULL,
                req=req,
                cache_id=cache_id,
                dst_geometry=list(dst_geometry),
                deadline_ms=deadline_ms,
                streams=streams,
                epoch=self.epoch,
            ),
            _wire.segments_to_bytes(segs),
        )

    async def done(self, timeout: float = 10.0) -> dict[str, Any]:
        """The next DONE (PINGs answered, TABLEs skipped)."""
        end = time.monotonic() + timeout
        while True:
            msg = await self.read(max(0.05, end - time.monotonic()))
            if msg.type == _wire.MsgType.DONE:
                return msg.body
            if msg.type == _wire.MsgType.PING:
                await self.write(_wire.MsgType.PONG, {"t": msg.body["t"]})


# ------------------------------------------------------------------ the siege


@dataclass
class Attack:
    """One hostile connection: what it sends, and when the server closed it."""

    kind: str
    bound: float  # seconds within which the server must have closed it
    payload: bytes = b""
    interval: float = 0.0  # seconds per byte (slowloris); 0: all at once
    closed_after: float | None = None
    error: str = ""
    sent: int = 0
    sock: socket.socket | None = None
    t0: float = 0.0
    next_send: float = 0.0

    @property
    def ok(self) -> bool:
        return self.closed_after is not None and self.closed_after <= self.bound


def _closed(sock: socket.socket) -> bool:
    """True once the server closed (EOF or reset); drains whatever it sent."""
    try:
        while True:
            data = sock.recv(65536, socket.MSG_DONTWAIT)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def hello_frame(cluster_id: int = 999) -> bytes:
    return _wire.encode(
        _wire.MsgType.HELLO,
        body_for(
            _wire.MsgType.HELLO,
            version=_wire.PROTOCOL_VERSION,
            cluster_id=cluster_id,
            host_id="adversity",
            pid=os.getpid(),
            role=int(LLMRole.DECODER),
            nonce=_wire.new_nonce(),
            want_auth=True,
        ),
    )


def attacks(handshake_timeout: float, rng: np.random.Generator, idle: int) -> list[Attack]:
    """Garbage, huge length prefixes, slowloris and idle connections."""
    hs = handshake_timeout + 5.0  # ended by the handshake timeout (slack: a loaded box)
    fast = 3.0  # refused from the header alone
    hdr = _wire.HEADER
    big = 0xFFFFFFFF
    v = _wire.PROTOCOL_VERSION
    m = _wire.MAGIC
    out = [
        Attack("huge-json-prefix", fast, hdr.pack(m, v, int(_wire.MsgType.HELLO), 0, big, 0)),
        Attack("huge-binary-prefix", fast, hdr.pack(m, v, int(_wire.MsgType.PULL), 0, 100, big)),
        Attack(
            "over-limit-json",
            fast,
            hdr.pack(m, v, int(_wire.MsgType.HELLO), 0, _wire.MAX_SMALL_JSON + 1, 0),
        ),
        Attack("table-first", fast, hdr.pack(m, v, int(_wire.MsgType.TABLE), 0, _wire.MAX_JSON, 0)),
        Attack("http", fast, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
        Attack("short-garbage", hs, b"ADD"),
        Attack("header-no-body", hs, hdr.pack(m, v, int(_wire.MsgType.HELLO), 0, 200, 0)),
    ]
    for i in range(6):
        n = int(rng.integers(16, 4096))
        out.append(Attack(f"garbage-{i}", hs, rng.integers(0, 256, n, dtype=np.uint8).tobytes()))
    for i in range(3):
        out.append(Attack(f"slowloris-{i}", hs, hello_frame(), interval=1.0))
    out += [Attack(f"idle-{i}", hs) for i in range(idle)]
    return out


class Siege:
    """Runs hostile connections against ``addr`` on one thread, off any event loop."""

    def __init__(self, addr: tuple[str, int], plan: list[Attack]) -> None:
        self.addr = addr
        self.plan = plan
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="adversity-siege", daemon=True)
        self.failure = ""

    def start(self) -> Siege:
        self.thread.start()
        return self

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)
        for a in self.plan:
            if a.sock is not None:
                a.sock.close()
                a.sock = None

    def _run(self) -> None:
        try:
            for a in self.plan:
                a.t0 = a.next_send = time.monotonic()
                try:
                    s = socket.create_connection(self.addr, timeout=10)
                except OSError as e:
                    a.error = f"connect: {e}"
                    a.closed_after = 0.0
                    continue
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.setblocking(False)
                a.sock = s
                if a.interval <= 0 and a.payload:
                    with contextlib.suppress(OSError):
                        a.sent = s.send(a.payload)
            end = time.monotonic() + max(a.bound for a in self.plan) + 10
            while not self.stop.is_set() and time.monotonic() < end:
                open_ = [a for a in self.plan if a.sock is not None]
                if not open_:
                    return
                now = time.monotonic()
                for a in open_:
                    assert a.sock is not None
                    if a.interval > 0 and a.sent < len(a.payload) and now >= a.next_send:
                        try:
                            a.sent += a.sock.send(a.payload[a.sent : a.sent + 1])
                        except BlockingIOError:
                            pass
                        except OSError:
                            a.closed_after = now - a.t0
                        a.next_send = now + a.interval
                    if a.closed_after is None and _closed(a.sock):
                        a.closed_after = now - a.t0
                    if a.closed_after is not None:
                        a.sock.close()
                        a.sock = None
                self.stop.wait(0.02)
        except Exception as e:  # reported by the test that checks the siege
            self.failure = f"{type(e).__name__}: {e}"
