"""Two-sided links across processes: this process and a peer process both call ``link``
with one rank table, poll ``query_register_mem_status`` until OK, pull each other's
caches (bytes checked), and both unlink. The routes: the same-host rendezvous directory
(a temporary ``AIODATADIST_RUNDIR`` in both environments; no ``listen_ip_info``) and a
``listen_ip_info`` in the rank table. A peer killed (-9) during PREPARING: FAILED within
the deadline. And upstream's switch-role sample flow across the two processes.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodatadist import LLMDataDist, LLMRole, RegisterMemStatus
from aiodatadist.testing import cluster_info
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import Harness, PeerProc, link, pull_and_check, until

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

LOCAL, PEER = 7101, 7102
LOCAL_SEED, PEER_SEED = 71, 72
DST = xc.Spec("dst", True, False, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE), model_id=7)
BOUND_S = 30.0


def rank_table(listen: dict[int, str] | None = None) -> str:
    servers = []
    for rank in (0, 1):
        dev: dict[str, Any] = {
            "device_id": str(rank),
            "device_ip": f"192.168.1.{rank + 1}",
            "super_device_id": str(rank),
            "rank_id": str(rank),
        }
        if listen and rank in listen:
            dev["listen_ip_info"] = listen[rank]
        servers.append({"server_id": f"10.0.0.{rank + 1}", "device": [dev]})
    return json.dumps(
        {"version": "1.2", "server_count": "2", "status": "completed", "server_list": servers}
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous_file(rundir: Path, cluster_id: int) -> dict[str, Any] | None:
    paths = list(rundir.glob(f"comm-*-cluster-{cluster_id}.json"))
    return json.loads(paths[0].read_text()) if paths else None


async def local_status(dd: LLMDataDist, comm_id: int) -> RegisterMemStatus:
    async with asyncio.timeout(BOUND_S):
        while True:
            status = dd.query_register_mem_status(comm_id)
            if status is not RegisterMemStatus.PREPARING:
                return status
            await asyncio.sleep(0.02)


async def peer_status(peer: PeerProc, comm_id: int) -> str:
    async with asyncio.timeout(BOUND_S):
        while True:
            status = (await peer.ok("comm_status", comm_id=comm_id))["status"]
            if status != "PREPARING":
                return str(status)
            await asyncio.sleep(0.02)


async def peer_pulls_and_checks(
    peer: PeerProc, src_blocks: list[int], dst_blocks: list[int]
) -> None:
    """The peer pulls this process's ``reg`` cache into its zeroed ``dst``; its digest must
    be the reference's."""
    await peer.ok("register", name="dst", model_id=DST.model_id, seed=None)
    await peer.ok(
        "pull_blocks",
        cluster_id=LOCAL,
        model_id=xc.SPECS["reg"].model_id,
        dst="dst",
        src_blocks=src_blocks,
        dst_blocks=dst_blocks,
        timeout=10,
    )
    want = xc.expect_blocks(
        np.zeros((DST.num_tensors, DST.nbytes), np.uint8),
        xc.reference(LOCAL_SEED, "reg"),
        DST.unit,
        src_blocks,
        dst_blocks,
        (0, 0, DST.num_tensors),
    )
    assert (await peer.ok("digest", name="dst"))["sha"] == xc.digests(want)
    await peer.ok("free", name="dst")


@pytest.fixture
def rundir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "run"
    monkeypatch.setenv("AIODATADIST_RUNDIR", str(path))
    return path


@pytest.mark.parametrize(
    ("route", "local_rank"),
    [("rendezvous", 0), ("rendezvous", 1), ("listen_ip_info", 0), ("listen_ip_info", 1)],
)
async def test_two_processes_link_pull_both_ways_and_unlink(
    rundir: Path, route: str, local_rank: int
) -> None:
    async with Harness() as h:
        peer = await h.peer(
            cluster_id=PEER, seed=PEER_SEED, listen=None, env={"AIODATADIST_RUNDIR": str(rundir)}
        )
        dd, caches = await h.local(LOCAL, role=LLMRole.MIX, seed=LOCAL_SEED)
        dst = xc.make_cache(dd, DST, None, LOCAL)
        members = {LOCAL: local_rank, PEER: 1 - local_rank}
        ordered = sorted(members.items(), key=lambda kv: kv[1])
        lower = ordered[0][0]
        listen = {0: f"127.0.0.1:{free_port()}"} if route == "listen_ip_info" else None
        table = rank_table(listen)
        # Both at once: the peer's call goes out first, ours right behind it.
        await peer.send(
            "comm_link", comm_name="pd_comm_x", members=[list(m) for m in ordered], rank_table=table
        )
        comm_id = await dd.link("pd_comm_x", dict(ordered), table)
        reply = await peer.reply()
        assert reply.get("ok"), reply
        peer_comm = int(reply["comm_id"])
        assert await local_status(dd, comm_id) is RegisterMemStatus.OK
        assert await peer_status(peer, peer_comm) == "OK"
        published = rendezvous_file(rundir, lower)
        assert published is not None and published["host"] == "127.0.0.1"
        if route == "listen_ip_info" and lower == LOCAL:
            assert listen is not None
            assert dd.listen_address == ("127.0.0.1", int(listen[0].rpartition(":")[2]))
        # This process pulls the peer's "alloc" cache; the peer pulls our "reg" cache.
        await pull_and_check(dd, dst, PEER, PEER_SEED, "alloc", [5, 0, 7], [1, 2, 3])
        await peer_pulls_and_checks(peer, [6, 1], [0, 4])
        # Both unlink; the second side finds its link already closed by the first.
        await dd.unlink(comm_id)
        await peer.ok("comm_unlink", comm_id=peer_comm)
        assert dd.links == []
        assert (await peer.ok("links"))["links"] == []
        assert rendezvous_file(rundir, lower) is None  # removed with the last comm
        del caches


