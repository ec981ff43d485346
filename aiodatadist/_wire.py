"""Control-plane wire format: versioned, length-prefixed, schema-checked frames.

Every control-plane message (link handshake, cache-table updates, remote pull and
push requests, keep-alives) travels as one *frame*::

    +-------+---------+------+-------+----------+----------+-------------+---------------+
    | magic | version | type | flags | json_len | bin_len  | JSON body   | binary tail   |
    | ADDW  |   u8    |  u8  |  u16  |   u32    |   u32    | json_len B  | bin_len B     |
    +-------+---------+------+-------+----------+----------+-------------+---------------+
     \\_______________ 16-byte header, struct "!4sBBHII" (network order) _______________/

The body is a UTF-8 JSON object checked against a strict per-type schema
(:data:`SCHEMAS`): unknown fields, missing fields, wrong types (``true`` is not an
int), negative or out-of-range integers, malformed hex and duplicate keys are all
refused.  Only ``PULL`` and ``PUSH`` carry a binary tail: their segments table, rows
of five little-endian uint64 ``(src_tensor, src_off, dst_tensor, dst_off, nbytes)``
(:func:`segments_to_bytes`, :func:`segments_from_bytes`).  Nothing is ever unpickled.

Limits are enforced from the header, before a byte of the body is read or
allocated: :data:`MAX_JSON` (4 MiB) for ``WELCOME`` and ``TABLE``, which carry the
cache table, :data:`MAX_SMALL_JSON` (64 KiB) for every other type, and
:data:`MAX_BINARY` (64 MiB) with at most :data:`MAX_SEGMENTS` rows for the tail.
:func:`read_message` can also refuse, from the header alone, any type the caller
does not expect at that point of the conversation (``accept=``).

Every rejection raises :class:`WireError` (a :class:`ValueError`); a peer that
goes away raises :class:`ConnectionClosed` (a :class:`WireError`).  After either,
and after a :class:`TimeoutError` from :func:`read_message`, the stream is no
longer in sync: the caller closes the connection.

Link handshake (reference section 8.2, with mutual authentication)::

    client                                             server
      | HELLO {version, cluster_id, host_id, pid, role,   |
      |        nonce = nonce_c, want_auth}              -> |  version differs -> REFUSE, close
      |                                                    |  (the server may also REFUSE a
      |                                                    |   want_auth that it cannot meet)
      | <- CHALLENGE {cluster_id, nonce = nonce_s,         |
      |               auth_required}                       |
      | AUTH {mac = client_mac(secret, nonce_c, nonce_s,   |
      |             client_id, server_id)  or "" }      -> |  check_auth + verify_mac;
      |                                                    |  failure -> REFUSE {
      |                                                    |    LLM_LINK_FAILED,
      |                                                    |    "authentication failed"}, close
      | <- WELCOME {cluster_id, host_id, pid, role, table, |
      |             data_paths, link_token,                |
      |             mac = server_mac(...) or None}         |
      |  client verifies WELCOME.mac before trusting       |
      |  anything in it (table, addresses, link_token)     |

* ``auth_required`` is true exactly when the server has a shared secret; then
  ``AUTH.mac`` is 64 hex digits, otherwise it is ``""`` (:func:`check_auth`).
* A client that has a secret requires the server to prove it too: it refuses a
  ``CHALLENGE`` with ``auth_required`` false, and a ``WELCOME`` whose ``mac`` does
  not verify.  A client without a secret cannot answer ``auth_required`` true.
* The MACs are HMAC-SHA256 over a domain-separated, length-prefixed encoding of
  both nonces and both cluster ids (:func:`client_mac`, :func:`server_mac`), so a
  MAC from one direction, one connection (nonce) or one pair of ids proves
  nothing for another.
* The server reveals nothing about registered memory (no table, pid or address)
  before authentication succeeds: the ``CHALLENGE`` schema has no field for it,
  and ``WELCOME`` is the first message that carries the table.
* Data-stream connections open with ``DATA_HELLO {link_token, stream, epoch}``;
  the token comes from ``WELCOME``. The linking side opens every data stream and
  numbers each (re)connected set of one direction with a new ``epoch``; ``PULL`` /
  ``PUSH`` name the epoch of the streams their bytes travel on, and the serving
  side uses only streams of that epoch. The bytes of each stream start with a
  header naming the request (``req``) they belong to (``_native.sock_header``).
  ``PULL`` / ``PUSH`` may name the cache's lease generation (``gen``) as the
  requester's table gave it: a cache that was re-bound since (its ``model_id`` or a
  row key went to another registration) is refused with ``LLM_KV_CACHE_NOT_EXIST``,
  (``DONE.stale``), and the requester refreshes its table and retries once, as the
  one-sided paths do.
* ``CANCEL {req, epoch}``: the requester gave up request ``req`` (``0``: none) and
  will never use its streams of epoch ``epoch`` or older again. The server drops the
  request if still queued, aborts it if running, and retires those streams.

The secret authenticates peers when they link; it does not protect the frames
that follow against an on-path attacker (no encryption, no per-frame MAC).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import json
import math
import re
import secrets
import struct
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import LLMStatusCode

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "AUTH_FAILED_REASON",
    "AUTH_FAILED_STATUS",
    "DATA_PATHS",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_BINARY",
    "MAX_DEADLINE_MS",
    "MAX_JSON",
    "MAX_SEGMENTS",
    "MAX_SMALL_JSON",
    "MAX_STREAMS",
    "MAX_TABLE_ENTRIES",
    "MAX_TEXT",
    "PROTOCOL_VERSION",
    "SCHEMAS",
    "SEGMENT_ROW_BYTES",
    "ConnectionClosed",
    "Field",
    "Header",
    "Message",
    "MsgType",
    "VersionMismatch",
    "WireError",
    "check_auth",
    "check_body",
    "check_cache_description",
    "client_mac",
    "decode",
    "decode_body",
    "decode_header",
    "encode",
    "expect",
    "new_nonce",
    "read_message",
    "segments_from_bytes",
    "segments_to_bytes",
    "server_mac",
    "verify_mac",
    "write_message",
]

# --------------------------------------------------------------------------- constants

PROTOCOL_VERSION = 2
"""Wire protocol version: the header byte and ``HELLO.version``; peers must match."""

MAGIC = b"ADDW"
HEADER = struct.Struct("!4sBBHII")
HEADER_SIZE = HEADER.size  # 16
KNOWN_FLAGS = 0
"""Header flag bits this version understands (none yet); any other bit is refused."""

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
"""Most parallel data streams per request (``DATA_HELLO.stream`` is below this)."""
MAX_DEADLINE_MS = 2**31 - 1
"""Largest ``deadline_ms`` a ``PULL``/``PUSH`` may carry (the server caps it further)."""
MAX_TEXT = 16 * 1024
"""Longest free-text field (``REFUSE.reason``, ``DONE.info``, ``ERROR.info``), in characters."""
MAX_HOST_ID = 256
MAX_TENSORS = 65536
MAX_SHAPE_DIMS = 64

DATA_PATHS = frozenset({"shm", "cma", "tcp"})
"""Data paths a server may offer in ``WELCOME.data_paths``."""

AUTH_FAILED_STATUS = int(LLMStatusCode.LLM_LINK_FAILED)
"""``REFUSE.status`` for a failed authentication."""
AUTH_FAILED_REASON = "authentication failed"
"""``REFUSE.reason`` for a failed authentication (says nothing more, on purpose)."""

_U64 = 2**64
_U32 = 2**32
_I31 = 2**31 - 1
_MAC_HEX = 64
_SHM_NAME = re.compile(r"/[A-Za-z0-9._-]{1,200}")
_HEX = re.compile(r"(?:[0-9a-f]{2})+")


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


_BIG_TYPES = frozenset({MsgType.WELCOME, MsgType.TABLE})
_BINARY_TYPES = frozenset({MsgType.PULL, MsgType.PUSH})


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


# --------------------------------------------------------------------------- schemas

Validator = Callable[[Any, str], None]
"""Checks a value whose type is already right; raises :class:`WireError` naming ``where``."""


class Field(NamedTuple):
    """One field of a message schema.

    Attributes:
        types: the accepted JSON types (``int`` never accepts ``bool``).
        required: whether the field must be present.
        check: further checks once the type is right, or None.
    """

    types: tuple[type, ...]
    required: bool = True
    check: Validator | None = None


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    for t in types:
        if t is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif t is type(None):
            if value is None:
                return True
        elif isinstance(value, t):
            return True
    return False


def _check_field(value: Any, f: Field, where: str) -> None:
    if not _type_ok(value, f.types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in f.types)
        raise WireError(f"{where}: expected {names}, got {_type_name(value)}")
    if isinstance(value, str):
        _check_utf8(value, where)
    if f.check is not None and value is not None:
        f.check(value, where)


def _check_utf8(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise WireError(f"{where}: string is not valid UTF-8 (lone surrogate)") from None


class _Range:
    """Validator: an integer in ``[lo, hi]``."""

    __slots__ = ("hi", "lo")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo = lo
        self.hi = hi

    def __call__(self, value: Any, where: str) -> None:
        if not self.lo <= value <= self.hi:
            raise WireError(f"{where}: {value} is out of range [{self.lo}, {self.hi}]")


_range = _Range


_u64 = _range(0, _U64 - 1)
_u32 = _range(0, _U32 - 1)
_positive_u64 = _range(1, _U64 - 1)


def _one_of(values: Collection[int]) -> Validator:
    def check(value: Any, where: str) -> None:
        if value not in values:
            raise WireError(f"{where}: {value!r} is not one of {sorted(values)}")

    return check


def _hex(min_len: int, max_len: int, *, allow_empty: bool = False) -> Validator:
    """Lowercase hex of an even length in ``[min_len, max_len]`` characters."""

    def check(value: Any, where: str) -> None:
        if allow_empty and value == "":
            return
        if not min_len <= len(value) <= max_len:
            raise WireError(
                f"{where}: hex string of {len(value)} characters, expected {min_len}..{max_len}"
            )
        if _HEX.fullmatch(value) is None:
            raise WireError(f"{where}: not lowercase hex of even length")

    return check


def _text(max_len: int, min_len: int = 0) -> Validator:
    def check(value: Any, where: str) -> None:
        if not min_len <= len(value) <= max_len:
            raise WireError(
                f"{where}: string of {len(value)} characters, expected {min_len}..{max_len}"
            )

    return check


def _list_of(item: Field, *, min_len: int = 0, max_len: int, unique: bool = False) -> Validator:
    fast_ints = item.check if item.types == (int,) and isinstance(item.check, _Range) else None
    fast_ints = None if unique else fast_ints

    def check(value: Any, where: str) -> None:
        if not min_len <= len(value) <= max_len:
            raise WireError(f"{where}: {len(value)} items, expected {min_len}..{max_len}")
        if (
            fast_ints is not None
            and all(type(v) is int for v in value)
            and (not value or (fast_ints.lo <= min(value) and max(value) <= fast_ints.hi))
        ):
            return  # the common case of a long list of in-range ints, without a call per item
        for i, v in enumerate(value):
            _check_field(v, item, f"{where}[{i}]")
        if unique and len(set(value)) != len(value):
            raise WireError(f"{where}: duplicate items")

    return check


def _finite(value: Any, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise WireError(f"{where}: {value} is not finite")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise WireError(f"{where}: {value} is out of the int64 range")


def _data_path(value: Any, where: str) -> None:
    if value not in DATA_PATHS:
        raise WireError(f"{where}: unknown data path {value!r} (known: {sorted(DATA_PATHS)})")


def _table(value: Any, where: str) -> None:
    if len(value) > MAX_TABLE_ENTRIES:
        raise WireError(f"{where}: {len(value)} caches, at most {MAX_TABLE_ENTRIES}")
    seen: set[int] = set()
    for i, d in enumerate(value):
        _check_description(d, f"{where}[{i}]")
        if d["cache_id"] in seen:
            raise WireError(f"{where}[{i}]: duplicate cache_id {d['cache_id']}")
        seen.add(d["cache_id"])


def _fd_socket(value: Any, where: str) -> None:
    if value is not None and _FD_SOCKET.fullmatch(value) is None:
        raise WireError(f"{where}: {value!r:.80} is not an fd socket name")


_FD_SOCKET = re.compile(r"aiodd-[0-9]{1,10}-[0-9a-f]{16}")
_INT = (int,)
_STR = (str,)
_BOOL = (bool,)
_LIST = (list,)

_GEOMETRY = Field(_LIST, check=_list_of(Field(_INT, check=_positive_u64), min_len=3, max_len=3))
_DEADLINE = Field(_INT, check=_range(1, MAX_DEADLINE_MS))
_STREAMS = Field(_INT, check=_range(1, MAX_STREAMS))
_EPOCH = Field(_INT, check=_u64)
# The lease generation of the cache as the requester's table gave it: the server serves
# only that registration and binding of the cache (a stale one: LLM_KV_CACHE_NOT_EXIST).
_GEN = Field(_INT, required=False, check=_u64)
_NONCE = Field(_STR, check=_hex(32, 128))
_STATUS = Field(_INT, check=_u32)
_INFO = Field(_STR, check=_text(MAX_TEXT))
_TIME = Field((int, float), check=_finite)

SCHEMAS: Mapping[MsgType, Mapping[str, Field]] = {
    MsgType.HELLO: {
        "version": Field(_INT, check=_range(0, 255)),
        "cluster_id": Field(_INT, check=_u64),
        "host_id": Field(_STR, check=_text(MAX_HOST_ID, 1)),
        "pid": Field(_INT, check=_range(1, _I31)),
        "role": Field(_INT, check=_one_of({1, 2, 3})),
        "nonce": _NONCE,
        "want_auth": Field(_BOOL),
    },
    MsgType.CHALLENGE: {
        "cluster_id": Field(_INT, check=_u64),
        "nonce": _NONCE,
        "auth_required": Field(_BOOL),
    },
    # "" only when the server has no secret: see check_auth().
    MsgType.AUTH: {"mac": Field(_STR, check=_hex(_MAC_HEX, _MAC_HEX, allow_empty=True))},
    MsgType.WELCOME: {
        "cluster_id": Field(_INT, check=_u64),
        "host_id": Field(_STR, check=_text(MAX_HOST_ID, 1)),
        "pid": Field(_INT, check=_range(1, _I31)),
        "role": Field(_INT, check=_one_of({1, 2, 3})),
        "table": Field(_LIST, check=_table),
        "data_paths": Field(
            _LIST, check=_list_of(Field(_STR, check=_data_path), max_len=8, unique=True)
        ),
        "link_token": Field(_STR, check=_hex(32, 128)),
        "mac": Field((str, type(None)), check=_hex(_MAC_HEX, _MAC_HEX)),
        # The server's abstract Unix socket for passing fds (segments, lease pages) to a
        # same-host client; null or absent: none (one-sided paths are not used).
        "fd_socket": Field((str, type(None)), required=False, check=_fd_socket),
    },
    MsgType.REFUSE: {"status": _STATUS, "reason": _INFO},
    MsgType.TABLE: {"version": Field(_INT, check=_u64), "table": Field(_LIST, check=_table)},
    MsgType.PULL: {
        "req": Field(_INT, check=_u64),
        "cache_id": Field(_INT, check=_u64),
        "dst_geometry": _GEOMETRY,
        "deadline_ms": _DEADLINE,
        "streams": _STREAMS,
        "epoch": _EPOCH,
        "gen": _GEN,
    },
    MsgType.PUSH: {
        "req": Field(_INT, check=_u64),
        "cache_id": Field(_INT, check=_u64),
        "src_geometry": _GEOMETRY,
        "deadline_ms": _DEADLINE,
        "streams": _STREAMS,
        "epoch": _EPOCH,
        "gen": _GEN,
    },
    MsgType.DONE: {
        "req": Field(_INT, check=_u64),
        "status": _STATUS,
        "info": _INFO,
        # True: refused because the requester's table is stale (the cache is gone or was
        # re-bound); nothing moved, and a refreshed table may name the right cache.
        "stale": Field(_BOOL, required=False),
    },
    MsgType.UNLINK: {"cluster_id": Field(_INT, check=_u64)},
    MsgType.PING: {"t": _TIME},
    MsgType.PONG: {"t": _TIME},
    MsgType.DATA_HELLO: {
        "link_token": Field(_STR, check=_hex(32, 128)),
        "stream": Field(_INT, check=_range(0, MAX_STREAMS - 1)),
        "epoch": _EPOCH,
    },
    MsgType.ERROR: {"status": _STATUS, "info": _INFO},
    MsgType.CANCEL: {"req": Field(_INT, check=_u64), "epoch": _EPOCH},
}
"""Per message type: field name -> :class:`Field`.  Fields not listed are refused."""


def _check_object(value: Any, schema: Mapping[str, Field], where: str) -> None:
    if not isinstance(value, dict):
        raise WireError(f"{where}: expected a JSON object, got {_type_name(value)}")
    for key in value:
        if key not in schema:
            raise WireError(f"{where}: unknown field {key!r}")
    for key, f in schema.items():
        if key not in value:
            if f.required:
                raise WireError(f"{where}: missing field {key!r}")
            continue
        _check_field(value[key], f, f"{where}.{key}")


def check_body(msg_type: MsgType, body: Any) -> dict[str, Any]:
    """Checks a decoded JSON body against the schema of ``msg_type``.

    Args:
        msg_type: the message type.
        body: the decoded JSON value.

    Returns:
        ``body`` itself, now known to match the schema.

    Raises:
        WireError: it does not match (the message names the field).
        VersionMismatch: a ``HELLO`` from another protocol version.
    """
    name = MsgType(msg_type).name
    if msg_type == MsgType.HELLO and isinstance(body, dict):
        # Before the strict check: another version may have other fields, and the
        # error must say "version", not "unknown field".
        version = body.get("version")
        if type(version) is int and version != PROTOCOL_VERSION:
            raise VersionMismatch(version, "HELLO")
    _check_object(body, SCHEMAS[msg_type], name)
    assert isinstance(body, dict)
    return body


# --------------------------------------------------------------------------- cache descriptions


def _row_keys(value: Any, where: str) -> None:
    for i, row in enumerate(value):
        w = f"{where}[{i}]"
        if not isinstance(row, list) or len(row) != 3:
            raise WireError(f"{w}: expected [key_id, model_id, row], got {row!r:.80}")
        for j, v in enumerate(row):
            _check_field(v, Field(_INT, check=_u64), f"{w}[{j}]")


def _lease(value: Any, where: str) -> None:
    if value is None:
        return
    if len(value) != 2 or any(type(v) is not int for v in value):
        raise WireError(f"{where}: expected [slot, generation], got {value!r:.80}")
    slot, gen = value
    if not 0 <= slot < 2**32:
        raise WireError(f"{where}: slot {slot} is out of range")
    if not 0 < gen < 2**63:
        raise WireError(f"{where}: generation {gen} is out of range")


_DESCRIPTION: Mapping[str, Field] = {
    "cache_id": Field(_INT, check=_u64),
    "num_tensors": Field(_INT, check=_range(1, MAX_TENSORS)),
    "num_blocks": Field(_INT, check=_positive_u64),
    "block_bytes": Field(_INT, check=_positive_u64),
    "is_blocks": Field(_BOOL),
    "addrs": Field(_LIST, check=_list_of(Field(_INT, check=_positive_u64), max_len=MAX_TENSORS)),
    "data_type": Field(_INT, check=_u32),
    "placement": Field(_INT, check=_range(0, 1)),
    "shape": Field(
        _LIST, check=_list_of(Field(_INT, check=_u64), min_len=1, max_len=MAX_SHAPE_DIMS)
    ),
    "model_id": Field((int, type(None)), check=_u64),
    "row_keys": Field(_LIST, check=_row_keys),
    "shm_name": Field((str, type(None)), check=_text(201, 2)),
    "shm_size": Field(_INT, check=_u64),
    "shm_offsets": Field(_LIST, check=_list_of(Field(_INT, check=_u64), max_len=MAX_TENSORS)),
    # [slot, generation] of the cache's lease for one-sided access (aiodatadist._leases);
    # null: none, so peers use tcp for it.
    "lease": Field((list, type(None)), required=False, check=_lease),
}


def _check_description(d: Any, where: str) -> None:
    _check_object(d, _DESCRIPTION, where)
    n, blocks, block_bytes = d["num_tensors"], d["num_blocks"], d["block_bytes"]
    tensor_bytes = blocks * block_bytes
    if tensor_bytes >= _U64:
        raise WireError(f"{where}: num_blocks * block_bytes = {tensor_bytes} overflows 64 bits")
    addrs = d["addrs"]
    if len(addrs) != n:
        raise WireError(f"{where}.addrs: {len(addrs)} addresses for num_tensors={n}")
    for i, a in enumerate(addrs):
        if a + tensor_bytes > _U64:
            raise WireError(f"{where}.addrs[{i}]: {a:#x} + {tensor_bytes} bytes overflows 64 bits")
    if d["shape"][0] != blocks:
        raise WireError(f"{where}.shape: shape[0]={d['shape'][0]} but num_blocks={blocks}")
    rows = d["row_keys"]
    if len(rows) > blocks:
        raise WireError(f"{where}.row_keys: {len(rows)} keys for {blocks} rows")
    keys: set[tuple[int, int]] = set()
    for i, (key_id, model_id, row) in enumerate(rows):
        if row >= blocks:
            raise WireError(f"{where}.row_keys[{i}]: row {row} >= num_blocks={blocks}")
        if (key_id, model_id) in keys:
            raise WireError(f"{where}.row_keys[{i}]: duplicate key ({key_id}, {model_id})")
        keys.add((key_id, model_id))
    name, size, offsets = d["shm_name"], d["shm_size"], d["shm_offsets"]
    if name is None:
        if size != 0 or offsets:
            raise WireError(f"{where}: shm_size/shm_offsets given without shm_name")
        return
    if _SHM_NAME.fullmatch(name) is None:
        raise WireError(f"{where}.shm_name: {name!r:.80} is not a valid shared-memory name")
    if len(offsets) != n:
        raise WireError(f"{where}.shm_offsets: {len(offsets)} offsets for num_tensors={n}")
    for i, off in enumerate(offsets):
        if off + tensor_bytes > size:
            raise WireError(
                f"{where}.shm_offsets[{i}]: tensor [{off}, {off + tensor_bytes}) lies outside "
                f"the {size}-byte segment"
            )


def check_cache_description(d: Any) -> dict[str, Any]:
    """Checks one cache description (``CacheEntry.describe()`` shape) from a peer.

    Beyond the field types: ``len(addrs) == num_tensors``, every address non-zero
    and ``addr + num_blocks * block_bytes`` within 64 bits, ``shape[0] ==
    num_blocks``, ``row_keys`` rows ``[key_id, model_id, row]`` with ``row <
    num_blocks`` and no key twice, and either no shared memory (``shm_name``
    null, ``shm_size`` 0, no offsets) or a valid POSIX name with one offset per
    tensor, each tensor inside ``shm_size``.

    Args:
        d: the decoded description.

    Returns:
        ``d`` itself, now known to be well formed.

    Raises:
        WireError: it is not.
    """
    _check_description(d, "cache")
    assert isinstance(d, dict)
    return d


# --------------------------------------------------------------------------- frames


class Header(NamedTuple):
    """A decoded, checked frame header."""

    version: int
    msg_type: MsgType
    flags: int
    json_len: int
    bin_len: int


@dataclass(frozen=True)
class Message:
    """One decoded, schema-checked message.

    Attributes:
        type: the message type.
        body: the JSON body (matches ``SCHEMAS[type]``).
        binary: the binary tail (segments of a ``PULL``/``PUSH``; else empty).
    """

    type: MsgType
    body: dict[str, Any]
    binary: bytes = b""


def _check_lengths(msg_type: MsgType, json_len: int, bin_len: int) -> None:
    limit = MAX_JSON if msg_type in _BIG_TYPES else MAX_SMALL_JSON
    if json_len > limit:
        raise WireError(f"{msg_type.name}: JSON body of {json_len} bytes exceeds {limit}")
    if json_len < 2:
        raise WireError(f"{msg_type.name}: JSON body of {json_len} bytes cannot be an object")
    if msg_type in _BINARY_TYPES:
        if bin_len > MAX_BINARY:
            raise WireError(f"{msg_type.name}: binary tail of {bin_len} bytes exceeds {MAX_BINARY}")
        if bin_len % SEGMENT_ROW_BYTES:
            raise WireError(
                f"{msg_type.name}: segments tail of {bin_len} bytes is not a multiple of "
                f"{SEGMENT_ROW_BYTES}"
            )
        if bin_len // SEGMENT_ROW_BYTES > MAX_SEGMENTS:
            raise WireError(
                f"{msg_type.name}: {bin_len // SEGMENT_ROW_BYTES} segments exceed {MAX_SEGMENTS}"
            )
    elif bin_len:
        raise WireError(f"{msg_type.name}: carries no binary tail, header says {bin_len} bytes")


def decode_header(data: bytes | bytearray | memoryview) -> Header:
    """Decodes and checks a 16-byte frame header.

    Every limit is checked here, so a caller reads the body only after this returns.

    Args:
        data: exactly :data:`HEADER_SIZE` bytes.

    Returns:
        The header.

    Raises:
        WireError: wrong size or magic, unknown type or flag bits, a length over
            the limits, or a binary tail on a type that carries none.
        VersionMismatch: another protocol version.
    """
    if len(data) != HEADER_SIZE:
        raise WireError(f"frame header is {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, raw_type, flags, json_len, bin_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not an aiodatadist control connection")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(version, "frame header")
    try:
        msg_type = MsgType(raw_type)
    except ValueError:
        raise WireError(f"unknown message type {raw_type}") from None
    if flags & ~KNOWN_FLAGS:
        raise WireError(f"{msg_type.name}: unknown flag bits {flags & ~KNOWN_FLAGS:#06x}")
    _check_lengths(msg_type, json_len, bin_len)
    return Header(version, msg_type, flags, json_len, bin_len)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise WireError(f"duplicate key {key!r:.80} in JSON object")
            seen.add(key)
    return out


def _reject_constant(name: str) -> Any:
    raise WireError(f"{name} is not valid JSON")


def _parse_json(msg_type: MsgType, raw: bytes | bytearray | memoryview) -> Any:
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise WireError(
            f"{msg_type.name}: body is not UTF-8 ({e.reason} at byte {e.start})"
        ) from None
    try:
        return json.loads(
            text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
        )
    except WireError as e:
        raise WireError(f"{msg_type.name}: {e}") from None
    except (ValueError, RecursionError) as e:
        # JSONDecodeError, an integer of too many digits, nesting too deep.
        raise WireError(f"{msg_type.name}: body is not valid JSON ({e})") from None


def decode_body(
    header: Header, json_bytes: bytes | bytearray | memoryview, binary: bytes | memoryview = b""
) -> Message:
    """Decodes and checks the body of a frame whose header was checked.

    Args:
        header: from :func:`decode_header`.
        json_bytes: exactly ``header.json_len`` bytes.
        binary: exactly ``header.bin_len`` bytes.

    Returns:
        The message.

    Raises:
        WireError: lengths that disagree with the header, a body that is not a
            UTF-8 JSON object, or one that breaks the schema of its type.
        VersionMismatch: a ``HELLO`` from another protocol version.
    """
    msg_type = header.msg_type
    if len(json_bytes) != header.json_len:
        raise WireError(
            f"{msg_type.name}: JSON body of {len(json_bytes)} bytes, header says {header.json_len}"
        )
    nbin = memoryview(binary).nbytes
    if nbin != header.bin_len:
        raise WireError(
            f"{msg_type.name}: binary tail of {nbin} bytes, header says {header.bin_len}"
        )
    body = check_body(msg_type, _parse_json(msg_type, json_bytes))
    return Message(msg_type, body, binary if isinstance(binary, bytes) else bytes(binary))


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decodes one complete frame (the inverse of :func:`encode`).

    Args:
        data: exactly one frame, header included.

    Returns:
        The message.

    Raises:
        WireError: truncated or trailing bytes, or anything :func:`decode_header`
            or :func:`decode_body` refuses.
    """
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        raise WireError(f"truncated frame: {len(view)} bytes, the header alone is {HEADER_SIZE}")
    header = decode_header(view[:HEADER_SIZE])
    end_json = HEADER_SIZE + header.json_len
    end = end_json + header.bin_len
    if len(view) != end:
        raise WireError(f"{header.msg_type.name}: frame of {len(view)} bytes, header says {end}")
    return decode_body(header, view[HEADER_SIZE:end_json], bytes(view[end_json:end]))


