"""Mutual authentication of a link: nonces and domain-separated HMAC-SHA256 proofs.

The handshake that carries them is described in :mod:`aiodatadist._wire`, which
re-exports every name here.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from typing import Any

from ._wire_protocol import WireError
from ._wire_schema import _HEX, _INT, _MAC_HEX, _NONCE, Field, _check_field, _type_name, _u64

__all__ = ["check_auth", "client_mac", "new_nonce", "server_mac", "verify_mac"]

_CLIENT_DOMAIN = b"aiodatadist-v1-client"
_SERVER_DOMAIN = b"aiodatadist-v1-server"


def new_nonce() -> str:
    """Returns a fresh nonce: 32 random bytes as 64 lowercase hex digits."""
    return secrets.token_hex(32)


def _mac(
    domain: bytes,
    secret: bytes,
    client_nonce: str,
    server_nonce: str,
    client_id: int,
    server_id: int,
) -> str:
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    if not secret:
        raise ValueError("secret must not be empty")
    fields: list[bytes] = [domain]
    for name, nonce in (("client_nonce", client_nonce), ("server_nonce", server_nonce)):
        _check_field(nonce, _NONCE, name)
        fields.append(bytes.fromhex(nonce))
    for name, cid in (("client_id", client_id), ("server_id", server_id)):
        _check_field(cid, Field(_INT, check=_u64), name)
        fields.append(cid.to_bytes(8, "big"))
    msg = b"".join(len(f).to_bytes(4, "big") + f for f in fields)
    # HMAC zero-pads short keys, so b"k" and b"k\0" would be the same key: key it with
    # a fixed-size digest of the secret instead.
    key = hashlib.sha256(bytes(secret)).digest()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def client_mac(
    secret: bytes, client_nonce: str, server_nonce: str, client_id: int, server_id: int
) -> str:
    """The client's proof that it knows the secret (``AUTH.mac``).

    HMAC-SHA256 keyed by ``SHA-256(secret)`` (so that secrets differing only by
    trailing zero bytes differ) over the fields ``b"aiodatadist-v1-client"``,
    both nonces (raw bytes) and both cluster ids (8-byte big-endian), each
    prefixed by its length as a 4-byte big-endian integer.

    Args:
        secret: the shared secret (non-empty).
        client_nonce: ``HELLO.nonce``.
        server_nonce: ``CHALLENGE.nonce``.
        client_id: the client's cluster id (``HELLO.cluster_id``).
        server_id: the server's cluster id (``CHALLENGE.cluster_id``).

    Returns:
        64 lowercase hex digits.

    Raises:
        TypeError: ``secret`` is not bytes.
        ValueError: an empty secret; WireError (a ValueError) for a malformed
            nonce or id.
    """
    return _mac(_CLIENT_DOMAIN, secret, client_nonce, server_nonce, client_id, server_id)


def server_mac(
    secret: bytes, client_nonce: str, server_nonce: str, client_id: int, server_id: int
) -> str:
    """The server's proof that it knows the secret (``WELCOME.mac``).

    As :func:`client_mac` with the domain ``b"aiodatadist-v1-server"``, so the
    two directions never share a MAC.
    """
    return _mac(_SERVER_DOMAIN, secret, client_nonce, server_nonce, client_id, server_id)


def verify_mac(expected: str, got: object) -> bool:
    """Compares a received MAC with the expected one in constant time.

    Args:
        expected: from :func:`client_mac` or :func:`server_mac`.
        got: what the peer sent (any value; not a str, or not ASCII, is False).

    Returns:
        Whether they are equal.
    """
    if not isinstance(got, str) or not got.isascii() or not expected:
        # Still spend the comparison, so the time does not tell what was wrong.
        hmac.compare_digest(expected.encode(), expected.encode())
        return False
    return hmac.compare_digest(expected.encode("ascii"), got.encode("ascii"))


def check_auth(body: Mapping[str, Any], *, auth_required: bool) -> str:
    """Checks an ``AUTH`` body against the server's mode and returns its MAC.

    Args:
        body: a schema-checked ``AUTH`` body.
        auth_required: whether this server has a secret (``CHALLENGE.auth_required``).

    Returns:
        The MAC: 64 hex digits when ``auth_required``, else ``""``.

    Raises:
        WireError: a missing MAC while auth is required, or one sent while it is not.
    """
    mac = body.get("mac")
    if not isinstance(mac, str):
        raise WireError(f"AUTH.mac: expected str, got {_type_name(mac)}")
    if auth_required:
        if len(mac) != _MAC_HEX or _HEX.fullmatch(mac) is None:
            raise WireError("AUTH.mac: authentication is required, expected 64 hex digits")
    elif mac:
        raise WireError("AUTH.mac: this server has no secret, expected an empty mac")
    return mac
