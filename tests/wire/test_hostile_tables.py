"""Hostile peers: a forged cache table, and idle connections to the port.

A peer's cache table cannot make our one-sided copies leave the memory we mapped.

A hostile owner lists a second cache in a segment we already mapped, claiming the
segment is far larger than the fd it sent: every offset passes the wire check against
that claimed size, and a copy through the mapping we hold would run past its end (a
SIGSEGV, or a copy into whatever else this process has mapped there). The table is
applied exactly as a TABLE message from the peer would be (schema-checked); the pull
must fail with LLM_PARAM_INVALID and the process must live.

The attack runs in a child process: before the fix it died with SIGSEGV, which would
have taken the whole test run with it.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
    _control,
    _wire,
)
from aiodatadist.testing import cluster_info

_ATTACK = r"""
import asyncio, sys
import numpy as np
from aiodatadist import BlocksCacheKey, CacheDesc, DataType, LLMException, Placement
from aiodatadist.testing import inproc_pair

async def main():
    async with inproc_pair(data_path="shm") as p:
        desc = CacheDesc(1, [4, 1024], DataType.DT_INT8, Placement.HOST)
        src = p.prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        src.tensors()[0].view(np.uint8)[...] = 0x5A
        arrays = [np.full((4, 1024), 0x11, np.int8)]
        dst = p.decoder.cache_manager.register_blocks_cache(desc, arrays)
        cm = p.decoder.cache_manager
        await cm.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0], timeout=5)
        assert (arrays[0][0].view(np.uint8) == 0x5A).all()
        link = p.decoder._rt.links.find(1)
        real = [e.describe() for e in link.path.remote_table]
        forged = dict(real[0])
        big = 1 << 40
        forged.update(
            cache_id=forged["cache_id"] + 1000, model_id=9, shm_size=big,
            shm_offsets=[big - 4 * 1024],
        )
        link.path.peer._apply_table({"table": real + [forged]})
        before = arrays[0].copy()
        try:
            await cm.pull_blocks(BlocksCacheKey(1, 9), dst, [0], [0], timeout=5)
        except LLMException as e:
            print("refused", int(e.status_code))
        else:
            print("success")
        assert (arrays[0] == before).all()
        # The link still works for the honest entry.
        await cm.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [1], timeout=5)
        assert (arrays[0][1].view(np.uint8) == 0x5A).all()
        print("alive")

if sys.argv[1] == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.slow  # a child process per event loop
def test_a_table_cannot_stretch_a_mapped_segment(loop: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _ATTACK, loop], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert proc.stdout.split() == [
        "refused",
        str(int(LLMStatusCode.LLM_PARAM_INVALID)),
        "alive",
    ], proc.stdout


# ------------------------------------------------------------------ idle connections


CAP = 48
"""The silent-connection cap for these tests: the real one is a 16th of the fd limit (up to
1024), more connections than a test should open (and than the accept backlog holds)."""


@pytest.fixture
def small_cap(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(_control, "MAX_HANDSHAKES", CAP)
    return CAP


@pytest.mark.asyncio
async def test_idle_connections_to_the_port_are_bounded(small_cap: int) -> None:
    """Anyone who reaches the port can open connections and say nothing (no secret is
    needed for that): at most MAX_HANDSHAKES silent ones are held at once, the oldest are
    closed as newer ones come, so the prompt's fds are not used up; a decoder still links and
    pulls, with the idle connections still open."""
    prompt = LLMDataDist(LLMRole.PROMPT, 941)
    decoder = LLMDataDist(LLMRole.DECODER, 942)
    await prompt.init({"llm.listenIpInfo": "127.0.0.1:0"})
    await decoder.init({"aiodatadist.DataPath": "tcp"})
    idle: list[socket.socket] = []
    loop = asyncio.get_running_loop()
    try:
        desc = CacheDesc(1, [2, 4096], DataType.DT_INT8, Placement.HOST)
        keep = [np.full((2, 4096), 0x2B, np.int8)]
        prompt.cache_manager.register_blocks_cache(desc, keep, BlocksCacheKey(941, 0))
        host, port = prompt.listen_address or ("", 0)
        n = small_cap * 3
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, (host, port))
            idle.append(s)
        server = prompt._server
        assert server is not None
        oldest = idle[: n - small_cap]
        ended: set[int] = set()
        end = loop.time() + 10
        while len(ended) < len(oldest):
            assert loop.time() < end, f"{len(oldest) - len(ended)} idle connections still open"
            assert len(server._unwelcomed) <= small_cap
            for i, s in enumerate(oldest):
                if i not in ended:
                    try:
                        if s.recv(16) == b"":
                            ended.add(i)
                    except BlockingIOError:
                        pass
                    except ConnectionError:  # closed with a reset
                        ended.add(i)
            await asyncio.sleep(0.01)
        status, _ = await decoder.link_clusters([cluster_info(941, host, port)], 5000)
        assert status == 0
        arrays = [np.zeros((2, 4096), np.int8)]
        dst = decoder.cache_manager.register_blocks_cache(desc, arrays)
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(941, 0), dst, [1], [0], timeout=5)
        assert (arrays[0][0].view(np.uint8) == 0x2B).all()
        assert len(server._unwelcomed) <= small_cap
    finally:
        for s in idle:
            s.close()
        await decoder.finalize()
        await prompt.finalize()


