"""Two-sided links in one process: ``link`` / ``query_register_mem_status`` / ``unlink``.

Both members call ``link`` with the same arguments (concurrently, or one late), poll
until OK, then each pulls the other's pattern-filled cache and the bytes are checked.
The routes of :mod:`aiodatadist._ranktable` are each taken: in-process, ``listen_ip_info``
(a real tcp control link inside one process) and the rendezvous directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio

from aiodatadist import (
    BlocksCacheKey,
    LLMDataDist,
    LLMException,
    LLMParamError,
    LLMRole,
    LLMStatusCode,
    RegisterMemStatus,
)
from aiodatadist.testing import cluster_info, make_blocks_cache, pattern_mismatches

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
BLOCK = (16, 2, 64)
POLL_BOUND_S = 20.0


def rank_table(
    ranks: Sequence[int], listen: dict[int, str] | None = None, version: str = "1.0"
) -> str:
    """An upstream rank table, one server per rank; ``listen``: rank -> listen_ip_info."""
    servers = []
    for rank in ranks:
        dev = {"device_id": str(rank), "device_ip": f"192.168.1.{rank + 1}", "rank_id": str(rank)}
        if listen and rank in listen:
            dev["listen_ip_info"] = listen[rank]
        servers.append({"server_id": f"10.0.0.{rank + 1}", "device": [dev]})
    return json.dumps(
        {
            "version": version,
            "server_count": str(len(servers)),
            "status": "completed",
            "server_list": servers,
        }
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_status(
    dd: LLMDataDist, comm_id: int, bound: float = POLL_BOUND_S
) -> RegisterMemStatus:
    """Polls as upstream's clients do, until the status is no longer PREPARING (bounded)."""
    async with asyncio.timeout(bound):
        # The API is a status query: polled, as upstream's clients poll it.
        while True:
            status = dd.query_register_mem_status(comm_id)
            if status is not RegisterMemStatus.PREPARING:
                return status
            await asyncio.sleep(0.01)


async def started(*dds: LLMDataDist) -> None:
    for dd in dds:
        await dd.init()


async def finalize(*dds: LLMDataDist) -> None:
    for dd in dds:
        await dd.finalize()


@pytest.fixture
def rundir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "run"
    monkeypatch.setenv("AIODATADIST_RUNDIR", str(path))
    return path


async def pull_both_ways(a: LLMDataDist, b: LLMDataDist, seed_a: int, seed_b: int) -> None:
    """Each side pulls blocks of the other's model-0 cache; the pattern is checked."""
    for me, other, seed in ((a, b, seed_b), (b, a, seed_a)):
        dst = make_blocks_cache(me, num_tensors=2, num_blocks=4, block_shape=BLOCK)
        src_blocks, dst_blocks = [3, 0, 2], [0, 1, 3]
        await me.cache_manager.pull_blocks(
            BlocksCacheKey(other.cluster_id, 0), dst.cache, src_blocks, dst_blocks
        )
        assert pattern_mismatches(dst.tensors, src_blocks, dst_blocks, seed) == []
        me.cache_manager.unregister_cache(dst.cache.cache_id)


@pytest_asyncio.fixture
async def two() -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    a, b = LLMDataDist(LLMRole.PROMPT, 5101), LLMDataDist(LLMRole.DECODER, 5102)
    await started(a, b)
    try:
        yield a, b
    finally:
        await finalize(a, b)


def fill(a: LLMDataDist, b: LLMDataDist) -> tuple[int, int]:
    # Registered before link(), as upstream asks; a seed unique per test and side.
    seed_a, seed_b = 0x5A00 + a.cluster_id, 0x5B00 + b.cluster_id
    make_blocks_cache(
        a, num_tensors=2, num_blocks=4, block_shape=BLOCK, model_id=0, seed=seed_a, pattern=True
    )
    make_blocks_cache(
        b, num_tensors=2, num_blocks=4, block_shape=BLOCK, model_id=0, seed=seed_b, pattern=True
    )
    return seed_a, seed_b