def _coerce_type(msg_type: MsgType | int) -> MsgType:
    try:
        return MsgType(msg_type)
    except ValueError:
        raise WireError(f"unknown message type {msg_type!r}") from None


def _encode_parts(
    msg_type: MsgType | int, body: Mapping[str, Any], binary: bytes | memoryview
) -> tuple[bytes, bytes | memoryview]:
    t = _coerce_type(msg_type)
    try:
        raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        data = raw.encode("utf-8")
    except (TypeError, ValueError) as e:
        raise WireError(f"{t.name}: body cannot be encoded as JSON ({e})") from None
    tail: bytes | memoryview = binary
    if not isinstance(binary, bytes):
        try:
            tail = memoryview(binary).cast("B")
        except (TypeError, ValueError) as e:
            raise WireError(f"{t.name}: binary tail must be contiguous bytes ({e})") from None
    nbin = len(tail)
    _check_lengths(t, len(data), nbin)
    # Check what the peer will decode, with the very same code.
    check_body(t, _parse_json(t, data))
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, t, 0, len(data), nbin) + data, tail


def encode(
    msg_type: MsgType | int, body: Mapping[str, Any], binary: bytes | memoryview = b""
) -> bytes:
    """Encodes one frame, after checking it exactly as the peer will.

    Args:
        msg_type: the message type.
        body: the JSON body; must match ``SCHEMAS[msg_type]``.
        binary: the binary tail (a ``PULL``/``PUSH`` segments table; else empty).

    Returns:
        The frame.

    Raises:
        WireError: the body breaks the schema, cannot be encoded, or the frame
            would exceed the limits.
    """
    head, tail = _encode_parts(msg_type, body, binary)
    return head + bytes(tail) if len(tail) else head


