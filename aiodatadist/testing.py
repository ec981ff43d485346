"""Test helpers: a linked prompt/decoder pair with real caches and real bytes.

Also usable outside pytest (embedded programs, examples)::

    async with inproc_pair() as pair:
        src = pair.prompt_cache(num_tensors=4, num_blocks=8, block_shape=(16, 2, 64))
        dst = pair.decoder_cache(num_tensors=4, num_blocks=8, block_shape=(16, 2, 64))
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0], [1])
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from .datadist import LLMDataDist
from .types import BlocksCacheKey, CacheDesc, DataType, KvCache, LLMClusterInfo, LLMRole, Placement

__all__ = ["FilledCache", "Pair", "cluster_info", "inproc_pair", "make_blocks_cache"]


@dataclass
class FilledCache:
    """A registered cache and numpy views of its tensors."""

    cache: KvCache
    tensors: list[Any]

    def block(self, tensor: int, block: int) -> Any:
        return self.tensors[tensor][block]


def cluster_info(
    remote_cluster_id: int, host: str | None = None, port: int | None = None
) -> LLMClusterInfo:
    """An ``LLMClusterInfo`` for ``remote_cluster_id`` (with its address when it is remote)."""
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    if host is not None and port is not None:
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(host, port)
    return info


def make_blocks_cache(
    dd: LLMDataDist,
    *,
    num_tensors: int = 4,
    num_blocks: int = 8,
    block_shape: Sequence[int] = (16, 2, 64),
    data_type: DataType = DataType.DT_FLOAT16,
    model_id: int | None = None,
    seed: int | None = None,
    allocate: bool = False,
) -> FilledCache:
    """Registers (or allocates in shared memory) a blocks cache on ``dd``.

    ``seed`` fills it with reproducible random bytes; None leaves it zeroed.
    """
    import numpy as np

    desc = CacheDesc(num_tensors, [num_blocks, *block_shape], data_type, Placement.HOST)
    key = None if model_id is None else BlocksCacheKey(dd.cluster_id, model_id)
    cm = dd.cache_manager
    if allocate:
        cache = cm.allocate_blocks_cache(desc, key)
        tensors = cache.tensors()
    else:
        dtype = data_type.to_numpy()
        # np.empty + fill touches every page now, so the first transfer does not
        # pay for page faults (a serving cache is resident too).
        tensors = [np.empty(desc.shape, dtype=dtype) for _ in range(num_tensors)]
        for t in tensors:
            t.view(np.uint8).fill(0)
        cache = cm.register_blocks_cache(desc, tensors, key)
    if seed is not None:
        rng = np.random.default_rng(seed)
        for t in tensors:
            raw = t.view(np.uint8)
            raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    return FilledCache(cache, tensors)


@dataclass
class Pair:
    """A prompt and a decoder in this process, linked (decoder -> prompt)."""

    prompt: LLMDataDist
    decoder: LLMDataDist
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self, model_id: int = 0) -> BlocksCacheKey:
        """The key a decoder uses to pull the prompt's blocks cache ``model_id``."""
        return BlocksCacheKey(self.prompt.cluster_id, model_id)

    def prompt_cache(self, *, model_id: int = 0, seed: int = 1, **kw: Any) -> FilledCache:
        return make_blocks_cache(self.prompt, model_id=model_id, seed=seed, **kw)

    def decoder_cache(self, **kw: Any) -> FilledCache:
        return make_blocks_cache(self.decoder, **kw)


@asynccontextmanager
async def inproc_pair(
    *,
    prompt_id: int = 1,
    decoder_id: int = 2,
    options: dict[str, str] | None = None,
    prompt_role: LLMRole = LLMRole.PROMPT,
    decoder_role: LLMRole = LLMRole.DECODER,
    link: bool = True,
) -> AsyncIterator[Pair]:
    """A linked prompt/decoder pair in this process; finalized on exit."""
    prompt = LLMDataDist(prompt_role, prompt_id)
    decoder = LLMDataDist(decoder_role, decoder_id)
    await prompt.init(dict(options or {}))
    try:
        await decoder.init(dict(options or {}))
        try:
            if link:
                status, _ = await decoder.link_clusters([cluster_info(prompt_id)])
                if status != 0:
                    raise RuntimeError(f"inproc link failed: {status!r}")
            yield Pair(prompt, decoder)
        finally:
            await decoder.finalize()
    finally:
        await prompt.finalize()
