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

This module is the frame format and the one import for the rest of the package:
the constants, message types and errors (``_wire_protocol``), the schemas
(``_wire_schema``) and the authentication (``_wire_auth``) live in their own
modules and are re-exported here.

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
import json
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ._wire_auth import check_auth, client_mac, new_nonce, server_mac, verify_mac
from ._wire_protocol import (
    AUTH_FAILED_REASON,
    AUTH_FAILED_STATUS,
    DATA_PATHS,
    MAX_BINARY,
    MAX_DEADLINE_MS,
    MAX_JSON,
    MAX_SEGMENTS,
    MAX_SMALL_JSON,
    MAX_STREAMS,
    MAX_TABLE_ENTRIES,
    MAX_TEXT,
    PROTOCOL_VERSION,
    SEGMENT_ROW_BYTES,
    ConnectionClosed,
    MsgType,
    VersionMismatch,
    WireError,
)
from ._wire_schema import SCHEMAS, Field, check_body, check_cache_description

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

MAGIC = b"ADDW"
HEADER = struct.Struct("!4sBBHII")
HEADER_SIZE = HEADER.size  # 16
KNOWN_FLAGS = 0
"""Header flag bits this version understands (none yet); any other bit is refused."""

_BIG_TYPES = frozenset({MsgType.WELCOME, MsgType.TABLE})
_BINARY_TYPES = frozenset({MsgType.PULL, MsgType.PUSH})


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
        if len(tail):
            # One send for both (a PULL's segments): two would wake the peer twice.
            writer.writelines((head, tail))
        else:
            writer.write(head)
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
