"""Many links at once: one decoder pulling from two prompts, one prompt serving two decoders."""

from __future__ import annotations

import asyncio

import pytest

from aiodatadist import BlocksCacheKey, LLMStatusCode
from aiodatadist.testing import cluster_info
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import Harness, assert_same, decoder_options, link, pull_and_check

pytestmark = pytest.mark.slow  # peer processes on every data path: the full run's

S = LLMStatusCode


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["tcp", "auto"])
async def test_one_decoder_two_prompts_at_once(path: str) -> None:
    async with Harness() as h:
        p1, p2 = await asyncio.gather(
            h.peer(cluster_id=41, data_path=path, seed=41),
            h.peer(cluster_id=42, data_path=path, seed=42),
        )
        dd, local = await h.local(43, decoder_options(path))
        status, statuses = await dd.link_clusters(
            [cluster_info(41, p1.host, p1.port), cluster_info(42, p2.host, p2.port)], 5000
        )
        assert status == S.LLM_SUCCESS and statuses == [S.LLM_SUCCESS, S.LLM_SUCCESS]
        # From both at once, into disjoint blocks of the same decoder caches.
        for _ in range(3):
            await asyncio.gather(
                pull_and_check(dd, local["reg"], 41, 41, "reg", [0, 1, 2, 3], [0, 1, 2, 3]),
                pull_and_check(dd, local["alloc"], 42, 42, "alloc", [4, 5, 6, 7], [4, 5, 6, 7]),
            )
            await asyncio.gather(
                pull_and_check(dd, local["alloc"], 41, 41, "alloc", [0, 1], [0, 1]),
                pull_and_check(dd, local["reg"], 42, 42, "reg", [6, 7], [6, 7]),
            )
        # Both caches now hold a mix of the two prompts, block by block.
        ref1, ref2 = xc.reference(41, "reg"), xc.reference(42, "reg")
        unit = xc.SPECS["reg"].unit
        want = xc.expect_blocks(
            xc.reference(None, "reg"), ref1, unit, [0, 1, 2, 3], [0, 1, 2, 3], (0, 0, 4)
        )
        want = xc.expect_blocks(want, ref2, unit, [6, 7], [6, 7], (0, 0, 4))
        assert_same(local["reg"].matrix(), want)


@pytest.mark.asyncio
async def test_one_prompt_two_decoders_at_once() -> None:
    """A prompt serves an in-process decoder and a subprocess decoder concurrently over tcp."""
    async with Harness() as h:
        prompt = await h.peer(cluster_id=51, data_path="tcp", seed=51)
        other = await h.peer(cluster_id=53, role="decoder", data_path="tcp", listen=None)
        dd, local = await h.local(52, decoder_options("tcp"))
        await link(dd, prompt, 51)
        r = await other.ok("link", cluster_id=51, host=prompt.host, port=prompt.port)
        assert r["status"] == 0, r
        links = (await prompt.ok("links"))["links"]
        assert sorted(lk["cluster_id"] for lk in links) == [52, 53]

        src_blocks, dst_blocks = [7, 6, 5, 4, 3], [0, 1, 2, 3, 4]

        async def remote_decoder() -> dict[str, object]:
            return await other.ok(
                "pull_blocks",
                cluster_id=51,
                model_id=xc.MODEL_REG,
                dst="reg",
                src_blocks=src_blocks,
                dst_blocks=dst_blocks,
                timeout=10,
            )

        async def local_decoder() -> None:
            for b in range(8):
                await pull_and_check(dd, local["alloc"], 51, 51, "alloc", [b], [7 - b])

        for _ in range(2):
            r, _ = await asyncio.gather(remote_decoder(), local_decoder())
            assert r["path"] == "tcp", r
        want = xc.expect_blocks(
            xc.reference(None, "reg"),
            xc.reference(51, "reg"),
            xc.SPECS["reg"].unit,
            src_blocks,
            dst_blocks,
            (0, 0, 4),
        )
        got = await other.ok("digest", name="reg")
        assert got["sha"] == xc.digests(want)
        # Each decoder also gets its own pushes from the prompt over its own link.
        r = await prompt.ok(
            "push",
            dst_cluster=53,
            src="alloc",
            model_id=xc.MODEL_ALLOC,
            src_blocks=[1],
            dst_blocks=[2],
        )
        assert r["status"] == 0, r
        want = xc.expect_blocks(
            xc.reference(None, "alloc"),
            xc.reference(51, "alloc"),
            xc.SPECS["alloc"].unit,
            [1],
            [2],
            (0, 0, 4),
        )
        assert (await other.ok("digest", name="alloc"))["sha"] == xc.digests(want)
        await dd.cache_manager.pull_blocks(
            BlocksCacheKey(51, xc.MODEL_REG), local["reg"].cache, [3], [3], timeout=5
        )