async def test_both_link_at_once_then_pull_both_ways(two: tuple[LLMDataDist, LLMDataDist]) -> None:
    a, b = two
    seeds = fill(a, b)
    members = {a.cluster_id: 0, b.cluster_id: 1}
    table = rank_table([0, 1], version="1.2")
    id_a, id_b = await asyncio.gather(
        a.link("pd_comm", members, table), b.link("pd_comm", members, table)
    )
    assert (id_a, id_b) == (1, 1)  # per instance, from 1
    assert await wait_status(a, id_a) is RegisterMemStatus.OK
    assert await wait_status(b, id_b) is RegisterMemStatus.OK
    await pull_both_ways(a, b, *seeds)
    await a.unlink(id_a)
    await b.unlink(id_b)  # its link was closed by a's unlink: success all the same
    assert a.links == [] and b.links == []
    for dd, comm_id in ((a, id_a), (b, id_b)):
        with pytest.raises(LLMException) as info:
            dd.query_register_mem_status(comm_id)
        assert info.value.status_code == S.LLM_NOT_YET_LINK
    # And they link again, under the same name.
    id_a, id_b = await asyncio.gather(
        a.link("pd_comm", members, table), b.link("pd_comm", members, table)
    )
    assert id_a == 2 and await wait_status(a, id_a) is RegisterMemStatus.OK
    assert await wait_status(b, id_b) is RegisterMemStatus.OK
    await pull_both_ways(a, b, *seeds)


@pytest.mark.parametrize("late", ["lower", "higher"])
async def test_one_member_calls_late(two: tuple[LLMDataDist, LLMDataDist], late: str) -> None:
    a, b = two
    seeds = fill(a, b)
    members = {a.cluster_id: 0, b.cluster_id: 1}
    table = rank_table([0, 1])
    first, second = (b, a) if late == "lower" else (a, b)
    id1 = await first.link("late", members, table)
    await asyncio.sleep(0.2)
    assert first.query_register_mem_status(id1) is RegisterMemStatus.PREPARING
    id2 = await second.link("late", members, table)
    assert await wait_status(first, id1) is RegisterMemStatus.OK
    assert await wait_status(second, id2) is RegisterMemStatus.OK
    await pull_both_ways(a, b, *seeds)
    await asyncio.gather(first.unlink(id1), second.unlink(id2))
    assert a.links == [] and b.links == []


async def test_three_members_link_pairwise() -> None:
    dds = [LLMDataDist(LLMRole.MIX, 5111 + i) for i in range(3)]
    await started(*dds)
    try:
        members = {dd.cluster_id: i for i, dd in enumerate(dds)}
        table = rank_table([0, 1, 2])
        ids = await asyncio.gather(*(dd.link("trio", members, table) for dd in dds))
        for dd, comm_id in zip(dds, ids, strict=True):
            assert await wait_status(dd, comm_id) is RegisterMemStatus.OK
            assert sorted(link.remote_cluster_id for link in dd.links) == sorted(
                set(members) - {dd.cluster_id}
            )
        await asyncio.gather(*(dd.unlink(c) for dd, c in zip(dds, ids, strict=True)))
        assert all(dd.links == [] for dd in dds)
    finally:
        await finalize(*dds)


async def test_listen_ip_info_route_in_one_process() -> None:
    """The lower rank's entry names an address: a real tcp control link, even in-process."""
    a, b = LLMDataDist(LLMRole.MIX, 5121), LLMDataDist(LLMRole.MIX, 5122)
    await started(a, b)
    try:
        seeds = fill(a, b)
        port = free_port()
        members = {a.cluster_id: 0, b.cluster_id: 1}
        table = rank_table([0, 1], listen={0: f"127.0.0.1:{port}"})
        ids = await asyncio.gather(a.link("tcp", members, table), b.link("tcp", members, table))
        assert await wait_status(a, ids[0]) is RegisterMemStatus.OK
        assert await wait_status(b, ids[1]) is RegisterMemStatus.OK
        assert a.listen_address == ("127.0.0.1", port)  # rank 0 listens where the table says
        assert b.listen_address is None  # rank 1 connects
        assert type(a.links[0].path).__name__ == "RemotePath"
        await pull_both_ways(a, b, *seeds)
        await a.unlink(ids[0])
        await b.unlink(ids[1])
        assert a.listen_address is None  # started for the comm: stopped with it
    finally:
        await finalize(a, b)


