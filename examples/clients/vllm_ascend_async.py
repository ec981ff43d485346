"""vllm-ascend's ``LLMDataDistCMgrConnector`` (v0.9.1 ... v0.11.0) awaited on ``aiodatadist``.

The same port as ``vllm_ascend_sync.py`` (read that one first), on the async API:
``from aiodatadist import ...`` and ``await`` before ``init``, ``link``, ``pull_blocks``
and ``finalize``. Beyond that, what an asyncio worker does differently:

* ``init`` cannot run in ``__init__``: the harness awaits ``worker.init_llm_datadist()``
  right after constructing the worker;
* the ``ThreadPoolExecutor(max_workers=1)`` of pulls becomes one asyncio task per request,
  serialized by an ``asyncio.Lock`` (one pull at a time, in submission order);
* the listener thread becomes a task; ``time.sleep(1)`` between polls becomes
  ``await asyncio.sleep(1)``; the side channel's blocking queue reads (ZMQ -> queues, as in
  the sync port) run in ``asyncio.to_thread`` so the loop keeps serving the link meanwhile.

Run it from the repository root::

    .venv/bin/python examples/clients/vllm_ascend_async.py [--loop asyncio|uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import random
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import numpy as np

import aiodatadist as llm_datadist
from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
)
from aiodatadist.testing.patterns import fill_pattern, pattern_blocks, pattern_mismatches

logger = logging.getLogger("vllm_ascend.llmdatadist_c_mgr_connector")

# ============================================================== the connector (worker side)

# torch dtype -> DataType in the connector; numpy dtypes here (numpy for torch).
NUMPY_DTYPE_TO_NPU_DTYPE = {
    np.dtype(np.float16): DataType.DT_FLOAT16,
    np.dtype(np.float32): DataType.DT_FLOAT,
    np.dtype(np.int8): DataType.DT_INT8,
    np.dtype(np.int32): DataType.DT_INT32,
    np.dtype(np.int64): DataType.DT_INT64,
}

SYNC_KV_TIMEOUT = 20000  # ms: the connector's value up to v0.10


class LLMDataDistCMgrEvent(Enum):
    ReqForMetadata = 0
    ReqForFinished = 1


@dataclass
class LLMDataDistCMgrAgentMetadata:
    super_pod_id: str | None
    server_id: str
    device_id: str
    device_ip: str
    super_device_id: str | None
    cluster_id: int


@dataclass
class ReqMeta:
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    engine_id: str
    remote_tp_size: int


@dataclass
class LLMDataDistCMgrConnectorMetadata:
    requests: dict[str, ReqMeta] = field(default_factory=dict)

    def add_new_req(
        self, request_id: str, local_block_ids: list[int], params: dict[str, Any]
    ) -> None:
        self.requests[request_id] = ReqMeta(
            local_block_ids=local_block_ids,
            remote_block_ids=params["remote_block_ids"],
            engine_id=params["remote_engine_id"],
            remote_host=params["remote_host"],
            remote_port=params["remote_port"],
            remote_tp_size=params["remote_tp_size"],
        )


class LLMDataDistCMgrConnectorWorker:
    """The connector's worker: one per TP rank (one per process here)."""

    def __init__(
        self,
        kv_role: str,
        global_rank_table: dict[str, Any],
        server_id: str,
        local_rank: int,
        rpc_port: int,
        side_channels: dict[int, Any],
        reply_queues: dict[int, Any],
    ) -> None:
        self.local_rank = local_rank
        self.tp_rank = 0
        self.tp_size = 1
        self.port = rpc_port
        # ZMQ -> queues: our ROUTER socket is side_channels[port]; a REQ socket to
        # host:port is a put on side_channels[port] (identity: our port) and a get on
        # reply_queues[our port].
        self.side_channels = side_channels
        self.reply_queues = reply_queues
        self.reply_queue = reply_queues[rpc_port]
        self.llm_datadist_role = LLMRole.PROMPT if kv_role == "kv_producer" else LLMRole.DECODER
        self.soc_info = (
            "A3"
            if any("super_device_id" in d for d in global_rank_table["prefill_device_list"])
            else "A2"
        )
        self.local_agent_metadata = self.read_agent_metadata(
            global_rank_table, server_id, local_rank, kv_role
        )
        self.llm_datadist = LLMDataDist(
            self.llm_datadist_role, self.local_agent_metadata.cluster_id
        )
        # init is awaited by the caller: await worker.init_llm_datadist()
        self.finished_reqs: set[str] = set()
        self.thread_lock = threading.Lock()
        self.linked_cluster: dict[int, int] = {}
        # ThreadPoolExecutor(max_workers=1) -> tasks taking turns on one lock
        self.executor = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()

    def read_agent_metadata(
        self, global_rank_table: dict[str, Any], server_id: str, device_rank: int, agent_role: str
    ) -> LLMDataDistCMgrAgentMetadata:
        devices_type_list = []
        agent_metadata = None
        if self.llm_datadist_role == LLMRole.PROMPT:
            devices_type_list.append("prefill_device_list")
        elif self.llm_datadist_role == LLMRole.DECODER:
            devices_type_list.append("decode_device_list")
        else:
            devices_type_list.append("prefill_device_list")
            devices_type_list.append("decode_device_list")
        for device_type in devices_type_list:
            device_list = global_rank_table[device_type]
            device_list = [d for d in device_list if d.get("server_id") == server_id]
            if len(device_list) <= device_rank:
                continue
            device_info = device_list[device_rank]
            agent_metadata = LLMDataDistCMgrAgentMetadata(
                super_pod_id=device_info.get("super_pod_id", None),
                server_id=device_info["server_id"],
                device_id=device_info["device_id"],
                device_ip=device_info["device_ip"],
                super_device_id=device_info.get("super_device_id", None),
                cluster_id=int(device_info["cluster_id"]),
            )
        assert agent_metadata is not None, (
            f"Can't read the target server_id {server_id} and device_rank {device_rank} "
            f"from rank table"
        )
        return agent_metadata

    async def init_llm_datadist(self) -> None:
        assert self.local_agent_metadata is not None
        llm_config = LLMConfig()
        llm_config.device_id = self.local_rank
        llm_config.sync_kv_timeout = SYNC_KV_TIMEOUT
        llm_config.enable_switch_role = True
        llm_config.enable_cache_manager = True
        llm_config.enable_remote_cache_accessible = True
        llm_config_options = llm_config.generate_options()
        await self.llm_datadist.init(llm_config_options)
        self.cache_manager = self.llm_datadist.cache_manager
        logger.info("Finish initializing llm_datadist with options %s", llm_config_options)

    async def listen_for_agent_metadata_req(self, event: asyncio.Event) -> None:
        # ZMQ -> queue: the ROUTER socket's recv_multipart is a get on our inbox.
        sock = self.side_channels[self.port]
        event.set()
        while True:
            item = await asyncio.to_thread(sock.get)
            if item is None:  # the harness stops the listener
                return
            event_msg, decode_msg, identity = item
            event_msg = LLMDataDistCMgrEvent(event_msg)
            if event_msg == LLMDataDistCMgrEvent.ReqForMetadata:
                if "cluster_id" in decode_msg:
                    decode_msg = LLMDataDistCMgrAgentMetadata(**decode_msg)
                    logger.info(
                        "LLMDataDistCMgrConnectorWorker: Receive message from cluster %d",
                        decode_msg.cluster_id,
                    )
                    self.reply_queues[identity].put(asdict(self.local_agent_metadata))
                    await self.add_remote_agent(decode_msg)
                else:
                    logger.warning("Receiving unrecognized decode_msg %s", decode_msg)
            elif event_msg == LLMDataDistCMgrEvent.ReqForFinished:
                finished_req_id = decode_msg[0]
                with self.thread_lock:
                    logger.debug("Request %s finished sending", finished_req_id)
                    self.finished_reqs.add(finished_req_id)
                self.reply_queues[identity].put(b"receiving decode finished")
            else:
                raise RuntimeError(
                    f"LLMDataDistCMgrConnectorWorker: Receiving unexpected "
                    f"request event {event_msg} from remote !"
                )

    async def register_kv_caches(self, kv_caches: dict[str, tuple[np.ndarray, ...]]) -> None:
        _, first_kv_cache_tuple = next(iter(kv_caches.items()))
        first_kv_cache = first_kv_cache_tuple[0]
        assert len(first_kv_cache_tuple) > 1
        assert self.local_agent_metadata is not None
        kv_cache_dtype = first_kv_cache.dtype
        self.use_mla: bool = first_kv_cache_tuple[0].shape[-1] != first_kv_cache_tuple[1].shape[-1]
        block_rank = 3
        if self.use_mla:
            self.block_len = [
                first_kv_cache_tuple[0].itemsize
                * math.prod(first_kv_cache_tuple[0].shape[-block_rank:]),
                first_kv_cache_tuple[1].itemsize
                * math.prod(first_kv_cache_tuple[1].shape[-block_rank:]),
            ]
        else:
            self.block_len = [
                first_kv_cache.itemsize * math.prod(first_kv_cache.shape[-block_rank:])
            ]
        alignment = 2 * 1024 * 1024
        self.cache_addr: Any = []
        if self.use_mla:
            cache_k_normed_addr_list = []
            cache_k_pe_addr_list = []
            k_normed = None
            k_pe = None
            for cache_or_caches in kv_caches.values():
                assert len(cache_or_caches) > 1
                k_normed, k_pe = cache_or_caches[0], cache_or_caches[1]
                cache_k_normed_addr_list.append(k_normed.ctypes.data)  # torch: data_ptr()
                cache_k_pe_addr_list.append(k_pe.ctypes.data)
            self.cache_addr = (cache_k_normed_addr_list, cache_k_pe_addr_list)
            assert k_normed is not None and k_pe is not None
            cache_desc_k_normed = CacheDesc(
                len(self.cache_addr[0]), [*k_normed.shape], NUMPY_DTYPE_TO_NPU_DTYPE[kv_cache_dtype]
            )
            cache_desc_k_pe = CacheDesc(
                len(self.cache_addr[1]), [*k_pe.shape], NUMPY_DTYPE_TO_NPU_DTYPE[kv_cache_dtype]
            )
            cache_key_k_normed = BlocksCacheKey(
                cluster_id=int(self.local_agent_metadata.cluster_id), model_id=0
            )
            cache_key_k_pe = BlocksCacheKey(
                cluster_id=int(self.local_agent_metadata.cluster_id), model_id=1
            )
            self.cache_desc = (cache_desc_k_normed, cache_desc_k_pe)
            self.cache_key = (cache_key_k_normed, cache_key_k_pe)
            try:
                cache_k_normed = self.cache_manager.register_blocks_cache(
                    self.cache_desc[0], self.cache_addr[0], self.cache_key[0]
                )
                cache_k_pe = self.cache_manager.register_blocks_cache(
                    self.cache_desc[1], self.cache_addr[1], self.cache_key[1]
                )
                self.cache = (cache_k_normed, cache_k_pe)
                logger.info("LLMDataDistWorker: End of register Paged Cache.")
            except (TypeError, ValueError) as e:
                raise RuntimeError(
                    f"LLMDataDistCMgrConnectorWorker: Passing unexpected parameter to "
                    f"register_block_cache, receiving [cache_desc: {self.cache_desc}, "
                    f"cache_addr: {self.cache_addr}, cache_key: {self.cache_key}]"
                ) from e
        else:
            cache = None
            for cache_or_caches in kv_caches.values():
                for cache in cache_or_caches:
                    base_addr = cache.ctypes.data  # torch: data_ptr()
                    assert base_addr % alignment == 0, (
                        "The address of the registered kv cache should be aligned to 2M"
                    )
                    self.cache_addr.append(base_addr)
            assert cache is not None
            self.cache_desc = CacheDesc(
                len(self.cache_addr), [*cache.shape], NUMPY_DTYPE_TO_NPU_DTYPE[kv_cache_dtype]
            )
            self.cache_key = BlocksCacheKey(cluster_id=int(self.local_agent_metadata.cluster_id))
            try:
                self.cache = self.cache_manager.register_blocks_cache(
                    self.cache_desc, self.cache_addr, self.cache_key
                )
                logger.info("LLMDataDistWorker: End of register Paged Cache.")
            except (TypeError, ValueError) as e:
                raise RuntimeError(
                    f"LLMDataDistCMgrConnectorWorker: Passing unexpected parameter to "
                    f"register_block_cache, receiving [cache_desc: {self.cache_desc}, "
                    f"cache_addr: {self.cache_addr}, cache_key: {self.cache_key}]"
                ) from e
        self.ready_event = asyncio.Event()
        self.metadata_agent_listener_t = asyncio.create_task(
            self.listen_for_agent_metadata_req(self.ready_event), name="metadata_agent_listener"
        )
        await self.ready_event.wait()

    def start_load_kv(self, metadata: LLMDataDistCMgrConnectorMetadata) -> None:
        futures = []
        for req_id, meta in metadata.requests.items():
            logger.debug("Start to transmit %s", req_id)
            future = asyncio.create_task(
                self._read_blocks_in_turn(
                    local_block_ids=meta.local_block_ids,
                    remote_block_ids=meta.remote_block_ids,
                    remote_ip=meta.remote_host,
                    remote_port=int(meta.remote_port),
                    remote_engine_id=meta.engine_id,
                    request_id=req_id,
                    remote_tp_size=meta.remote_tp_size,
                )
            )
            futures.append(future)
            self.tasks.add(future)
            future.add_done_callback(self.tasks.discard)

        def handle_exception(future: Any) -> None:
            if not future.cancelled() and future.exception():
                logger.error("KV transfer task failed: %s", future.exception())

        for future in futures:
            future.add_done_callback(handle_exception)

    async def add_remote_agent(self, metadata: LLMDataDistCMgrAgentMetadata) -> int:
        assert self.local_agent_metadata is not None
        remote_cluster_id = metadata.cluster_id
        if remote_cluster_id in self.linked_cluster:
            logger.debug(
                "LLMDataDistCMgrConnectorWorker: remote cluster_id: %d already linked "
                "with this server, skip the connection",
                remote_cluster_id,
            )
            return remote_cluster_id
        remote_super_pod_id = metadata.super_pod_id
        remote_server_id = metadata.server_id
        is_same_server = remote_server_id == self.local_agent_metadata.server_id
        is_same_pod = remote_super_pod_id == self.local_agent_metadata.super_pod_id
        if self.llm_datadist_role == LLMRole.PROMPT:
            prefill_metadata = self.local_agent_metadata
            decode_metadata = metadata
        else:
            prefill_metadata = metadata
            decode_metadata = self.local_agent_metadata
        comm_name = f"pd_comm_{prefill_metadata.device_ip}_{decode_metadata.device_ip}"
        cluster_rank_info = {prefill_metadata.cluster_id: 0, decode_metadata.cluster_id: 1}
        rank_table: dict[str, Any] = {}
        rank_table["version"] = "1.2"
        rank_table["server_count"] = "1" if is_same_server else "2"
        rank_table["status"] = "completed"

        # generate server_list for rank table
        rank_table["server_list"] = []
        decode_server_device_info = None
        prefill_server_device_info = {
            "device": [
                {
                    k: v
                    for k, v in [
                        ("device_id", prefill_metadata.device_id),
                        ("device_ip", prefill_metadata.device_ip),
                        ("super_device_id", prefill_metadata.super_device_id),
                        ("rank_id", "0"),
                    ]
                    if v is not None
                }
            ],
            "server_id": prefill_metadata.server_id,
        }
        if is_same_server:
            prefill_server_device_info["device"].append(  # type: ignore[attr-defined]
                {
                    k: v
                    for k, v in [
                        ("device_id", decode_metadata.device_id),
                        ("device_ip", decode_metadata.device_ip),
                        ("super_device_id", decode_metadata.super_device_id),
                        ("rank_id", "1"),
                    ]
                    if v is not None
                }
            )
        else:
            decode_server_device_info = {
                "device": [
                    {
                        k: v
                        for k, v in [
                            ("device_id", decode_metadata.device_id),
                            ("device_ip", decode_metadata.device_ip),
                            ("super_device_id", decode_metadata.super_device_id),
                            ("rank_id", "1"),
                        ]
                        if v is not None
                    }
                ],
                "server_id": decode_metadata.server_id,
            }
        rank_table["server_list"].append(prefill_server_device_info)
        if decode_server_device_info is not None:
            rank_table["server_list"].append(decode_server_device_info)

        if self.soc_info == "A3":
            # generate super_pod_list for rank table
            super_pod_list = []
            prefill_super_pod_info = {
                "super_pod_id": prefill_metadata.super_pod_id,
                "server_list": [{"server_id": prefill_metadata.server_id}],
            }
            if is_same_pod and not is_same_server:
                prefill_super_pod_info["server_list"].append(  # type: ignore[attr-defined]
                    {"server_id": decode_metadata.server_id}
                )
            super_pod_list.append(prefill_super_pod_info)
            if not is_same_pod:
                decode_super_pod_info = {
                    "super_pod_id": decode_metadata.super_pod_id,
                    "server_list": [{"server_id": decode_metadata.server_id}],
                }
                super_pod_list.append(decode_super_pod_info)
            rank_table["super_pod_list"] = super_pod_list
        logger.info("LLMDataDistCMgrConnectorWorker: try link with remote, comm id: %s", comm_name)
        logger.info("rank table \n%s", rank_table)
        logger.info("comm name: %s", comm_name)
        logger.info("cluster rank info: %s", cluster_rank_info)
        comm_id = await self.llm_datadist.link(comm_name, cluster_rank_info, json.dumps(rank_table))
        while True:
            ret = self.llm_datadist.query_register_mem_status(comm_id=comm_id)
            if ret == llm_datadist.RegisterMemStatus.OK:
                logger.info("LLMDataDistCMgrConnectorWorker: Linking success, comm id: %d", comm_id)
                break
            elif ret == llm_datadist.RegisterMemStatus.FAILED:
                raise RuntimeError(
                    f"LLMDataDistCMgrConnectorWorker: Linking failed, comm id: {comm_id}"
                )
            await asyncio.sleep(1)
            logger.info("Checking query_register_mem_status again")
        self.linked_cluster.update({remote_cluster_id: comm_id})
        logger.info("cached linked cluster: %s", self.linked_cluster)
        logger.info(
            "Successfully build link with cluster id %d with cluster name %s !",
            remote_cluster_id,
            comm_name,
        )
        return remote_cluster_id

    async def connect_to_remote_agent(self, host: str, port: int) -> int:
        # ZMQ -> queues: a REQ round trip to tcp://host:port.
        logger.debug("Querying metadata from url: tcp://%s:%d", host, port)
        sock = self.side_channels[port]
        logger.info("Try request remote metadata from socket......")
        sock.put(
            (
                LLMDataDistCMgrEvent.ReqForMetadata.value,
                asdict(self.local_agent_metadata),
                self.port,
            )
        )
        metadata = await asyncio.to_thread(self.reply_queue.get)
        metadata = LLMDataDistCMgrAgentMetadata(**metadata)
        logger.info("recving metadata: %s", metadata)
        cluster_id = await self.add_remote_agent(metadata)
        return cluster_id

    async def send_finish_to_remote(self, host: str, ports: list[int], request_id: str) -> None:
        for port in ports:
            logger.debug("Sending finished to remote: tcp://%s:%d", host, port)
            # ZMQ -> queues: a REQ round trip.
            sock = self.side_channels[port]
            try:
                sock.put((LLMDataDistCMgrEvent.ReqForFinished.value, [request_id], self.port))
                logger.debug("Request id %s finished message send to remote %d", request_id, port)
                _ = await asyncio.to_thread(self.reply_queue.get)
            except Exception as e:
                logger.error("Failed to send reqest_id %s to prefill: %s", request_id, e)

    async def _read_blocks_in_turn(self, **kwargs: Any) -> None:
        async with self.executor:  # one pull at a time, as the single-thread executor
            await self._read_blocks(**kwargs)

    async def _read_blocks(
        self,
        local_block_ids: list[int],
        remote_block_ids: list[int],
        remote_ip: str,
        remote_port: int,
        remote_engine_id: str,
        request_id: str,
        remote_tp_size: int,
    ) -> None:
        tp_offset = self.tp_rank % remote_tp_size
        remote_cluster_id = await self.connect_to_remote_agent(remote_ip, remote_port + tp_offset)
        num_local_blocks = len(local_block_ids)
        if num_local_blocks == 0:
            return
        num_remote_blocks = len(remote_block_ids)
        assert num_local_blocks <= num_remote_blocks
        if num_local_blocks < num_remote_blocks:
            remote_block_ids = remote_block_ids[-num_local_blocks:]

        logger.info("remote cluster id is: %d", remote_cluster_id)
        if self.use_mla:
            remote_cache_key_k_normed = BlocksCacheKey(cluster_id=remote_cluster_id, model_id=0)
            remote_cache_key_k_pe = BlocksCacheKey(cluster_id=remote_cluster_id, model_id=1)
            logger.info("Try pull blocks from remote server")
            try:
                await self.cache_manager.pull_blocks(
                    remote_cache_key_k_normed, self.cache[0], remote_block_ids, local_block_ids
                )
                await self.cache_manager.pull_blocks(
                    remote_cache_key_k_pe, self.cache[1], remote_block_ids, local_block_ids
                )
            except (TypeError, ValueError) as e:
                raise RuntimeError(
                    f"LLMDataDistCMgrConnectorWorker: Passing unexpected parameter to "
                    f"pull_blocks remote_cache_key: {remote_cache_key_k_normed} "
                    f"{remote_cache_key_k_pe}, cache: {self.cache}, local_block_ids: "
                    f"{local_block_ids}, remote_block_ids: {remote_block_ids}"
                ) from e
            except LLMException as e:
                raise RuntimeError(
                    "LLMDataDistCMgrConnectorWorker: Timeout during pull_blocks, you can try "
                    "to increase the sync_kv_timeout config or checking your connect status"
                ) from e
        else:
            remote_cache_key = BlocksCacheKey(cluster_id=remote_cluster_id)
            logger.info("Try pull blocks from remote server")
            try:
                await self.cache_manager.pull_blocks(
                    remote_cache_key, self.cache, remote_block_ids, local_block_ids
                )
            except (TypeError, ValueError) as e:
                raise RuntimeError(
                    f"LLMDataDistCMgrConnectorWorker: Passing unexpected parameter to "
                    f"pull_blocks remote_cache_key: {remote_cache_key}, cache: {self.cache}, "
                    f"local_block_ids: {local_block_ids}, remote_block_ids: {remote_block_ids}"
                ) from e
            except LLMException as e:
                raise RuntimeError(
                    "LLMDataDistCMgrConnectorWorker: Timeout during pull_blocks, you can try "
                    "to increase the sync_kv_timeout config or checking your connect status"
                ) from e
        remote_ports = list(
            range(remote_port + self.tp_rank, remote_port + int(remote_tp_size), self.tp_size)
        )
        await self.send_finish_to_remote(remote_ip, remote_ports, request_id)
        with self.thread_lock:
            self.finished_reqs.add(request_id)

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self.thread_lock:
            req_ids_to_ret = copy.deepcopy(self.finished_reqs)
            self.finished_reqs.clear()
        if self.llm_datadist_role == LLMRole.PROMPT:
            return req_ids_to_ret, set()
        return set(), req_ids_to_ret


