"""The fd channel (one abstract Unix SEQPACKET socket per same-host link) and the wire
fields of one-sided access: ``lease`` in cache descriptions, ``fd_socket`` in WELCOME.

Every channel here is a real socket carrying real fds; hostile messages (too many fds,
garbage, unsealed segments, a wrong link token) close the channel and every fd that
came with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    _native,
    _wire,
)
from aiodatadist._caches import CacheEntry, Region
from aiodatadist._fdchannel import FdChannel, connect_channel
from aiodatadist._lease_book import LeaseBook
from aiodatadist._leases import LeasePage
from aiodatadist.testing import cluster_info

pytestmark = pytest.mark.asyncio


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _until(pred: object, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():  # type: ignore[operator]
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def _chans() -> AsyncIterator[tuple[FdChannel, FdChannel]]:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender, receiver = FdChannel(a, loop, os.getpid()), FdChannel(b, loop, os.getpid())
    receiver.start()
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.release_page()


# ------------------------------------------------------------------ wire fields


def _description(**extra: object) -> dict[str, object]:
    d: dict[str, object] = {
        "cache_id": 1, "num_tensors": 1, "num_blocks": 4, "block_bytes": 4096,
        "is_blocks": True, "addrs": [1 << 20], "data_type": 0, "placement": 0,
        "shape": [4, 4096], "model_id": 0, "row_keys": [], "shm_name": None, "shm_size": 0,
        "shm_offsets": [],
    }  # fmt: skip
    d.update(extra)
    return d


@pytest.mark.parametrize("lease", [None, [0, 1], [4095, 2**63 - 1]])
async def test_descriptions_carry_a_lease(lease: object) -> None:
    assert _wire.check_cache_description(_description(lease=lease))["lease"] == lease
    _wire.check_cache_description(_description())  # absent: no lease


@pytest.mark.parametrize(
    "lease", [[1], [1, 2, 3], [-1, 1], [0, 0], [0, 2**63], [2**32, 1], ["0", 1], [True, 1], 5, {}]
)
async def test_bad_leases_are_refused(lease: object) -> None:
    with pytest.raises(_wire.WireError, match="lease"):
        _wire.check_cache_description(_description(lease=lease))


def _welcome(**extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "cluster_id": 1, "host_id": "h", "pid": 10, "role": 1, "table": [], "data_paths": ["tcp"],
        "link_token": "ab" * 16, "mac": None,
    }  # fmt: skip
    body.update(extra)
    return body


async def test_welcome_fd_socket_field() -> None:
    for ok in (None, "aiodd-123-0123456789abcdef"):
        _wire.check_body(_wire.MsgType.WELCOME, _welcome(fd_socket=ok))
    _wire.check_body(_wire.MsgType.WELCOME, _welcome())
    for bad in ("", "/tmp/x", "aiodd-1-xyz", "\0aiodd-1-0123456789abcdef", 5):
        with pytest.raises(_wire.WireError, match="fd_socket"):
            _wire.check_body(_wire.MsgType.WELCOME, _welcome(fd_socket=bad))


# ------------------------------------------------------------------ the channel itself


async def test_segments_and_pages_arrive() -> None:
    seg = _native.ShmSegment.create("/aiodd-test-chan-seg", 8192)
    page = LeasePage.create("/aiodd-test-chan-page", 8)
    async with _chans() as (sender, receiver):
        np.frombuffer(seg, dtype=np.uint8)[:] = 0x31
        _native.lease_publish(page.addr(3), 77)
        loop = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(
            receiver.segment_fd("/aiodd-test-chan-seg", loop.time() + 5, "t")
        )
        await asyncio.sleep(0.01)
        assert not waiting.done()  # it waits for the fd (bounded), no mapping by name
        sender.send({"t": "seg", "name": "/aiodd-test-chan-seg", "size": 8192}, seg.fd)
        sender.send({"t": "page", "slots": 8}, page.seg.fd)
        fd, size = await asyncio.wait_for(waiting, 5)
        assert size == 8192 and fd != seg.fd
        mapped = _native.ShmSegment.from_fd(fd, size)
        assert (np.frombuffer(mapped, dtype=np.uint8) == 0x31).all()
        mapped.close()
        peer_page = await receiver.peer_page(loop.time() + 5, "t")
        assert _native.lease_gen(peer_page.addr(3)) == 77
        assert _native.lease_enter(peer_page.addr(3), 77)  # the reader count is shared
        assert _native.lease_readers(page.addr(3)) == 1
        _native.lease_exit(peer_page.addr(3))
        with pytest.raises(LLMException) as info:
            peer_page.addr(8)  # bounds-checked
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        # An fd that arrived before any table listed its name is kept; once a table listed
        # it and a later one does not, it is closed.
        receiver.forget(set())
        os.fstat(fd)
        receiver.forget({"/aiodd-test-chan-seg"})
        receiver.forget(set())
        with pytest.raises(OSError):
            os.fstat(fd)
    seg.close()
    page.close()


async def test_a_missing_segment_times_out() -> None:
    async with _chans() as (_, receiver):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(LLMException) as info:
            await receiver.segment_fd("/aiodd-test-never", loop.time() + 0.1, "pull_blocks")
        assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert loop.time() - t0 < 2


def _raw_send(sock: socket.socket, body: bytes, fds: list[int]) -> None:
    socket.send_fds(sock, [body], fds)


@pytest.mark.parametrize(
    "case", ["two_fds", "garbage", "unknown", "no_fd", "unsealed_page", "bad_name", "huge"]
)
async def test_hostile_messages_close_the_channel_and_their_fds(case: str) -> None:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    receiver = FdChannel(b, loop, os.getpid())
    receiver.start()
    memfds = [os.memfd_create("aiodd-test-hostile", os.MFD_CLOEXEC) for _ in range(2)]
    for fd in memfds:
        os.ftruncate(fd, 4096)
    try:
        before = _open_fds()
        seg = json.dumps({"t": "seg", "name": "/aiodd-1-x", "size": 4096}).encode()
        msg, fds = {
            "two_fds": (seg, memfds),
            "garbage": (b"\xff{not json", memfds[:1]),
            "unknown": (json.dumps({"t": "evil"}).encode(), memfds[:1]),
            "no_fd": (seg, []),
            "unsealed_page": (json.dumps({"t": "page", "slots": 256}).encode(), memfds[:1]),
            "bad_name": (json.dumps({"t": "seg", "name": "../x", "size": 1}).encode(), memfds),
            "huge": (b" " * 4096 + seg, memfds[:1]),
        }[case]
        _raw_send(a, msg, fds)
        await _until(lambda: receiver.closed)
        # Every fd that came in was closed again (the channel's own socket too).
        assert _open_fds() <= before - 1
        assert receiver.page is None
    finally:
        receiver.close()
        a.close()
        for fd in memfds:
            os.close(fd)


# ------------------------------------------------------------------ a real link


async def test_a_same_host_link_gets_an_fd_channel_and_refuses_strangers() -> None:
    """Two instances linked over loopback (one process: same host, pid verified): the
    link's fd channel carries the prompt's segment and lease page, shm pulls verify; a
    connection to the prompt's fd socket with a wrong token, or nothing but garbage, is
    closed without being attached to anything."""
    prompt = LLMDataDist(LLMRole.PROMPT, 901)
    decoder = LLMDataDist(LLMRole.DECODER, 902)
    await prompt.init({"llm.listenIpInfo": "127.0.0.1:0", "aiodatadist.DataPath": "shm"})
    await decoder.init({"aiodatadist.DataPath": "shm"})
    try:
        desc = CacheDesc(2, [4, 2048], DataType.DT_FLOAT16, Placement.HOST)
        src = prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(901, 3))
        for t, v in enumerate(src.tensors()):
            flat = v.reshape(-1).view(np.uint8)
            flat[...] = np.arange(flat.size, dtype=np.uint64).astype(np.uint8) ^ t
        host, port = prompt.listen_address or ("", 0)
        status, _ = await decoder.link_clusters([cluster_info(901, host, port)])
        assert status == LLMStatusCode.LLM_SUCCESS
        dst_arrays = [np.full((4, 2048), 7, np.float16) for _ in range(2)]
        dst = decoder.cache_manager.register_blocks_cache(desc, dst_arrays)
        await decoder.cache_manager.pull_blocks(
            BlocksCacheKey(901, 3), dst, [0, 1, 2, 3], [3, 2, 1, 0], timeout=5
        )
        for t, v in enumerate(src.tensors()):
            assert np.array_equal(dst_arrays[t][::-1].view(np.uint8), v.view(np.uint8))
        dlink = decoder._rt.links.find(901)
        assert dlink is not None
        assert dlink.path.fds is not None and dlink.path.fds.page is not None
        plink = prompt._rt.links.find(902)
        assert plink is not None
        await _until(lambda: plink.path.fds is not None)  # the server side attached it
        server = prompt._server
        listener = server._fd_listener
        assert listener is not None
        # A stranger: the right socket, a wrong token.
        rogue = connect_channel(listener.name, "cd" * 16, asyncio.get_running_loop(), os.getpid())
        rogue.start()
        await _until(lambda: rogue.closed)
        # Another: garbage instead of a hello.
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        raw.connect("\0" + listener.name)
        raw.send(b"garbage")
        raw.setblocking(False)
        got = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(raw, 16), 5)
        assert got == b""  # closed by the server
        raw.close()
        # The real link is untouched.
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(901, 3), dst, [0], [0], timeout=5)
    finally:
        await decoder.finalize()
        await prompt.finalize()


async def test_losing_an_index_binding_renews_the_lease() -> None:
    """A blocks cache whose model_id a later registration takes over (and a row whose key
    is removed) gets a new generation: a peer still holding the old table cannot enter
    its lease (it refreshes instead of reading the cache under the key's old meaning)."""
    prompt = LLMDataDist(LLMRole.PROMPT, 911)
    decoder = LLMDataDist(LLMRole.DECODER, 912)
    await prompt.init({"llm.listenIpInfo": "127.0.0.1:0", "aiodatadist.DataPath": "shm"})
    await decoder.init({"aiodatadist.DataPath": "shm"})
    try:
        desc = CacheDesc(1, [4, 2048], DataType.DT_FLOAT16, Placement.HOST)
        first = prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(911, 3))
        first.tensors()[0].view(np.uint8)[...] = 0x11
        host, port = prompt.listen_address or ("", 0)
        status, _ = await decoder.link_clusters([cluster_info(911, host, port)])
        assert status == LLMStatusCode.LLM_SUCCESS
        dst_arrays = [np.zeros((4, 2048), np.float16)]
        dst = decoder.cache_manager.register_blocks_cache(desc, dst_arrays)
        key = BlocksCacheKey(911, 3)
        await decoder.cache_manager.pull_blocks(key, dst, [0], [0], timeout=5)
        assert (dst_arrays[0][0].view(np.uint8) == 0x11).all()
        link = decoder._rt.links.find(911)
        assert link is not None and link.path.fds is not None
        page = link.path.fds.page
        assert page is not None
        stale = link.path.remote_table.blocks(3)
        assert stale is not None and stale.lease is not None
        addr = page.addr(stale.lease[0])
        assert _native.lease_gen(addr) == stale.lease[1]

        second = prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(911, 3))
        second.tensors()[0].view(np.uint8)[...] = 0x22
        # The first cache is still registered (by id), under a new generation.
        assert _native.lease_gen(addr) not in (0, stale.lease[1])
        assert not _native.lease_enter(addr, stale.lease[1])
        # A pull through the stale table fails its enter, refreshes, reads the new owner.
        await decoder.cache_manager.pull_blocks(key, dst, [1], [1], timeout=5)
        assert (dst_arrays[0][1].view(np.uint8) == 0x22).all()
        assert link.path.remote_table.blocks(3).cache_id == second.cache_id

        rows = prompt.cache_manager.allocate_cache(
            CacheDesc(1, [2, 2048], DataType.DT_FLOAT16, Placement.HOST),
            [CacheKey(911, req_id=5)],
        )
        await link.path.refresh(asyncio.get_running_loop().time() + 5)
        row_entry = link.path.remote_table.row((5, 0))
        assert row_entry is not None and row_entry[0].lease is not None
        slot, gen = row_entry[0].lease
        prompt.cache_manager.remove_cache_key(CacheKey(911, req_id=5))
        assert _native.lease_gen(page.addr(slot)) not in (0, gen)
        prompt.cache_manager.deallocate_cache(rows)
    finally:
        await decoder.finalize()
        await prompt.finalize()


