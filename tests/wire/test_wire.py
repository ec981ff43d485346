"""The control-plane wire format: frames, limits, schemas, streams, segments."""

from __future__ import annotations

import asyncio
import copy
import json
import struct
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiodatadist import _wire as w
from aiodatadist._wire import MsgType, WireError
from aiodatadist._wire_schema import _DESCRIPTION

NONCE = "ab" * 32
MAC = "cd" * 32
TOKEN = "ef" * 16


def registered_cache(cache_id: int = 7) -> dict[str, Any]:
    """A user-registered blocks cache, as ``CacheEntry.describe()`` gives it."""
    return {
        "cache_id": cache_id,
        "num_tensors": 4,
        "num_blocks": 16,
        "block_bytes": 4096,
        "is_blocks": True,
        "addrs": [0x7F00_0000_0000 + t * 0x10_0000 for t in range(4)],
        "data_type": 1,
        "placement": 0,
        "shape": [16, 16, 2, 64],
        "model_id": 0,
        "row_keys": [],
        "shm_name": None,
        "shm_size": 0,
        "shm_offsets": [],
    }


def shm_cache(cache_id: int = 8) -> dict[str, Any]:
    """An allocated non-block cache in a shared-memory segment, with two keyed rows."""
    stride = 8 * 1024
    return {
        "cache_id": cache_id,
        "num_tensors": 2,
        "num_blocks": 4,
        "block_bytes": 2048,
        "is_blocks": False,
        "addrs": [0x7E00_0000_0000, 0x7E00_0000_0000 + stride],
        "data_type": 27,
        "placement": 0,
        "shape": [4, 1024],
        "model_id": None,
        "row_keys": [[11, 0, 0], [2**64 - 2, 3, 3]],
        "shm_name": "/aiodd-123-9-1",
        "shm_size": 2 * stride,
        "shm_offsets": [0, stride],
    }


V = w.PROTOCOL_VERSION


def sample_segments() -> np.ndarray:
    return np.array([[0, 0, 0, 4096, 4096], [1, 8192, 1, 0, 4096], [3, 0, 3, 0, 65536]], np.uint64)


def samples() -> dict[MsgType, tuple[dict[str, Any], bytes]]:
    """One valid (body, binary) per message type."""
    geometry = [4, 16, 4096]
    segs = w.segments_to_bytes(sample_segments())
    return {
        MsgType.HELLO: (
            {
                "version": w.PROTOCOL_VERSION,
                "cluster_id": 2**64 - 1,
                "host_id": "host-a/boot-id",
                "pid": 4242,
                "role": 2,
                "nonce": NONCE,
                "want_auth": True,
            },
            b"",
        ),
        MsgType.CHALLENGE: ({"cluster_id": 0, "nonce": NONCE, "auth_required": True}, b""),
        MsgType.AUTH: ({"mac": MAC}, b""),
        MsgType.WELCOME: (
            {
                "cluster_id": 1,
                "host_id": "host-b",
                "pid": 1,
                "role": 1,
                "table": [registered_cache(), shm_cache()],
                "data_paths": ["shm", "cma", "tcp"],
                "link_token": TOKEN,
                "mac": MAC,
            },
            b"",
        ),
        MsgType.REFUSE: ({"status": w.AUTH_FAILED_STATUS, "reason": w.AUTH_FAILED_REASON}, b""),
        MsgType.TABLE: (
            {
                "version": 3,
                "table": [shm_cache()],
                "engines": {
                    "nixl": {"name": "aiodd-1-2-0a0b0c0d", "md": "00ff"},
                    "mooncake": {"segment": "10.0.0.1:15000"},
                },
            },
            b"",
        ),
        MsgType.PULL: (
            {
                "req": 9,
                "cache_id": 7,
                "dst_geometry": geometry,
                "deadline_ms": 1000,
                "streams": 4,
                "epoch": 3,
            },
            segs,
        ),
        MsgType.PUSH: (
            {
                "req": 10,
                "cache_id": 7,
                "src_geometry": geometry,
                "deadline_ms": 1,
                "streams": 16,
                "epoch": 2**64 - 1,
            },
            segs,
        ),
        MsgType.DONE: ({"req": 9, "status": 0, "info": ""}, b""),
        MsgType.UNLINK: ({"cluster_id": 5}, b""),
        MsgType.PING: ({"t": 12345}, b""),
        MsgType.PONG: ({"t": 1.5}, b""),
        MsgType.DATA_HELLO: ({"link_token": TOKEN, "stream": 15, "epoch": 1}, b""),
        MsgType.ERROR: ({"status": 0xFFFFFFFF, "info": "naïve ünïcödé ✓"}, b""),
        MsgType.CANCEL: ({"req": 9, "epoch": 3}, b""),
        MsgType.LEASE: ({"req": 11, "cache_id": 7, "gen": 4}, b""),
        MsgType.LEASED: ({"req": 11, "status": 0, "info": "", "stale": False}, b""),
        MsgType.UNLEASE: ({"req": 11}, b""),
    }


def sample_frames() -> list[bytes]:
    return [w.encode(t, body, binary) for t, (body, binary) in samples().items()]


