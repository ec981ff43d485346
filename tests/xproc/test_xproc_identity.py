"""The one-sided paths act on the process and segments a peer names: a peer may only name
itself. A pid that does not hold the peer's end of the connection gets tcp only, and a
shared-memory segment that is not the peer's is refused before it is mapped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from typing import Any

import pytest

from aiodatadist import (
    BlocksCacheKey,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    _native,
    _wire,
)
from aiodatadist._control import host_identity
from aiodatadist.config import DataPath
from aiodatadist.testing import cluster_info, make_blocks_cache

FAKE = 51
TENSOR = 4 * 4096


def _table(shm_name: str | None) -> list[dict[str, Any]]:
    return [
        {
            "cache_id": 1, "num_tensors": 1, "num_blocks": 4, "block_bytes": 4096,
            "is_blocks": True, "addrs": [1 << 40], "data_type": 4, "placement": 0,
            "shape": [4, 4096], "model_id": 0, "row_keys": [],
            "shm_name": shm_name, "shm_size": TENSOR if shm_name else 0,
            "shm_offsets": [0] if shm_name else [],
        }
    ]  # fmt: skip


async def _fake_prompt(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    pid: int,
    shm_name: str | None,
    stop: asyncio.Event,
) -> None:
    msg = await _wire.read_message(reader, timeout=5)
    if msg.type == _wire.MsgType.DATA_HELLO:
        writer.write(b"\x01")
        await writer.drain()
        await stop.wait()
        writer.close()
        return
    await _wire.write_message(writer, _wire.MsgType.CHALLENGE, {
        "cluster_id": FAKE, "nonce": _wire.new_nonce(), "auth_required": False,
    })  # fmt: skip
    await _wire.read_message(reader, timeout=5)
    await _wire.write_message(writer, _wire.MsgType.WELCOME, {
        "cluster_id": FAKE, "host_id": host_identity(), "pid": pid,
        "role": int(LLMRole.PROMPT), "table": _table(shm_name),
        "data_paths": ["shm", "cma", "tcp"], "link_token": "cd" * 16, "mac": None,
    })  # fmt: skip
    await _wire.read_message(reader, timeout=5)
    await stop.wait()
    writer.close()


async def _link_fake(pid: int, shm_name: str | None, data_path: str) -> tuple[Any, ...]:
    stop = asyncio.Event()
    server = await asyncio.start_server(
        lambda r, w: _fake_prompt(r, w, pid, shm_name, stop), "127.0.0.1", 0
    )
    dd = LLMDataDist(LLMRole.DECODER, 52)
    await dd.init({"aiodatadist.DataPath": data_path, "aiodatadist.TcpStreams": "1"})
    port = server.sockets[0].getsockname()[1]
    status, _ = await dd.link_clusters([cluster_info(FAKE, "127.0.0.1", port)])
    assert status == LLMStatusCode.LLM_SUCCESS
    return dd, server, stop


async def _close(dd: LLMDataDist, server: asyncio.Server, stop: asyncio.Event) -> None:
    stop.set()
    await dd.finalize()
    server.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(server.wait_closed(), 2)


@pytest.mark.asyncio
async def test_a_peer_claiming_another_pid_gets_tcp_only() -> None:
    victim = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(30)"
    )
    try:
        dd, server, stop = await _link_fake(victim.pid, None, "auto")
        try:
            link = dd.links[0]
            assert link.path.cma is None and link.path.shm is None
            remote = link.path.remote_table.blocks(0)
            assert link.path.path_for(remote).kinds == (DataPath.TCP,)
        finally:
            await _close(dd, server, stop)
    finally:
        victim.kill()
        await asyncio.wait_for(victim.wait(), 5)


def _mappings_of(label: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(f"/memfd:{label} " in line for line in f)


@pytest.mark.asyncio
async def test_a_segment_that_is_not_the_peers_is_refused() -> None:
    # The fake prompt runs in this process, so its pid (ours) is verified; the segment it
    # names belongs to a "process" 1, though. Segments are mapped only from fds the peer
    # sends over its fd channel, under a lease: a peer that merely names one (no lease,
    # no fd channel) gets nothing mapped, and a forced shm pull is refused.
    other = _native.ShmSegment.create(f"/aiodd-1-{os.getpid()}-not-yours", TENSOR)
    try:
        dd, server, stop = await _link_fake(os.getpid(), other.name, "shm")
        try:
            assert dd.links[0].path.shm is not None  # same host, pid verified
            dst = make_blocks_cache(dd, num_tensors=1, num_blocks=4, block_shape=(4096,),
                                    data_type=DataType.DT_UINT8)  # fmt: skip
            with pytest.raises(LLMException) as info:
                await dd.cache_manager.pull_blocks(
                    BlocksCacheKey(FAKE, 0), dst.cache, [0], [0], timeout=2
                )
            assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
            assert "no lease" in str(info.value)
            assert _mappings_of(other.name) == 1  # only its creator's mapping
        finally:
            await _close(dd, server, stop)
    finally:
        other.close()