# ------------------------------------------------------------------ the owner's book


class _Entry:
    def __init__(self, cache_id: int) -> None:
        self.cache_id = cache_id
        self.lease: tuple[int, int] | None = None
        # (what the serve book records of a cache: no memory behind it, nothing serves it)
        self.geometry = _native.Geometry(1, 1, 1)
        self.addrs = [4096]
        self.device_id = None


async def test_the_book_revokes_on_every_page_or_changes_nothing() -> None:
    """Two links (two pages): a reader on the second page at the bound restores the first
    page's generation too (LLM_LINK_BUSY upstairs, nothing changed); without readers both
    are revoked; a freed slot is reused under a new generation; a dead peer's page does
    not hold a revocation up."""
    loop = asyncio.get_running_loop()
    book = LeaseBook(f"/aiodd-{os.getpid()}-test-book")
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(3)]
    peers = [FdChannel(b, loop, os.getpid()) for _, b in pairs]
    for p in peers:
        p.start()
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await asyncio.wait_for(child.wait(), 10)
    ours = [FdChannel(a, loop, os.getpid()) for a, _ in pairs[:2]]
    ours.append(FdChannel(pairs[2][0], loop, child.pid))  # a peer that is gone already
    try:
        entry = _Entry(1)
        book.grant(entry)  # type: ignore[arg-type]
        for c in ours:
            c.start(book)
        await _until(lambda: all(p.page is not None for p in peers))
        assert entry.lease is not None
        slot, gen = entry.lease
        addrs = [p.page.addr(slot) for p in peers if p.page is not None]
        assert [_native.lease_gen(a) for a in addrs] == [gen] * 3
        assert _native.lease_enter(addrs[1], gen)
        assert _native.lease_enter(addrs[2], gen)  # the dead peer's stuck reader
        t0 = time.monotonic()
        assert not book.revoke(entry, 0.2)  # type: ignore[arg-type]
        assert time.monotonic() - t0 >= 0.1  # it waited: half the 0.2 s at least
        assert [_native.lease_gen(a) for a in addrs] == [gen] * 3  # all restored
        _native.lease_exit(addrs[1])
        assert book.revoke(entry, 5)  # type: ignore[arg-type]
        assert _native.lease_gen(addrs[0]) == gen | (1 << 63)
        assert _native.lease_gen(addrs[1]) == gen | (1 << 63)
        book.release(entry)  # type: ignore[arg-type]
        assert entry.lease is None and _native.lease_gen(addrs[0]) == 0
        again = _Entry(2)
        book.grant(again)  # type: ignore[arg-type]
        assert again.lease is not None and again.lease[0] == slot and again.lease[1] > gen
        assert not _native.lease_enter(addrs[0], gen)  # the old generation stays dead
        # A link that closes: its page is revoked as a whole at once.
        ours[0].close()
        assert _native.lease_gen(addrs[0]) & (1 << 63)
        assert not _native.lease_enter(addrs[0], again.lease[1])
    finally:
        for c in ours:
            c.close()
        for p in peers:
            p.release_page()
        book.close()


