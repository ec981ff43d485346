"""``push_blocks`` and ``push_cache`` into a peer process, over cma and tcp, with the bytes
checked on the peer (its sha256 per tensor against the numpy reference)."""

from __future__ import annotations

import pytest

from aiodatadist import BlocksCacheKey, CacheKeyByIdAndIndex
from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import Harness, decoder_options, link

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]  # a peer process per data path

PROMPT, LOCAL = 21, 22
SEED, LOCAL_SEED = 9, 31


@pytest.mark.parametrize("path", ["cma", "tcp"])
async def test_pushes_land_in_the_peer(path: str) -> None:
    async with Harness() as h:
        peer = await h.peer(cluster_id=PROMPT, data_path=path, seed=SEED)
        dd, local = await h.local(LOCAL, decoder_options(path), seed=LOCAL_SEED)
        await link(dd, peer, PROMPT)
        lk = dd._rt.links.find(PROMPT)
        assert lk is not None
        if path == "cma" and lk.path.cma is None:
            pytest.skip(f"the kernel refuses CMA here (errno {lk.path.cma_refused_errno})")
        assert lk.data_path == path
        cm = dd.cache_manager

        # push_blocks: local "reg" layer 1 -> the peer's "reg" layer 0, then every layer
        # with contiguous source blocks.
        spec = xc.SPECS["reg"]
        src = local["reg"].matrix()
        want = xc.reference(SEED, "reg")
        key = BlocksCacheKey(PROMPT, xc.MODEL_REG)
        await cm.push_blocks(
            key, local["reg"].cache, [7, 2], [0, 5], range(1, 2), range(0, 1), timeout=10
        )
        want = xc.expect_blocks(want, src, spec.unit, [7, 2], [0, 5], (2, 0, 2))
        await cm.push_blocks(key, local["reg"].cache, dst_blocks=[3, 1], timeout=10)
        want = xc.expect_blocks(want, src, spec.unit, [0, 1], [3, 1], (0, 0, spec.num_tensors))
        reply = await peer.ok("digest", name="reg")
        assert reply["sha"] == xc.digests(want)

        # push_cache: local "rows_reg" row 1 -> the peer's "rows_reg" row 2 (every layer),
        # then row 3 layer 0 -> row 0 layer 1.
        rspec = xc.SPECS["rows_reg"]
        rsrc = local["rows_reg"].matrix()
        rwant = xc.reference(SEED, "rows_reg")
        cid = peer.cache_id("rows_reg")
        await cm.push_cache(CacheKeyByIdAndIndex(PROMPT, cid, 2), local["rows_reg"].cache, 1)
        rwant = xc.expect_row(rwant, rsrc, rspec.unit, 1, 2, (0, 0, rspec.num_tensors))
        await cm.push_cache(
            CacheKeyByIdAndIndex(PROMPT, cid, 0),
            local["rows_reg"].cache,
            3,
            src_layer_range=range(0, 1),
            dst_layer_range=range(1, 2),
            timeout=10,
        )
        rwant = xc.expect_row(rwant, rsrc, rspec.unit, 3, 0, (0, 2, 2))
        reply = await peer.ok("digest", name="rows_reg")
        assert reply["sha"] == xc.digests(rwant)
        # The peer's other caches are untouched.
        reply = await peer.ok("digest", name="alloc")
        assert reply["sha"] == xc.digests(xc.reference(SEED, "alloc"))
