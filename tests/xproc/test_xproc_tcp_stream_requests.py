"""tcp stream requests on the wire: a hand-driven requester against a prompt process.

A tiny pull is asked on a data stream (``tcp_requests``) and answered on it: the stream
header of the request's tag and the bytes, or a refusal after which the stream is still
in step. The serving side checks every request against what it registered, whatever the
requester sends: outside the cache, an unknown cache, a stale generation or too many
bytes are refused (nothing else is sent); a stream that carries something that is not a
request is retired (closed), never answered.
"""

from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest

from aiodatadist import LLMStatusCode, _native
from aiodatadist.transports.tcp_requests import encode_request
from aiodatadist.transports.tcp_streams import LOOP_MAX_BYTES
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import Harness, RawClient, recv_exact, recv_payload

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]  # a peer process

PROMPT, RAW = 71, 73
SEED = 23
S = LLMStatusCode


def _segments(rows: list[tuple[int, int, int, int, int]]) -> bytes:
    return np.array(rows, dtype="<u8").reshape(-1, 5).tobytes()


async def _ask(
    sock: socket.socket, tag: int, cache: int, rows: list[tuple[int, ...]], **kw: object
) -> None:
    geometry = kw.pop("geometry", (4, 8, xc.SPECS["reg"].unit))
    gen = kw.pop("gen", None)
    frame = encode_request(tag, cache, gen, geometry, 2000, _segments(rows))  # type: ignore[arg-type]
    await asyncio.get_running_loop().sock_sendall(sock, frame)


async def _refusal(sock: socket.socket, tag: int) -> dict[str, object]:
    head = await recv_exact(sock, _native.SOCK_HEADER_BYTES)
    assert head[:8] == _native.SOCK_REFUSAL_MAGIC, head
    assert int.from_bytes(head[8:16], "little") == tag, head
    body = await recv_exact(sock, int.from_bytes(head[16:24], "little"))
    got: dict[str, object] = json.loads(body)
    return got


async def _closed(sock: socket.socket) -> bool:
    """The peer closed ``sock`` (within a bound), having sent nothing more on it."""
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1), 5) == b""
    except ConnectionError:
        return True


async def test_requests_are_checked_refusals_keep_the_stream_and_junk_retires_it() -> None:
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, data_path="tcp", seed=SEED)
        reg = prompt.cache_id("reg")
        unit = xc.SPECS["reg"].unit
        ref = xc.reference(SEED, "reg")
        async with RawClient(prompt.host, prompt.port) as raw:
            await raw.handshake(RAW)
            s = await raw.open_stream(0, epoch=1)
            await _ask(s, 1, reg, [(1, 2 * unit, 0, 0, unit)])
            assert await recv_payload(s, 1, unit) == ref[1, 2 * unit : 3 * unit].tobytes()
            # Outside the cache: refused, and nothing else comes on the stream.
            await _ask(s, 2, reg, [(0, 8 * unit, 0, 0, unit)])
            r = await _refusal(s, 2)
            assert r["status"] != S.LLM_SUCCESS and r["stale"] is False, r
            assert "outside" in str(r["info"]), r
            # A cache it does not have (or no longer has, for this generation): stale.
            await _ask(s, 3, reg + 1000, [(0, 0, 0, 0, unit)])
            r = await _refusal(s, 3)
            assert (r["status"], r["stale"]) == (S.LLM_KV_CACHE_NOT_EXIST, True), r
            await _ask(s, 4, reg, [(0, 0, 0, 0, unit)], gen=(1 << 62) + 5)
            r = await _refusal(s, 4)
            assert (r["status"], r["stale"]) == (S.LLM_KV_CACHE_NOT_EXIST, True), r
            # More than a stream request may move (the same tensor read again and again).
            tensor = 8 * unit
            rows = [(i % 4, 0, 0, i * tensor, tensor) for i in range(LOOP_MAX_BYTES // tensor + 1)]
            await _ask(s, 5, reg, rows, geometry=(1, 64, tensor))
            r = await _refusal(s, 5)
            assert r["status"] == S.LLM_PARAM_INVALID, r
            # After every refusal the stream is in step: the next request is served on it.
            await _ask(s, 6, reg, [(3, 7 * unit, 0, 0, unit)])
            assert await recv_payload(s, 6, unit) == ref[3, 7 * unit : 8 * unit].tobytes()
            # Something that is not a request: the stream is retired, nothing answered.
            await asyncio.get_running_loop().sock_sendall(s, b"aNOTAREQUEST" * 8)
            assert await _closed(s)
            got = (await prompt.ok("serve_stats", cluster_id=RAW))["stats"]
            assert (got["served"], got["failed"]) == (2, 4), got