def raw_frame(
    msg_type: int,
    body: Any = None,
    binary: bytes = b"",
    *,
    json_bytes: bytes | None = None,
    version: int = w.PROTOCOL_VERSION,
    flags: int = 0,
    magic: bytes = w.MAGIC,
) -> bytes:
    """A frame built without any check (what a hostile or buggy peer could send)."""
    if json_bytes is None:
        json_bytes = json.dumps(body).encode()
    header = w.HEADER.pack(magic, version, msg_type, flags, len(json_bytes), len(binary))
    return header + json_bytes + binary


def feed(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


# --------------------------------------------------------------------------- round trips


def test_samples_cover_every_type() -> None:
    assert set(samples()) == set(MsgType)
    assert set(w.SCHEMAS) == set(MsgType)
    assert [int(t) for t in MsgType] == list(range(1, 19))


@pytest.mark.parametrize("msg_type", list(MsgType), ids=lambda t: t.name)
def test_round_trip(msg_type: MsgType) -> None:
    body, binary = samples()[msg_type]
    frame = w.encode(msg_type, body, binary)
    header = w.decode_header(frame[: w.HEADER_SIZE])
    assert header == w.Header(
        w.PROTOCOL_VERSION, msg_type, 0, len(frame) - 16 - len(binary), len(binary)
    )
    msg = w.decode(frame)
    assert msg == w.Message(msg_type, body, binary)
    assert msg.type is msg_type
    split = w.decode_body(header, frame[16 : 16 + header.json_len], frame[16 + header.json_len :])
    assert split == msg
    # Encoding is deterministic and canonical.
    assert w.encode(msg.type, msg.body, msg.binary) == frame


def test_header_layout() -> None:
    frame = w.encode(MsgType.PING, {"t": 1})
    assert w.HEADER_SIZE == 16
    assert frame[:4] == b"ADDW"
    magic, version, t, flags, jlen, blen = struct.unpack("!4sBBHII", frame[:16])
    assert (magic, version, t, flags, blen) == (b"ADDW", V, 11, 0, 0)
    assert frame[16:] == b'{"t":1}' and jlen == 7


def test_encode_accepts_int_type_and_intenum_values() -> None:
    from aiodatadist.errors import LLMStatusCode

    frame = w.encode(5, {"status": LLMStatusCode.LLM_LINK_FAILED, "reason": "x"})
    msg = w.decode(frame)
    assert msg.type is MsgType.REFUSE
    assert msg.body["status"] == 0x5010B009 == w.AUTH_FAILED_STATUS


def test_encode_binary_memoryview_of_uint64_array() -> None:
    segs = sample_segments()
    body, _ = samples()[MsgType.PULL]
    frame = w.encode(MsgType.PULL, body, segs.data)
    msg = w.decode(frame)
    assert msg.binary == segs.astype("<u8").tobytes()
    assert np.array_equal(w.segments_from_bytes(msg.binary), segs)


def test_encode_refuses_non_json_and_unknown_type() -> None:
    with pytest.raises(WireError, match="cannot be encoded"):
        w.encode(MsgType.PING, {"t": object()})
    with pytest.raises(WireError, match="cannot be encoded"):
        w.encode(MsgType.PING, {"t": float("nan")})
    with pytest.raises(WireError, match="unknown message type"):
        w.encode(99, {"t": 1})
    with pytest.raises(WireError, match="unknown message type"):
        w.encode(0, {"t": 1})


def test_expect() -> None:
    msg = w.decode(w.encode(MsgType.PING, {"t": 1}))
    assert w.expect(msg, MsgType.PING, MsgType.PONG) is msg
    with pytest.raises(WireError, match="expected HELLO or DATA_HELLO, got PING"):
        w.expect(msg, MsgType.HELLO, MsgType.DATA_HELLO)


def test_challenge_cannot_reveal_memory() -> None:
    """Before authentication the server has no field to leak a table, pid or address in."""
    body, _ = samples()[MsgType.CHALLENGE]
    for extra in ({"table": [registered_cache()]}, {"pid": 1}, {"addrs": [1]}, {"host_id": "h"}):
        with pytest.raises(WireError, match="unknown field"):
            w.encode(MsgType.CHALLENGE, {**body, **extra})
    assert set(w.SCHEMAS[MsgType.CHALLENGE]) == {"cluster_id", "nonce", "auth_required"}
    assert set(w.SCHEMAS[MsgType.AUTH]) == {"mac"}


# --------------------------------------------------------------------------- schema rejections

Mutation = Callable[[dict[str, Any]], None]


def _set(key: str, value: Any) -> Mutation:
    def mutate(body: dict[str, Any]) -> None:
        body[key] = value

    return mutate


def _del(key: str) -> Mutation:
    def mutate(body: dict[str, Any]) -> None:
        del body[key]

    return mutate


def _table0(key: str, value: Any) -> Mutation:
    def mutate(body: dict[str, Any]) -> None:
        body["table"][0][key] = value

    return mutate


def _table0_del(key: str) -> Mutation:
    def mutate(body: dict[str, Any]) -> None:
        del body["table"][0][key]

    return mutate


REJECTIONS: list[tuple[str, MsgType, Mutation, str]] = [
    # missing / unknown
    ("missing", MsgType.HELLO, _del("nonce"), "missing field 'nonce'"),
    ("missing-mac", MsgType.WELCOME, _del("mac"), "missing field 'mac'"),
    ("missing-epoch", MsgType.DATA_HELLO, _del("epoch"), "missing field 'epoch'"),
    ("pull-missing-epoch", MsgType.PULL, _del("epoch"), "missing field 'epoch'"),
    ("unknown", MsgType.HELLO, _set("extra", 1), "unknown field 'extra'"),
    ("unknown-auth", MsgType.AUTH, _set("user", "x"), "unknown field 'user'"),
    ("unknown-ping", MsgType.PING, _set("x", 1), "unknown field 'x'"),
    # wrong types
    ("str-for-int", MsgType.HELLO, _set("cluster_id", "1"), "HELLO.cluster_id: expected int"),
    ("float-for-int", MsgType.PULL, _set("req", 1.0), "expected int, got float"),
    ("null-for-int", MsgType.DONE, _set("status", None), "expected int, got null"),
    ("int-for-str", MsgType.REFUSE, _set("reason", 5), "expected str, got int"),
    ("int-for-bool", MsgType.HELLO, _set("want_auth", 1), "expected bool, got int"),
    ("list-for-str", MsgType.AUTH, _set("mac", [MAC]), "expected str, got list"),
    ("dict-for-list", MsgType.TABLE, _set("table", {}), "expected list, got dict"),
    ("str-for-time", MsgType.PING, _set("t", "1"), "expected int or float"),
    # bool where int is expected
    ("bool-for-int", MsgType.HELLO, _set("pid", True), "expected int, got bool"),
    ("bool-for-u64", MsgType.UNLINK, _set("cluster_id", False), "expected int, got bool"),
    ("bool-for-time", MsgType.PING, _set("t", True), "expected int or float, got bool"),
    ("bool-in-geometry", MsgType.PULL, _set("dst_geometry", [1, True, 1]), "got bool"),
    # negative
    ("negative-cluster", MsgType.HELLO, _set("cluster_id", -1), "out of range"),
    ("negative-req", MsgType.DONE, _set("req", -5), "out of range"),
    ("negative-status", MsgType.ERROR, _set("status", -1), "out of range"),
    ("zero-pid", MsgType.HELLO, _set("pid", 0), "out of range"),
    ("zero-geometry", MsgType.PUSH, _set("src_geometry", [1, 0, 1]), "out of range"),
    ("zero-deadline", MsgType.PULL, _set("deadline_ms", 0), "out of range"),
    # too large
    ("u64-overflow", MsgType.HELLO, _set("cluster_id", 2**64), "out of range"),
    ("req-overflow", MsgType.PULL, _set("req", 2**64), "out of range"),
    ("deadline-overflow", MsgType.PULL, _set("deadline_ms", 2**31), "out of range"),
    ("streams-17", MsgType.PULL, _set("streams", 17), "out of range"),
    ("streams-0", MsgType.PUSH, _set("streams", 0), "out of range"),
    ("stream-18", MsgType.DATA_HELLO, _set("stream", 18), "out of range"),
    ("epoch-negative", MsgType.DATA_HELLO, _set("epoch", -1), "out of range"),
    ("epoch-overflow", MsgType.PULL, _set("epoch", 2**64), "out of range"),
    ("epoch-bool", MsgType.PUSH, _set("epoch", True), "expected int, got bool"),
    ("cancel-req-negative", MsgType.CANCEL, _set("req", -1), "out of range"),
    ("cancel-epoch-str", MsgType.CANCEL, _set("epoch", "1"), "expected int"),
    ("table-engine-unknown", MsgType.TABLE, _set("engines", {"ucx": {}}), "unknown engine"),
    (
        "table-nixl-md-not-hex",
        MsgType.TABLE,
        _set("engines", {"nixl": {"name": "a", "md": "ZZ"}}),
        "not lowercase hex",
    ),
    (
        "table-nixl-extra-key",
        MsgType.TABLE,
        _set("engines", {"nixl": {"name": "a", "md": "00", "x": 1}}),
        "unknown field",
    ),
    (
        "welcome-mooncake-segment",
        MsgType.TABLE,
        _set("engines", {"mooncake": {"segment": "no port"}}),
        "not a 'host:port' segment",
    ),
    (
        "welcome-mooncake-port-range",
        MsgType.TABLE,
        _set("engines", {"mooncake": {"segment": "h:99999"}}),
        "not a 'host:port' segment",
    ),
    ("lease-gen-str", MsgType.LEASE, _set("gen", "1"), "expected int"),
    ("leased-no-info", MsgType.LEASED, lambda b: b.pop("info"), "missing field"),
    ("status-u32", MsgType.DONE, _set("status", 2**32), "out of range"),
    ("role-4", MsgType.HELLO, _set("role", 4), "not one of"),
    ("role-0", MsgType.WELCOME, _set("role", 0), "not one of"),
    ("version-255+", MsgType.TABLE, _set("version", 2**64), "out of range"),
    ("host-id-long", MsgType.HELLO, _set("host_id", "h" * 257), "257 characters"),
    ("host-id-empty", MsgType.HELLO, _set("host_id", ""), "0 characters"),
    ("reason-long", MsgType.REFUSE, _set("reason", "x" * (w.MAX_TEXT + 1)), "characters"),
    ("ping-int64", MsgType.PING, _set("t", 2**63), "int64"),
    ("geometry-2", MsgType.PULL, _set("dst_geometry", [1, 2]), "2 items, expected 3..3"),
    ("geometry-4", MsgType.PULL, _set("dst_geometry", [1, 2, 3, 4]), "4 items"),
    # bad hex
    ("nonce-short", MsgType.HELLO, _set("nonce", "ab" * 15), "30 characters"),
    ("nonce-long", MsgType.CHALLENGE, _set("nonce", "ab" * 65), "130 characters"),
    ("nonce-not-hex", MsgType.HELLO, _set("nonce", "zz" * 32), "not lowercase hex"),
    ("nonce-upper", MsgType.HELLO, _set("nonce", "AB" * 32), "not lowercase hex"),
    ("nonce-odd", MsgType.HELLO, _set("nonce", "a" * 33), "not lowercase hex"),
    ("mac-63", MsgType.AUTH, _set("mac", MAC[:63]), "63 characters"),
    ("mac-65", MsgType.AUTH, _set("mac", MAC + "0"), "65 characters"),
    ("mac-space", MsgType.AUTH, _set("mac", " " * 64), "not lowercase hex"),
    ("welcome-mac-empty", MsgType.WELCOME, _set("mac", ""), "0 characters"),
    ("welcome-mac-int", MsgType.WELCOME, _set("mac", 0), "expected str or null"),
    ("token-short", MsgType.DATA_HELLO, _set("link_token", "ab"), "2 characters"),
    ("token-hex", MsgType.WELCOME, _set("link_token", "g" * 32), "not lowercase hex"),
    # data paths
    ("path-unknown", MsgType.WELCOME, _set("data_paths", ["rdma"]), "unknown data path"),
    ("path-twice", MsgType.WELCOME, _set("data_paths", ["tcp", "tcp"]), "duplicate"),
    ("path-int", MsgType.WELCOME, _set("data_paths", [1]), "expected str"),
    # cache descriptions inside a table
    ("table-too-many", MsgType.TABLE, _set("table", [shm_cache()] * 4097), "at most 4096"),
    (
        "table-dup-id",
        MsgType.TABLE,
        _set("table", [shm_cache(), shm_cache()]),
        "duplicate cache_id",
    ),
    ("table-not-obj", MsgType.TABLE, _set("table", [1]), "expected a JSON object"),
    ("desc-missing", MsgType.WELCOME, _table0_del("addrs"), "table[0]: missing field 'addrs'"),
    ("desc-unknown", MsgType.WELCOME, _table0("local", True), "unknown field 'local'"),
    ("desc-addrs-count", MsgType.WELCOME, _table0("addrs", [1, 2, 3]), "3 addresses"),
    ("desc-addr-zero", MsgType.WELCOME, _table0("addrs", [1, 0, 2, 3]), "addrs[1]: 0 is out"),
    ("desc-addr-big", MsgType.WELCOME, _table0("addrs", [1, 2, 3, 2**64]), "out of range"),
    ("desc-addr-bool", MsgType.WELCOME, _table0("addrs", [1, 2, True, 3]), "got bool"),
    ("desc-addr-wrap", MsgType.WELCOME, _table0("addrs", [1, 2, 3, 2**64 - 10]), "overflows"),
    ("desc-tensors-0", MsgType.WELCOME, _table0("num_tensors", 0), "out of range"),
    ("desc-blocks-neg", MsgType.WELCOME, _table0("num_blocks", -16), "out of range"),
    ("desc-bb-float", MsgType.WELCOME, _table0("block_bytes", 4096.0), "got float"),
    ("desc-isb-int", MsgType.WELCOME, _table0("is_blocks", 1), "expected bool"),
    ("desc-placement", MsgType.WELCOME, _table0("placement", 2), "out of range"),
    ("desc-placement-missing", MsgType.WELCOME, _table0_del("placement"), "missing field"),
    ("desc-shape-0", MsgType.WELCOME, _table0("shape", [8, 16, 2, 64]), "shape[0]=8"),
    ("desc-shape-empty", MsgType.WELCOME, _table0("shape", []), "0 items"),
    ("desc-model-neg", MsgType.WELCOME, _table0("model_id", -1), "out of range"),
    ("desc-model-str", MsgType.WELCOME, _table0("model_id", "0"), "expected int or null"),
    ("desc-rowkey-2", MsgType.WELCOME, _table0("row_keys", [[1, 2]]), "key_id, model_id, row"),
    ("desc-rowkey-row", MsgType.WELCOME, _table0("row_keys", [[1, 2, 16]]), "row 16 >= num_blocks"),
    ("desc-rowkey-dup", MsgType.WELCOME, _table0("row_keys", [[1, 2, 0], [1, 2, 1]]), "duplicate"),
    ("desc-rowkey-neg", MsgType.WELCOME, _table0("row_keys", [[1, -2, 0]]), "out of range"),
    ("desc-shm-size", MsgType.WELCOME, _table0("shm_size", 5), "without shm_name"),
    ("desc-shm-offsets", MsgType.WELCOME, _table0("shm_offsets", [0]), "without shm_name"),
]

SHM_REJECTIONS: list[tuple[str, Any, Any, str]] = [
    ("name-no-slash", "shm_name", "aiodd-1", "not a valid shared-memory name"),
    ("name-dotdot-slash", "shm_name", "/../etc/passwd", "not a valid shared-memory name"),
    ("name-nul", "shm_name", "/a\x00b", "not a valid shared-memory name"),
    ("name-space", "shm_name", "/a b", "not a valid shared-memory name"),
    ("name-long", "shm_name", "/" + "a" * 201, "202 characters"),
    ("name-slash-only", "shm_name", "/", "1 characters"),
    ("name-int", "shm_name", 5, "expected str or null"),
    ("offsets-count", "shm_offsets", [0], "1 offsets for num_tensors=2"),
    ("offset-outside", "shm_offsets", [0, 16 * 1024], "outside the 16384-byte segment"),
    ("offset-neg", "shm_offsets", [0, -1], "out of range"),
    ("size-small", "shm_size", 100, "outside the 100-byte segment"),
    ("size-neg", "shm_size", -1, "out of range"),
]


@pytest.mark.parametrize(
    ("case", "msg_type", "mutate", "match"), REJECTIONS, ids=[r[0] for r in REJECTIONS]
)
def test_schema_rejection(case: str, msg_type: MsgType, mutate: Mutation, match: str) -> None:
    body, binary = copy.deepcopy(samples()[msg_type])
    mutate(body)
    # The sender refuses to send it ...
    with pytest.raises(WireError, match=_re(match)):
        w.encode(msg_type, body, binary)
    # ... and the receiver refuses it when a peer sends it anyway.
    with pytest.raises(WireError, match=_re(match)):
        w.decode(raw_frame(msg_type, body, binary))


@pytest.mark.parametrize(
    ("case", "key", "value", "match"), SHM_REJECTIONS, ids=[r[0] for r in SHM_REJECTIONS]
)
def test_cache_description_shm_rejection(case: str, key: str, value: Any, match: str) -> None:
    d = shm_cache()
    assert w.check_cache_description(d) is d
    d[key] = value
    with pytest.raises(WireError, match=_re(match)):
        w.check_cache_description(d)
    with pytest.raises(WireError, match=_re(match)):
        w.decode(raw_frame(MsgType.TABLE, {"version": 1, "table": [d]}))


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_cache_description_accepts_describe_output() -> None:
    """The exact dict CacheEntry.describe() produces passes, for both kinds of cache."""
    from aiodatadist._caches import CacheEntry

    entry = CacheEntry(
        cache_id=3,
        num_tensors=2,
        num_blocks=4,
        block_bytes=64,
        is_blocks=False,
        addrs=[0x1000, 0x2000],
        data_type=1,
        shape=(4, 32),
        model_id=None,
        row_keys={(5, 0): 1, (6, 0): 3},
        shm_name="/aiodd-1-2-3",
        shm_size=1024,
        shm_offsets=[0, 512],
    )
    d = entry.describe()
    assert set(d) == set(_DESCRIPTION)
    assert w.check_cache_description(d) is d
    back = CacheEntry.from_description(
        w.decode(w.encode(MsgType.TABLE, {"version": 1, "table": [d]})).body["table"][0]
    )
    assert back.describe() == d


def test_cache_description_not_a_dict() -> None:
    bad: Any
    for bad in (None, [], "x", 1):
        with pytest.raises(WireError, match="expected a JSON object"):
            w.check_cache_description(bad)


def test_check_body_types() -> None:
    with pytest.raises(WireError, match="PING: expected a JSON object, got list"):
        w.check_body(MsgType.PING, [1])
    body = {"t": 1}
    assert w.check_body(MsgType.PING, body) is body


def test_pull_may_carry_no_segments() -> None:
    body, _ = samples()[MsgType.PULL]
    assert w.decode(w.encode(MsgType.PULL, body)).binary == b""


# --------------------------------------------------------------------------- JSON-level rejections


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"t":"\xc3"}', "not UTF-8"),
        (b'{"t":1', "not valid JSON"),
        (b"[1,2]", "expected a JSON object, got list"),
        (b'"str"', "expected a JSON object, got str"),
        (b"null", "expected a JSON object, got null"),
        (b'{"t":NaN}', "NaN is not valid JSON"),
        (b'{"t":Infinity}', "Infinity is not valid JSON"),
        (b'{"t":-Infinity}', "-Infinity is not valid JSON"),
        (b'{"t":1e400}', "inf is not finite"),
        (b'{"t":1,"t":2}', "duplicate key 't'"),
        (b'{"t":1} x', "not valid JSON"),
        (b'{"t":1}{"t":2}', "not valid JSON"),
        (b'{"t":"\\ud800"}', "expected int or float"),
        (b'{"t":' + b"9" * 5000 + b"}", "not valid JSON"),
        (b'{"t":' + b"[" * 30000 + b"]" * 30000 + b"}", "not valid JSON"),
        (b"\xef\xbb\xbf" + b'{"t":1}', "not valid JSON"),
        (b"  ", "not valid JSON"),
    ],
)
def test_json_rejection(raw: bytes, match: str) -> None:
    with pytest.raises(WireError, match=_re(match)):
        w.decode(raw_frame(MsgType.PING, json_bytes=raw))


