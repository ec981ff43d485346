"""HIXL ``pull_blocks_xpyd_sample.py`` on async ``aiodatadist``: 2 P, 2 D, every D pulls from both.

Upstream: ``hicann/hixl`` ``examples/python/llm_datadist/pull_blocks_xpyd_sample.py`` (as
the reference describes it, §10.5; written here in the shape of its sibling samples).
Every instance is named by its listen address, ``cluster_id = (ipv4 << 16) | port``, and
uses ``local_comm_res=""``. Each P registers a blocks cache under ``BlocksCacheKey(P, 0)``
and listens; each D links to both P in one ``link_clusters`` call and pulls from each
(``pull_blocks(BlocksCacheKey(p, 0), cache, src_blocks=, dst_blocks=)``) into its own
blocks; everyone force-unlinks its own side, unregisters and finalizes.

The block lists are chosen so that every transfer is distinct: D ``j`` pulls P's blocks
``[j, j + 1]``, from P 0 into its blocks [0, 2], from P 1 into [1, 3]; its block 4 is
never pulled into.

Changed from the sample's shape (everything else is its sequence of calls):

* the import: ``aiodatadist`` in place of ``llm_datadist``, and ``await`` on every call
  that talks to a peer (``async def`` where the sample's functions make such calls);
* numpy arrays in place of torch NPU tensors (``arr.ctypes.data`` for ``tensor.data_ptr()``),
  filled with a pattern unique to each instance, and checked after each pull;
* ``torch.distributed`` (``init_process_group``, ``barrier``) -> a ``multiprocessing``
  barrier (``harness.dist``; awaited in a thread, ``await dist.abarrier()``, so the
  event loop goes on serving the peer meanwhile), and one command starts every role;
* all four instances on 127.0.0.1 with free ports (upstream: one host or NPU each).

Run from the repository root::

    python examples/clients/samples/pull_blocks_xpyd_async.py [--loop uvloop]
"""

from __future__ import annotations

import argparse
import ipaddress
import logging

import harness
from harness import dist  # in place of: import torch.distributed as dist

