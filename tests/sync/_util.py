"""Helpers of the sync API tests (plain functions: no event loop in the test's thread)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import aiodatadist.sync as sd
from aiodatadist._portal import portal
from aiodatadist.testing import FilledCache, cluster_info, make_blocks_cache, pattern_mismatches

BLOCK_SHAPE = (16, 2, 64)  # the "small" workload: 4 KiB per block per tensor
BOUND_S = 10.0  # generous: "it ended", never a speed claim


@dataclass
class SyncPair:
    prompt: sd.LLMDataDist
    decoder: sd.LLMDataDist

    def key(self, model_id: int = 0) -> sd.BlocksCacheKey:
        return sd.BlocksCacheKey(self.prompt.cluster_id, model_id)

    def prompt_cache(self, seed: int, *, model_id: int = 0, **kw: Any) -> FilledCache:
        kw.setdefault("block_shape", BLOCK_SHAPE)
        return make_blocks_cache(self.prompt, model_id=model_id, seed=seed, pattern=True, **kw)

    def decoder_cache(self, **kw: Any) -> FilledCache:
        kw.setdefault("block_shape", BLOCK_SHAPE)
        return make_blocks_cache(self.decoder, **kw)


@contextlib.contextmanager
def open_pair(prompt_id: int, decoder_id: int, *, link: bool = True) -> Iterator[SyncPair]:
    """A sync PROMPT and DECODER, linked in-process (decoder -> prompt); finalized on exit."""
    prompt = sd.LLMDataDist(sd.LLMRole.PROMPT, prompt_id)
    decoder = sd.LLMDataDist(sd.LLMRole.DECODER, decoder_id)
    prompt.init({})
    try:
        decoder.init({})
        try:
            if link:
                status, per = decoder.link_clusters([cluster_info(prompt_id)], timeout=3000)
                assert status == sd.LLMStatusCode.LLM_SUCCESS, (status, per)
            yield SyncPair(prompt, decoder)
        finally:
            decoder.finalize()
    finally:
        prompt.finalize()


def assert_pulled(
    dst: FilledCache, src_blocks: list[int], dst_blocks: list[int], seed: int, **kw: Any
) -> None:
    bad = pattern_mismatches(dst.tensors, src_blocks, dst_blocks, seed, **kw)
    assert not bad, "\n".join(map(str, bad[:5]))


def untouched(dst: FilledCache, blocks: list[int]) -> bool:
    return not any(t[blocks].view(np.uint8).any() for t in dst.tensors)


@contextlib.contextmanager
def holding_link(dd: sd.LLMDataDist, remote_cluster_id: int) -> Iterator[None]:
    """Holds the link's FIFO slot (on the portal) so that transfers on it queue up."""
    (link,) = [ln for ln in dd.links if ln.remote_cluster_id == remote_cluster_id]
    portal.call(link.slot.acquire, (None,))
    try:
        yield
    finally:
        portal.call(link.slot.release)