def test_lone_surrogate_in_string_rejected() -> None:
    frame = raw_frame(MsgType.ERROR, json_bytes=b'{"status":1,"info":"a\\udc80"}')
    with pytest.raises(WireError, match="lone surrogate"):
        w.decode(frame)
    with pytest.raises(WireError):
        w.encode(MsgType.ERROR, {"status": 1, "info": "a\udc80"})


def test_non_ascii_strings_round_trip() -> None:
    body = {"status": 1, "info": '\u00e9\u4e2d\U0001f600 \\ " \n'}
    assert w.decode(w.encode(MsgType.ERROR, body)).body == body


# --------------------------------------------------------------------------- header rejections


@pytest.mark.parametrize(
    ("header", "exc", "match"),
    [
        (w.HEADER.pack(b"ADDX", 1, 11, 0, 7, 0), WireError, "bad magic"),
        (w.HEADER.pack(b"GET ", 1, 11, 0, 7, 0), WireError, "bad magic"),
        (w.HEADER.pack(b"ADDW", 0, 11, 0, 7, 0), w.VersionMismatch, "peer speaks version 0"),
        (
            w.HEADER.pack(b"ADDW", V + 1, 11, 0, 7, 0),
            w.VersionMismatch,
            f"this side speaks version {V}",
        ),
        (w.HEADER.pack(b"ADDW", V, 0, 0, 7, 0), WireError, "unknown message type 0"),
        (w.HEADER.pack(b"ADDW", V, 19, 0, 7, 0), WireError, "unknown message type 19"),
        (w.HEADER.pack(b"ADDW", V, 255, 0, 7, 0), WireError, "unknown message type 255"),
        (w.HEADER.pack(b"ADDW", V, 11, 1, 7, 0), WireError, "unknown flag bits 0x0001"),
        (w.HEADER.pack(b"ADDW", V, 11, 0x8000, 7, 0), WireError, "unknown flag bits 0x8000"),
        (w.HEADER.pack(b"ADDW", V, 11, 0, 1, 0), WireError, "cannot be an object"),
        (w.HEADER.pack(b"ADDW", V, 11, 0, 0, 0), WireError, "cannot be an object"),
        (w.HEADER.pack(b"ADDW", V, 11, 0, w.MAX_SMALL_JSON + 1, 0), WireError, "exceeds 65536"),
        (w.HEADER.pack(b"ADDW", V, 1, 0, 2**32 - 1, 0), WireError, "exceeds"),
        (w.HEADER.pack(b"ADDW", V, 6, 0, w.MAX_JSON + 1, 0), WireError, f"exceeds {w.MAX_JSON}"),
        (w.HEADER.pack(b"ADDW", V, 4, 0, 2**30, 0), WireError, f"exceeds {w.MAX_JSON}"),
        (w.HEADER.pack(b"ADDW", V, 11, 0, 7, 40), WireError, "carries no binary tail"),
        (w.HEADER.pack(b"ADDW", V, 6, 0, 7, 1), WireError, "carries no binary tail"),
        (w.HEADER.pack(b"ADDW", V, 7, 0, 7, 41), WireError, "not a multiple of 40"),
        (w.HEADER.pack(b"ADDW", V, 8, 0, 7, 39), WireError, "not a multiple of 40"),
        (
            w.HEADER.pack(b"ADDW", V, 7, 0, 7, 40 * (w.MAX_SEGMENTS + 1)),
            WireError,
            "segments exceed",
        ),
        (w.HEADER.pack(b"ADDW", V, 7, 0, 7, w.MAX_BINARY + 40), WireError, "exceeds 67108864"),
        (w.HEADER.pack(b"ADDW", V, 7, 0, 7, 2**32 - 8), WireError, "exceeds 67108864"),
    ],
)
def test_header_rejection(header: bytes, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=_re(match)):
        w.decode_header(header)


