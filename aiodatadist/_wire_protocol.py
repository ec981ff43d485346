"""The control plane's protocol constants: version, limits, message types and errors.

The frame format and the handshake are described in :mod:`aiodatadist._wire`,
which re-exports every name here.
"""

from __future__ import annotations

import enum

from .config import DataPath
from .errors import LLMStatusCode

__all__ = [
    "AUTH_FAILED_REASON",
    "AUTH_FAILED_STATUS",
    "DATA_PATHS",
    "MAX_BINARY",
    "MAX_DEADLINE_MS",
    "MAX_ENGINE_METADATA",
    "MAX_HOST_ID",
    "MAX_JSON",
    "MAX_SEGMENTS",
    "MAX_SHAPE_DIMS",
    "MAX_SMALL_JSON",
    "MAX_STREAMS",
    "MAX_TABLE_ENTRIES",
    "MAX_TENSORS",
    "MAX_TEXT",
    "PROTOCOL_VERSION",
    "SEGMENT_ROW_BYTES",
    "ConnectionClosed",
    "MsgType",
    "VersionMismatch",
    "WireError",
]

PROTOCOL_VERSION = 6
"""Wire protocol version: the header byte and ``HELLO.version``; peers must match.
3: small tcp pulls are asked on a data stream (``transports/tcp_requests.py``), which a
version-2 peer would never answer. 4: each direction has a request stream
(``DATA_HELLO.stream`` ``MAX_STREAMS + direction``), which a version-3 peer refuses.
5: a stream request moves up to 4 MiB (``tcp_requests.STREAM_MAX_BYTES``), which a
version-4 peer refuses (its bound is 256 KiB). 6: a ``LEASE`` for an engine's push says
``write`` (the owner refuses it while the cache is fenced), which a version-5 peer refuses."""

MAX_JSON = 16 * 1024 * 1024
"""Largest JSON body (``WELCOME`` and ``TABLE``, which carry the cache table)."""
MAX_SMALL_JSON = 64 * 1024
"""Largest JSON body of every other message type."""
MAX_BINARY = 64 * 1024 * 1024
"""Largest binary tail."""
SEGMENT_ROW_BYTES = 40
"""One segments row: five little-endian uint64."""
MAX_SEGMENTS = 1_000_000
"""Most segments rows one ``PULL``/``PUSH`` may carry."""
MAX_TABLE_ENTRIES = 4096
"""Most caches one cache table may describe."""
MAX_STREAMS = 16
"""Most parallel data streams per request (``DATA_HELLO.stream`` is below this for a
data stream; ``MAX_STREAMS`` and ``MAX_STREAMS + 1`` name the two request streams)."""
MAX_DEADLINE_MS = 2**31 - 1
"""Largest ``deadline_ms`` a ``PULL``/``PUSH`` may carry (the server caps it further)."""
MAX_TEXT = 16 * 1024
"""Longest free-text field (``REFUSE.reason``, ``DONE.info``, ``ERROR.info``), in characters."""
MAX_HOST_ID = 256
MAX_ENGINE_METADATA = 8 * 1024 * 1024
"""Longest engine metadata in ``WELCOME``/``TABLE`` ``engines`` (hex characters)."""
MAX_TENSORS = 65536
MAX_SHAPE_DIMS = 64

DATA_PATHS = frozenset(p.value for p in (*DataPath.remote(), *DataPath.engines()))
"""Data paths a server may offer in ``WELCOME.data_paths``."""

AUTH_FAILED_STATUS = int(LLMStatusCode.LLM_LINK_FAILED)
"""``REFUSE.status`` for a failed authentication."""
AUTH_FAILED_REASON = "authentication failed"
"""``REFUSE.reason`` for a failed authentication (says nothing more, on purpose)."""


class MsgType(enum.IntEnum):
    """Control-plane message types (the header's type byte)."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    REFUSE = 5
    TABLE = 6
    PULL = 7
    PUSH = 8
    DONE = 9
    UNLINK = 10
    PING = 11
    PONG = 12
    DATA_HELLO = 13
    ERROR = 14
    CANCEL = 15
    LEASE = 16
    LEASED = 17
    UNLEASE = 18


# --------------------------------------------------------------------------- errors


class WireError(ValueError):
    """A frame that breaks the format, its limits or its schema; close the connection."""


class ConnectionClosed(WireError):
    """The peer closed (or reset) the connection.

    Attributes:
        clean: True when it closed between two frames, False in the middle of one.
    """

    def __init__(self, message: str, *, clean: bool = False) -> None:
        super().__init__(message)
        self.clean = clean


class VersionMismatch(WireError):
    """The peer speaks another protocol version.

    Attributes:
        local: this side's version (:data:`PROTOCOL_VERSION`).
        remote: the peer's version.
    """

    def __init__(self, remote: int, where: str) -> None:
        super().__init__(
            f"protocol version mismatch in {where}: peer speaks version {remote}, "
            f"this side speaks version {PROTOCOL_VERSION}"
        )
        self.local = PROTOCOL_VERSION
        self.remote = remote