@pytest.mark.asyncio
async def test_a_peer_that_spoke_is_not_evicted_by_a_flood_behind_it(small_cap: int) -> None:
    """A flood of silent connections lands right behind an honest client's HELLO, all
    accepted before any handshake runs: past MAX_HANDSHAKES the server closes silent ones,
    never the client whose first message is already here (it gets its CHALLENGE)."""
    prompt = LLMDataDist(LLMRole.PROMPT, 943)
    await prompt.init({"llm.listenIpInfo": "127.0.0.1:0"})
    flood: list[socket.socket] = []
    honest = socket.socket()
    try:
        host, port = prompt.listen_address or ("", 0)
        # Blocking connects, no await in between: the kernel completes them all (its accept
        # queue holds them) before the server's loop accepts the first.
        honest.connect((host, port))
        hello = {
            "version": _wire.PROTOCOL_VERSION, "cluster_id": 944, "host_id": "elsewhere",
            "pid": 1, "role": int(LLMRole.DECODER), "nonce": _wire.new_nonce(), "want_auth": False,
        }  # fmt: skip
        honest.sendall(_wire.encode(_wire.MsgType.HELLO, hello))
        for _ in range(small_cap + 16):  # under asyncio's default backlog of 100
            s = socket.socket()
            s.connect((host, port))
            flood.append(s)
        honest.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=honest)
        try:
            msg = await _wire.read_message(reader, timeout=5)
            assert msg.type == _wire.MsgType.CHALLENGE, msg
            server = prompt._server
            assert server is not None and len(server._unwelcomed) <= small_cap
        finally:
            writer.close()
    finally:
        for s in flood:
            s.close()
        await prompt.finalize()


# ------------------------------------------------------------------ fd channel floods

_FD_FLOOD = r"""
import asyncio, os, resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
from aiodatadist import _native
from aiodatadist._fdchannel import HELD_FDS_CAP, FdChannel

async def main():
    assert HELD_FDS_CAP == 128, HELD_FDS_CAP
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    seg = _native.ShmSegment.create(f"/aiodd-{os.getpid()}-flood", 4096)
    base = len(os.listdir("/proc/self/fd"))
    receiver = FdChannel(b, loop, os.getpid())
    receiver.start()
    sent = 0
    for i in range(200):
        try:
            socket.send_fds(a, [(b'{"t": "seg", "name": "/aiodd-%d-s%d", "size": 4096}'
                                 % (os.getpid(), i))], [seg.fd])
        except OSError:
            break  # the receiver closed the channel
        sent += 1
        if i % 16 == 0:
            await asyncio.sleep(0)
    for _ in range(200):
        if receiver.closed:
            break
        await asyncio.sleep(0.01)
    print("closed" if receiver.closed else "open", len(os.listdir("/proc/self/fd")) - base)

asyncio.run(main())
"""


def test_a_peer_cannot_make_us_hold_more_fds_than_a_share_of_our_limit() -> None:
    """A linked peer sends segment fds without end: with a 256-fd limit the channel holds
    at most half of it, then closes (and closes every fd it held)."""
    proc = subprocess.run(
        [sys.executable, "-c", _FD_FLOOD], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    state, extra = proc.stdout.split()
    assert state == "closed", proc.stdout
    assert int(extra) <= 0, f"{extra} fds left open by the closed channel"


def test_the_silent_connection_cap_is_a_share_of_the_fd_limit() -> None:
    """A 16th of the fd limit, 64..1024: a burst of a few hundred silent connections (a
    siege) must not crowd out an honest client on a machine that allows thousands of fds."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert _control.MAX_HANDSHAKES == max(64, min(1024, soft // 16))
