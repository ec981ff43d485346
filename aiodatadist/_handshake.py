"""The link handshake and its authentication, both sides (the linking side is the *client*)::

    client                                   server (has listen_ip_info)
    HELLO {version, cluster_id, host_id, pid, role, nonce_c, want_auth} ->
                                          <- CHALLENGE {cluster_id, nonce_s, auth_required}
    AUTH {mac_c = HMAC(secret, ...)}      ->
                                          <- WELCOME {..., table, data_paths, link_token, mac_s}
                                             or REFUSE {status, reason} and close
    TABLE {version, table}                ->

The server reveals nothing about registered memory (no table, pid or address)
before the peer proved the shared secret, when one is configured. What the
handshake agreed on (who the peer is, the link token, its table) is returned;
the control plane (:mod:`aiodatadist._control`) makes the link's connection of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import struct
import termios
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _wire
from ._caches import CacheTable
from .config import DataPath
from .errors import LLMException, LLMStatusCode, failure, to_status_code
from .transports.host import host_identity
from .transports.peer import PeerInfo

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = [
    "Agreed",
    "client_handshake",
    "engines_info",
    "has_spoken",
    "offered_paths",
    "server_handshake",
    "table_body",
]


@dataclass
class Agreed:
    """What a completed handshake established."""

    info: PeerInfo
    link_token: str
    table: CacheTable
    fd_socket: str | None
    """The server's fd socket for this link (None: no fd channel)."""
    table_version: int
    """The version of our table the peer was sent."""


def offered_paths(rt: Runtime) -> list[DataPath]:
    """The cross-process paths this instance offers (the forced one, or all: ours and
    the engines it runs)."""
    forced = rt.options.data_path
    if forced in DataPath.remote() or forced in DataPath.engines():
        return [forced]
    return [*DataPath.remote(), *(a.kind for a in rt.engines)]


def engines_info(rt: Runtime) -> dict[str, Any]:
    """What a peer needs to reach this instance's engines now (WELCOME, TABLE)."""
    return {a.kind.value: a.info() for a in rt.engines}


def table_body(rt: Runtime) -> dict[str, Any]:
    """A ``TABLE`` message's body: our cache table, and our engines' info with it (a
    registration can change it: a peer must see both together)."""
    own = rt.caches.table
    body: dict[str, Any] = {"version": own.version, "table": own.describe()}
    if rt.engines:
        body["engines"] = engines_info(rt)
    return body


def _refused(body: dict[str, Any]) -> LLMException:
    """A server's REFUSE: its status, but never success, and LLM_FAILED for one it made up."""
    code = to_status_code(int(body["status"]))
    if code == LLMStatusCode.LLM_SUCCESS:
        code = LLMStatusCode.LLM_LINK_FAILED
    return failure(code, f"refused: {body['reason']}")


def _unexpected(msg: _wire.Message) -> LLMException:
    return failure(LLMStatusCode.LLM_LINK_FAILED, f"unexpected {msg.type!r} during the handshake")


async def client_handshake(
    rt: Runtime,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    expect_cluster: int,
    where: str,
) -> Agreed:
    """The client's side, up to and including its TABLE (the caller bounds it in time).

    Raises:
        LLMLinkError: LLM_LINK_FAILED (refused, auth failed, wrong peer), or the status
            the server refused with (e.g. LLM_ALREADY_LINK).
        _wire.WireError, OSError: the connection broke or carried garbage.
    """
    secret = rt.options.shared_secret
    nonce_c = _wire.new_nonce()
    hello = {
        "version": _wire.PROTOCOL_VERSION,
        "cluster_id": rt.cluster_id,
        "host_id": host_identity(),
        "pid": os.getpid(),
        "role": int(rt.role),
        "nonce": nonce_c,
        "want_auth": secret is not None,
    }
    await _wire.write_message(writer, _wire.MsgType.HELLO, hello)
    msg = await _wire.read_message(reader, timeout=None)
    if msg.type == _wire.MsgType.REFUSE:
        raise _refused(msg.body)
    if msg.type != _wire.MsgType.CHALLENGE:
        raise _unexpected(msg)
    server_id = int(msg.body["cluster_id"])
    nonce_s = str(msg.body["nonce"])
    if msg.body["auth_required"] and secret is None:
        raise failure(
            LLMStatusCode.LLM_LINK_FAILED,
            "the peer requires a shared secret and none is configured",
        )
    mac = _wire.client_mac(secret, nonce_c, nonce_s, rt.cluster_id, server_id) if secret else ""
    await _wire.write_message(writer, _wire.MsgType.AUTH, {"mac": mac})
    msg = await _wire.read_message(reader, timeout=None)
    if msg.type == _wire.MsgType.REFUSE:
        raise _refused(msg.body)
    if msg.type != _wire.MsgType.WELCOME:
        raise _unexpected(msg)
    w = msg.body
    if secret is not None:
        expected = _wire.server_mac(secret, nonce_c, nonce_s, rt.cluster_id, server_id)
        if not _wire.verify_mac(expected, w.get("mac") or ""):
            raise failure(
                LLMStatusCode.LLM_LINK_FAILED, "the peer could not prove the shared secret"
            )
    if int(w["cluster_id"]) != expect_cluster:
        raise failure(
            LLMStatusCode.LLM_LINK_FAILED,
            f"{where} is cluster {w['cluster_id']}, not {expect_cluster}",
        )
    table = CacheTable.from_description(list(w["table"]))
    paths = [DataPath(p) for p in w["data_paths"]]  # (the schema allows only these)
    info = PeerInfo(int(w["cluster_id"]), str(w["host_id"]), int(w["pid"]), int(w["role"]), paths)
    info.engines = dict(w.get("engines") or {})
    fd_socket = w.get("fd_socket")
    body = table_body(rt)
    version = body["version"]
    await _wire.write_message(writer, _wire.MsgType.TABLE, body)
    fd = fd_socket if isinstance(fd_socket, str) else None
    return Agreed(info, str(w["link_token"]), table, fd, version)


