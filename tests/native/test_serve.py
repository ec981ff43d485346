"""``ServeBook`` / ``StreamServer``: the native serving of tcp stream requests, on its own.

A socket pair stands in for a request stream: this side asks (``encode_request``), the
server's thread answers from memory recorded in the book, under the lease words of the
book. Exact bytes (a pattern unique to each request), refusals that keep the stream in
step, a revoked lease refused, junk shut down, and the thread joined by ``stop``. (This
file runs under ASan and UBSan in CI, with the rest of ``tests/native``.)
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiodatadist import _native as n
from aiodatadist.errors import NATIVE_STATUS_TABLE, LLMStatusCode
from aiodatadist.transports.tcp_requests import encode_request
from tests._procs import named_threads
from tests.native._helpers import bases, pattern

NT, NB, BB = 2, 8, 4096  # 2 tensors x 8 blocks x 4 KiB
NOT_EXIST = int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
CODES = [int(NATIVE_STATUS_TABLE.get(int(s), LLMStatusCode.LLM_FAILED)) for s in n.Status]
TIMEOUT_S = 5.0


@pytest.fixture
def served() -> Iterator[tuple[n.ServeBook, n.StreamServer, socket.socket, np.ndarray]]:
    src = pattern(NT, NB * BB, seed=0x5E7E)
    book = n.ServeBook(16)
    book.put(7, 3, 11, n.Geometry(NT, NB, BB), bases(src), False)
    n.lease_publish(book.slot_addr(3), 11)
    server = n.StreamServer(book, 2.0, 256 * 1024, CODES, NOT_EXIST)
    ours, theirs = socket.socketpair()
    ours.settimeout(TIMEOUT_S)
    server.serve(os.dup(theirs.fileno()))
    theirs.close()
    try:
        yield book, server, ours, src
    finally:
        server.stop()
        ours.close()


def _ask(sock: socket.socket, tag: int, cache: int, gen: int | None, rows: list[Any]) -> None:
    segs = np.array(rows, dtype="<u8").reshape(-1, 5).tobytes()
    sock.sendall(encode_request(tag, cache, gen, (NT, NB, BB), 2000, segs))


def _recv(sock: socket.socket, size: int) -> bytes:
    out = b""
    while len(out) < size:
        got = sock.recv(size - len(out))
        assert got, "the server closed the stream"
        out += got
    return out


def _answer(sock: socket.socket, tag: int) -> tuple[bytes, Any]:
    """(the payload, None) or (b"", the refusal's body)."""
    head = _recv(sock, n.SOCK_HEADER_BYTES)
    assert int.from_bytes(head[8:16], "little") == tag, head
    size = int.from_bytes(head[16:24], "little")
    body = _recv(sock, size)
    if head[:8] == n.SOCK_REFUSAL_MAGIC:
        return b"", json.loads(body)
    assert head == n.sock_header(tag, size), head
    return body, None


def test_requests_are_answered_from_the_book_or_refused(served: Any) -> None:
    book, server, sock, src = served
    flat = src.view(np.uint8).reshape(NT, NB * BB)
    _ask(sock, 1, 7, 11, [(1, 5 * BB, 0, 0, BB), (0, 2 * BB, 1, BB, BB)])
    body, refusal = _answer(sock, 1)
    assert refusal is None
    assert body == flat[1, 5 * BB : 6 * BB].tobytes() + flat[0, 2 * BB : 3 * BB].tobytes()
    _ask(sock, 2, 7, 12, [(0, 0, 0, 0, BB)])  # another generation: stale
    assert _answer(sock, 2)[1] == {"status": NOT_EXIST, "info": _answer_info(2), "stale": True}
    _ask(sock, 3, 99, None, [(0, 0, 0, 0, BB)])  # no such cache: stale
    r = _answer(sock, 3)[1]
    assert r is not None and (r["status"], r["stale"]) == (NOT_EXIST, True), r
    _ask(sock, 4, 7, None, [(0, NB * BB, 0, 0, BB)])  # outside the cache
    r = _answer(sock, 4)[1]
    assert r is not None and r["stale"] is False and "outside" in r["info"], r
    assert r["status"] == CODES[int(n.Status.OUT_OF_RANGE)], r
    # The owner revokes the lease (a free in progress): refused, nothing read.
    assert n.lease_revoke(book.slot_addr(3), 0.0)
    _ask(sock, 5, 7, 11, [(0, 0, 0, 0, BB)])
    r = _answer(sock, 5)[1]
    assert r is not None and (r["status"], r["stale"]) == (NOT_EXIST, True), r
    n.lease_publish(book.slot_addr(3), 11)
    _ask(sock, 6, 7, None, [(1, 7 * BB, 0, 0, BB)])  # still in step: served
    assert _answer(sock, 6) == (flat[1, 7 * BB :].tobytes(), None)
    # (an answer is counted once its last byte is sent: maybe just after we have it all)
    end = time.monotonic() + TIMEOUT_S
    while server.served < 2 and time.monotonic() < end:
        time.sleep(0.001)
    assert (server.served, server.failed) == (2, 4)
    book.remove(7)
    assert 7 not in book and len(book) == 0


def _answer_info(tag: int) -> str:
    del tag
    return "cache 7 was re-bound since the requester's table (generation 12, now 11)"


def test_junk_shuts_the_stream_down_and_stop_joins(served: Any) -> None:
    _, server, sock, _ = served
    sock.sendall(b"x" * 100)  # not a request
    assert sock.recv(1) == b""  # shut down, nothing answered
    running = _serving_threads()
    server.stop()
    server.stop()  # (idempotent)
    assert _serving_threads() == running - 1  # its thread is gone


def _serving_threads() -> int:
    return named_threads("aiodd-serve")
