"""omni-infer's ``LLMDataDistManager`` on ``aiodatadist.sync``.

The PD manager omni-infer vendors into vllm-ascend (reference §10.4), ported with only
these changes:

* the import: ``from llm_datadist import ...`` -> ``from aiodatadist.sync import ...``;
* numpy arrays for the NPU cache tensors (``data_ptr()`` -> ``ctypes.data``), and
  ``torch.npu.set_device`` before pulling is a no-op (no NPU);
* multiprocessing queues and barriers carry what omni-infer's scheduler carries;
* the status poll interval: 3 s in omni-infer, 1 s here (``LINK_STATUS_QUERY_INTERVAL``)
  to keep the run short; the first poll after ``link`` usually sees PREPARING.

The manager's logic: ``LLMConfig(device_id, enable_switch_role, enable_cache_manager,
sync_kv_timeout=20000 ("RoCE timeout is 20s"), enable_remote_cache_accessible=True)``; one
blocks cache per sub-cache index (``model_id``), with a key only on the prefill side;
two-sided ``link`` per (prefill rank, decode rank) pair, created in batches of 32 with 0.5 s
pauses, then every link's ``query_register_mem_status`` polled until all are OK; pulls with
a retry set (3 attempts, 2 s apart, on ``LLM_REPEAT_REQUEST``, ``LLM_CLUSTER_NUM_EXCEED_LIMIT``,
``LLM_PROCESSING_LINK``, ``LLM_DEVICE_OUT_OF_MEMORY``, ``LLM_TIMEOUT``,
``LLM_WAIT_PROCESS_TIMEOUT``, ``LLM_LINK_BUSY``; any other code re-raised at once); one
pull thread per remote prefill cluster, each with its own queue.

Processes: two prefill ranks and one decode rank (2P1D). Prefill rank 0 registers its
third sub-cache late, so the decoder's first pull from it fails with
``LLM_KV_CACHE_NOT_EXIST``: not in the retry set, re-raised without a retry, caught by the
pull thread and reported; once the cache is there the request is pulled again and succeeds.

Run it from the repository root::

    .venv/bin/python examples/clients/omni_infer_sync.py

``AIODATADIST_PORTAL_LOOP=uvloop`` runs the library's portal loop on uvloop.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiodatadist.sync import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    RegisterMemStatus,
)
from aiodatadist.testing.patterns import fill_pattern, pattern_blocks, pattern_mismatches

logger = logging.getLogger("omni.accelerators.pd.llmdatadist_manager")

# ================================================================== llmdatadist_manager.py

RETRYABLE_EXCEPTIONS = {
    LLMStatusCode.LLM_REPEAT_REQUEST,
    LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
    LLMStatusCode.LLM_PROCESSING_LINK,
    LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
    LLMStatusCode.LLM_TIMEOUT,
    LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
    LLMStatusCode.LLM_LINK_BUSY,
}
KV_CACHE_RETRY_TIMES = 3
KV_CACHE_RETRY_WAIT_SECOND = 2
SCHEDULER_LINK_BATCH_SIZE = 32
SCHEDULER_LINK_INTERVAL = 0.5
LINK_STATUS_QUERY_INTERVAL = 1  # omni-infer: 3 s
SYNC_KV_TIMEOUT = 20000  # RoCE timeout is 20s


@dataclass
class RankInfo:
    cluster_id: int
    host_ip: str
    device_id: int
    device_ip: str


@dataclass
class LLMDataDistConfig:
    role: LLMRole
    local: RankInfo


class LLMDataDistManager:
    def __init__(self, config: LLMDataDistConfig) -> None:
        self.config = config
        self.local_rank = config.local.device_id
        self.data_dist_engine = self._init_llm_data_dist()
        self.data_dist_manager = self.data_dist_engine.cache_manager
        self.registered_kv_caches: list[Any] = []
        self.registered_link_infos: dict[tuple[int, int], int] = {}

    def _init_llm_data_dist(self) -> LLMDataDist:
        data_dist = LLMDataDist(self.config.role, self.config.local.cluster_id)
        llm_config = LLMConfig()
        llm_config.device_id = self.local_rank
        llm_config.enable_switch_role = True
        llm_config.enable_cache_manager = True
        # RoCE timeout is 20s
        llm_config.sync_kv_timeout = SYNC_KV_TIMEOUT
        llm_config.enable_remote_cache_accessible = True
        options = llm_config.generate_options()
        data_dist.init(options)
        logger.info("init llm datadist with options %s", options)
        return data_dist

    def register_memory(self, kv_caches: list[list[np.ndarray]], data_type: DataType) -> None:
        """One blocks cache per sub-cache index; peers pull it as that ``model_id``."""
        for model_id, sub_kv_caches in enumerate(kv_caches):
            self.register_sub_cache(model_id, sub_kv_caches, data_type)

    def register_sub_cache(
        self, model_id: int, sub_kv_caches: list[np.ndarray], data_type: DataType
    ) -> None:
        cache_desc = CacheDesc(
            num_tensors=len(sub_kv_caches),
            shape=list(sub_kv_caches[0].shape),
            data_type=data_type,
        )
        cache_addrs = [int(item.ctypes.data) for item in sub_kv_caches]  # item.data_ptr()
        if self.config.role == LLMRole.PROMPT:
            cache_key = BlocksCacheKey(self.data_dist_engine.cluster_id, model_id=model_id)
            kv_cache = self.data_dist_manager.register_blocks_cache(
                cache_desc, cache_addrs, cache_key
            )
        else:
            kv_cache = self.data_dist_manager.register_blocks_cache(cache_desc, cache_addrs)
        while len(self.registered_kv_caches) <= model_id:
            self.registered_kv_caches.append(None)
        self.registered_kv_caches[model_id] = kv_cache
        logger.info("register kv cache model_id %d: %s", model_id, cache_desc)

    @staticmethod
    def _rank_table(prompt: RankInfo, decode: RankInfo) -> str:
        server_list: list[dict[str, Any]] = []
        for rank_id, r in enumerate((prompt, decode)):
            device = {
                "device_id": str(r.device_id),
                "device_ip": r.device_ip,
                "rank_id": str(rank_id),
            }
            if server_list and server_list[-1]["server_id"] == r.host_ip:
                server_list[-1]["device"].append(device)
            else:
                server_list.append({"server_id": r.host_ip, "device": [device]})
        return json.dumps(
            {
                "version": "1.0",
                "server_count": str(len(server_list)),
                "status": "completed",
                "server_list": server_list,
            }
        )

    def register_link(self, pairs: list[tuple[RankInfo, RankInfo]]) -> None:
        """Links every (prefill rank, decode rank) pair, then waits until all are ready."""
        for start in range(0, len(pairs), SCHEDULER_LINK_BATCH_SIZE):
            for prompt, decode in pairs[start : start + SCHEDULER_LINK_BATCH_SIZE]:
                comm_name = f"omni_{prompt.cluster_id}_{decode.cluster_id}"
                cluster_rank_info = {prompt.cluster_id: 0, decode.cluster_id: 1}
                comm_id = self.data_dist_engine.link(
                    comm_name, cluster_rank_info, self._rank_table(prompt, decode)
                )
                self.registered_link_infos[(prompt.cluster_id, decode.cluster_id)] = comm_id
            if start + SCHEDULER_LINK_BATCH_SIZE < len(pairs):
                time.sleep(SCHEDULER_LINK_INTERVAL)
        pending = dict(self.registered_link_infos)
        while pending:
            for pair, comm_id in list(pending.items()):
                status = self.data_dist_engine.query_register_mem_status(comm_id)
                if status == RegisterMemStatus.OK:
                    del pending[pair]
                elif status == RegisterMemStatus.FAILED:
                    raise RuntimeError(f"link {pair} (comm {comm_id}) failed")
            if pending:
                logger.info("links not ready yet: %s", sorted(pending))
                time.sleep(LINK_STATUS_QUERY_INTERVAL)
        logger.info("all %d links ready", len(self.registered_link_infos))

    def _pull_blocks(
        self,
        src_cache_key: BlocksCacheKey,
        dst_cache: Any,
        src_blocks: list[int],
        dst_blocks: list[int],
    ) -> bool:
        """Pulls with the retry set; any other status code is re-raised at once."""
        for attempt in range(KV_CACHE_RETRY_TIMES):
            try:
                self.data_dist_manager.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks)
                return True
            except LLMException as e:
                if e.status_code in RETRYABLE_EXCEPTIONS:
                    logger.warning(
                        "kv cache pull blocks failed, need retry (%d/%d): %s",
                        attempt + 1,
                        KV_CACHE_RETRY_TIMES,
                        e,
                    )
                    time.sleep(KV_CACHE_RETRY_WAIT_SECOND)
                else:
                    logger.error("kv cache pull blocks failed: %s", e)
                    raise
        return False

    def pull_kv(self, src_blocks: list[int], tgt_blocks: list[int], prompt_cluster_id: int) -> None:
        # torch.npu.set_device(self.local_rank): context is lost when several threads pull
        for model_id, kv_cache in enumerate(self.registered_kv_caches):
            prompt_cache_key = BlocksCacheKey(
                prompt_cluster_id=prompt_cluster_id, model_id=model_id
            )
            if not self._pull_blocks(prompt_cache_key, kv_cache, src_blocks, tgt_blocks):
                raise RuntimeError(
                    f"pull kv from {prompt_cluster_id} model {model_id} failed "
                    f"after {KV_CACHE_RETRY_TIMES} attempts"
                )

    def unlink_all(self) -> None:
        for comm_id in self.registered_link_infos.values():
            self.data_dist_engine.unlink(comm_id)
        self.registered_link_infos.clear()


class KVPuller:
    """One pull thread per remote prefill cluster, each with its own queue."""

    def __init__(self, manager: LLMDataDistManager, on_done: Any) -> None:
        self.manager = manager
        self.on_done = on_done
        self.queues: dict[int, queue.Queue[Any]] = {}
        self.threads: list[threading.Thread] = []

    def submit(self, prompt_cluster_id: int, req_id: str, src: list[int], dst: list[int]) -> None:
        if prompt_cluster_id not in self.queues:
            q: queue.Queue[Any] = queue.Queue()
            self.queues[prompt_cluster_id] = q
            t = threading.Thread(
                target=self._run,
                args=(prompt_cluster_id, q),
                daemon=True,
                name=f"kv-puller-{prompt_cluster_id}",
            )
            t.start()
            self.threads.append(t)
        self.queues[prompt_cluster_id].put((req_id, src, dst))

    def _run(self, prompt_cluster_id: int, q: queue.Queue[Any]) -> None:
        while (item := q.get()) is not None:
            req_id, src, dst = item
            try:
                self.manager.pull_kv(src, dst, prompt_cluster_id)
            except (LLMException, RuntimeError) as e:
                self.on_done(req_id, e)  # the scheduler marks the request failed
            else:
                self.on_done(req_id, None)

    def stop(self) -> None:
        for q in self.queues.values():
            q.put(None)
        for t in self.threads:
            t.join()


# =================================================== the harness (stands in for omni-infer)

BOUND_S = 20.0  # every wait of the harness: a failed peer ends the run instead of hanging it
HOST = "127.0.0.1"
LAYERS, NUM_BLOCKS = 3, 24
SUB_CACHES = [(16, 1, 32), (16, 1, 8), (16, 4)]  # per-tensor block shapes, model_id 0, 1, 2
LATE_MODEL_ID = 2  # prefill rank 0 registers this sub-cache late
PREFILLS = [RankInfo(10, HOST, 0, "10.2.0.1"), RankInfo(11, HOST, 1, "10.2.0.2")]
DECODE = RankInfo(20, HOST, 2, "10.2.0.3")
REQUESTS = [  # (request id, prefill rank, prefill blocks, decode blocks)
    ("r0", 0, [1, 2, 3], [4, 5, 6]),
    ("r1", 1, [7, 0], [10, 11]),
    ("r2", 0, [20, 9], [0, 23]),
    ("r3", 1, [12, 13, 14, 15], [15, 16, 17, 18]),
]


def _seed(what: str, model_id: int) -> int:
    return zlib.crc32(f"omni-infer/{what}/model{model_id}".encode())


def make_kv_caches() -> list[list[np.ndarray]]:
    return [
        [np.zeros((NUM_BLOCKS, *shape), np.float16) for _ in range(LAYERS)] for shape in SUB_CACHES
    ]


class _RetryLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.retries = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.retries += "need retry" in record.getMessage()


def run_prefill(rank: int, commands: Any, replies: Any, done: Any) -> None:
    logging.basicConfig(level=logging.WARNING)
    manager = LLMDataDistManager(LLMDataDistConfig(LLMRole.PROMPT, PREFILLS[rank]))
    kv_caches = make_kv_caches()
    for req_id, r, src, _ in REQUESTS:
        if r == rank:
            for model_id, tensors in enumerate(kv_caches):
                for t, arr in enumerate(tensors):
                    raw = arr.view(np.uint8).reshape(NUM_BLOCKS, -1)
                    raw[src] = pattern_blocks(_seed(req_id, model_id), t, src, raw.shape[1])
    late = rank == 0
    for model_id, tensors in enumerate(kv_caches):
        if not (late and model_id == LATE_MODEL_ID):
            manager.register_sub_cache(model_id, tensors, DataType.DT_FLOAT16)
    manager.register_link([(PREFILLS[rank], DECODE)])
    if late:
        assert commands.get(timeout=BOUND_S) == "register late sub-cache"
        manager.register_sub_cache(LATE_MODEL_ID, kv_caches[LATE_MODEL_ID], DataType.DT_FLOAT16)
        replies.put("registered")
    done.wait(BOUND_S)
    manager.unlink_all()
    manager.data_dist_engine.finalize()


def run_decode(commands: Any, replies: Any, done: Any, results: Any) -> None:
    logging.basicConfig(level=logging.WARNING)
    retry_log = _RetryLog()
    logger.addHandler(retry_log)
    manager = LLMDataDistManager(LLMDataDistConfig(LLMRole.DECODER, DECODE))
    kv_caches = make_kv_caches()
    for model_id, tensors in enumerate(kv_caches):
        fill_pattern(tensors, _seed("decode-background", model_id))
    manager.register_memory(kv_caches, DataType.DT_FLOAT16)
    manager.register_link([(p, DECODE) for p in PREFILLS])  # one batch, both links
    outcomes: queue.Queue[tuple[str, BaseException | None]] = queue.Queue()
    puller = KVPuller(manager, lambda req_id, err: outcomes.put((req_id, err)))

    def pull(req_id: str) -> BaseException | None:
        _, rank, src, dst = next(r for r in REQUESTS if r[0] == req_id)
        puller.submit(PREFILLS[rank].cluster_id, req_id, src, dst)
        got, err = outcomes.get(timeout=BOUND_S)
        assert got == req_id
        return err

    # r0: prefill rank 0 has no sub-cache 2 yet -> LLM_KV_CACHE_NOT_EXIST, not retried.
    err = pull("r0")
    assert isinstance(err, LLMException), f"r0: expected LLM_KV_CACHE_NOT_EXIST, got {err!r}"
    assert err.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, err.status_code
    assert retry_log.retries == 0, "LLM_KV_CACHE_NOT_EXIST must not be retried"
    commands.put("register late sub-cache")
    assert replies.get(timeout=BOUND_S) == "registered"
    for req_id, *_ in REQUESTS:  # r0 rescheduled, then the rest
        err = pull(req_id)
        assert err is None, f"{req_id}: {err!r}"
    puller.stop()
    checked = 0
    for req_id, _, src, dst in REQUESTS:
        for model_id, tensors in enumerate(kv_caches):
            bad = pattern_mismatches(tensors, src, dst, _seed(req_id, model_id))
            assert not bad, f"{req_id} model {model_id}: {bad[0]}"
            checked += len(dst) * sum(t[0].nbytes for t in tensors)
    named = {b for *_, dst in REQUESTS for b in dst}
    untouched = [b for b in range(NUM_BLOCKS) if b not in named]
    for model_id, tensors in enumerate(kv_caches):
        bad = pattern_mismatches(
            tensors, untouched, untouched, _seed("decode-background", model_id)
        )
        assert not bad, f"a block no request named changed: model {model_id}: {bad[0]}"
    done.wait(BOUND_S)
    manager.unlink_all()
    manager.data_dist_engine.finalize()
    results.put(
        f"2P1D: {len(REQUESTS)} requests x {len(SUB_CACHES)} sub-caches from "
        f"{len(PREFILLS)} prefill ranks, {checked} bytes checked; "
        f"LLM_KV_CACHE_NOT_EXIST re-raised without retry, then pulled"
    )


def main() -> int:
    if os.environ.get("AIODATADIST_RUNDIR"):
        return run_all()
    # link()'s same-host rendezvous directory, private to this run, inherited by the ranks.
    with tempfile.TemporaryDirectory(prefix="aiodd-run-") as rundir:
        os.environ["AIODATADIST_RUNDIR"] = rundir
        return run_all()


def run_all() -> int:
    ctx = mp.get_context("spawn")
    commands, replies, done, results = ctx.Queue(), ctx.Queue(), ctx.Barrier(3), ctx.Queue()
    procs = [
        ctx.Process(
            target=run_prefill, name=f"prefill-{rank}", args=(rank, commands, replies, done)
        )
        for rank in range(len(PREFILLS))
    ]
    procs.append(
        ctx.Process(target=run_decode, name="decode", args=(commands, replies, done, results))
    )
    for p in procs:
        p.start()
    line = None
    deadline = time.monotonic() + BOUND_S + 10
    while line is None and time.monotonic() < deadline:
        try:
            line = results.get(timeout=0.1)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a rank failed: its peers would only wait for it
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
    print(f"OK omni_infer_sync (portal loop {loop}): LLMDataDistManager pulls verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