async def test_an_owner_of_many_segments_keeps_its_fd_channel() -> None:
    """A new link to a prompt that allocated hundreds of caches: every segment's fd goes
    out at once, more than the socket buffer holds. The channel queues what does not fit
    (it used to close itself, leaving the link without one-sided paths); every cache,
    the last one allocated included, is then pulled over shm with its own bytes."""
    n = 300
    prompt = LLMDataDist(LLMRole.PROMPT, 921)
    decoder = LLMDataDist(LLMRole.DECODER, 922)
    await prompt.init({"llm.listenIpInfo": "127.0.0.1:0"})
    await decoder.init({"aiodatadist.DataPath": "shm"})
    try:
        desc = CacheDesc(1, [2, 4096], DataType.DT_INT8, Placement.HOST)
        caches = [
            prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(921, i))
            for i in range(n)
        ]
        for i, c in enumerate(caches):
            c.tensors()[0].view(np.uint8)[...] = i % 251 + 1
        host, port = prompt.listen_address or ("", 0)
        status, _ = await decoder.link_clusters([cluster_info(921, host, port)])
        assert status == LLMStatusCode.LLM_SUCCESS
        arrays = [np.zeros((2, 4096), np.int8)]
        dst = decoder.cache_manager.register_blocks_cache(desc, arrays)
        for i in (0, n // 2, n - 1):
            await decoder.cache_manager.pull_blocks(
                BlocksCacheKey(921, i), dst, [1], [0], timeout=5
            )
            assert (arrays[0][0].view(np.uint8) == i % 251 + 1).all()
        link = decoder._rt.links.find(921)
        assert link is not None and link.path.fds is not None
        assert not link.path.fds.closed
        # And a burst of allocations on a live link goes through as well.
        more = [
            prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(921, n + i))
            for i in range(n)
        ]
        more[-1].tensors()[0].view(np.uint8)[...] = 0xAB
        await decoder.cache_manager.pull_blocks(
            BlocksCacheKey(921, 2 * n - 1), dst, [1], [1], timeout=5
        )
        assert (arrays[0][1].view(np.uint8) == 0xAB).all()
        assert not link.path.fds.closed
    finally:
        await decoder.finalize()
        await prompt.finalize()


