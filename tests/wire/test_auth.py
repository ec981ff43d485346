"""Link authentication (HMAC challenge-response) and the handshake over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import random
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from aiodatadist import _wire as w
from aiodatadist._wire import MsgType, WireError
from tests.wire.test_wire import raw_frame, registered_cache, sample_frames

SECRET = b"correct horse battery staple"
CLIENT_ID = 1001
SERVER_ID = 2002


# --------------------------------------------------------------------------- MACs


def test_new_nonce() -> None:
    nonces = {w.new_nonce() for _ in range(100)}
    assert len(nonces) == 100
    for n in nonces:
        assert len(n) == 64 and int(n, 16) >= 0 and n == n.lower()
        w.check_body(MsgType.CHALLENGE, {"cluster_id": 1, "nonce": n, "auth_required": True})


def _reference_mac(direction: bytes, secret: bytes, nc: str, ns: str, cid: int, sid: int) -> str:
    """The documented encoding, written out independently of the module."""
    fields = [
        b"aiodatadist-v1-" + direction,
        bytes.fromhex(nc),
        bytes.fromhex(ns),
        struct.pack(">Q", cid),
        struct.pack(">Q", sid),
    ]
    msg = b"".join(struct.pack(">I", len(f)) + f for f in fields)
    return hmac.new(hashlib.sha256(secret).digest(), msg, hashlib.sha256).hexdigest()


def test_mac_encoding_is_pinned() -> None:
    nc, ns = "00" * 32, "ff" * 32
    assert w.client_mac(SECRET, nc, ns, 1, 2) == _reference_mac(b"client", SECRET, nc, ns, 1, 2)
    assert w.server_mac(SECRET, nc, ns, 1, 2) == _reference_mac(b"server", SECRET, nc, ns, 1, 2)
    mac = w.client_mac(SECRET, nc, ns, 1, 2)
    assert len(mac) == 64 and mac == mac.lower()
    # A well-formed AUTH/WELCOME mac by the schema.
    w.check_body(MsgType.AUTH, {"mac": mac})


def test_right_secret_verifies_both_ways() -> None:
    nc, ns = w.new_nonce(), w.new_nonce()
    # Client computes, server verifies with its own copy of the secret.
    sent = w.client_mac(SECRET, nc, ns, CLIENT_ID, SERVER_ID)
    assert w.verify_mac(w.client_mac(bytes(SECRET), nc, ns, CLIENT_ID, SERVER_ID), sent)
    # Server proves itself, client verifies.
    proof = w.server_mac(SECRET, nc, ns, CLIENT_ID, SERVER_ID)
    assert w.verify_mac(w.server_mac(SECRET, nc, ns, CLIENT_ID, SERVER_ID), proof)


def test_wrong_secret_fails() -> None:
    nc, ns = w.new_nonce(), w.new_nonce()
    for wrong in (b"wrong", SECRET + b"\x00", SECRET[:-1], b"\x00" + SECRET):
        assert not w.verify_mac(
            w.client_mac(SECRET, nc, ns, CLIENT_ID, SERVER_ID),
            w.client_mac(wrong, nc, ns, CLIENT_ID, SERVER_ID),
        )
        assert not w.verify_mac(
            w.server_mac(SECRET, nc, ns, CLIENT_ID, SERVER_ID),
            w.server_mac(wrong, nc, ns, CLIENT_ID, SERVER_ID),
        )


def test_client_and_server_macs_differ() -> None:
    nc, ns = w.new_nonce(), w.new_nonce()
    c = w.client_mac(SECRET, nc, ns, CLIENT_ID, SERVER_ID)
    s = w.server_mac(SECRET, nc, ns, CLIENT_ID, SERVER_ID)
    assert c != s
    assert not w.verify_mac(s, c) and not w.verify_mac(c, s)
    # Reflection: the server's proof for a connection is no client proof for the mirrored one.
    assert w.server_mac(SECRET, ns, nc, SERVER_ID, CLIENT_ID) != c


def test_replay_with_another_nonce_fails() -> None:
    nc, ns = w.new_nonce(), w.new_nonce()
    old = w.client_mac(SECRET, nc, ns, CLIENT_ID, SERVER_ID)
    # The server hands out a fresh nonce per connection: the recorded MAC does not verify.
    assert not w.verify_mac(w.client_mac(SECRET, nc, w.new_nonce(), CLIENT_ID, SERVER_ID), old)
    # Nor does a replayed WELCOME proof against a fresh client nonce.
    old_proof = w.server_mac(SECRET, nc, ns, CLIENT_ID, SERVER_ID)
    assert not w.verify_mac(
        w.server_mac(SECRET, w.new_nonce(), ns, CLIENT_ID, SERVER_ID), old_proof
    )


def test_mac_binds_every_input() -> None:
    nc, ns = w.new_nonce(), w.new_nonce()
    base = w.client_mac(SECRET, nc, ns, CLIENT_ID, SERVER_ID)
    variants = [
        w.client_mac(SECRET, ns, nc, CLIENT_ID, SERVER_ID),  # nonces swapped
        w.client_mac(SECRET, nc, ns, SERVER_ID, CLIENT_ID),  # ids swapped
        w.client_mac(SECRET, nc, ns, CLIENT_ID + 1, SERVER_ID),
        w.client_mac(SECRET, nc, ns, CLIENT_ID, SERVER_ID + 1),
        w.client_mac(
            SECRET, nc[:-2] + "00" if nc[-2:] != "00" else nc[:-2] + "01", ns, CLIENT_ID, SERVER_ID
        ),
    ]
    assert len({base, *variants}) == len(variants) + 1
    # Length prefixes: moving bytes from one nonce to the other changes the MAC.
    a, b = "11" * 16, "22" * 20
    moved = w.client_mac(SECRET, a + "22" * 4, "22" * 16, 0, 0)
    assert moved != w.client_mac(SECRET, a, b, 0, 0)


def test_mac_argument_checks() -> None:
    nc, ns = w.new_nonce(), w.new_nonce()
    with pytest.raises(ValueError, match="must not be empty"):
        w.client_mac(b"", nc, ns, 1, 2)
    with pytest.raises(TypeError, match="secret must be bytes"):
        w.server_mac("text", nc, ns, 1, 2)  # type: ignore[arg-type]
    with pytest.raises(WireError, match="client_nonce"):
        w.client_mac(SECRET, "xyz", ns, 1, 2)
    with pytest.raises(WireError, match="server_nonce"):
        w.client_mac(SECRET, nc, "AB" * 32, 1, 2)
    with pytest.raises(WireError, match="client_id"):
        w.client_mac(SECRET, nc, ns, -1, 2)
    with pytest.raises(WireError, match="server_id"):
        w.server_mac(SECRET, nc, ns, 1, 2**64)
    with pytest.raises(WireError, match="server_id"):
        w.server_mac(SECRET, nc, ns, 1, True)


def test_verify_mac_odd_inputs() -> None:
    mac = w.client_mac(SECRET, w.new_nonce(), w.new_nonce(), 1, 2)
    assert w.verify_mac(mac, mac)
    for got in (None, "", mac[:-1], mac + "0", mac.upper(), "é" * 64, 0, b"x", [mac]):
        assert not w.verify_mac(mac, got)
    assert not w.verify_mac("", "")


def test_check_auth_modes() -> None:
    mac = "ab" * 32
    assert w.check_auth({"mac": mac}, auth_required=True) == mac
    assert w.check_auth({"mac": ""}, auth_required=False) == ""
    with pytest.raises(WireError, match="authentication is required"):
        w.check_auth({"mac": ""}, auth_required=True)
    with pytest.raises(WireError, match="has no secret"):
        w.check_auth({"mac": mac}, auth_required=False)
    with pytest.raises(WireError, match="expected str"):
        w.check_auth({}, auth_required=True)
    # The schema lets both forms through; check_auth picks the one the mode allows.
    assert w.decode(w.encode(MsgType.AUTH, {"mac": ""})).body == {"mac": ""}


# --------------------------------------------------------------------------- handshake over sockets


@dataclass
class ServerLog:
    """What the test server saw: the messages it parsed and how each connection ended."""

    messages: list[w.Message] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def serve_handshake_parser(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: ServerLog | None = None
) -> None:
    """The parsing loop a control-plane server runs: read frames, echo them, close on error.

    Every frame is checked before it is acted on; the first WireError (garbage,
    limits, schema, version), a closed connection or a timeout ends the
    connection at once.
    """
    try:
        while True:
            msg = await w.read_message(reader, timeout=5)
            if log is not None:
                log.messages.append(msg)
            await w.write_message(writer, msg.type, msg.body, msg.binary)
    except (WireError, TimeoutError) as e:
        if log is not None:
            log.errors.append(e)
    finally:
        await _close(writer)
        if log is not None:
            log.closed.set()


@contextlib.asynccontextmanager
async def listening(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (fails the test if it never does)."""
    return await asyncio.wait_for(reader.read(), 5)