# ================================================ the harness (stands in for vLLM's schedulers)

BOUND_S = 20.0  # every wait of the harness: a failed peer ends the run instead of hanging it
HOST = "127.0.0.1"
# (request id, remote blocks, local blocks): fewer local blocks = a prefix cached on D.
WAVES = [
    [("req-0", 4, 4), ("req-1", 6, 4), ("req-2", 1, 1)],
    [("req-3", 5, 2), ("req-4", 3, 3)],  # after P freed wave 0: reuses its blocks
]
MODELS = {
    # kind: (layers, blocks, per-tensor block shape of cache 0, of cache 1 (MLA) or None)
    "mha": (4, 24, (16, 2, 16), None),
    "mla": (61, 16, (4, 1, 32), (4, 1, 8)),
}


def _seed(kind: str, what: str, model_id: int) -> int:
    """A pattern seed unique to (model kind, request or background, cache)."""
    return zlib.crc32(f"vllm-ascend/{kind}/{what}/model{model_id}".encode())


def _aligned(shape: tuple[int, ...], dtype: Any, alignment: int = 2 << 20) -> np.ndarray:
    """A zeroed array starting on an ``alignment`` boundary (the connector asserts 2 MiB)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + alignment, np.uint8)
    off = (-raw.ctypes.data) % alignment
    return raw[off : off + nbytes].view(dtype).reshape(shape)


def make_kv_caches(kind: str) -> tuple[dict[str, tuple[np.ndarray, ...]], list[list[np.ndarray]]]:
    """vLLM's per-layer KV tensors, and the tensors of each registered cache in order."""
    layers, blocks, shape0, shape1 = MODELS[kind]
    kv_caches: dict[str, tuple[np.ndarray, ...]] = {}
    for layer in range(layers):
        name = f"model.layers.{layer}.self_attn.attn"
        second = shape0 if shape1 is None else shape1
        kv_caches[name] = (
            _aligned((blocks, *shape0), np.float16),
            _aligned((blocks, *second), np.float16),
        )
    if shape1 is None:  # MHA: K0, V0, K1, V1, ... in one cache
        per_cache = [[t for pair in kv_caches.values() for t in pair]]
    else:  # MLA: k_normed of every layer, then k_pe of every layer
        per_cache = [[p[0] for p in kv_caches.values()], [p[1] for p in kv_caches.values()]]
    return kv_caches, per_cache


