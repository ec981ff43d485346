"""What a running native job uses stays alive until the job has returned.

A link can be closed under a transfer (the peer's control connection dropping, the
client replacing its data streams, an unlink): the sockets and
shared-memory mappings the job was given must not be closed or unmapped under it.
A closed socket frees its fd number, and the next socket or file this process opens
would get it: the job would then read bytes from, or send the cache to, the wrong
connection.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from typing import Any

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, LLMException, LLMRole, LLMStatusCode, _native
from aiodatadist._caches import CacheEntry, CacheTable
from aiodatadist._fdchannel import FdChannel
from aiodatadist._leases import LeasePage
from aiodatadist.transports.base import Call
from aiodatadist.transports.shm import ShmPath
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import (
    Harness,
    RawClient,
    decoder_options,
    link,
    stop_when_bytes_land,
    until,
)

PROMPT, DECODER, RAW = 41, 42, 43
SEED = 17
S = LLMStatusCode


def _same_sockets(fds: list[int], inodes: list[int]) -> list[str]:
    """What is wrong with ``fds`` (closed, or another file now), compared with ``inodes``."""
    wrong = []
    for fd, ino in zip(fds, inodes, strict=True):
        try:
            now = os.fstat(fd).st_ino
        except OSError as e:
            wrong.append(f"fd {fd}: {e}")
            continue
        if now != ino:
            wrong.append(f"fd {fd} is another file now")
    return wrong


@pytest.mark.asyncio
async def test_link_closed_under_a_pull_keeps_its_streams_until_the_mover_returns() -> None:
    """A tcp pull is blocked in the native receiver (the prompt frozen mid-transfer) when
    the link closes (what the read loop does when the control connection breaks): the
    receiver's sockets are shut down, not closed, so it fails at once, and their fd numbers
    stay ours until it returned."""
    async with Harness() as h:
        prompt = await h.peer(cluster_id=PROMPT, data_path="tcp", seed=SEED, big_mib=64)
        dd, local = await h.local(DECODER, decoder_options("tcp"), big_mib=64)
        await link(dd, prompt, PROMPT)
        lk = dd._rt.links.find(PROMPT)
        assert lk is not None
        peer = lk.path.peer  # type: ignore[attr-defined]
        big = local["big"]
        nblocks = big.spec.shape[0]
        stamps: dict[str, float] = {}
        watcher = threading.Thread(
            target=stop_when_bytes_land, args=(big.views[0], prompt.pid, stamps), daemon=True
        )
        watcher.start()
        loop = asyncio.get_running_loop()
        pull = asyncio.ensure_future(
            dd.cache_manager.pull_blocks(
                BlocksCacheKey(PROMPT, xc.MODEL_BIG),
                big.cache,
                list(range(nblocks)),
                list(range(nblocks)),
                timeout=10.0,
            )
        )
        try:
            await asyncio.to_thread(watcher.join, 6)
            assert "stopped" in stamps, "no byte of the pull ever landed"
            socks = [s for s in peer.streams.sockets[peer.streams.my_direction] if s is not None]
            fds = [s.fileno() for s in socks]
            inodes = [os.fstat(fd).st_ino for fd in fds]
            assert dd._rt.executor.in_flight == 1 and not pull.done()
            started = loop.time()
            await peer.close("control connection lost (test)")
            # Files opened now would take any fd number the close freed.
            spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(len(fds) + 4)]
            try:
                if dd._rt.executor.in_flight:
                    assert _same_sockets(fds, inodes) == []
            finally:
                for fd in spare:
                    os.close(fd)
            with pytest.raises(LLMException) as ei:
                await asyncio.wait_for(pull, 15)
            # The receiver was woken at once, not by the pull's deadline.
            assert ei.value.status_code != S.LLM_TIMEOUT, ei.value
            assert loop.time() - started < 3.0
            # Once it returned, nothing is left open.
            assert all(s.fileno() == -1 for s in socks)
            assert peer.streams._in_use == {} and peer.streams._retired == set()
        finally:
            prompt.kill(signal.SIGCONT)


@pytest.mark.asyncio
async def test_replaced_stream_is_not_closed_under_the_serving_job() -> None:
    """The serving side sends a big pull to a client that does not read; the client opens
    a new data stream in the same slot. The serving job's socket is shut down (the job
    fails at once, not at its deadline) and closed only after the job returned."""
    async with Harness() as h:
        opts = decoder_options("tcp", **{"llm.listenIpInfo": "127.0.0.1:0"})
        dd, local = await h.local(PROMPT, opts, role=LLMRole.PROMPT, seed=SEED, big_mib=64)
        assert dd.listen_address is not None
        host, port = dd.listen_address
        big = local["big"]
        entry = dd._rt.caches.entries[big.cache.cache_id]
        tensor = big.spec.nbytes
        async with RawClient(host, port) as raw:
            await raw.handshake(RAW)
            await raw.open_stream(0)
            assert dd._server is not None
            (peer,) = dd._server.peers.values()
            await raw.pull(
                1,
                big.cache.cache_id,
                [(0, 0, 0, 0, tensor)],
                dst_geometry=(1, big.spec.shape[0], big.spec.unit),
                deadline_ms=10_000,
            )
            loop = asyncio.get_running_loop()
            await until(lambda: entry.busy > 0, what="the serving job to start")
            await asyncio.sleep(0.2)  # blocked: the raw client reads nothing
            sock = peer.streams.sockets[0][0]  # the client-initiated direction
            assert sock is not None
            fd, ino = sock.fileno(), os.fstat(sock.fileno()).st_ino
            started = loop.time()
            await raw.open_stream(0)  # replaces slot 0 under the running job
            spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(4)]
            try:
                if entry.busy:
                    assert _same_sockets([fd], [ino]) == []
            finally:
                for f in spare:
                    os.close(f)
            done = await raw.done(timeout=15)
            assert done["req"] == 1
            assert done["status"] not in (S.LLM_SUCCESS, S.LLM_TIMEOUT), done
            assert loop.time() - started < 3.0
            assert entry.busy == 0 and sock.fileno() == -1
            assert peer.streams._in_use == {} and peer.streams._retired == set()


class _GatedExecutor:
    """Stands in for the transfer executor: runs each job only once ``gate`` is set, as a
    busy worker thread would."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.gate = asyncio.Event()
        self.yield_due = 0.0  # TransferExecutor's: when a fair inline job yields next

    async def run(self, job: Any, **_: Any) -> Any:
        self.started.set()
        await self.gate.wait()
        return job(_native.Control())


