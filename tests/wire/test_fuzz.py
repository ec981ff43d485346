"""Hostile input: truncation, random bytes, bit flips, mutated bodies.

Decoding may succeed or raise WireError (ConnectionClosed on a stream); any other
exception is a bug.  Deterministic: every generator is ``random.Random(seed)``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
from typing import Any

import pytest

from aiodatadist import _wire as w
from aiodatadist._wire import MsgType, WireError
from tests.wire.test_wire import feed, raw_frame, sample_frames, samples

SEED = 20260530


def _decode_or_wire_error(data: bytes) -> w.Message | None:
    try:
        msg = w.decode(data)
    except WireError:
        return None
    # Whatever decodes must be something we would send, and decode the same again.
    again = w.decode(w.encode(msg.type, msg.body, msg.binary))
    assert again == msg
    return msg


async def _read_all_or_wire_error(data: bytes) -> list[w.Message]:
    reader = feed(data)
    out = []
    while True:
        try:
            out.append(await w.read_message(reader, timeout=5))
        except WireError:
            return out


# --------------------------------------------------------------------------- truncation


def test_truncated_at_every_offset_sync() -> None:
    for frame in sample_frames():
        for cut in range(len(frame)):
            with pytest.raises(WireError):
                w.decode(frame[:cut])


@pytest.mark.asyncio
async def test_truncated_at_every_offset_stream() -> None:
    for frame in sample_frames():
        for cut in range(len(frame)):
            with pytest.raises(w.ConnectionClosed) as info:
                await w.read_message(feed(frame[:cut]), timeout=5)
            assert info.value.clean == (cut == 0)
        assert await w.read_message(feed(frame), timeout=5) == w.decode(frame)


# --------------------------------------------------------------------------- random bytes


def test_random_bytes() -> None:
    rng = random.Random(SEED)
    for _ in range(3000):
        data = rng.randbytes(rng.randrange(0, 300))
        assert _decode_or_wire_error(data) is None


def test_random_bodies_behind_valid_headers() -> None:
    """Random types, flags and lengths behind the right magic, to get past the first check."""
    rng = random.Random(SEED + 1)
    decoded = 0
    for _ in range(3000):
        t = rng.choice([rng.randrange(256), *map(int, MsgType)])
        flags = 0 if rng.random() < 0.9 else rng.randrange(1 << 16)
        body = rng.randbytes(rng.randrange(0, 64))
        binary = rng.randbytes(rng.choice([0, 0, 40, 80, rng.randrange(100)]))
        jlen = len(body) if rng.random() < 0.9 else rng.randrange(1 << 32)
        head = w.HEADER.pack(w.MAGIC, w.PROTOCOL_VERSION, t, flags, jlen, len(binary))
        decoded += _decode_or_wire_error(head + body + binary) is not None
    assert decoded == 0  # random bytes are never a valid JSON object of the right shape


def test_random_json_values() -> None:
    """Random JSON documents of every type, in frames of every message type."""
    rng = random.Random(SEED + 2)
    for _ in range(2000):
        t = rng.choice(list(MsgType))
        doc = json.dumps(_random_json(rng, 3)).encode()
        binary = bytes(40) if t in (MsgType.PULL, MsgType.PUSH) and rng.random() < 0.5 else b""
        _decode_or_wire_error(raw_frame(t, json_bytes=doc, binary=binary))


def _random_json(rng: random.Random, depth: int) -> Any:
    keys = ["t", "mac", "req", "epoch", "table", "version", "nonce", "cluster_id", "x", ""]
    kind = rng.randrange(9 if depth > 0 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice(
            [0, 1, -1, 2**31, 2**63, 2**64 - 1, 2**64, -(2**70), rng.randrange(-9, 9)]
        )
    if kind == 3:
        return rng.choice([0.0, -0.5, 1e308, 1.5, 2.0**70])
    if kind == 4:
        return rng.choice(["", "ab" * 32, "x" * 300, "\u00e9", "/dev/shm/x", "AB" * 16])
    if kind == 5:
        return "".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(8)))
    if kind == 6:
        return rng.choice(keys)
    if kind == 7:
        return [_random_json(rng, depth - 1) for _ in range(rng.randrange(5))]
    return {rng.choice(keys): _random_json(rng, depth - 1) for _ in range(rng.randrange(5))}


# --------------------------------------------------------------------------- bit flips


def test_bit_flipped_frames() -> None:
    rng = random.Random(SEED + 3)
    frames = sample_frames()
    survived = 0
    for _ in range(4000):
        frame = bytearray(rng.choice(frames))
        for _ in range(rng.choice([1, 1, 2, 3, 8])):
            pos = rng.randrange(len(frame))
            frame[pos] ^= 1 << rng.randrange(8)
        survived += _decode_or_wire_error(bytes(frame)) is not None
    # Some flips land in a value that stays valid (a hex digit, a segment), most do not.
    assert 0 < survived < 4000


def test_byte_insertions_and_deletions() -> None:
    rng = random.Random(SEED + 4)
    frames = sample_frames()
    for _ in range(2000):
        frame = bytearray(rng.choice(frames))
        pos = rng.randrange(len(frame))
        if rng.random() < 0.5:
            del frame[pos : pos + rng.randrange(1, 4)]
        else:
            frame[pos:pos] = rng.randbytes(rng.randrange(1, 4))
        _decode_or_wire_error(bytes(frame))


@pytest.mark.asyncio
async def test_bit_flipped_streams() -> None:
    """Several frames on one stream, corrupted: the reader stops at the first bad one."""
    rng = random.Random(SEED + 5)
    frames = sample_frames()
    for _ in range(300):
        stream = bytearray(b"".join(rng.sample(frames, 4)))
        for _ in range(rng.randrange(1, 4)):
            pos = rng.randrange(len(stream))
            stream[pos] ^= 1 << rng.randrange(8)
        got = await _read_all_or_wire_error(bytes(stream))
        assert len(got) <= 4


# --------------------------------------------------------------------------- mutated bodies

HOSTILE_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31 - 1,
    2**31,
    2**63,
    2**64 - 1,
    2**64,
    -(2**64),
    1.0,
    -0.0,
    1e300,
    "",
    "0",
    "ab" * 32,
    "AB" * 32,
    "x" * 1000,
    "/aiodd-1",
    "/..",
    [],
    [1],
    [1, 2, 3],
    [[1, 2, 3]],
    [-1, 0, 1],
    {},
    {"a": 1},
    [{}],
    ["shm"],
    ["shm", "shm"],
]


def _mutate(rng: random.Random, body: Any) -> None:
    """Replaces, deletes or adds one value somewhere inside ``body`` (in place)."""
    node = body
    while True:
        if isinstance(node, dict) and node:
            key = rng.choice(list(node))
            child = node[key]
            if isinstance(child, (dict, list)) and child and rng.random() < 0.6:
                node = child
                continue
            op = rng.randrange(3)
            if op == 0:
                node[key] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
            elif op == 1:
                del node[key]
            else:
                node[rng.choice(["x", key + "_", "addrs", "mac"])] = rng.choice(HOSTILE_VALUES)
            return
        if isinstance(node, list) and node:
            i = rng.randrange(len(node))
            child = node[i]
            if isinstance(child, (dict, list)) and child and rng.random() < 0.6:
                node = child
                continue
            op = rng.randrange(3)
            if op == 0:
                node[i] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
            elif op == 1:
                del node[i]
            else:
                node.append(copy.deepcopy(rng.choice(HOSTILE_VALUES)))
            return
        return


def test_mutated_bodies_encode_and_decode() -> None:
    """Mutated bodies: encode refuses with WireError or the peer decodes the same thing."""
    rng = random.Random(SEED + 6)
    base = samples()
    refused = 0
    for _ in range(3000):
        t = rng.choice(list(MsgType))
        body, binary = copy.deepcopy(base[t])
        for _ in range(rng.randrange(1, 3)):
            _mutate(rng, body)
        try:
            frame = w.encode(t, body, binary)
        except WireError:
            refused += 1
            # The peer refuses exactly what the sender refuses.
            with pytest.raises(WireError):
                w.decode(raw_frame(t, body, binary))
            continue
        assert w.decode(frame) == w.Message(t, json.loads(json.dumps(body)), binary)
    assert refused > 2000


def test_mutated_cache_descriptions() -> None:
    rng = random.Random(SEED + 7)
    table = samples()[MsgType.WELCOME][0]["table"]
    for _ in range(3000):
        d = copy.deepcopy(rng.choice(table))
        _mutate(rng, d)
        try:
            w.check_cache_description(d)
        except WireError:
            continue
        # Accepted ones are internally consistent.
        assert len(d["addrs"]) == d["num_tensors"]
        assert all(a > 0 for a in d["addrs"])


def test_segments_from_random_bytes() -> None:
    rng = random.Random(SEED + 8)
    for _ in range(500):
        data = rng.randbytes(rng.randrange(0, 200))
        try:
            arr = w.segments_from_bytes(data)
        except WireError:
            assert len(data) % 40
            continue
        assert arr.shape == (len(data) // 40, 5)


@pytest.mark.asyncio
async def test_stream_of_random_garbage_terminates() -> None:
    """A reader fed random bytes always ends with WireError, never hangs or raises else."""
    rng = random.Random(SEED + 9)
    for _ in range(300):
        data = rng.randbytes(rng.randrange(0, 100))
        if rng.random() < 0.5:
            data = w.MAGIC + bytes([w.PROTOCOL_VERSION]) + data
        got = await asyncio.wait_for(_read_all_or_wire_error(data), 5)
        assert got == []