def _fill(tensors: list[np.ndarray], blocks: list[int], seed: int) -> None:
    for t, arr in enumerate(tensors):
        raw = arr.view(np.uint8).reshape(arr.shape[0], -1)
        raw[blocks] = pattern_blocks(seed, t, blocks, raw.shape[1])


async def run_prefill(
    kind: str,
    rank_table: dict[str, Any],
    local_rank: int,
    port: int,
    side_channels: dict[int, Any],
    reply_queues: dict[int, Any],
    proxy: Any,
    done: Any,
) -> None:
    logging.basicConfig(level=logging.WARNING)
    worker = LLMDataDistCMgrConnectorWorker(
        "kv_producer", rank_table, HOST, local_rank, port, side_channels, reply_queues
    )
    await worker.init_llm_datadist()
    kv_caches, per_cache = make_kv_caches(kind)
    await worker.register_kv_caches(kv_caches)
    free = list(range(MODELS[kind][1]))
    random.Random(kind).shuffle(free)  # non-contiguous block ids, as a busy scheduler gives
    for wave in WAVES:
        owned: dict[str, list[int]] = {}
        for req_id, n_remote, _ in wave:
            ids = [free.pop() for _ in range(n_remote)]
            owned[req_id] = ids
            for model_id, tensors in enumerate(per_cache):
                _fill(tensors, ids, _seed(kind, req_id, model_id))
            # request_finished's kv_transfer_params, through the proxy to the decoder
            proxy.put(
                (
                    req_id,
                    {
                        "do_remote_prefill": True,
                        "remote_block_ids": ids,
                        "remote_engine_id": f"prefill-{local_rank}",
                        "remote_host": HOST,
                        "remote_port": port,
                        "remote_tp_size": 1,
                    },
                )
            )
        deadline = time.monotonic() + BOUND_S
        while owned:  # the scheduler frees a request's blocks once D reported it done
            finished_sending, _ = worker.get_finished()
            for req_id in finished_sending:
                free.extend(owned.pop(req_id))
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill {kind}: no ReqForFinished for {sorted(owned)}")
            await asyncio.sleep(0.01)
    proxy.put(None)
    await asyncio.to_thread(done.wait, BOUND_S)
    side_channels[port].put(None)  # stop the listener task
    await worker.metadata_agent_listener_t
    await worker.llm_datadist.finalize()


