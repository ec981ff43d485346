"""HIXL ``transfer_cache_async_sample.py`` on async ``aiodatadist``: P pushes layers into D.

Upstream: ``hicann/hixl`` ``examples/python/transfer_cache_async_sample.py``. Both sides
enable the cache manager and remote cache access; D listens, P links to D with
``link_clusters`` and starts ``transfer_cache_async`` of its blocks cache with a
``TransferWithCacheKeyConfig(BlocksCacheKey(D, 0), range(0, 1), range(0, 1))`` and a
``LayerSynchronizer`` (no block indices: the whole layer, every block); D reads what
landed after a barrier; both force-unlink (each side its own), unregister and finalize.

Changed from upstream (everything else is the sample's code, in its order):

* the import: ``aiodatadist`` in place of ``llm_datadist``, and ``await`` on every call
  that talks to a peer (``async def`` where the sample's functions make such calls);
* numpy arrays in place of torch NPU tensors (``arr.ctypes.data`` for ``tensor.data_ptr()``),
  filled with a pattern unique to each side instead of ones / zeros, and checked where the
  sample logs them; P also checks what its ``CacheTask`` reports (``synchronize()`` before
  the sample's ``get_results()``);
* ``torch.distributed`` (``init_process_group``, ``barrier``) -> a ``multiprocessing``
  barrier (``harness.dist``; awaited in a thread, ``await dist.abarrier()``, so the
  event loop goes on serving the peer meanwhile), and one command starts every role;
* free ports for the fixed 26000 / 26001 (both roles on one host); the Ascend-only CLI
  options (``--device_id``, ``--transfer_backend``, ``--local_comm_res``) dropped.

Run from the repository root::

    python examples/clients/samples/transfer_cache_async_async.py [--loop uvloop]
"""

from __future__ import annotations

import argparse
import logging
from typing import Optional

import harness
from harness import dist  # in place of: import torch.distributed as dist

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)

NUM_TENSORS = 2
BLOCKS_NUM = 3
KV_SHAPE = 10
PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
DECODER_PORT = harness.port("DECODER_PORT", 26000)  # a free port when launched by main()
PROMPT_PORT = harness.port("PROMPT_PORT", 26001)

P_SEED = harness.seed("transfer_cache_async", "P", "transferred")
D_SEED = harness.seed("transfer_cache_async", "D", "initial")


async def init_llm_datadist(
    role: LLMRole, cluster_id: int, args: argparse.Namespace
) -> LLMDataDist:
    # init_process_group(...) dropped: the launcher attached `dist` to this process.
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = args.device_id
    if role == LLMRole.DECODER:
        llm_config.listen_ip_info = f"{args.local_host_ip}:{DECODER_PORT}"
    else:
        llm_config.listen_ip_info = f"{args.local_host_ip}:{PROMPT_PORT}"
    llm_config.enable_cache_manager = True
    llm_config.enable_remote_cache_accessible = True  # remote caches directly accessible
    llm_options = llm_config.generate_options()
    await datadist.init(llm_options)
    logging.info(f"init {role} success, cluster_id={cluster_id}")
    return datadist


class LayerSynchronizerImpl(LayerSynchronizer):
    def __init__(self, ret: bool = True) -> None:
        self._ret = ret

    def synchronize_layer(
        self,
        layer_index: int,
        timeout_in_millis: Optional[int],  # noqa: UP045 (as upstream)
    ) -> bool:
        return self._ret


async def run_prompt_sample(datadist: LLMDataDist, local_host_ip: str, remote_host_ip: str) -> None:
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
    await dist.abarrier()  # register end

    # 2. link to the decoder
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, PROMPT_PORT)
    cluster.append_remote_ip_info(remote_host_ip, DECODER_PORT)
    ret, _ = await datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    logging.info("link success")

    # 3. transfer the cache to the decoder, layer by layer, in the background
    transfer_config = TransferWithCacheKeyConfig(
        BlocksCacheKey(DECODER_CLUSTER_ID, 0), range(0, 1), range(0, 1)
    )
    cache_task = await cache_manager.transfer_cache_async(
        cache, LayerSynchronizerImpl(True), [transfer_config]
    )  # asynchronous layer-wise transfer
    status = await cache_task.synchronize()  # added: upstream only calls get_results()
    results = await cache_task.get_results()
    if status != LLMStatusCode.LLM_SUCCESS or results != [LLMStatusCode.LLM_SUCCESS]:
        raise Exception(f"transfer failed: {status}, {results}")  # added
    await dist.abarrier()  # transfer cache end

    # 4. unlink
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    ret, _ = await datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()
    logging.info("[finalize] success")


async def run_decoder_sample(
    datadist: LLMDataDist, local_host_ip: str, remote_host_ip: str
) -> None:
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
    cache = cache_manager.register_blocks_cache(
        cache_desc, [addr, addr2], BlocksCacheKey(DECODER_CLUSTER_ID, 0)
    )
    logging.info("register_blocks_cache success")
    await dist.abarrier()  # register end

    # 2. wait for the prompt's transfer
    await dist.abarrier()  # prompt transfer cache end
    logging.info(f"after prompt transfer cache, tensor={tensor}")
    logging.info(f"after prompt transfer cache, tensor2={tensor2}")
    for t, arr in enumerate((tensor, tensor2)):  # added: the bytes, where upstream logs
        harness.expect_blocks(f"D tensor {t}", arr, [(P_SEED, t, b) for b in range(BLOCKS_NUM)])
    harness.verified("P transferred layer 0 (K and V, every block) into D's cache")

    # 3. unlink
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    ret, _ = await datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()
    logging.info("[finalize] success")


# -------------------------------------------------------------- in place of upstream's __main__


async def prompt_main(args: argparse.Namespace) -> None:
    datadist = await init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, args)
    await run_prompt_sample(datadist, args.local_host_ip, args.remote_host_ip)


async def decoder_main(args: argparse.Namespace) -> None:
    datadist = await init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, args)
    await run_decoder_sample(datadist, args.local_host_ip, args.remote_host_ip)


def main() -> int:
    cli = harness.sample_parser(__doc__, sync=False).parse_args()
    harness.assign_ports("PROMPT_PORT", "DECODER_PORT")
    args = argparse.Namespace(
        device_id=0, local_host_ip="127.0.0.1", remote_host_ip="127.0.0.1", loop=cli.loop
    )
    return harness.launch(
        "transfer_cache_async_async",
        [("P", prompt_main, args), ("D", decoder_main, args)],
        expect_verified=1,
        loop=cli.loop,
    )


if __name__ == "__main__":
    raise SystemExit(main())
