"""The control plane's message schemas: every field of every message, checked strictly.

:data:`SCHEMAS` maps each :class:`~aiodatadist._wire_protocol.MsgType` to its
fields; :func:`check_body` applies it to a decoded JSON body, and
:func:`check_cache_description` checks one entry of a cache table. Unknown,
missing or mistyped fields (``true`` is not an int), out-of-range integers and
malformed hex are refused with a :class:`~aiodatadist._wire_protocol.WireError`
naming the field. Re-exported by :mod:`aiodatadist._wire`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

from ._wire_protocol import (
    DATA_PATHS,
    MAX_DEADLINE_MS,
    MAX_ENGINE_METADATA,
    MAX_HOST_ID,
    MAX_SHAPE_DIMS,
    MAX_STREAMS,
    MAX_TABLE_ENTRIES,
    MAX_TENSORS,
    MAX_TEXT,
    PROTOCOL_VERSION,
    MsgType,
    VersionMismatch,
    WireError,
)

__all__ = ["SCHEMAS", "Field", "Validator", "check_body", "check_cache_description"]

_U64 = 2**64
_U32 = 2**32
_I31 = 2**31 - 1
_MAC_HEX = 64
_SHM_NAME = re.compile(r"/[A-Za-z0-9._-]{1,200}")
_HEX = re.compile(r"(?:[0-9a-f]{2})+")


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


_SEGMENT = re.compile(r"[A-Za-z0-9.:\[\]_-]{1,300}:[0-9]{1,5}")


def _engines(value: Any, where: str) -> None:
    # Only the engines this side runs, each with its own fixed keys.
    for name, info in value.items():
        schema = _ENGINE_SCHEMAS.get(name)
        if schema is None:
            raise WireError(f"{where}: unknown engine {name!r:.40}")
        _check_object(info, schema, f"{where}.{name}")


def _segment(value: Any, where: str) -> None:
    if _SEGMENT.fullmatch(value) is None or not 0 < int(value.rpartition(":")[2]) < 65536:
        raise WireError(f"{where}: {value!r:.80} is not a 'host:port' segment")


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

_ENGINE_NAME = Field(_STR, check=_text(MAX_HOST_ID, 1))
_ENGINE_SCHEMAS: Mapping[str, Mapping[str, Field]] = {
    "nixl": {"name": _ENGINE_NAME, "md": Field(_STR, check=_hex(2, MAX_ENGINE_METADATA))},
    "mooncake": {"segment": Field(_STR, check=_segment)},
}
# The engines a side runs and what a peer needs to reach them (absent: none).
_ENGINES = Field((dict,), required=False, check=_engines)

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
        "engines": _ENGINES,
    },
    MsgType.REFUSE: {"status": _STATUS, "reason": _INFO},
    MsgType.TABLE: {
        "version": Field(_INT, check=_u64),
        "table": Field(_LIST, check=_table),
        "engines": _ENGINES,
    },
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
        "stream": Field(_INT, check=_range(0, MAX_STREAMS + 1)),  # (+ the request streams)
        "epoch": _EPOCH,
    },
    MsgType.ERROR: {"status": _STATUS, "info": _INFO},
    MsgType.CANCEL: {"req": Field(_INT, check=_u64), "epoch": _EPOCH},
    # Leases over the control plane for engine transfers between hosts (_engine_lease).
    MsgType.LEASE: {
        "req": Field(_INT, check=_u64),
        "cache_id": Field(_INT, check=_u64),
        "gen": _GEN,
        "write": Field(_BOOL, required=False),
    },
    MsgType.LEASED: {
        "req": Field(_INT, check=_u64),
        "status": _STATUS,
        "info": _INFO,
        "stale": Field(_BOOL, required=False),
    },
    MsgType.UNLEASE: {"req": Field(_INT, check=_u64)},
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
    # The CUDA device of a cache registered from device tensors; null/absent: host memory.
    "device_id": Field((int, type(None)), required=False, check=_range(0, _I31)),
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
