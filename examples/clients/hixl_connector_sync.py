"""vllm-ascend's ``HIXLConnector`` (PR #13526) on ``aiodatadist.sync``.

The connector's datadist wrapper and decode-side pull path (reference §10.2), ported
with only these changes:

* the import: ``from llm_datadist import ...`` -> ``from aiodatadist.sync import ...``;
* numpy arrays for torch tensors (``t.data_ptr()`` -> ``a.ctypes.data``, arrays kept
  alive), and the pool initializer's ``torch.npu.set_device(dev)`` is a no-op (no NPU);
* a multiprocessing queue and barrier carry what vLLM's scheduler and proxy carry (the
  request's remote block ids, host and port).

The connector's logic as it is: a process-singleton wrapper with
``LLMConfig(device_id, local_comm_res="", transfer_backend="hixl", listen_ip_info=...)``
plus ``link_total_time`` / ``link_retry_count`` / ``sync_kv_timeout``; cluster ids as
HIXL's samples make them (``(ipv4 << 16) | port``); ``ensure_linked`` (one
``link_clusters`` to the prefill's listen address, idempotent under a lock, called by
every pull thread); a unique ``model_id`` per registered cache (two KV-cache groups
with K and V per layer, and a Mamba group's conv and ssm states as two caches with one
tensor per layer); pulls on a ``ThreadPoolExecutor(32)``, all on one link, one
``pull_blocks`` per contiguous run of blocks with explicit
``src_layer_range=dst_layer_range=range(num_tensors // 2)`` (Mamba:
``range(num_tensors)`` with ``tensor_num_per_layer=1``); ``LLMException`` logged and
re-raised; shutdown by ``unlink_clusters(..., force=True)`` and ``finalize``.

Run it from the repository root::

    .venv/bin/python examples/clients/hixl_connector_sync.py

``AIODATADIST_PORTAL_LOOP=uvloop`` runs the library's portal loop on uvloop.
"""

from __future__ import annotations

import ipaddress
import logging
import multiprocessing as mp
import os
import queue
import random
import socket
import sys
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiodatadist.sync import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from aiodatadist.testing.patterns import fill_pattern, pattern_blocks, pattern_mismatches

logger = logging.getLogger("vllm_ascend.distributed.kv_p2p.hixl_connector")

# ===================================================== utils/hixl_datadist.py (the wrapper)


def make_cluster_id(ip: str, port: int) -> int:
    """A cluster id unique per listen address, as HIXL's samples make it."""
    return (int(ipaddress.IPv4Address(ip)) << 16) | port