def expect(msg: Message, *types: MsgType) -> Message:
    """Returns ``msg`` if its type is one of ``types``.

    Raises:
        WireError: it is not (an out-of-order message).
    """
    if msg.type not in types:
        wanted = " or ".join(t.name for t in types)
        raise WireError(f"expected {wanted}, got {msg.type.name}")
    return msg


# --------------------------------------------------------------------------- streams


async def _read(reader: asyncio.StreamReader, accept: Collection[MsgType] | None) -> Message:
    try:
        raw = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ConnectionClosed(
                f"connection closed inside a frame header ({len(e.partial)} of {HEADER_SIZE} bytes)"
            ) from None
        raise ConnectionClosed("connection closed by peer", clean=True) from None
    except ConnectionError as e:
        raise ConnectionClosed(f"connection lost: {e}") from e
    header = decode_header(raw)
    if accept is not None and header.msg_type not in accept:
        wanted = " or ".join(MsgType(t).name for t in accept)
        raise WireError(f"expected {wanted}, got {header.msg_type.name}")
    try:
        body = await reader.readexactly(header.json_len)
        binary = await reader.readexactly(header.bin_len) if header.bin_len else b""
    except asyncio.IncompleteReadError as e:
        raise ConnectionClosed(
            f"connection closed inside a {header.msg_type.name} frame "
            f"({len(e.partial)} of {e.expected} bytes read)"
        ) from None
    except ConnectionError as e:
        raise ConnectionClosed(f"connection lost: {e}") from e
    return decode_body(header, body, binary)


