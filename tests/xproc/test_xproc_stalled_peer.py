"""A peer that completes the handshake and then stops reading its control connection.

Sending a request whose segment table is larger than the socket buffers then blocks in
``drain()``; the pull must still end at its deadline with ``LLMTimeoutError``, and the
decoder must stay usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    DataType,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    LLMTimeoutError,
    _wire,
)
from aiodatadist._control import host_identity
from aiodatadist.testing import cluster_info, make_blocks_cache

STALLED = 41
BLOCKS, BLOCK_BYTES = 100_000, 64  # 2 tensors x 100k scattered blocks: ~8 MB of segments


def _remote_table() -> list[dict[str, Any]]:
    return [
        {
            "cache_id": 1,
            "num_tensors": 2,
            "num_blocks": BLOCKS,
            "block_bytes": BLOCK_BYTES,
            "is_blocks": True,
            "addrs": [0x7F00_0000_0000, 0x7F10_0000_0000],
            "data_type": 4,
            "placement": 0,
            "shape": [BLOCKS, BLOCK_BYTES],
            "model_id": 0,
            "row_keys": [],
            "shm_name": None,
            "shm_size": 0,
            "shm_offsets": [],
        }
    ]


async def _stalled_server(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stop: asyncio.Event
) -> None:
    msg = await _wire.read_message(reader, timeout=5)
    if msg.type == _wire.MsgType.DATA_HELLO:  # a data stream: acknowledge it, then idle
        writer.write(b"\x01")
        await writer.drain()
        await stop.wait()
        writer.close()
        return
    await _wire.write_message(writer, _wire.MsgType.CHALLENGE, {
        "cluster_id": STALLED, "nonce": _wire.new_nonce(), "auth_required": False,
    })  # fmt: skip
    await _wire.read_message(reader, timeout=5)  # AUTH
    await _wire.write_message(writer, _wire.MsgType.WELCOME, {
        # Another host as far as the client can tell: it uses the tcp path.
        "cluster_id": STALLED, "host_id": host_identity() + "-elsewhere", "pid": os.getpid(),
        "role": int(LLMRole.PROMPT), "table": _remote_table(), "data_paths": ["tcp"],
        "link_token": "ab" * 16, "mac": None,
    })  # fmt: skip
    await _wire.read_message(reader, timeout=5)  # the client's TABLE
    await stop.wait()  # ... and never read again
    writer.close()


@pytest.mark.asyncio
async def test_pull_to_a_peer_that_stopped_reading_ends_at_its_deadline() -> None:
    stop = asyncio.Event()
    server = await asyncio.start_server(lambda r, w: _stalled_server(r, w, stop), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    dd = LLMDataDist(LLMRole.DECODER, 42)
    await dd.init({"aiodatadist.TcpStreams": "1"})
    try:
        status, _ = await dd.link_clusters([cluster_info(STALLED, "127.0.0.1", port)])
        assert status == LLMStatusCode.LLM_SUCCESS
        dst = make_blocks_cache(dd, num_tensors=2, num_blocks=BLOCKS, block_shape=(BLOCK_BYTES,),
                                data_type=DataType.DT_UINT8)  # fmt: skip
        ids = list(range(0, BLOCKS, 2))  # every other block: nothing merges
        loop = asyncio.get_running_loop()
        for _ in range(2):  # the second one also finds the control socket still clogged
            t0 = loop.time()
            with pytest.raises(LLMTimeoutError):
                await dd.cache_manager.pull_blocks(
                    BlocksCacheKey(STALLED, 0), dst.cache, ids, ids, timeout=0.3
                )
            assert loop.time() - t0 < 2.0  # generous: the deadline was honoured
        assert not np.any(dst.tensors[0][1::2])  # untouched blocks stay untouched
    finally:
        # Every step bounded, and the server closed whatever finalize does: a server
        # left open made uvloop's close() hang the whole run (see tests/conftest.py).
        stop.set()
        try:
            await asyncio.wait_for(dd.finalize(), 10)
        finally:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)