async def refuse(writer: asyncio.StreamWriter, status: LLMStatusCode, reason: str) -> None:
    """Sends REFUSE (best effort) and closes the connection."""
    with contextlib.suppress(Exception):
        await _wire.write_message(
            writer, _wire.MsgType.REFUSE, {"status": int(status), "reason": reason}
        )
    writer.close()


async def server_handshake(
    rt: Runtime,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    hello: dict[str, Any],
    timeout: float,
    offer_fd: Callable[[str, str], str | None],
) -> Agreed | None:
    """The server's side after the client's HELLO, up to and including the client's TABLE.

    ``offer_fd(host_id, token)``: the fd socket name to offer this client (or None).
    Returns None when the client was refused or hung up (the connection is closed).

    Raises:
        _wire.WireError, OSError, TimeoutError: a message broke, was garbage or late.
    """
    if int(hello["version"]) != _wire.PROTOCOL_VERSION:
        await refuse(
            writer,
            LLMStatusCode.LLM_LINK_FAILED,
            f"protocol version {hello['version']} != {_wire.PROTOCOL_VERSION}",
        )
        return None
    client_id = int(hello["cluster_id"])
    secret = rt.options.shared_secret
    nonce_s = _wire.new_nonce()
    challenge = {"cluster_id": rt.cluster_id, "nonce": nonce_s, "auth_required": secret is not None}
    await _wire.write_message(writer, _wire.MsgType.CHALLENGE, challenge)
    auth = await _wire.read_message(reader, timeout=timeout, accept=(_wire.MsgType.AUTH,))
    if auth.type != _wire.MsgType.AUTH:
        writer.close()
        return None
    if secret is not None:
        expected = _wire.client_mac(secret, hello["nonce"], nonce_s, client_id, rt.cluster_id)
        if not _wire.verify_mac(expected, str(auth.body["mac"])):
            await refuse(writer, LLMStatusCode.LLM_LINK_FAILED, "authentication failed")
            return None
    if client_id == rt.cluster_id:
        await refuse(writer, LLMStatusCode.LLM_PARAM_INVALID, "same cluster id as the server")
        return None
    if rt.links.find(client_id) is not None:
        await refuse(
            writer, LLMStatusCode.LLM_ALREADY_LINK, f"cluster {client_id} is already linked"
        )
        return None
    token = secrets.token_hex(16)
    fd_socket = offer_fd(str(hello["host_id"]), token)
    own = rt.caches.table
    welcomed_version = own.version
    mac = (
        _wire.server_mac(secret, hello["nonce"], nonce_s, client_id, rt.cluster_id)
        if secret is not None
        else None
    )
    paths = offered_paths(rt)
    welcome = {
        "cluster_id": rt.cluster_id,
        "host_id": host_identity(),
        "pid": os.getpid(),
        "role": int(rt.role),
        "table": own.describe(),
        "data_paths": [p.value for p in paths],
        "link_token": token,
        "mac": mac,
        "fd_socket": fd_socket,
    }
    if rt.engines:
        welcome["engines"] = engines_info(rt)
    await _wire.write_message(writer, _wire.MsgType.WELCOME, welcome)
    first = await _wire.read_message(reader, timeout=timeout, accept=(_wire.MsgType.TABLE,))
    if first.type != _wire.MsgType.TABLE:
        writer.close()
        return None
    table = CacheTable.from_description(
        [_wire.check_cache_description(d) for d in first.body["table"]]
    )
    info = PeerInfo(client_id, str(hello["host_id"]), int(hello["pid"]), int(hello["role"]), paths)
    info.engines = dict(first.body.get("engines") or {})
    return Agreed(info, token, table, fd_socket, welcomed_version)


def has_spoken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Whether bytes from the peer wait to be read on this connection."""
    if getattr(reader, "_buffer", None):  # read from the socket, not parsed yet
        return True
    sock = writer.get_extra_info("socket")
    try:
        pending = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, AttributeError, ValueError):
        return False
    return bool(struct.unpack("i", pending)[0])