async def read_message(
    reader: asyncio.StreamReader,
    *,
    timeout: float | None,
    accept: Collection[MsgType] | None = None,
) -> Message:
    """Reads, checks and decodes the next frame.

    The header is checked (limits included) before the body is read, so a
    hostile length allocates nothing.

    Args:
        reader: the connection.
        timeout: seconds for the whole frame, or None to wait for ever.
        accept: the types acceptable here, or None for any; another type is
            refused from its header, before its body is read.

    Returns:
        The message.

    Raises:
        ConnectionClosed: the peer closed or reset the connection
            (``clean`` when between frames).
        WireError: a frame that breaks the format, limits, schema or ``accept``.
        TimeoutError: no complete frame within ``timeout``.
    """
    if timeout is None:
        return await _read(reader, accept)
    try:
        return await asyncio.wait_for(_read(reader, accept), timeout)
    except asyncio.TimeoutError:  # noqa: UP041 (not the builtin before Python 3.11)
        raise TimeoutError(f"no complete control message within {timeout} s") from None


async def write_message(
    writer: asyncio.StreamWriter,
    msg_type: MsgType | int,
    body: Mapping[str, Any],
    binary: bytes | memoryview = b"",
) -> None:
    """Encodes (checking it) and writes one frame, then drains the writer.

    The binary tail is written as is, without a copy into the frame.

    Raises:
        WireError: as :func:`encode`; nothing is written then.
        ConnectionClosed: the connection was lost.
    """
    head, tail = _encode_parts(msg_type, body, binary)
    try:
        writer.write(head)
        if len(tail):
            writer.write(tail)
        await writer.drain()
    except ConnectionError as e:
        raise ConnectionClosed(f"connection lost: {e}") from e


