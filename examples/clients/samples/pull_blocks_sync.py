"""HIXL ``pull_blocks_sample.py`` on ``aiodatadist.sync``: D pulls blocks from P.

Upstream: ``hicann/hixl`` ``examples/python/llm_datadist/pull_blocks_sample.py`` (as the
reference describes it, §10.5; written here in the shape of its sibling samples). P
registers a blocks cache under ``BlocksCacheKey(0, 0)`` and listens; D registers its own,
links to P with ``link_clusters`` and pulls P's blocks [0, 1] into its blocks [0, 2] with
the v2 keywords (``pull_blocks(..., src_blocks=, dst_blocks=)``); both force-unlink (each
side its own), unregister and finalize.

Changed from upstream (everything else is the sample's code, in its order):

* the import: ``aiodatadist.sync`` in place of ``llm_datadist``;
* numpy arrays in place of torch NPU tensors (``arr.ctypes.data`` for ``tensor.data_ptr()``),
  filled with a pattern unique to each side instead of ones / zeros, and checked where the
  sample logs them (D's block 1, not pulled into, must be untouched);
* ``torch.distributed`` (``init_process_group``, ``barrier``) -> a ``multiprocessing``
  barrier (``harness.dist``), and one command starts both roles as processes;
* free ports for the fixed 26000 / 26001 (both roles on one host); the Ascend-only CLI
  options (``--device_id``, ``--transfer_backend``, ``--local_comm_res``) dropped.

Run from the repository root::

    python examples/clients/samples/pull_blocks_sync.py [--loop uvloop]
"""

from __future__ import annotations

import argparse
import logging
import os

import harness
from harness import dist  # in place of: import torch.distributed as dist

from aiodatadist.sync import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)

NUM_TENSORS = 2
BLOCKS_NUM = 3
KV_SHAPE = 10
PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
PROMPT_PORT = harness.port("PROMPT_PORT", 26000)  # a free port when launched by main()
DECODER_PORT = harness.port("DECODER_PORT", 26001)

P_SEED = harness.seed("pull_blocks", "P", "initial")
D_SEED = harness.seed("pull_blocks", "D", "initial")


def init_llm_datadist(role: LLMRole, cluster_id: int, args: argparse.Namespace) -> LLMDataDist:
    # init_process_group(...) dropped: the launcher attached `dist` to this process.
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = args.device_id
    llm_config.local_comm_res = ""
    if role == LLMRole.PROMPT:
        llm_config.listen_ip_info = f"{args.local_host_ip}:{PROMPT_PORT}"
    else:
        llm_config.listen_ip_info = f"{args.local_host_ip}:{DECODER_PORT}"
    llm_options = llm_config.generate_options()
    datadist.init(llm_options)
    logging.info(f"init {role} success, cluster_id={cluster_id}")
    return datadist


def run_prompt_sample(datadist: LLMDataDist) -> None:
    # 1. register memory
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=NUM_TENSORS,
        shape=[BLOCKS_NUM, KV_SHAPE],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensor = harness.pattern_tensor(P_SEED, 0, (BLOCKS_NUM, KV_SHAPE))  # was torch.ones(...)
    tensor2 = harness.pattern_tensor(P_SEED, 1, (BLOCKS_NUM, KV_SHAPE))
    addr = int(tensor.ctypes.data)  # was tensor.data_ptr()
    addr2 = int(tensor2.ctypes.data)
    cache = cache_manager.register_blocks_cache(
        cache_desc, [addr, addr2], BlocksCacheKey(PROMPT_CLUSTER_ID, 0)
    )
    logging.info("register_blocks_cache success")

    dist.barrier()  # register end

    # 2. wait for the decoder's pull
    dist.barrier()  # decoder pull blocks end

    # 3. unlink
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    logging.info("[finalize] success")


def run_decoder_sample(datadist: LLMDataDist, local_host_ip: str, remote_host_ip: str) -> None:
    # 1. register memory
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=NUM_TENSORS,
        shape=[BLOCKS_NUM, KV_SHAPE],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensor = harness.pattern_tensor(D_SEED, 0, (BLOCKS_NUM, KV_SHAPE))  # was torch.full(0)
    tensor2 = harness.pattern_tensor(D_SEED, 1, (BLOCKS_NUM, KV_SHAPE))
    addr = int(tensor.ctypes.data)
    addr2 = int(tensor2.ctypes.data)
    cache = cache_manager.register_blocks_cache(cache_desc, [addr, addr2])
    logging.info("register_blocks_cache success")
    dist.barrier()  # register end

    # 2. link to the prompt
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, DECODER_PORT)
    cluster.append_remote_ip_info(remote_host_ip, PROMPT_PORT)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")

    # 3. pull blocks from the prompt
    cache_manager.pull_blocks(
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0),
        cache,
        src_blocks=[0, 1],
        dst_blocks=[0, 2],
    )
    logging.info(f"after decoder pull, tensor={tensor}")
    logging.info(f"after decoder pull, tensor2={tensor2}")
    for t, arr in enumerate((tensor, tensor2)):  # added: the bytes, where upstream logs
        harness.expect_blocks(
            f"D tensor {t}", arr, [(P_SEED, t, 0), (D_SEED, t, 1), (P_SEED, t, 1)]
        )
    harness.verified("D pulled P's blocks [0, 1] into its [0, 2], 2 tensors; D's 1 untouched")

    dist.barrier()  # pull_blocks end

    # 4. unlink
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


# -------------------------------------------------------------- in place of upstream's __main__


def prompt_main(args: argparse.Namespace) -> None:
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, args)
    run_prompt_sample(datadist)


def decoder_main(args: argparse.Namespace) -> None:
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, args)
    run_decoder_sample(datadist, args.local_host_ip, args.remote_host_ip)


def main() -> int:
    cli = harness.sample_parser(__doc__, sync=True).parse_args()
    if cli.loop:
        os.environ["AIODATADIST_PORTAL_LOOP"] = cli.loop  # the children inherit it
    harness.assign_ports("PROMPT_PORT", "DECODER_PORT")
    args = argparse.Namespace(
        device_id=0, local_host_ip="127.0.0.1", remote_host_ip="127.0.0.1", loop=cli.loop
    )
    return harness.launch(
        "pull_blocks_sync",
        [("P", prompt_main, args), ("D", decoder_main, args)],
        expect_verified=1,
        loop=harness.expected_portal_loop(),
    )


if __name__ == "__main__":
    raise SystemExit(main())