from aiodatadist import (
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
P_BLOCKS_NUM = 3
D_BLOCKS_NUM = 5
KV_SHAPE = 10
HOST_IP = "127.0.0.1"
P_PORTS = [harness.port("P0_PORT", 26000), harness.port("P1_PORT", 26001)]
D_PORTS = [harness.port("D0_PORT", 26002), harness.port("D1_PORT", 26003)]
DST_BLOCKS_PER_P = [[0, 2], [1, 3]]


def cluster_id_of(ip: str, port: int) -> int:
    return (int(ipaddress.IPv4Address(ip)) << 16) | port


P_CLUSTER_IDS = [cluster_id_of(HOST_IP, port) for port in P_PORTS]
D_CLUSTER_IDS = [cluster_id_of(HOST_IP, port) for port in D_PORTS]


def src_blocks_of(d_index: int) -> list[int]:
    return [d_index, d_index + 1]


def p_seed(i: int) -> int:
    return harness.seed("pull_blocks_xpyd", "P", i)


def d_seed(j: int) -> int:
    return harness.seed("pull_blocks_xpyd", "D", j)


async def init_llm_datadist(
    role: LLMRole, cluster_id: int, device_id: int, port: int
) -> LLMDataDist:
    # init_process_group(...) dropped: the launcher attached `dist` to this process.
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = device_id
    llm_config.local_comm_res = ""
    llm_config.listen_ip_info = f"{HOST_IP}:{port}"
    llm_options = llm_config.generate_options()
    await datadist.init(llm_options)
    logging.info(f"init {role} success, cluster_id={cluster_id}")
    return datadist


async def run_prompt_sample(datadist: LLMDataDist, index: int) -> None:
    # 1. register memory
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=NUM_TENSORS,
        shape=[P_BLOCKS_NUM, KV_SHAPE],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensors = [
        harness.pattern_tensor(p_seed(index), t, (P_BLOCKS_NUM, KV_SHAPE))
        for t in range(NUM_TENSORS)
    ]
    addrs = [int(t.ctypes.data) for t in tensors]
    cache = cache_manager.register_blocks_cache(
        cache_desc, addrs, BlocksCacheKey(P_CLUSTER_IDS[index], 0)
    )
    logging.info("register_blocks_cache success")
    await dist.abarrier()  # register end

    # 2. wait for every decoder's pulls
    await dist.abarrier()  # decoders pull blocks end

    # 3. unlink (force: this side only; each D unlinks its own)
    clusters = []
    for d_cluster_id in D_CLUSTER_IDS:
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = d_cluster_id
        clusters.append(cluster)
    ret, _ = await datadist.unlink_clusters(clusters, 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()
    logging.info("[finalize] success")


async def run_decoder_sample(datadist: LLMDataDist, index: int) -> None:
    # 1. register memory
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=NUM_TENSORS,
        shape=[D_BLOCKS_NUM, KV_SHAPE],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensors = [
        harness.pattern_tensor(d_seed(index), t, (D_BLOCKS_NUM, KV_SHAPE))
        for t in range(NUM_TENSORS)
    ]
    addrs = [int(t.ctypes.data) for t in tensors]
    cache = cache_manager.register_blocks_cache(cache_desc, addrs)
    logging.info("register_blocks_cache success")
    await dist.abarrier()  # register end

    # 2. link to every prompt, in one call
    clusters = []
    for p_cluster_id, p_port in zip(P_CLUSTER_IDS, P_PORTS, strict=True):
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = p_cluster_id
        cluster.append_local_ip_info(HOST_IP, 0)
        cluster.append_remote_ip_info(HOST_IP, p_port)
        clusters.append(cluster)
    ret, rets = await datadist.link_clusters(clusters, 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception(f"link failed: {rets}")

    # 3. pull blocks from each prompt
    want = [[(d_seed(index), t, b) for b in range(D_BLOCKS_NUM)] for t in range(NUM_TENSORS)]
    for i, p_cluster_id in enumerate(P_CLUSTER_IDS):
        src_blocks, dst_blocks = src_blocks_of(index), DST_BLOCKS_PER_P[i]
        await cache_manager.pull_blocks(
            BlocksCacheKey(p_cluster_id, 0),
            cache,
            src_blocks=src_blocks,
            dst_blocks=dst_blocks,
        )
        for t, arr in enumerate(tensors):  # added: every block, pulled or not
            for s, d in zip(src_blocks, dst_blocks, strict=True):
                want[t][d] = (p_seed(i), t, s)
            harness.expect_blocks(f"D{index} tensor {t}", arr, want[t])
        harness.verified(
            f"D{index} pulled P{i}'s blocks {src_blocks} into its {dst_blocks}, 2 tensors; "
            "the other blocks as they were"
        )
    await dist.abarrier()  # decoders pull blocks end

    # 4. unlink
    clusters = []
    for p_cluster_id in P_CLUSTER_IDS:
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = p_cluster_id
        clusters.append(cluster)
    ret, _ = await datadist.unlink_clusters(clusters, 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


# -------------------------------------------------------------- in place of upstream's __main__


async def prompt_main(args: argparse.Namespace) -> None:
    datadist = await init_llm_datadist(
        LLMRole.PROMPT, P_CLUSTER_IDS[args.index], args.device_id, P_PORTS[args.index]
    )
    await run_prompt_sample(datadist, args.index)


async def decoder_main(args: argparse.Namespace) -> None:
    datadist = await init_llm_datadist(
        LLMRole.DECODER, D_CLUSTER_IDS[args.index], args.device_id, D_PORTS[args.index]
    )
    await run_decoder_sample(datadist, args.index)


def main() -> int:
    cli = harness.sample_parser(__doc__, sync=False).parse_args()
    harness.assign_ports("P0_PORT", "P1_PORT", "D0_PORT", "D1_PORT")

    def args(index: int) -> argparse.Namespace:
        return argparse.Namespace(device_id=index, index=index, loop=cli.loop)

    return harness.launch(
        "pull_blocks_xpyd_async",
        [
            ("P0", prompt_main, args(0)),
            ("P1", prompt_main, args(1)),
            ("D0", decoder_main, args(0)),
            ("D1", decoder_main, args(1)),
        ],
        expect_verified=4,
        loop=cli.loop,
    )


if __name__ == "__main__":
    raise SystemExit(main())