async def test_peer_killed_while_preparing_fails_within_the_deadline(rundir: Path) -> None:
    async with Harness() as h:
        peer = await h.peer(
            cluster_id=PEER, seed=PEER_SEED, listen=None, env={"AIODATADIST_RUNDIR": str(rundir)}
        )
        dd, _ = await h.local(
            LOCAL,
            {"llm.LinkTotalTime": "2", "llm.SyncKvCacheWaitTime": "5000"},
            role=LLMRole.MIX,
            seed=LOCAL_SEED,
        )
        table = rank_table()
        members = [[PEER, 0], [LOCAL, 1]]
        # The peer (rank 0) publishes its address and waits for us ...
        await peer.ok("comm_link", comm_name="doomed", members=members, rank_table=table)
        await until(lambda: rendezvous_file(rundir, PEER) is not None, 10, "the peer's file")
        peer.kill()  # ... and dies (-9) before we call link: its file stays, stale.
        await peer.wait_dead()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        comm_id = await dd.link("doomed", dict(members), table)
        assert dd.query_register_mem_status(comm_id) is RegisterMemStatus.PREPARING
        assert await local_status(dd, comm_id) is RegisterMemStatus.FAILED
        assert 1.8 <= loop.time() - t0 < 10  # the 2 s deadline, honoured
        assert dd.links == []
        await dd.unlink(comm_id)

        # And the other way round: killed while it waits for our (never made) link.
        peer2 = await h.peer(
            cluster_id=PEER + 1,
            seed=PEER_SEED,
            listen=None,
            env={"AIODATADIST_RUNDIR": str(rundir)},
        )
        members2 = [[LOCAL, 0], [PEER + 1, 1]]
        comm_id = await dd.link("doomed2", dict(members2), table)  # we listen, publish, wait
        await peer2.ok("comm_link", comm_name="doomed2", members=members2, rank_table=table)
        peer2.kill()
        await peer2.wait_dead()
        status = await local_status(dd, comm_id)
        # It may have linked before it died (the loss then fails the comm) or not at all.
        assert status is RegisterMemStatus.FAILED or (
            status is RegisterMemStatus.OK and await _fails_soon(dd, comm_id)
        )
        await dd.unlink(comm_id)


async def _fails_soon(dd: LLMDataDist, comm_id: int) -> bool:
    async with asyncio.timeout(BOUND_S):
        while True:
            if dd.query_register_mem_status(comm_id) is RegisterMemStatus.FAILED:
                return True
            await asyncio.sleep(0.02)


async def test_switch_role_sample_flow_across_processes() -> None:
    """Upstream's switch-role sample: D links to P and pulls; both unlink; P becomes the
    decoder (a pure client), D the prompt (listening); P links to D and pulls."""
    async with Harness() as h:
        p = await h.peer(cluster_id=PEER, seed=PEER_SEED)  # PROMPT, listening
        d, _ = await h.local(LOCAL, role=LLMRole.DECODER, seed=LOCAL_SEED)
        dst = xc.make_cache(d, DST, None, LOCAL)
        await link(d, p, PEER)
        await pull_and_check(d, dst, PEER, PEER_SEED, "reg", [3, 4], [0, 1])
        status, _ = await d.unlink_clusters([cluster_info(PEER)])
        assert status == 0
        port = free_port()
        await d.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
        r = await p.ok("switch_role", role="DECODER")
        assert r["address"] is None
        assert d.role is LLMRole.PROMPT and d.listen_address == ("127.0.0.1", port)
        r = await p.ok("link", cluster_id=LOCAL, host="127.0.0.1", port=port)
        assert r["status"] == 0, r
        await peer_pulls_and_checks(p, [2, 7, 0], [5, 6, 7])
        r = await p.ok("unlink", cluster_id=LOCAL)
        assert r["status"] == 0, r
