"""MindIE-LLM's ``SeparateDeploymentEngine`` awaited on ``aiodatadist``.

The same port as ``mindie_sync.py`` (read that one first), on the async API:
``from aiodatadist import ...`` and ``await`` before ``init``, ``link``, ``unlink``,
``pull_blocks`` and ``finalize``. What an asyncio engine does differently:

* construction that awaits ``init`` is a coroutine (``await SeparateDeploymentEngine.create(...)``);
* the link window of 16 threads becomes tasks, at most 16 at once (``asyncio.Semaphore(16)``);
  ``time.sleep(1)`` between status queries becomes ``await asyncio.sleep(1)``;
* the harness's barrier waits run in ``asyncio.to_thread``.

Run it from the repository root::

    .venv/bin/python examples/clients/mindie_async.py [--loop asyncio|uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
)
from aiodatadist.testing.patterns import fill_pattern, pattern_blocks, pattern_mismatches

logger = logging.getLogger("mindie_llm.text_generator.utils.separate_deployment_engine")

# ======================================================== separate_deployment_engine.py


class PDErrorCode(IntEnum):
    """What the engine reports upward (MindIE's own codes; only their meaning matters here)."""

    SUCCESS = 0
    PD_PARAM_INVALID = 1
    PD_PULL_KV_FAILED = 2
    PD_LINK_FAILED = 3


ROLE_MAP = {"prefill": LLMRole.PROMPT, "decoder": LLMRole.DECODER, "flex": LLMRole.MIX}
MAX_LINK_WINDOW = 16
QUERY_TRIES = 3
LINK_TIMEOUT_S = 300


@dataclass
class RemoteInstance:
    cluster_id: int
    host_ip: str
    device_id: int
    device_ip: str
    dp_rank: int


class SeparateDeploymentEngine:
    def __init__(
        self,
        role: str,
        local: RemoteInstance,
        kv_trans_timeout: int = 1,
        kv_link_timeout: int = 1080,
        rdma_sl: int | None = 4,
        rdma_tc: int | None = 132,
    ) -> None:
        self.role = ROLE_MAP[role]
        self.local = local
        llm_config = LLMConfig()
        llm_config.device_id = local.device_id
        llm_config.enable_cache_manager = True
        llm_config.enable_remote_cache_accessible = True
        llm_config.link_total_time = kv_link_timeout
        llm_config.link_retry_count = 80
        llm_config.sync_kv_timeout = kv_trans_timeout * 1000
        options = llm_config.generate_options()
        if rdma_sl is not None:
            options["llm.RdmaServiceLevel"] = str(rdma_sl)
        if rdma_tc is not None:
            options["llm.RdmaTrafficClass"] = str(rdma_tc)
        self.separate_deployment_engine = LLMDataDist(self.role, local.cluster_id)
        self.options = options  # init is awaited by create()
        self.cache_manager: Any = None
        self.npu_cache: dict[int, Any] = {}
        self.linked: dict[int, int] = {}  # remote cluster id -> comm id
        self.already_link_tolerated = 0

    @classmethod
    async def create(
        cls,
        role: str,
        local: RemoteInstance,
        **kwargs: Any,
    ) -> SeparateDeploymentEngine:
        engine = cls(role, local, **kwargs)
        await engine.separate_deployment_engine.init(engine.options)
        engine.cache_manager = engine.separate_deployment_engine.cache_manager
        return engine

    def register_kv_cache(self, kv_cache: list[list[np.ndarray]], data_type: DataType) -> None:
        """``kv_cache[model_id]``: the tensors of one cache (K = 0, V = 1), one per layer."""
        for model_id, tensors in enumerate(kv_cache):
            cache_desc = CacheDesc(
                num_tensors=len(tensors),
                shape=list(tensors[0].shape),
                data_type=data_type,
                placement=Placement.DEVICE,
            )
            addrs = [t.ctypes.data for t in tensors]  # torch_npu: tensor.data_ptr()
            cache_key = BlocksCacheKey(self.local.cluster_id, model_id)
            self.npu_cache[model_id] = self.cache_manager.register_blocks_cache(
                cache_desc, addrs, cache_key
            )
            logger.info("registered model_id %d: %d tensors", model_id, len(tensors))

    def _build_link_args(self, remote: RemoteInstance) -> tuple[str, dict[int, int], str]:
        members = sorted([self.local, remote], key=lambda m: ipaddress.IPv4Address(m.device_ip))
        lo, hi = members
        link_name = (
            f"link{hi.device_ip}:{lo.device_ip}_"
            f"{min(lo.dp_rank, hi.dp_rank)}:{max(lo.dp_rank, hi.dp_rank)}"
        )
        cluster_rank_info = {m.cluster_id: rank for rank, m in enumerate(members)}
        server_list: list[dict[str, Any]] = []
        for rank, m in enumerate(members):
            device = {"device_id": str(m.device_id), "device_ip": m.device_ip, "rank_id": str(rank)}
            if server_list and server_list[-1]["server_id"] == m.host_ip:
                server_list[-1]["device"].append(device)
            else:
                server_list.append({"server_id": m.host_ip, "device": [device]})
        rank_table = {
            "server_count": str(len(server_list)),
            "server_list": server_list,
            "status": "completed",
            "version": "1.0",
        }
        return link_name, cluster_rank_info, json.dumps(rank_table)

    async def _link_one(self, remote: RemoteInstance, deadline: float) -> PDErrorCode:
        link_name, cluster_rank_info, rank_table = self._build_link_args(remote)
        while time.monotonic() < deadline:
            try:
                comm_id = await self.separate_deployment_engine.link(
                    link_name, cluster_rank_info, rank_table
                )
            except LLMException as e:
                if e.status_code == LLMStatusCode.LLM_ALREADY_LINK:
                    logger.info("%s already linked, skip", link_name)
                    self.already_link_tolerated += 1
                    return PDErrorCode.SUCCESS
                logger.error("link %s failed: %s", link_name, e)
                return PDErrorCode.PD_LINK_FAILED
            for _ in range(QUERY_TRIES):
                status = self.separate_deployment_engine.query_register_mem_status(comm_id)
                if status == RegisterMemStatus.OK:
                    self.linked[remote.cluster_id] = comm_id
                    logger.info("link %s ready (comm %d)", link_name, comm_id)
                    return PDErrorCode.SUCCESS
                if status == RegisterMemStatus.FAILED:
                    break
                await asyncio.sleep(1)
            logger.warning("link %s not ready after %d queries, retry", link_name, QUERY_TRIES)
            await self.separate_deployment_engine.unlink(comm_id)
        return PDErrorCode.PD_LINK_FAILED

    async def link(self, remotes: list[RemoteInstance]) -> list[PDErrorCode]:
        """Links to every remote: at most 16 attempts at once, 5 minutes for all."""
        deadline = time.monotonic() + LINK_TIMEOUT_S
        window = asyncio.Semaphore(MAX_LINK_WINDOW)

        async def attempt(remote: RemoteInstance) -> PDErrorCode:
            async with window:
                return await self._link_one(remote, deadline)

        return list(await asyncio.gather(*(attempt(r) for r in remotes)))

    async def pull_kv(
        self, remote_cluster_id: int, src_block_table: list[int], dst_block_table: list[int]
    ) -> PDErrorCode:
        for model_id, npu_cache in self.npu_cache.items():
            num_blocks = npu_cache.cache_desc.shape[0]
            if any(b < 0 or b >= num_blocks for b in dst_block_table):
                logger.error(
                    "dst block table out of range [0, %d): %s", num_blocks, dst_block_table
                )
                return PDErrorCode.PD_PARAM_INVALID
            try:
                await self.cache_manager.pull_blocks(
                    BlocksCacheKey(remote_cluster_id, model_id),
                    npu_cache,
                    src_block_table,
                    dst_block_table,
                )
            except LLMException as e:
                logger.error(
                    "pull kv from cluster %d model %d failed: %s",
                    remote_cluster_id,
                    model_id,
                    e.status_code,
                )
                return PDErrorCode.PD_PULL_KV_FAILED
        return PDErrorCode.SUCCESS

    async def unlink(self, remote_cluster_id: int) -> None:
        comm_id = self.linked.pop(remote_cluster_id)
        await self.separate_deployment_engine.unlink(comm_id)

    async def finalize(self) -> None:
        for remote_cluster_id in list(self.linked):
            await self.unlink(remote_cluster_id)
        await self.separate_deployment_engine.finalize()


# ====================================================== the harness (stands in for MindIE)

BOUND_S = 20.0  # every wait of the harness: a failed peer ends the run instead of hanging it
HOST = "127.0.0.1"
LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 4, 32, (16, 2, 16)  # [num_blocks, block_size, heads, dim]
INSTANCES = {  # device IPs: the decoder's is the smallest, so it is rank 0 of its pair
    "prefill": RemoteInstance(100, HOST, 0, "10.1.0.5", 0),
    "decoder": RemoteInstance(200, HOST, 1, "10.1.0.3", 0),
    "flex": RemoteInstance(300, HOST, 2, "10.1.0.9", 1),
}
REQUESTS = {  # puller -> (request id, prefill blocks, local blocks)
    "decoder": [("d-0", [3, 4, 5, 9], [0, 1, 2, 7]), ("d-1", [11, 2], [20, 21])],
    "flex": [("f-0", [17, 18], [5, 6]), ("f-1", [25, 1, 30], [30, 0, 12])],
}


def _seed(what: str, model_id: int) -> int:
    return zlib.crc32(f"mindie/{what}/model{model_id}".encode())


def make_kv_cache() -> list[list[np.ndarray]]:
    """K cache (model_id 0) and V cache (model_id 1): one tensor per layer each."""
    return [
        [np.zeros((NUM_BLOCKS, *BLOCK_SHAPE), np.float16) for _ in range(LAYERS)] for _ in range(2)
    ]


async def run_instance(role: str, linked_ready: Any, done: Any, results: Any) -> None:
    logging.basicConfig(level=logging.WARNING)
    me = INSTANCES[role]
    engine = await SeparateDeploymentEngine.create(role, me)
    kv_cache = make_kv_cache()
    for model_id, tensors in enumerate(kv_cache):
        if role == "prefill":
            for req_id, src, _ in (r for rs in REQUESTS.values() for r in rs):
                for t, arr in enumerate(tensors):
                    raw = arr.view(np.uint8).reshape(NUM_BLOCKS, -1)
                    raw[src] = pattern_blocks(_seed(req_id, model_id), t, src, raw.shape[1])
        else:
            fill_pattern(tensors, _seed(f"{role}-background", model_id))
    engine.register_kv_cache(kv_cache, DataType.DT_FLOAT16)
    if role == "prefill":
        codes = await engine.link([INSTANCES["decoder"], INSTANCES["flex"]])
    else:
        # The coordinator's link command arrives twice: LLM_ALREADY_LINK, tolerated.
        codes = await engine.link([INSTANCES["prefill"], INSTANCES["prefill"]])
    assert all(c == PDErrorCode.SUCCESS for c in codes), f"{role}: link {codes}"
    await asyncio.to_thread(linked_ready.wait, BOUND_S)
    summary = f"{role}: linked {sorted(engine.linked)}"
    if role != "prefill":
        prefill = INSTANCES["prefill"].cluster_id
        checked = 0
        for req_id, src, dst in REQUESTS[role]:
            code = await engine.pull_kv(prefill, src, dst)
            assert code == PDErrorCode.SUCCESS, f"{role} {req_id}: {code.name}"
            for model_id, tensors in enumerate(kv_cache):
                bad = pattern_mismatches(tensors, src, dst, _seed(req_id, model_id))
                assert not bad, f"{role} {req_id} model {model_id}: {bad[0]}"
                checked += len(dst) * sum(t[0].nbytes for t in tensors)
        # The engine's own checks: a destination block out of range never reaches the API,
        # a pull over a link that does not exist comes back as MindIE's pull error.
        bad_dst = await engine.pull_kv(prefill, [0], [NUM_BLOCKS])
        assert bad_dst == PDErrorCode.PD_PARAM_INVALID, bad_dst
        unlinked = await engine.pull_kv(999, [0], [NUM_BLOCKS - 1])
        assert unlinked == PDErrorCode.PD_PULL_KV_FAILED, unlinked
        named = {b for _, _, dst in REQUESTS[role] for b in dst}
        untouched = [b for b in range(NUM_BLOCKS) if b not in named]
        for model_id, tensors in enumerate(kv_cache):
            bad = pattern_mismatches(
                tensors, untouched, untouched, _seed(f"{role}-background", model_id)
            )
            assert not bad, f"{role}: a block no request named changed: {bad[0]}"
        summary += (
            f", {len(REQUESTS[role])} requests x 2 caches, {checked} bytes checked, "
            f"ALREADY_LINK tolerated {engine.already_link_tolerated}x"
        )
    await asyncio.to_thread(done.wait, BOUND_S)  # nobody unlinks before every pull is done
    await engine.finalize()  # unlinks every comm (both sides unlink), then finalizes
    results.put(summary)


def run_on_loop(loop: str, fn: Any, *args: Any) -> None:
    """An instance process's entry: ``fn(*args)`` on an asyncio or a uvloop event loop."""
    if loop == "uvloop":
        import uvloop

        uvloop.run(fn(*args))
    else:
        asyncio.run(fn(*args))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    loop = parser.parse_args().loop
    if os.environ.get("AIODATADIST_RUNDIR"):
        return run_all(loop)
    # link()'s same-host rendezvous directory, private to this run, inherited by the instances.
    with tempfile.TemporaryDirectory(prefix="aiodd-run-") as rundir:
        os.environ["AIODATADIST_RUNDIR"] = rundir
        return run_all(loop)


def run_all(loop: str) -> int:
    ctx = mp.get_context("spawn")
    linked_ready, done, results = ctx.Barrier(3), ctx.Barrier(3), ctx.Queue()
    procs = [
        ctx.Process(
            target=run_on_loop,
            name=role,
            args=(loop, run_instance, role, linked_ready, done, results),
        )
        for role in INSTANCES
    ]
    for p in procs:
        p.start()
    lines: list[str] = []
    deadline = time.monotonic() + BOUND_S + 10
    while len(lines) < len(procs) and time.monotonic() < deadline:
        try:
            lines.append(results.get(timeout=0.1))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # an instance failed: its peers would only wait for it
    for p in procs:
        p.join(BOUND_S if len(lines) == len(procs) else 0.5)
        if p.exitcode is None:
            p.kill()
            p.join()
    failed = [f"{p.name} exit {p.exitcode}" for p in procs if p.exitcode != 0]
    if failed or len(lines) != len(procs):
        print(f"FAILED: {', '.join(failed) or 'missing results'}")
        return 1
    for line in sorted(lines):
        print(line)
    print(f"OK mindie_async ({loop}): SeparateDeploymentEngine pulls verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