@pytest.mark.asyncio
async def test_shm_close_waits_for_the_copy_that_uses_the_mapping() -> None:
    """The link is closed (force unlink, finalize) while a copy out of the peer's mapped
    segment is still queued or running: the segment stays mapped until the copy has
    returned (unmapping it first would make the copy fault), and is unmapped then."""
    tensor = 4 * 4096
    name = f"/aiodd-{os.getpid()}-test-lifetime"  # segments are named after their maker
    owner = _native.ShmSegment.create(name, tensor)
    try:
        data = np.random.default_rng(SEED).integers(0, 256, tensor, dtype=np.uint8)
        np.frombuffer(owner, dtype=np.uint8)[:] = data
        remote = CacheEntry(
            cache_id=1,
            num_tensors=1,
            num_blocks=4,
            block_bytes=4096,
            is_blocks=True,
            addrs=[1 << 40],
            shm_name=name,
            shm_size=tensor,
            shm_offsets=[0],
            lease=(0, 1),
            local=False,
        )
        # The segment and a lease page reach the path as a peer sends them: over a real
        # SEQPACKET fd channel.
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs, ours = FdChannel(a, loop, os.getpid()), FdChannel(b, loop, os.getpid())
        ours.start()
        page = LeasePage.create(f"/aiodd-{os.getpid()}-test-lease")
        _native.lease_publish(page.addr(0), 1)
        theirs.send({"t": "page", "slots": page.slots}, page.seg.fd)
        theirs.send({"t": "seg", "name": name, "size": tensor}, owner.fd)
        dst = np.zeros(tensor, dtype=np.uint8)
        local = CacheEntry(
            cache_id=2,
            num_tensors=1,
            num_blocks=4,
            block_bytes=4096,
            is_blocks=True,
            addrs=[dst.ctypes.data],
        )
        plan = _native.Plan.blocks(
            remote.geometry, local.geometry, [0, 1, 2, 3], [0, 1, 2, 3], 0, 0, 1
        )
        executor = _GatedExecutor()
        path = ShmPath(os.getpid(), CacheTable())
        path.fds = ours
        call = Call("pull_blocks", None, executor)  # type: ignore[arg-type]
        pull = asyncio.ensure_future(path.pull(plan, remote, local, call))
        await asyncio.wait_for(executor.started.wait(), 5)
        mapped = list(path._maps.values())
        assert len(mapped) == 1
        path.unmap()  # the link goes away under the queued copy
        path.forget(set(), busy=False)
        assert not mapped[0].closed, "unmapped under a copy that still uses it"
        executor.gate.set()
        await asyncio.wait_for(pull, 5)
        assert np.array_equal(dst, data)
        assert mapped[0].closed and path._maps == {}
        assert _native.lease_readers(page.addr(0)) == 0
        ours.release_page()
        theirs.close()
        page.close()
    finally:
        owner.close()