class HixlDataDist:
    """The process's one LLM-DataDist instance, with the links it made."""

    _instance: HixlDataDist | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get_instance(
        cls, role: LLMRole, device_id: int, listen_ip: str, listen_port: int, **kwargs: Any
    ) -> HixlDataDist:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls(role, device_id, listen_ip, listen_port, **kwargs)
            return cls._instance

    def __init__(
        self,
        role: LLMRole,
        device_id: int,
        listen_ip: str,
        listen_port: int,
        link_total_time: int | None = None,
        link_retry_count: int | None = None,
        sync_kv_timeout: int | None = None,
        ge_options: dict[str, str] | None = None,
    ) -> None:
        self.listen_ip = listen_ip
        self.listen_port = listen_port
        self.cluster_id = make_cluster_id(listen_ip, listen_port)
        config = LLMConfig()
        config.device_id = device_id
        config.local_comm_res = ""  # implies the cache manager and remote-accessible caches
        config.transfer_backend = "hixl"
        config.listen_ip_info = f"{listen_ip}:{listen_port}"
        if link_total_time is not None:
            config.link_total_time = link_total_time
        if link_retry_count is not None:
            config.link_retry_count = link_retry_count
        if sync_kv_timeout is not None:
            config.sync_kv_timeout = sync_kv_timeout
        if ge_options:
            config.ge_options = ge_options
        self.datadist = LLMDataDist(role, self.cluster_id)
        self.datadist.init(config.generate_options())
        self.cache_manager = self.datadist.cache_manager
        self._link_lock = threading.Lock()
        self._linked: dict[int, LLMClusterInfo] = {}
        self._next_model_id = 0
        logger.info(
            "hixl datadist cluster %d listening on %s:%d", self.cluster_id, listen_ip, listen_port
        )

    def register_blocks_cache(
        self,
        tensors: list[np.ndarray],
        data_type: DataType,
    ) -> tuple[Any, int]:
        # A unique model_id per registered cache: the native index is last-wins, so two
        # caches under one key would silently re-point pulls.
        model_id = self._next_model_id
        self._next_model_id += 1
        desc = CacheDesc(len(tensors), list(tensors[0].shape), data_type)
        addrs = [t.ctypes.data for t in tensors]  # torch: t.data_ptr()
        cache = self.cache_manager.register_blocks_cache(
            desc, addrs, BlocksCacheKey(self.cluster_id, model_id)
        )
        return cache, model_id

    def ensure_linked(self, remote_cluster_id: int, ip: str, port: int) -> None:
        with self._link_lock:
            if remote_cluster_id in self._linked:
                return
            info = LLMClusterInfo()
            info.remote_cluster_id = remote_cluster_id
            info.append_local_ip_info(self.listen_ip, self.listen_port)
            info.append_remote_ip_info(ip, port)
            ret, rets = self.datadist.link_clusters([info], 5000)
            if ret != LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(
                    f"link_clusters to {remote_cluster_id} ({ip}:{port}) failed: {ret}, {rets}"
                )
            self._linked[remote_cluster_id] = info
            logger.info("linked to cluster %d at %s:%d", remote_cluster_id, ip, port)

    def pull_blocks(
        self,
        remote_cluster_id: int,
        model_id: int,
        cache: Any,
        src_blocks: list[int],
        dst_blocks: list[int],
        layer_range: range,
        tensor_num_per_layer: int,
    ) -> None:
        try:
            self.cache_manager.pull_blocks(
                BlocksCacheKey(remote_cluster_id, model_id),
                cache,
                src_blocks,
                dst_blocks,
                src_layer_range=layer_range,
                dst_layer_range=layer_range,
                tensor_num_per_layer=tensor_num_per_layer,
            )
        except LLMException as e:
            logger.error(
                "pull_blocks from cluster %d model %d failed: %s (%s)",
                remote_cluster_id,
                model_id,
                e,
                e.status_code,
            )
            raise

    def shutdown(self) -> None:
        with self._link_lock:
            for remote_cluster_id, info in list(self._linked.items()):
                ret, _ = self.datadist.unlink_clusters([info], 5000, force=True)
                if ret != LLMStatusCode.LLM_SUCCESS:
                    logger.warning("unlink of cluster %d: %s", remote_cluster_id, ret)
                del self._linked[remote_cluster_id]
        self.datadist.finalize()


# ============================================== kv_p2p/hixl_connector.py (the worker side)


@dataclass
class RegisteredCache:
    name: str
    cache: Any
    model_id: int
    num_tensors: int
    tensor_num_per_layer: int


@dataclass
class ReqMeta:
    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int


def _set_device(device_id: int) -> None:
    # torch.npu.set_device(device_id): the NPU device is thread-local; no NPU here.
    pass