async def test_a_peer_that_stops_reading_costs_a_bounded_number_of_fds() -> None:
    """Sends to a peer that never reads queue (a dup of each fd) while the socket is full:
    past MAX_BACKLOG the channel closes and every queued dup is closed with it."""
    from aiodatadist._fdchannel import MAX_BACKLOG

    loop = asyncio.get_running_loop()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    seg = _native.ShmSegment.create(f"/aiodd-{os.getpid()}-backlog", 4096)
    base = _open_fds()
    sender = FdChannel(a, loop, os.getpid())
    try:
        sent = 0
        while not sender.closed:
            sender.send({"t": "seg", "name": f"/aiodd-{os.getpid()}-s{sent}", "size": 4096}, seg.fd)
            sent += 1
            if sent % 256 == 0:
                assert _open_fds() <= base + MAX_BACKLOG + 1
            assert sent < 100_000, "the channel never gave up on a peer that does not read"
        assert sent > MAX_BACKLOG  # the socket's own buffer came first
        await asyncio.sleep(0)  # (closing runs on the loop: we are on it already)
        assert _open_fds() <= base - 1, "queued fds (or the socket) were left open"
    finally:
        sender.close()
        b.close()
        seg.close()


async def test_idle_connections_to_the_fd_socket_are_bounded() -> None:
    """Any local process can reach the abstract fd socket: connections that never say
    hello are held (each for up to HELLO_TIMEOUT) only up to MAX_PENDING at once (past
    it the oldest is closed), so a flood cannot use up the prompt's fds; the next
    same-host link still gets its fd channel."""
    from aiodatadist._fdchannel import MAX_PENDING

    loop = asyncio.get_running_loop()
    prompt = LLMDataDist(LLMRole.PROMPT, 931)
    first = LLMDataDist(LLMRole.DECODER, 932)
    second = LLMDataDist(LLMRole.DECODER, 933)
    await prompt.init({"llm.listenIpInfo": "127.0.0.1:0", "aiodatadist.DataPath": "shm"})
    await first.init({"aiodatadist.DataPath": "shm"})
    await second.init({"aiodatadist.DataPath": "shm"})
    flood: list[socket.socket] = []
    try:
        desc = CacheDesc(1, [2, 4096], DataType.DT_INT8, Placement.HOST)
        src = prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(931, 0))
        src.tensors()[0].view(np.uint8)[...] = 0x6D
        host, port = prompt.listen_address or ("", 0)
        status, _ = await first.link_clusters([cluster_info(931, host, port)])
        assert status == LLMStatusCode.LLM_SUCCESS
        listener = prompt._server._fd_listener
        assert listener is not None
        n = MAX_PENDING * 4
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            flood.append(s)
            for _try in range(1000):
                try:
                    s.connect("\0" + listener.name)
                    break
                except BlockingIOError:  # its backlog is full: let the prompt accept
                    await asyncio.sleep(0.005)
            else:
                raise AssertionError("the prompt stopped accepting connections")
            if len(flood) % 32 == 0:
                await asyncio.sleep(0.01)  # let the prompt accept
        # The oldest are closed by the prompt as newer ones come: their reads see the end.
        oldest = flood[: n - MAX_PENDING]
        ended: set[int] = set()

        def oldest_closed() -> bool:
            for i, s in enumerate(oldest):
                if i not in ended:
                    with contextlib.suppress(BlockingIOError):
                        if s.recv(16) == b"":
                            ended.add(i)
            assert len(listener.pending) <= MAX_PENDING
            return len(ended) == len(oldest)

        await _until(oldest_closed, timeout=10)
        assert len(listener.pending) == MAX_PENDING
        # With the flood still holding MAX_PENDING connections, a new link gets its channel.
        status, _ = await second.link_clusters([cluster_info(931, host, port)])
        assert status == LLMStatusCode.LLM_SUCCESS
        arrays = [np.zeros((2, 4096), np.int8)]
        dst = second.cache_manager.register_blocks_cache(desc, arrays)
        await second.cache_manager.pull_blocks(BlocksCacheKey(931, 0), dst, [1], [1], timeout=5)
        assert (arrays[0][1].view(np.uint8) == 0x6D).all()
        link = second._rt.links.find(931)
        assert link is not None and link.path.fds is not None
        assert not link.path.fds.closed
        assert len(listener.pending) <= MAX_PENDING
        del loop
    finally:
        for s in flood:
            s.close()
        await second.finalize()
        await first.finalize()
        await prompt.finalize()