async def _closed_by_peer(reader: asyncio.StreamReader) -> None:
    """Waits for the server's close: EOF, or a reset when it left our bytes unread."""
    with contextlib.suppress(ConnectionResetError):
        assert await asyncio.wait_for(reader.read(), 5) == b""


@pytest.mark.asyncio
async def test_echo_server_round_trips_every_type() -> None:
    log = ServerLog()
    async with listening(lambda r, wr: serve_handshake_parser(r, wr, log)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        frames = sample_frames()
        for frame in frames:
            writer.write(frame)
        await writer.drain()
        for frame in frames:
            msg = await w.read_message(reader, timeout=5)
            assert w.encode(msg.type, msg.body, msg.binary) == frame
        writer.write_eof()
        assert await _read_all(reader) == b""
        await asyncio.wait_for(log.closed.wait(), 5)
        await _close(writer)
    assert len(log.messages) == len(frames)
    assert len(log.errors) == 1 and isinstance(log.errors[0], w.ConnectionClosed)
    assert log.errors[0].clean


_V = w.PROTOCOL_VERSION
GARBAGE: list[tuple[str, bytes, type[BaseException]]] = [
    ("http", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", WireError),
    ("zeros", bytes(64), WireError),
    ("random", random.Random(7).randbytes(200), WireError),
    ("bad-version", raw_frame(MsgType.PING, {"t": 1}, version=9), w.VersionMismatch),
    ("huge-json", w.HEADER.pack(b"ADDW", _V, MsgType.TABLE, 0, 2**30, 0), WireError),
    ("huge-binary", w.HEADER.pack(b"ADDW", _V, MsgType.PULL, 0, 2, 2**31), WireError),
    ("bad-schema", raw_frame(MsgType.PING, {"t": 1, "evil": True}), WireError),
    ("pickle", raw_frame(MsgType.PING, json_bytes=b"\x80\x04\x95\x05" + bytes(20)), WireError),
    ("unknown-type", raw_frame(200, {"t": 1}), WireError),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("case", "garbage", "exc"), GARBAGE, ids=[g[0] for g in GARBAGE])
async def test_garbage_closes_the_connection(
    case: str, garbage: bytes, exc: type[BaseException]
) -> None:
    log = ServerLog()
    async with listening(lambda r, wr: serve_handshake_parser(r, wr, log)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        good = w.encode(MsgType.PING, {"t": 1})
        # A valid frame first (echoed), then garbage: the server closes without waiting
        # for more (no EOF is sent from this side).
        writer.write(good)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(len(good)), 5) == good
        writer.write(garbage)
        await writer.drain()
        await asyncio.wait_for(log.closed.wait(), 5)
        await _closed_by_peer(reader)
        await _close(writer)
    assert [m.type for m in log.messages] == [MsgType.PING]
    assert len(log.errors) == 1 and type(log.errors[0]) is exc, log.errors


@pytest.mark.asyncio
async def test_truncated_frame_then_eof_closes() -> None:
    log = ServerLog()
    async with listening(lambda r, wr: serve_handshake_parser(r, wr, log)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(w.encode(MsgType.PING, {"t": 1})[:-3])
        writer.write_eof()
        assert await _read_all(reader) == b""
        await asyncio.wait_for(log.closed.wait(), 5)
        await _close(writer)
    assert isinstance(log.errors[0], w.ConnectionClosed) and not log.errors[0].clean


# The full link handshake, as the control plane runs it (module docstring of _wire).

TABLE = [registered_cache(1)]


async def serve_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    secret: bytes | None,
    log: ServerLog,
) -> None:
    """Server side of the link handshake; reveals the table only after authentication."""
    try:
        hello = (await w.read_message(reader, timeout=5, accept={MsgType.HELLO})).body
        if hello["want_auth"] and secret is None:
            await w.write_message(
                writer,
                MsgType.REFUSE,
                {"status": w.AUTH_FAILED_STATUS, "reason": "this server has no shared secret"},
            )
            return
        nonce_s = w.new_nonce()
        await w.write_message(
            writer,
            MsgType.CHALLENGE,
            {"cluster_id": SERVER_ID, "nonce": nonce_s, "auth_required": secret is not None},
        )
        auth = await w.read_message(reader, timeout=5, accept={MsgType.AUTH})
        log.messages.append(auth)
        try:
            mac = w.check_auth(auth.body, auth_required=secret is not None)
            ok = secret is None or w.verify_mac(
                w.client_mac(secret, hello["nonce"], nonce_s, hello["cluster_id"], SERVER_ID), mac
            )
        except WireError:
            ok = False
        if not ok:
            await w.write_message(
                writer,
                MsgType.REFUSE,
                {"status": w.AUTH_FAILED_STATUS, "reason": w.AUTH_FAILED_REASON},
            )
            return
        proof = (
            w.server_mac(secret, hello["nonce"], nonce_s, hello["cluster_id"], SERVER_ID)
            if secret is not None
            else None
        )
        await w.write_message(
            writer,
            MsgType.WELCOME,
            {
                "cluster_id": SERVER_ID,
                "host_id": "server-host",
                "pid": 77,
                "role": 1,
                "table": TABLE,
                "data_paths": ["tcp"],
                "link_token": w.new_nonce()[:32],
                "mac": proof,
            },
        )
    except (WireError, TimeoutError) as e:
        log.errors.append(e)
    finally:
        await _close(writer)
        log.closed.set()


class LinkRefused(Exception):
    pass


async def link(
    port: int, secret: bytes | None, *, tamper_mac: bool = False
) -> tuple[w.Message, bytes]:
    """Client side; returns the verified WELCOME and every byte the server sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = bytearray()
    try:
        nonce_c = w.new_nonce()
        await w.write_message(
            writer,
            MsgType.HELLO,
            {
                "version": w.PROTOCOL_VERSION,
                "cluster_id": CLIENT_ID,
                "host_id": "client-host",
                "pid": 12,
                "role": 2,
                "nonce": nonce_c,
                "want_auth": secret is not None,
            },
        )
        msg = await w.read_message(reader, timeout=5, accept={MsgType.CHALLENGE, MsgType.REFUSE})
        received += w.encode(msg.type, msg.body)
        if msg.type == MsgType.REFUSE:
            raise LinkRefused(msg.body)
        ch = msg.body
        if ch["auth_required"] and secret is None:
            raise LinkRefused("server requires a shared secret")
        if secret is not None and not ch["auth_required"]:
            raise LinkRefused("server cannot prove the shared secret")
        mac = (
            w.client_mac(secret, nonce_c, ch["nonce"], CLIENT_ID, ch["cluster_id"])
            if secret is not None
            else ""
        )
        if tamper_mac:
            mac = "00" * 32
        await w.write_message(writer, MsgType.AUTH, {"mac": mac})
        msg = await w.read_message(reader, timeout=5, accept={MsgType.WELCOME, MsgType.REFUSE})
        received += w.encode(msg.type, msg.body)
        if msg.type == MsgType.REFUSE:
            raise LinkRefused(msg.body)
        if secret is not None:
            expected = w.server_mac(secret, nonce_c, ch["nonce"], CLIENT_ID, ch["cluster_id"])
            if not w.verify_mac(expected, msg.body["mac"]):
                raise LinkRefused("server proof failed")
        received += await _read_all(reader)
        return msg, bytes(received)
    finally:
        await _close(writer)


@pytest.mark.asyncio
@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
async def test_handshake_succeeds(secret: bytes | None) -> None:
    log = ServerLog()
    async with listening(lambda r, wr: serve_handshake(r, wr, secret=secret, log=log)) as port:
        welcome, _ = await link(port, secret)
        await asyncio.wait_for(log.closed.wait(), 5)
    assert welcome.type is MsgType.WELCOME
    assert welcome.body["table"] == TABLE
    assert (welcome.body["mac"] is None) == (secret is None)
    assert log.errors == []


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("server_secret", "client_secret", "tamper", "refusal"),
    [
        (SECRET, b"wrong secret", False, w.AUTH_FAILED_REASON),
        (SECRET, SECRET, True, w.AUTH_FAILED_REASON),
        (SECRET, None, False, "requires a shared secret"),
        (None, SECRET, False, "has no shared secret"),
    ],
    ids=["wrong-secret", "forged-mac", "client-without-secret", "server-without-secret"],
)
async def test_handshake_refused_reveals_nothing(
    server_secret: bytes | None, client_secret: bytes | None, tamper: bool, refusal: str
) -> None:
    log = ServerLog()
    handler = lambda r, wr: serve_handshake(r, wr, secret=server_secret, log=log)  # noqa: E731
    async with listening(handler) as port:
        with pytest.raises(LinkRefused, match=refusal) as info:
            await link(port, client_secret, tamper_mac=tamper)
        await asyncio.wait_for(log.closed.wait(), 5)
    if refusal == w.AUTH_FAILED_REASON:
        assert info.value.args[0] == {"status": 0x5010B009, "reason": "authentication failed"}
    assert log.errors == [] or all(isinstance(e, w.ConnectionClosed) for e in log.errors)


@pytest.mark.asyncio
async def test_wrong_secret_gets_only_challenge_and_refuse() -> None:
    """Byte-level check: a client that fails auth receives no table, pid or address."""
    log = ServerLog()
    server_bytes = bytearray()

    async def spy(r: asyncio.StreamReader, wr: asyncio.StreamWriter) -> None:
        real_write = wr.write

        def write(data: Any) -> None:
            server_bytes.extend(bytes(data))
            real_write(data)

        wr.write = write  # type: ignore[method-assign]
        await serve_handshake(r, wr, secret=SECRET, log=log)

    async with listening(spy) as port:
        with pytest.raises(LinkRefused):
            await link(port, b"not the secret")
        await asyncio.wait_for(log.closed.wait(), 5)
    msgs = []
    data = bytes(server_bytes)
    while data:
        h = w.decode_header(data[:16])
        end = 16 + h.json_len + h.bin_len
        msgs.append(w.decode(data[:end]))
        data = data[end:]
    assert [m.type for m in msgs] == [MsgType.CHALLENGE, MsgType.REFUSE]
    for addr in TABLE[0]["addrs"]:
        assert str(addr).encode() not in server_bytes
    for word in (b'"table"', b'"pid"', b'"addrs"', b'"host_id"', b'"link_token"'):
        assert word not in server_bytes


@pytest.mark.asyncio
async def test_server_refuses_replayed_auth() -> None:
    """An AUTH recorded from one connection does not open another."""
    log = ServerLog()
    recorded: list[str] = []

    async with listening(lambda r, wr: serve_handshake(r, wr, secret=SECRET, log=log)) as port:
        # First connection: a legitimate client, whose AUTH an eavesdropper records.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        nonce_c = w.new_nonce()
        hello = {
            "version": w.PROTOCOL_VERSION,
            "cluster_id": CLIENT_ID,
            "host_id": "c",
            "pid": 5,
            "role": 2,
            "nonce": nonce_c,
            "want_auth": True,
        }
        await w.write_message(writer, MsgType.HELLO, hello)
        ch = (await w.read_message(reader, timeout=5)).body
        recorded.append(w.client_mac(SECRET, nonce_c, ch["nonce"], CLIENT_ID, SERVER_ID))
        await w.write_message(writer, MsgType.AUTH, {"mac": recorded[0]})
        assert (await w.read_message(reader, timeout=5)).type is MsgType.WELCOME
        await _close(writer)
        # Second connection: the eavesdropper replays HELLO and AUTH verbatim.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await w.write_message(writer, MsgType.HELLO, hello)
        await w.read_message(reader, timeout=5, accept={MsgType.CHALLENGE})
        await w.write_message(writer, MsgType.AUTH, {"mac": recorded[0]})
        refused = await w.read_message(reader, timeout=5)
        assert refused.type is MsgType.REFUSE
        assert refused.body["reason"] == w.AUTH_FAILED_REASON
        assert await _read_all(reader) == b""
        await _close(writer)