# --------------------------------------------------------------------------- segments


def segments_to_bytes(segments: npt.NDArray[Any]) -> bytes:
    """Encodes a segments table for a ``PULL``/``PUSH`` tail.

    Args:
        segments: an ``(n, 5)`` array of non-negative integers, rows
            ``(src_tensor, src_off, dst_tensor, dst_off, nbytes)``.

    Returns:
        ``n * 40`` bytes: little-endian uint64, row after row.

    Raises:
        WireError: wrong shape or dtype, a negative value, or over :data:`MAX_SEGMENTS` rows.
    """
    import numpy as np

    arr = np.asarray(segments)
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise WireError(f"segments must have shape (n, 5), got {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise WireError(f"segments must be integers, got dtype {arr.dtype}")
    if arr.shape[0] > MAX_SEGMENTS:
        raise WireError(f"{arr.shape[0]} segments exceed {MAX_SEGMENTS}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise WireError("segments must not be negative")
    return np.ascontiguousarray(arr, dtype="<u8").tobytes()


def segments_from_bytes(data: bytes | memoryview) -> npt.NDArray[np.uint64]:
    """Decodes a ``PULL``/``PUSH`` segments tail.

    Only the format is checked here; the serving side still checks every
    segment against the memory it registered.

    Args:
        data: a multiple of 40 bytes, at most :data:`MAX_SEGMENTS` rows.

    Returns:
        A read-only ``(n, 5)`` uint64 array (a view of ``data`` on little-endian hosts).

    Raises:
        WireError: a length that is not a whole number of rows, or too many rows.
    """
    import numpy as np

    nbytes = memoryview(data).nbytes
    if nbytes % SEGMENT_ROW_BYTES:
        raise WireError(f"segments of {nbytes} bytes are not a multiple of {SEGMENT_ROW_BYTES}")
    n = nbytes // SEGMENT_ROW_BYTES
    if n > MAX_SEGMENTS:
        raise WireError(f"{n} segments exceed {MAX_SEGMENTS}")
    arr = np.frombuffer(data, dtype="<u8").reshape(n, 5)
    return arr.astype(np.uint64, copy=False)


# --------------------------------------------------------------------------- authentication

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