async def test_the_book_publishes_a_caches_fence_count_on_every_page() -> None:
    """A fence on a cache (an aborted engine transfer may still write into it) is counted
    in the cache's slot of every peer's page, a page attached later included, and the
    count goes at unfence and at release: a peer's one-sided push reads it
    (``_leases.leased(writes=True)``)."""
    loop = asyncio.get_running_loop()
    book = LeaseBook(f"/aiodd-{os.getpid()}-test-fences")
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    peers = [FdChannel(b, loop, os.getpid()) for _, b in pairs]
    ours = [FdChannel(a, loop, os.getpid()) for a, _ in pairs]
    for p in peers:
        p.start()
    entry = CacheEntry(
        cache_id=1, num_tensors=1, num_blocks=4, block_bytes=64, is_blocks=True, addrs=[1 << 20]
    )
    other = CacheEntry(
        cache_id=2, num_tensors=1, num_blocks=4, block_bytes=64, is_blocks=True, addrs=[1 << 21]
    )
    try:
        book.grant(entry)
        book.grant(other)
        ours[0].start(book)
        await _until(lambda: peers[0].page is not None)
        assert entry.lease is not None and other.lease is not None
        first = [entry.fence(Region(None)), entry.fence(Region(None))]
        ours[1].start(book)  # a link made while the fences are up
        await _until(lambda: peers[1].page is not None)
        slots = [p.page.addr(entry.lease[0]) for p in peers if p.page is not None]
        others = [p.page.addr(other.lease[0]) for p in peers if p.page is not None]
        assert [_native.lease_fences(a) for a in slots] == [2, 2]
        assert [_native.lease_fences(a) for a in others] == [0, 0]
        entry.unfence(first[0])
        assert [_native.lease_fences(a) for a in slots] == [1, 1]
        # The count is read from any thread (a reaper's) at the time of the write.
        await asyncio.to_thread(entry.unfence, first[1])
        assert [_native.lease_fences(a) for a in slots] == [0, 0]
        entry.fence(Region(None))
        assert [_native.lease_fences(a) for a in slots] == [1, 1]
        slot = entry.lease[0]
        assert book.revoke(entry, 5)
        book.release(entry)  # (an unregister with a fence up waits; the book clears anyway)
        assert entry.fences_changed is None
        assert [_native.lease_fences(a) for a in slots] == [0, 0]
        again = CacheEntry(
            cache_id=3, num_tensors=1, num_blocks=4, block_bytes=64, is_blocks=True, addrs=[1 << 22]
        )
        book.grant(again)  # the slot reused: no fence of the cache before
        assert again.lease is not None and again.lease[0] == slot
        assert [_native.lease_fences(a) for a in slots] == [0, 0]
    finally:
        for c in ours:
            c.close()
        for p in peers:
            p.release_page()
        book.close()