class _ErrorFlag(logging.Handler):
    """Notices the connector's 'KV transfer task failed' log (the only trace of a failed pull)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


async def run_decode(
    kind: str,
    rank_table: dict[str, Any],
    local_rank: int,
    port: int,
    side_channels: dict[int, Any],
    reply_queues: dict[int, Any],
    proxy: Any,
    done: Any,
    results: Any,
) -> None:
    logging.basicConfig(level=logging.WARNING)
    errors = _ErrorFlag()
    logger.addHandler(errors)
    worker = LLMDataDistCMgrConnectorWorker(
        "kv_consumer", rank_table, HOST, local_rank, port, side_channels, reply_queues
    )
    await worker.init_llm_datadist()
    kv_caches, per_cache = make_kv_caches(kind)
    for model_id, tensors in enumerate(per_cache):  # what the blocks held before: must stay
        fill_pattern(tensors, _seed(kind, "decode-background", model_id))
    await worker.register_kv_caches(kv_caches)
    free = list(range(MODELS[kind][1]))
    random.Random(f"{kind}-decode").shuffle(free)
    expected: dict[str, tuple[list[int], list[int]]] = {}
    while (item := await asyncio.to_thread(proxy.get, timeout=BOUND_S)) is not None:
        req_id, params = item
        n_local = next(n for wave in WAVES for r, _, n in wave if r == req_id)
        local_ids = [free.pop() for _ in range(n_local)]
        meta = LLMDataDistCMgrConnectorMetadata()
        meta.add_new_req(req_id, local_ids, params)
        worker.start_load_kv(meta)
        expected[req_id] = (params["remote_block_ids"][-n_local:], local_ids)
    finished: set[str] = set()
    deadline = time.monotonic() + BOUND_S
    while finished != set(expected):
        finished |= worker.get_finished()[1]
        if errors.records:
            raise RuntimeError(f"decode {kind}: {errors.records}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"decode {kind}: not finished: {set(expected) - finished}")
        await asyncio.sleep(0.01)
    checked = 0
    for req_id, (remote_ids, local_ids) in expected.items():
        for model_id, tensors in enumerate(per_cache):
            bad = pattern_mismatches(tensors, remote_ids, local_ids, _seed(kind, req_id, model_id))
            assert not bad, f"{kind} {req_id} model {model_id}: {bad[0]} ({len(bad)} blocks)"
            checked += len(local_ids) * sum(t[0].nbytes for t in tensors)
    untouched = sorted(free)
    for model_id, tensors in enumerate(per_cache):
        seed = _seed(kind, "decode-background", model_id)
        bad = pattern_mismatches(tensors, untouched, untouched, seed)
        assert not bad, f"{kind}: a block no request named changed: {bad[0]}"
    await asyncio.to_thread(done.wait, BOUND_S)
    side_channels[port].put(None)
    await worker.metadata_agent_listener_t
    await worker.llm_datadist.finalize()
    results.put(f"{kind}: {len(expected)} requests, {checked} bytes checked")


def run_on_loop(loop: str, fn: Any, *args: Any) -> None:
    """A worker process's entry: ``fn(*args)`` on an asyncio or a uvloop event loop."""
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
    # link()'s same-host rendezvous directory, private to this run, inherited by the workers.
    with tempfile.TemporaryDirectory(prefix="aiodd-run-") as rundir:
        os.environ["AIODATADIST_RUNDIR"] = rundir
        return run_all(loop)