def test_header_limits_are_inclusive() -> None:
    assert w.decode_header(w.HEADER.pack(b"ADDW", V, 6, 0, w.MAX_JSON, 0)).json_len == w.MAX_JSON
    assert (
        w.decode_header(w.HEADER.pack(b"ADDW", V, 4, 0, w.MAX_JSON, 0)).msg_type is MsgType.WELCOME
    )
    assert w.decode_header(w.HEADER.pack(b"ADDW", V, 11, 0, w.MAX_SMALL_JSON, 0)).flags == 0
    h = w.decode_header(w.HEADER.pack(b"ADDW", V, 7, 0, 2, 40 * w.MAX_SEGMENTS))
    assert h.bin_len == 40 * w.MAX_SEGMENTS <= w.MAX_BINARY


@pytest.mark.parametrize("size", [0, 1, 15, 17, 32])
def test_header_wrong_size(size: int) -> None:
    with pytest.raises(WireError, match="frame header is 16 bytes"):
        w.decode_header(b"ADDW" + bytes(size)[4:] if size >= 4 else bytes(size))


def test_version_mismatch_names_both_versions() -> None:
    body = dict(samples()[MsgType.HELLO][0], version=V + 1, new_field_of_next=[1, 2])
    with pytest.raises(w.VersionMismatch) as info:
        w.decode(raw_frame(MsgType.HELLO, body))
    assert f"version {V + 1}" in str(info.value) and f"version {V}" in str(info.value)
    assert (info.value.local, info.value.remote) == (V, V + 1)
    assert isinstance(info.value, WireError)
    with pytest.raises(w.VersionMismatch, match="peer speaks version 7"):
        w.decode(raw_frame(MsgType.HELLO, {"version": 7}))
    with pytest.raises(w.VersionMismatch, match="peer speaks version 1"):
        # The version before transfer identity (stream epochs, CANCEL): refused.
        w.decode(raw_frame(MsgType.HELLO, samples()[MsgType.HELLO][0], version=1))
    with pytest.raises(w.VersionMismatch):
        w.encode(MsgType.HELLO, body)