async def test_rendezvous_route_in_one_process(rundir: Path) -> None:
    tcp = {"aiodatadist.DataPath": "tcp"}  # no in-process route: the rendezvous directory
    a, b = LLMDataDist(LLMRole.MIX, 5131, tcp), LLMDataDist(LLMRole.MIX, 5132, tcp)
    await started(a, b)
    try:
        seeds = fill(a, b)
        members = {a.cluster_id: 0, b.cluster_id: 1}
        table = rank_table([0, 1])
        # The higher rank first: it waits (backing off) for the lower rank's file.
        id_b = await b.link("rdv", members, table)
        await asyncio.sleep(0.1)
        assert not list(rundir.glob("*cluster-5131.json"))  # noqa: ASYNC240 (tmpfs)
        id_a = await a.link("rdv", members, table)
        assert await wait_status(a, id_a) is RegisterMemStatus.OK
        assert await wait_status(b, id_b) is RegisterMemStatus.OK
        (path,) = rundir.glob("comm-*-cluster-5131.json")  # noqa: ASYNC240 (tmpfs)
        published = json.loads(path.read_text())
        key = published.pop("comm")
        assert path.name == f"comm-{key}-cluster-5131.json"
        assert published == {"host": "127.0.0.1", "port": a.listen_address[1], "pid": os.getpid()}
        assert os.stat(rundir).st_mode & 0o777 == 0o700
        await pull_both_ways(a, b, *seeds)
        await b.unlink(id_b)
        await a.unlink(id_a)
        assert not path.exists()  # removed with its comm
        assert a.listen_address is None
    finally:
        await finalize(a, b)


async def test_untrusted_rundir_fails_the_comm(rundir: Path) -> None:
    os.mkdir(rundir, 0o700)
    os.chmod(rundir, 0o777)  # anyone could plant an address here
    tcp = {"aiodatadist.DataPath": "tcp", "llm.LinkTotalTime": "30"}
    a, b = LLMDataDist(LLMRole.MIX, 5141, tcp), LLMDataDist(LLMRole.MIX, 5142, tcp)
    await started(a, b)
    try:
        members = {a.cluster_id: 0, b.cluster_id: 1}
        ids = await asyncio.gather(*(dd.link("bad", members, rank_table([0, 1])) for dd in (a, b)))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await wait_status(a, ids[0]) is RegisterMemStatus.FAILED
        assert await wait_status(b, ids[1]) is RegisterMemStatus.FAILED
        assert loop.time() - t0 < 10  # at once, not at the 30 s deadline
        assert os.listdir(rundir) == []
        await a.unlink(ids[0])
        await b.unlink(ids[1])
    finally:
        await finalize(a, b)


