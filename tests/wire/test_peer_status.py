"""Statuses a peer sends (``REFUSE.status``, ``DONE.status``) are only the peer's word.

A fake link server, driven frame by frame, answers the real client (``link_clusters``,
``pull_blocks`` over tcp) with statuses a real server never sends, or that say why it
would not serve: the client must map every one to an :class:`LLMException` with a
status of the upstream table (unknown -> ``LLM_FAILED``), never report success for a
refused link, and report the peer's reason rather than its own abort of the receiver.
A tiny pull is refused on its data stream (a stream request's refusal), a bigger one
with a DONE on the control connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from aiodatadist import _wire as w
from aiodatadist.testing import cluster_info, make_blocks_cache
from aiodatadist.transports.tcp_requests import decode_request, encode_refusal
from aiodatadist.transports.tcp_streams import LOOP_MAX_BYTES

S = LLMStatusCode
SERVER, CLIENT = 71, 72
NUM_BLOCKS, BLOCK_BYTES = 128, 4096


def _description() -> dict[str, Any]:
    return {
        "cache_id": 5,
        "num_tensors": 2,
        "num_blocks": NUM_BLOCKS,
        "block_bytes": BLOCK_BYTES,
        "is_blocks": True,
        "addrs": [1 << 40, 2 << 40],
        "data_type": 1,
        "placement": 0,
        "shape": [NUM_BLOCKS, 16, 2, 64],
        "model_id": 0,
        "row_keys": [],
        "shm_name": None,
        "shm_size": 0,
        "shm_offsets": [],
    }


class FakeServer:
    """Answers HELLO with ``refuse`` (a REFUSE status) or completes the handshake, acks
    data streams, and answers every PULL with DONE ``done_status`` (every stream request
    with a refusal of that status)."""

    def __init__(self, *, refuse: int | None = None, done_status: int = 0) -> None:
        self.refuse = refuse
        self.done_status = done_status
        self.token = "ab" * 16
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        with contextlib.suppress(w.WireError, OSError, TimeoutError):
            msg = await w.read_message(reader, timeout=5)
            if msg.type == w.MsgType.DATA_HELLO:
                writer.write(b"\x01")
                await writer.drain()
                buf = b""
                while chunk := await reader.read(1 << 16):
                    buf += chunk
                    got = decode_request(buf)
                    if got is not None:
                        buf = buf[got[1] :]
                        writer.write(encode_refusal(got[0].tag, self.done_status, "fake", False))
                        await writer.drain()
                return
            if self.refuse is not None:
                body = {"status": self.refuse, "reason": "no"}
                await w.write_message(writer, w.MsgType.REFUSE, body)
                return
            await w.write_message(
                writer,
                w.MsgType.CHALLENGE,
                {"cluster_id": SERVER, "nonce": "cd" * 32, "auth_required": False},
            )
            await w.read_message(reader, timeout=5, accept=(w.MsgType.AUTH,))
            await w.write_message(
                writer,
                w.MsgType.WELCOME,
                {
                    "cluster_id": SERVER,
                    "host_id": "fake-host",
                    "pid": 1,
                    "role": int(LLMRole.PROMPT),
                    "table": [_description()],
                    "data_paths": ["tcp"],
                    "link_token": self.token,
                    "mac": None,
                },
            )
            while True:
                msg = await w.read_message(reader, timeout=None)
                if msg.type == w.MsgType.PULL:
                    body = {"req": msg.body["req"], "status": self.done_status, "info": "fake"}
                    await w.write_message(writer, w.MsgType.DONE, body)
                elif msg.type == w.MsgType.UNLINK:
                    writer.close()  # as a real server answers an unlink (else: 1 s bound)
                    return

    async def close(self) -> None:
        for wr in self.writers:
            wr.close()


@contextlib.asynccontextmanager
async def serving(fake: FakeServer) -> AsyncIterator[int]:
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await fake.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


@contextlib.asynccontextmanager
async def client() -> AsyncIterator[LLMDataDist]:
    dd = LLMDataDist(LLMRole.DECODER, CLIENT)
    await dd.init({"aiodatadist.DataPath": "tcp"})
    try:
        yield dd
    finally:
        await asyncio.wait_for(dd.finalize(), 10)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("refused_with", "expected"),
    [
        (0, S.LLM_LINK_FAILED),  # "refused, all is well": still no link
        (12345, S.LLM_FAILED),  # not a status of the table
        (int(S.LLM_ALREADY_LINK), S.LLM_ALREADY_LINK),
    ],
)
async def test_refuse_status_from_the_server(refused_with: int, expected: S) -> None:
    fake = FakeServer(refuse=refused_with)
    async with serving(fake) as port, client() as dd:
        status, statuses = await asyncio.wait_for(
            dd.link_clusters([cluster_info(SERVER, "127.0.0.1", port)], 3000), 10
        )
        assert list(statuses) == [expected]
        assert status != S.LLM_SUCCESS
        assert dd.links == []


@pytest.mark.asyncio
@pytest.mark.parametrize("blocks", [2, 64])  # a stream request; one over LOOP_MAX_BYTES
@pytest.mark.parametrize(
    ("done_status", "expected"),
    [
        (int(S.LLM_KV_CACHE_NOT_EXIST), S.LLM_KV_CACHE_NOT_EXIST),
        (int(S.LLM_PARAM_INVALID), S.LLM_PARAM_INVALID),
        (12345, S.LLM_FAILED),
    ],
)
async def test_done_status_from_the_server(done_status: int, expected: S, blocks: int) -> None:
    """The server refuses the pull (DONE with a failure) and sends no byte: the pull fails
    at once with the server's status, not with the receiver's abort (LLM_TIMEOUT)."""
    fake = FakeServer(done_status=done_status)
    async with serving(fake) as port, client() as dd:
        status, _ = await dd.link_clusters([cluster_info(SERVER, "127.0.0.1", port)], 3000)
        assert status == S.LLM_SUCCESS
        filled = make_blocks_cache(dd, num_tensors=2, num_blocks=NUM_BLOCKS)  # 4 KiB blocks
        assert (blocks * 2 * BLOCK_BYTES > LOOP_MAX_BYTES) == (blocks == 64)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(LLMException) as ei:
            await asyncio.wait_for(
                dd.cache_manager.pull_blocks(
                    BlocksCacheKey(SERVER, 0),
                    filled.cache,
                    list(range(blocks)),
                    list(range(blocks, 2 * blocks)),
                    timeout=5,
                ),
                10,
            )
        assert ei.value.status_code == expected, ei.value
        assert loop.time() - started < 2.5
        assert not any(np.any(t) for t in filled.tensors)