def test_decode_length_mismatches() -> None:
    frame = w.encode(MsgType.PING, {"t": 1})
    header = w.decode_header(frame[:16])
    with pytest.raises(WireError, match="header says 7"):
        w.decode_body(header, frame[16:-1])
    with pytest.raises(WireError, match="binary tail of 1 bytes, header says 0"):
        w.decode_body(header, frame[16:], b"x")
    with pytest.raises(WireError, match="header says 23"):
        w.decode(frame + b"\x00")
    with pytest.raises(WireError, match="header says 23"):
        w.decode(frame[:-1])
    with pytest.raises(WireError, match="truncated frame"):
        w.decode(frame[:10])


# --------------------------------------------------------------------------- segments


def test_segments_round_trip() -> None:
    segs = sample_segments()
    data = w.segments_to_bytes(segs)
    assert len(data) == 3 * w.SEGMENT_ROW_BYTES
    assert data[:8] == (0).to_bytes(8, "little") and data[24:32] == (4096).to_bytes(8, "little")
    back = w.segments_from_bytes(data)
    assert back.dtype == np.uint64 and back.shape == (3, 5)
    assert np.array_equal(back, segs)
    big = np.array([[2**64 - 1] * 5], dtype=np.uint64)
    assert np.array_equal(w.segments_from_bytes(w.segments_to_bytes(big)), big)
    assert w.segments_from_bytes(b"").shape == (0, 5)
    assert w.segments_to_bytes(np.zeros((0, 5), np.uint64)) == b""
    # Other integer dtypes, non-contiguous input, big-endian input.
    assert w.segments_to_bytes(segs.astype(np.int64)) == data
    assert w.segments_to_bytes(segs.astype(">u8")) == data
    assert w.segments_to_bytes(np.asfortranarray(segs)) == data
    assert w.segments_from_bytes(memoryview(data)).shape == (3, 5)