@pytest.mark.parametrize("absent_rank", [0, 1])
async def test_a_member_that_never_links_fails_at_the_deadline(absent_rank: int) -> None:
    opts = {"llm.LinkTotalTime": "1"}
    a, b = LLMDataDist(LLMRole.MIX, 5151, opts), LLMDataDist(LLMRole.MIX, 5152)
    await started(a, b)  # b is initialized in this process but never calls link()
    try:
        members = (
            {b.cluster_id: 0, a.cluster_id: 1}
            if absent_rank == 0
            else {a.cluster_id: 0, b.cluster_id: 1}
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        comm_id = await a.link("lonely", members, rank_table([0, 1]))
        assert a.query_register_mem_status(comm_id) is RegisterMemStatus.PREPARING
        assert await wait_status(a, comm_id) is RegisterMemStatus.FAILED
        assert 0.9 <= loop.time() - t0 < 6  # the 1 s deadline, honoured
        assert a.links == [] and b.links == []
        await a.unlink(comm_id)
    finally:
        await finalize(a, b)


async def test_failed_when_a_link_is_lost_after_ok(two: tuple[LLMDataDist, LLMDataDist]) -> None:
    a, b = two
    members = {a.cluster_id: 0, b.cluster_id: 1}
    ids = await asyncio.gather(*(dd.link("lost", members, rank_table([0, 1])) for dd in two))
    assert await wait_status(a, ids[0]) is RegisterMemStatus.OK
    status, _ = await b.unlink_clusters([cluster_info(a.cluster_id)], force=True)
    assert status == S.LLM_SUCCESS
    assert a.query_register_mem_status(ids[0]) is RegisterMemStatus.FAILED
    assert b.query_register_mem_status(ids[1]) is RegisterMemStatus.FAILED
    await a.unlink(ids[0])
    await b.unlink(ids[1])


async def test_already_linked_and_name_in_use(two: tuple[LLMDataDist, LLMDataDist]) -> None:
    a, b = two
    c = LLMDataDist(LLMRole.MIX, 5103)
    await c.init()
    try:
        members = {a.cluster_id: 0, b.cluster_id: 1}
        status, _ = await b.link_clusters([cluster_info(a.cluster_id)])
        assert status == S.LLM_SUCCESS
        for dd in (a, b):
            with pytest.raises(LLMException) as info:
                await dd.link("x", members, rank_table([0, 1]))
            assert info.value.status_code == S.LLM_ALREADY_LINK
            assert "[link]" in str(info.value) or "link" in str(info.value)
        await b.unlink_clusters([cluster_info(a.cluster_id)])
        comm_id = await a.link("x", {a.cluster_id: 0, c.cluster_id: 1}, rank_table([0, 1]))
        with pytest.raises(LLMException) as info:  # the name is in use
            await a.link("x", {a.cluster_id: 0, b.cluster_id: 1}, rank_table([0, 1]))
        assert info.value.status_code == S.LLM_ALREADY_LINK
        with pytest.raises(LLMException) as info:  # c is a member of another comm
            await a.link("y", {a.cluster_id: 0, c.cluster_id: 1}, rank_table([0, 1]))
        assert info.value.status_code == S.LLM_ALREADY_LINK
        await a.unlink(comm_id)
    finally:
        await c.finalize()


async def test_unknown_comm_id(two: tuple[LLMDataDist, LLMDataDist]) -> None:
    a, _ = two
    for call in (lambda: a.query_register_mem_status(7),):
        with pytest.raises(LLMException) as info:
            call()
        assert info.value.status_code == S.LLM_NOT_YET_LINK
    with pytest.raises(LLMException) as info:
        await a.unlink(7)
    assert info.value.status_code == S.LLM_NOT_YET_LINK
    for bad, exc in (
        ("1", TypeError),
        (1.0, TypeError),
        (True, TypeError),
        (-1, LLMParamError),
        (2**64, LLMParamError),
    ):
        with pytest.raises(exc):
            a.query_register_mem_status(bad)  # type: ignore[arg-type]
        with pytest.raises(exc):
            await a.unlink(bad)  # type: ignore[arg-type]


ME = 5101
GOOD = {ME: 0, 5102: 1}
TABLE = rank_table([0, 1])


@pytest.mark.parametrize(
    ("args", "exc", "words"),
    [
        ((1, GOOD, TABLE), TypeError, "comm_name"),
        (("", GOOD, TABLE), LLMParamError, "comm_name"),
        (("x" * 128, GOOD, TABLE), LLMParamError, "comm_name"),
        (("c", [(ME, 0)], TABLE), TypeError, "cluster_rank_info"),
        (("c", {str(ME): 0, 5102: 1}, TABLE), TypeError, "cluster_rank_info key"),
        (("c", {ME: "0", 5102: 1}, TABLE), TypeError, "cluster_rank_info value"),
        (("c", {ME: 0, 5102: True}, TABLE), TypeError, "cluster_rank_info value"),
        (("c", {ME: 0, -1: 1}, TABLE), LLMParamError, "uint64"),
        (("c", {ME: 0, 5102: 2**32}, TABLE), LLMParamError, "uint32"),
        (("c", {ME: 0}, TABLE), LLMParamError, "bigger than 1"),
        (("c", {ME: 0, 2: 1, 3: 2, 4: 3, 5: 4}, TABLE), LLMParamError, "greater than 4"),
        (("c", {ME: 1, 5102: 0}, TABLE), LLMParamError, "ordered"),
        (("c", {ME: 0, 5102: 0}, TABLE), LLMParamError, "duplicated"),
        (("c", GOOD, b"{}"), TypeError, "rank_table"),
        (("c", GOOD, "{"), LLMParamError, "not JSON"),
        (("c", GOOD, rank_table([0, 2])), LLMParamError, "no rank 1"),
        (("c", {5103: 0, 5104: 1}, TABLE), LLMParamError, "not in cluster_rank_info"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
async def test_argument_checks(
    two: tuple[LLMDataDist, LLMDataDist], args: tuple, exc: type[Exception], words: str
) -> None:
    a, _ = two
    with pytest.raises(exc, match=words) as info:
        await a.link(*args)
    if exc is LLMParamError:
        assert info.value.status_code == S.LLM_PARAM_INVALID  # type: ignore[attr-defined]
    with pytest.raises(LLMException):
        a.query_register_mem_status(1)  # nothing was started


async def test_link_needs_init() -> None:
    dd = LLMDataDist(LLMRole.MIX, 5199)
    with pytest.raises(RuntimeError, match="not initialized"):
        await dd.link("c", {5199: 0, 1: 1}, TABLE)
    with pytest.raises(RuntimeError, match="not initialized"):
        dd.query_register_mem_status(1)


async def test_an_inbound_link_that_came_first_is_taken_over() -> None:
    """The lower rank already listens (llm.listenIpInfo): the higher rank's link arrives
    before the lower rank calls link(); that call adopts it instead of ALREADY_LINK."""
    port = free_port()
    a = LLMDataDist(LLMRole.MIX, 5161, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
    b = LLMDataDist(LLMRole.MIX, 5162)
    await started(a, b)
    try:
        seeds = fill(a, b)
        members = {a.cluster_id: 0, b.cluster_id: 1}
        table = rank_table([0, 1], listen={0: f"127.0.0.1:{port}"})
        id_b = await b.link("early", members, table)
        assert await wait_status(b, id_b) is RegisterMemStatus.OK
        assert [link.remote_cluster_id for link in a.links] == [b.cluster_id]
        id_a = await a.link("early", members, table)
        assert await wait_status(a, id_a) is RegisterMemStatus.OK
        await pull_both_ways(a, b, *seeds)
        await a.unlink(id_a)
        await b.unlink(id_b)
        assert a.links == [] and b.links == []
        assert a.listen_address == ("127.0.0.1", port)  # configured: it stays
    finally:
        await finalize(a, b)


def comm_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("aiodatadist-comm-")]


async def test_finalize_and_unlink_end_establishment(rundir: Path) -> None:
    a = LLMDataDist(LLMRole.MIX, 5171, {"llm.LinkTotalTime": "60"})
    await a.init()
    try:
        # Members that never come: one we wait for (we are rank 0), one we look for.
        waiting = await a.link("wait", {5171: 0, 5172: 1}, rank_table([0, 1]))
        looking = await a.link("look", {5173: 0, 5171: 1}, rank_table([0, 1]))
        await asyncio.sleep(0.05)
        assert len(comm_tasks()) == 2
        assert a.query_register_mem_status(looking) is RegisterMemStatus.PREPARING
        (name,) = os.listdir(rundir)  # we accept for "wait"
        assert name.startswith("comm-") and name.endswith("-cluster-5171.json")
        await a.unlink(waiting)
        assert len(comm_tasks()) == 1
    finally:
        await a.finalize()
    assert comm_tasks() == []  # finalize cancelled the other: nothing left running
    assert os.listdir(rundir) == []


async def test_at_most_512_comms(rundir: Path) -> None:
    a = LLMDataDist(LLMRole.MIX, 5181, {"llm.LinkTotalTime": "60"})
    await a.init()
    try:
        table = rank_table([0, 1])
        # We are rank 0 of each: every comm waits for its member's inbound link.
        ids = [await a.link(f"c{i}", {5181: 0, 100_000 + i: 1}, table) for i in range(512)]
        assert ids == list(range(1, 513))
        with pytest.raises(LLMException) as info:
            await a.link("one-too-many", {5181: 0, 99_999: 1}, table)
        assert info.value.status_code == S.LLM_CLUSTER_NUM_EXCEED_LIMIT
        await a.unlink(ids[0])
        await a.link("now-fits", {5181: 0, 99_999: 1}, table)
    finally:
        await a.finalize()
    assert comm_tasks() == []


async def test_a_refused_handshake_fails_the_connecting_side() -> None:
    """Different shared secrets: the higher rank's handshake is refused: FAILED at once, not
    retried until the deadline (the lower rank keeps waiting until its own)."""
    port = free_port()
    a = LLMDataDist(
        LLMRole.MIX, 5191, {"aiodatadist.SharedSecret": "one", "llm.LinkTotalTime": "60"}
    )
    b = LLMDataDist(
        LLMRole.MIX, 5192, {"aiodatadist.SharedSecret": "two", "llm.LinkTotalTime": "60"}
    )
    await started(a, b)
    try:
        members = {a.cluster_id: 0, b.cluster_id: 1}
        table = rank_table([0, 1], listen={0: f"127.0.0.1:{port}"})
        ids = await asyncio.gather(a.link("auth", members, table), b.link("auth", members, table))
        assert await wait_status(b, ids[1]) is RegisterMemStatus.FAILED
        assert a.query_register_mem_status(ids[0]) is RegisterMemStatus.PREPARING
        assert a.links == [] and b.links == []
        await a.unlink(ids[0])
        await b.unlink(ids[1])
    finally:
        await finalize(a, b)


async def test_rendezvous_keeps_other_jobs_apart(rundir: Path) -> None:
    # Two jobs on one host reusing cluster ids: the rendezvous file is keyed by the comm
    # (name, cluster_rank_info, the ranks' device entries), so a member of one job never
    # finds, and never links to, the other job's listener.
    opts = {"aiodatadist.DataPath": "tcp", "llm.LinkTotalTime": "1"}
    a, b = LLMDataDist(LLMRole.MIX, 5181, opts), LLMDataDist(LLMRole.MIX, 5182, opts)
    await started(a, b)
    try:
        members = {a.cluster_id: 0, b.cluster_id: 1}
        theirs = rank_table([0, 1]).replace("192.168.1.", "192.168.9.")  # other devices
        id_a = await a.link("pd_comm", members, rank_table([0, 1]))
        id_b = await b.link("pd_comm", members, theirs)
        assert await wait_status(b, id_b) is RegisterMemStatus.FAILED
        assert await wait_status(a, id_a) is RegisterMemStatus.FAILED
        assert b.links == [] and a.links == []
        await a.unlink(id_a)
        await b.unlink(id_b)
        assert os.listdir(rundir) == []
        # The same job (identical arguments) does find itself.
        id_a = await a.link("pd_comm", members, rank_table([0, 1]))
        id_b = await b.link("pd_comm", members, rank_table([0, 1]))
        assert await wait_status(b, id_b) is RegisterMemStatus.OK
        assert await wait_status(a, id_a) is RegisterMemStatus.OK
    finally:
        await finalize(a, b)


async def test_hccl_connect_timeout_is_the_default_deadline(
    rundir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without llm.LinkTotalTime, upstream falls back to $HCCL_CONNECT_TIMEOUT (seconds).
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1")
    async with LLMDataDist(LLMRole.MIX, 5191) as a:
        loop = asyncio.get_running_loop()
        start = loop.time()
        comm = await a.link("never", {5191: 0, 5192: 1}, rank_table([0, 1]))
        assert await wait_status(a, comm, bound=10) is RegisterMemStatus.FAILED
        assert 0.5 <= loop.time() - start < 5
        await a.unlink(comm)
