"""A plain asyncio script: a prompt and a decoder in one process, a pull with layer ranges.

The prompt "prefills" a 4-layer KV cache (K and V per layer, so 8 tensors of 16 blocks)
in shared memory; the decoder registers its own numpy arrays, links, and pulls three
blocks of layers 1 and 2 into different block ids, then checks every byte.

Run it from the repository root:

    .venv/bin/python examples/simple_pull.py
"""

from __future__ import annotations

import asyncio

import numpy as np

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)

PROMPT_ID, DECODER_ID = 1, 2
LAYERS, TENSORS_PER_LAYER = 4, 2  # K and V
BLOCKS, BLOCK_SHAPE = 16, (16, 2, 64)  # 16 tokens x 2 heads x 64 dims per block


async def main() -> int:
    desc = CacheDesc(
        LAYERS * TENSORS_PER_LAYER, [BLOCKS, *BLOCK_SHAPE], DataType.DT_FLOAT16, Placement.HOST
    )
    async with (
        LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as prompt,
        LLMDataDist(LLMRole.DECODER, DECODER_ID) as decoder,
    ):
        # Prompt side: a blocks cache in shared memory, pullable as model_id 0.
        src = prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT_ID, 0))
        rng = np.random.default_rng(0)
        for tensor in src.tensors():
            tensor[...] = rng.standard_normal(tensor.shape)

        # Decoder side: its own memory, registered (no key: nobody pulls from it).
        dst_tensors = [np.zeros(desc.shape, np.float16) for _ in range(desc.num_tensors)]
        dst = decoder.cache_manager.register_blocks_cache(desc, dst_tensors)

        info = LLMClusterInfo()
        info.remote_cluster_id = PROMPT_ID  # same process: linked in-process, no address
        status, _ = await decoder.link_clusters([info], timeout=3000)
        if status != LLMStatusCode.LLM_SUCCESS:
            print(f"link failed: {status}")
            return 1

        prompt_blocks, decoder_blocks = [0, 1, 5], [3, 4, 9]
        layers = range(1, 3)  # layers 1 and 2 = tensors [2, 6)
        await decoder.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT_ID, 0),
            dst,
            prompt_blocks,
            decoder_blocks,
            src_layer_range=layers,
            dst_layer_range=layers,
            tensor_num_per_layer=TENSORS_PER_LAYER,
            timeout=1.0,  # seconds, for the whole call
        )

        first, last = layers.start * TENSORS_PER_LAYER, layers.stop * TENSORS_PER_LAYER
        src_tensors = src.tensors()
        for t in range(desc.num_tensors):
            for s, d in zip(prompt_blocks, decoder_blocks, strict=True):
                if first <= t < last:
                    ok = np.array_equal(dst_tensors[t][d], src_tensors[t][s])
                else:
                    ok = not dst_tensors[t][d].any()  # layers outside the range: untouched
                if not ok:
                    print(f"mismatch: tensor {t}, block {s} -> {d}")
                    return 1
        moved = len(prompt_blocks) * (last - first) * dst_tensors[0][0].nbytes
        print(
            f"pulled blocks {prompt_blocks} -> {decoder_blocks} of layers "
            f"{layers.start}..{layers.stop - 1} (tensors {first}..{last - 1}): "
            f"{moved} bytes over the {decoder.links[0].data_path} path, verified"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