def contiguous_runs(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Splits a block mapping into runs contiguous on both sides: one pull per run."""
    runs: list[tuple[list[int], list[int]]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0][-1] + 1 == s and runs[-1][1][-1] + 1 == d:
            runs[-1][0].append(s)
            runs[-1][1].append(d)
        else:
            runs.append(([s], [d]))
    return runs


class HIXLConnectorWorker:
    def __init__(self, role: LLMRole, device_id: int, listen_ip: str, listen_port: int) -> None:
        self.datadist = HixlDataDist.get_instance(
            role,
            device_id,
            listen_ip,
            listen_port,
            link_total_time=30,
            link_retry_count=3,
            sync_kv_timeout=5000,
        )
        self.registered: list[RegisteredCache] = []
        self.executor = ThreadPoolExecutor(
            max_workers=32,
            initializer=_set_device,
            initargs=(device_id,),
            thread_name_prefix="hixl-pull",
        )

    def register_kv_caches(self, kv_cache_groups: dict[str, dict[str, Any]]) -> None:
        for name, group in kv_cache_groups.items():
            if group["kind"] == "attention":  # K0, V0, K1, V1, ...: two tensors per layer
                tensors = [t for layer in group["layers"] for t in layer]
                cache, model_id = self.datadist.register_blocks_cache(tensors, group["dtype"])
                self.registered.append(RegisteredCache(name, cache, model_id, len(tensors), 2))
            else:  # Mamba: conv and ssm states as two caches, one tensor per layer
                for state in ("conv", "ssm"):
                    tensors = [layer[state] for layer in group["layers"]]
                    cache, model_id = self.datadist.register_blocks_cache(
                        tensors, group["dtype"][state]
                    )
                    self.registered.append(
                        RegisteredCache(f"{name}.{state}", cache, model_id, len(tensors), 1)
                    )

    def _pull_run(
        self,
        meta: ReqMeta,
        remote_cluster_id: int,
        reg: RegisteredCache,
        src: list[int],
        dst: list[int],
    ) -> None:
        self.datadist.ensure_linked(remote_cluster_id, meta.remote_host, meta.remote_port)
        if reg.tensor_num_per_layer == 1:
            layer_range = range(reg.num_tensors)
        else:
            layer_range = range(reg.num_tensors // 2)
        self.datadist.pull_blocks(
            remote_cluster_id,
            reg.model_id,
            reg.cache,
            src,
            dst,
            layer_range,
            reg.tensor_num_per_layer,
        )

    def start_load_kv(self, requests: list[ReqMeta]) -> list[Future[None]]:
        futures = []
        for meta in requests:
            remote_cluster_id = make_cluster_id(meta.remote_host, meta.remote_port)
            for src, dst in contiguous_runs(meta.remote_block_ids, meta.local_block_ids):
                for reg in self.registered:
                    futures.append(
                        self.executor.submit(self._pull_run, meta, remote_cluster_id, reg, src, dst)
                    )
        return futures

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)
        self.datadist.shutdown()


# ================================================ the harness (stands in for vLLM and the proxy)

BOUND_S = 20.0  # every wait of the harness: a failed peer ends the run instead of hanging it
HOST = "127.0.0.1"
NUM_BLOCKS = 48
N_REQUESTS = 6


def make_kv_cache_groups() -> dict[str, dict[str, Any]]:
    """A hybrid model's caches: full and sliding-window attention groups and a Mamba group."""

    def blocks(*shape: int, dtype: Any = np.float16) -> np.ndarray:
        return np.zeros((NUM_BLOCKS, *shape), dtype)

    return {
        "full_attn": {
            "kind": "attention",
            "dtype": DataType.DT_FLOAT16,
            "layers": [(blocks(16, 2, 16), blocks(16, 2, 16)) for _ in range(4)],
        },
        "sliding_attn": {
            "kind": "attention",
            "dtype": DataType.DT_FLOAT16,
            "layers": [(blocks(16, 1, 32), blocks(16, 1, 32)) for _ in range(2)],
        },
        "mamba": {
            "kind": "mamba",
            "dtype": {"conv": DataType.DT_FLOAT16, "ssm": DataType.DT_FLOAT},
            "layers": [
                {"conv": blocks(4, 64), "ssm": blocks(8, 16, dtype=np.float32)} for _ in range(3)
            ],
        },
    }


def cache_tensors(
    worker: HIXLConnectorWorker,
    groups: dict[str, dict[str, Any]],
) -> dict[int, list[np.ndarray]]:
    """The tensors of each registered cache (by model_id), in registration order."""
    out = {}
    for reg in worker.registered:
        name, _, state = reg.name.partition(".")
        layers = groups[name]["layers"]
        out[reg.model_id] = (
            [layer[state] for layer in layers] if state else [t for lay in layers for t in lay]
        )
    return out


def _seed(what: str, model_id: int) -> int:
    return zlib.crc32(f"hixl-connector/{what}/model{model_id}".encode())


def _chunked_order(rng: random.Random) -> list[int]:
    """Every block id once, in shuffled runs of 1..3 consecutive ids."""
    chunks, b = [], 0
    while b < NUM_BLOCKS:
        n = min(rng.randint(1, 3), NUM_BLOCKS - b)
        chunks.append(list(range(b, b + n)))
        b += n
    rng.shuffle(chunks)
    return [i for c in chunks for i in c]


def _fill(tensors: list[np.ndarray], blocks: list[int], seed: int) -> None:
    for t, arr in enumerate(tensors):
        raw = arr.view(np.uint8).reshape(arr.shape[0], -1)
        raw[blocks] = pattern_blocks(seed, t, blocks, raw.shape[1])


def run_prefill(port: int, proxy: Any, done: Any) -> None:
    logging.basicConfig(level=logging.WARNING)
    worker = HIXLConnectorWorker(LLMRole.PROMPT, 0, HOST, port)
    groups = make_kv_cache_groups()
    worker.register_kv_caches(groups)
    tensors = cache_tensors(worker, groups)
    order = _chunked_order(random.Random("prefill"))
    requests = []
    for r in range(N_REQUESTS):
        ids = order[r * 7 : r * 7 + 5 + r % 3]
        for model_id, ts in tensors.items():
            _fill(ts, ids, _seed(f"req-{r}", model_id))
        requests.append((f"req-{r}", ids))
    proxy.put(requests)
    done.wait(BOUND_S)  # the decoder pulled everything
    worker.shutdown()


def run_decode(port: int, prefill_port: int, proxy: Any, done: Any, results: Any) -> None:
    logging.basicConfig(level=logging.WARNING)
    worker = HIXLConnectorWorker(LLMRole.DECODER, 1, HOST, port)
    groups = make_kv_cache_groups()
    worker.register_kv_caches(groups)
    tensors = cache_tensors(worker, groups)
    for model_id, ts in tensors.items():
        fill_pattern(ts, _seed("decode-background", model_id))
    order = _chunked_order(random.Random("decode"))
    metas = []
    for req_id, remote_ids in proxy.get(timeout=BOUND_S):
        local_ids, order = order[: len(remote_ids)], order[len(remote_ids) :]
        metas.append(ReqMeta(req_id, local_ids, remote_ids, HOST, prefill_port))
    futures = worker.start_load_kv(metas)
    for f in futures:
        f.result(timeout=BOUND_S)
    checked = 0
    for meta in metas:
        for model_id, ts in tensors.items():
            bad = pattern_mismatches(
                ts, meta.remote_block_ids, meta.local_block_ids, _seed(meta.req_id, model_id)
            )
            assert not bad, f"{meta.req_id} model {model_id}: {bad[0]} ({len(bad)} blocks)"
            checked += len(meta.local_block_ids) * sum(t[0].nbytes for t in ts)
    for model_id, ts in tensors.items():
        bad = pattern_mismatches(ts, order, order, _seed("decode-background", model_id))
        assert not bad, f"a block no request named changed: model {model_id}: {bad[0]}"
    links = len(worker.datadist.datadist.links)
    done.wait(BOUND_S)
    worker.shutdown()
    results.put(
        f"{len(metas)} requests, {len(futures)} pull_blocks calls from 32 threads "
        f"on {links} link, {len(tensors)} caches, {checked} bytes checked"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def main() -> int:
    ctx = mp.get_context("spawn")
    prefill_port, decode_port = _free_port(), _free_port()
    proxy, done, results = ctx.Queue(), ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=run_prefill, name="prefill", args=(prefill_port, proxy, done)),
        ctx.Process(
            target=run_decode, name="decode", args=(decode_port, prefill_port, proxy, done, results)
        ),
    ]
    for p in procs:
        p.start()
    line = None
    deadline = time.monotonic() + BOUND_S + 10
    while line is None and time.monotonic() < deadline:
        try:
            line = results.get(timeout=0.1)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a worker failed: its peer would only wait for it
    for p in procs:
        p.join(BOUND_S if line is not None else 0.5)
        if p.exitcode is None:
            p.kill()
            p.join()
    failed = [f"{p.name} exit {p.exitcode}" for p in procs if p.exitcode != 0]
    if failed or line is None:
        print(f"FAILED: {', '.join(failed) or 'no result'}")
        return 1
    print(line)
    loop = os.environ.get("AIODATADIST_PORTAL_LOOP", "asyncio")
    print(f"OK hixl_connector_sync (portal loop {loop}): HIXLConnector pulls verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