@pytest.mark.parametrize(
    ("arr", "match"),
    [
        (np.zeros((3, 4), np.uint64), r"shape \(n, 5\)"),
        (np.zeros(5, np.uint64), r"shape \(n, 5\)"),
        (np.zeros((1, 5, 1), np.uint64), r"shape \(n, 5\)"),
        (np.zeros((2, 5), np.float64), "must be integers"),
        (np.zeros((2, 5), bool), "must be integers"),
        (np.array([[0, 0, 0, 0, -1]], np.int64), "negative"),
    ],
)
def test_segments_to_bytes_rejects(arr: np.ndarray, match: str) -> None:
    with pytest.raises(WireError, match=match):
        w.segments_to_bytes(arr)


def test_segments_limits() -> None:
    with pytest.raises(WireError, match="not a multiple of 40"):
        w.segments_from_bytes(bytes(41))
    too_many = bytes(40 * (w.MAX_SEGMENTS + 1))
    with pytest.raises(WireError, match="segments exceed"):
        w.segments_from_bytes(too_many)
    with pytest.raises(WireError, match="segments exceed"):
        w.segments_to_bytes(np.zeros((w.MAX_SEGMENTS + 1, 5), np.uint64))
    body, _ = samples()[MsgType.PULL]
    with pytest.raises(WireError, match="segments exceed"):
        w.encode(MsgType.PULL, body, too_many)
    with pytest.raises(WireError, match="not a multiple of 40"):
        w.encode(MsgType.PULL, body, b"x" * 39)
    with pytest.raises(WireError, match="carries no binary tail"):
        w.encode(MsgType.DONE, {"req": 1, "status": 0, "info": ""}, b"x" * 40)