def run_all(loop: str) -> int:
    ctx = mp.get_context("spawn")
    # DISAGGREGATED_PREFILL_RANK_TABLE_PATH's content, as gen_ranktable.py writes it.
    a2 = {
        "prefill_device_list": [
            {"server_id": HOST, "device_id": "0", "device_ip": "10.20.0.1", "cluster_id": "1"}
        ],
        "decode_device_list": [
            {"server_id": HOST, "device_id": "1", "device_ip": "10.20.0.2", "cluster_id": "2"}
        ],
    }
    a3 = {
        "prefill_device_list": [
            {
                "server_id": HOST,
                "device_id": "2",
                "device_ip": "10.20.0.3",
                "super_pod_id": "0",
                "super_device_id": "131074",
                "cluster_id": "3",
            }
        ],
        "decode_device_list": [
            {
                "server_id": HOST,
                "device_id": "3",
                "device_ip": "10.20.0.4",
                "super_pod_id": "0",
                "super_device_id": "131075",
                "cluster_id": "4",
            }
        ],
    }
    # VLLM_ASCEND_LLMDD_RPC_PORT per worker; ZMQ -> one inbox queue per port.
    ports = {"mha": (5557, 5558), "mla": (5567, 5568)}
    side_channels = {p: ctx.Queue() for pair in ports.values() for p in pair}
    replies = {p: ctx.Queue() for p in side_channels}
    results = ctx.Queue()
    procs, keep = [], []
    for kind, table in (("mha", a2), ("mla", a3)):
        proxy, done = ctx.Queue(), ctx.Barrier(2)
        keep.append((proxy, done))  # alive until the children have unpickled them
        p_port, d_port = ports[kind]
        procs.append(
            ctx.Process(
                target=run_on_loop,
                name=f"prefill-{kind}",
                args=(
                    loop,
                    run_prefill,
                    kind,
                    table,
                    0,
                    p_port,
                    side_channels,
                    replies,
                    proxy,
                    done,
                ),
            )
        )
        procs.append(
            ctx.Process(
                target=run_on_loop,
                name=f"decode-{kind}",
                args=(
                    loop,
                    run_decode,
                    kind,
                    table,
                    0,
                    d_port,
                    side_channels,
                    replies,
                    proxy,
                    done,
                    results,
                ),
            )
        )
    for p in procs:
        p.start()
    lines: list[str] = []
    deadline = time.monotonic() + BOUND_S + 10
    while len(lines) < len(ports) and time.monotonic() < deadline:
        try:
            lines.append(results.get(timeout=0.1))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a worker failed: its peers would only wait for it
    for p in procs:
        p.join(BOUND_S if len(lines) == len(ports) else 0.5)
        if p.exitcode is None:
            p.kill()
            p.join()
    failed = [f"{p.name} exit {p.exitcode}" for p in procs if p.exitcode != 0]
    if failed or len(lines) != len(ports):
        print(f"FAILED: {', '.join(failed) or 'missing results'}")
        return 1
    for line in sorted(lines):
        print(line)
    print(f"OK vllm_ascend_async ({loop}): LLMDataDistCMgrConnector MHA + MLA pulls verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