# --------------------------------------------------------------------------- streams


@pytest.mark.asyncio
async def test_read_message_sequence_and_clean_eof() -> None:
    frames = sample_frames()
    reader = feed(b"".join(frames))
    got = [await w.read_message(reader, timeout=5) for _ in frames]
    assert [m.type for m in got] == list(MsgType)
    assert [(m.body, m.binary) for m in got] == list(samples().values())
    with pytest.raises(w.ConnectionClosed) as info:
        await w.read_message(reader, timeout=5)
    assert info.value.clean


@pytest.mark.asyncio
async def test_read_message_eof_inside_frame() -> None:
    frame = w.encode(MsgType.PING, {"t": 1})
    for cut, where in (
        (5, "inside a frame header"),
        (16, "inside a PING frame"),
        (len(frame) - 1, "6 of 7 bytes"),
    ):
        with pytest.raises(w.ConnectionClosed, match=where) as info:
            await w.read_message(feed(frame[:cut]), timeout=5)
        assert not info.value.clean


@pytest.mark.asyncio
async def test_read_message_timeout() -> None:
    reader = feed(w.encode(MsgType.PING, {"t": 1})[:20], eof=False)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"within 0\.05 s"):
        await w.read_message(reader, timeout=0.05)
    assert time.monotonic() - t0 < 5
    with pytest.raises(TimeoutError):
        await w.read_message(feed(b"", eof=False), timeout=0.01)


@pytest.mark.asyncio
async def test_read_message_no_timeout() -> None:
    msg = await w.read_message(feed(w.encode(MsgType.PING, {"t": 1})), timeout=None)
    assert msg.body == {"t": 1}


@pytest.mark.asyncio
async def test_read_message_reset_is_connection_closed() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(b"ADDW")
    reader.set_exception(ConnectionResetError("reset by peer"))
    with pytest.raises(w.ConnectionClosed, match="reset by peer"):
        await w.read_message(reader, timeout=5)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "header",
    [
        w.HEADER.pack(b"ADDW", V, MsgType.TABLE, 0, 2**30, 0),  # 1 GiB of JSON
        w.HEADER.pack(b"ADDW", V, MsgType.PULL, 0, 2, 2**30),  # 1 GiB of segments
        w.HEADER.pack(b"ADDW", V, MsgType.HELLO, 0, 2**32 - 1, 0),
        w.HEADER.pack(b"ADDW", V, MsgType.PING, 0, 2, 2**32 - 1),
    ],
    ids=["json-1GiB", "segments-1GiB", "hello-4GiB", "ping-binary"],
)
async def test_limits_checked_from_header_before_body(header: bytes) -> None:
    """A header claiming a huge body is refused at once: nothing read, nothing allocated."""
    reader = feed(header, eof=False)  # no body, no EOF: reading the body would hang
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(WireError, match=r"exceeds|no binary tail") as info:
            await w.read_message(reader, timeout=5)
        elapsed = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not isinstance(info.value, w.ConnectionClosed)
    assert elapsed < 1.0
    assert peak < 1 << 20


@pytest.mark.asyncio
async def test_accept_refuses_from_the_header() -> None:
    """An unexpected type is refused before its (legal, 4 MiB) body is read."""
    header = w.HEADER.pack(b"ADDW", V, MsgType.WELCOME, 0, w.MAX_JSON, 0)
    reader = feed(header, eof=False)
    with pytest.raises(WireError, match="expected HELLO or DATA_HELLO, got WELCOME"):
        await w.read_message(reader, timeout=5, accept=(MsgType.HELLO, MsgType.DATA_HELLO))
    ok = feed(w.encode(MsgType.PING, {"t": 2}))
    assert (await w.read_message(ok, timeout=5, accept={MsgType.PING})).body == {"t": 2}


@pytest.mark.asyncio
async def test_write_message_over_a_socket() -> None:
    received: asyncio.Queue[w.Message] = asyncio.Queue()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(len(MsgType)):
                await received.put(await w.read_message(reader, timeout=5))
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for t, (body, binary) in samples().items():
            tail = sample_segments().data if binary else b""
            await w.write_message(writer, t, body, tail)
        for t, (body, binary) in samples().items():
            msg = await asyncio.wait_for(received.get(), 5)
            assert (msg.type, msg.body, msg.binary) == (t, body, binary)
        with pytest.raises(WireError, match="unknown field"):
            await w.write_message(writer, MsgType.PING, {"t": 1, "u": 2})
    finally:
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_big_table_and_segments_over_a_stream() -> None:
    """Frames near the limits decode, and a 1-million-row segments table round-trips."""
    entries = []
    for i in range(600):
        d = registered_cache(i)
        d.update(num_tensors=64, addrs=[0x7F00_0000_0000 + t * 2**30 for t in range(64)])
        entries.append(d)
    table = w.encode(MsgType.TABLE, {"version": 1, "table": entries})
    assert 200_000 < len(table) < w.MAX_JSON
    segs = np.arange(w.MAX_SEGMENTS * 5, dtype=np.uint64).reshape(-1, 5)
    body, _ = samples()[MsgType.PULL]
    pull = w.encode(MsgType.PULL, body, w.segments_to_bytes(segs))
    reader = feed(table + pull)
    assert len((await w.read_message(reader, timeout=10)).body["table"]) == 600
    msg = await w.read_message(reader, timeout=10)
    assert np.array_equal(w.segments_from_bytes(msg.binary), segs)
