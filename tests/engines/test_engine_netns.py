"""Each engine between two network namespaces: separate host identities, so no fd channel and
no lease page; every engine transfer runs under the control-plane lease (LEASE/LEASED/
UNLEASE). The namespaces come from ``tests/xproc/test_xproc_netns.py`` (root and
iproute2, else skipped saying which is missing)."""

from __future__ import annotations

import pytest

from aiodatadist.testing import engine_unavailable
from tests.xproc import xproc_common as xc
from tests.xproc.test_xproc_netns import PROMPT_IP, Pair, netns_pair
from tests.xproc.xproc_harness import Harness

pytestmark = [pytest.mark.slow]

__all__ = ["netns_pair"]

PROMPT, DECODER = 81, 82
SEED = 23


@pytest.mark.asyncio
@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
async def test_engine_across_network_namespaces(netns_pair: Pair, engine: str) -> None:
    # The decoder listens nowhere: its engine advertises an address the prompt can reach
    # (Mooncake: the first non-loopback IPv4 address; there is no default route here).
    options = {"aiodatadist.Engines": engine}
    why = engine_unavailable(engine)
    if why is not None:
        pytest.skip(why)
    async with Harness() as h:
        prompt = await h.peer(
            cluster_id=PROMPT,
            seed=SEED,
            listen=f"{PROMPT_IP}:0",
            netns=netns_pair.prompt_ns,
            data_path=engine,
            options=options,
        )
        decoder = await h.peer(
            cluster_id=DECODER,
            role="decoder",
            listen=None,
            netns=netns_pair.decoder_ns,
            data_path=engine,
            options=options,
        )
        assert prompt.ready["host_id"] != decoder.ready["host_id"]
        r = await decoder.ok("link", cluster_id=PROMPT, host=PROMPT_IP, port=prompt.port)
        assert r["status"] == 0 and r["statuses"] == [0], (r, prompt.stderr_tail())
        links = (await decoder.ok("links"))["links"]
        assert links == [{"cluster_id": PROMPT, "data_path": engine}], links

        expected: dict[str, object] = {}
        for name in ("alloc", "reg"):
            spec = xc.SPECS[name]
            r = await decoder.ok(
                "pull_blocks",
                cluster_id=PROMPT,
                model_id=spec.model_id,
                dst=name,
                src_blocks=[0, 3, 5],
                dst_blocks=[7, 1, 2],
                timeout=10,
            )
            assert r["path"] == engine, r
            expected[name] = xc.expect_blocks(
                xc.reference(None, name),
                xc.reference(SEED, name),
                spec.unit,
                [0, 3, 5],
                [7, 1, 2],
                (0, 0, 4),
            )
        # The prompt pushes across the namespaces into the decoder, over the engine too.
        r = await prompt.ok(
            "push",
            dst_cluster=DECODER,
            src="reg",
            model_id=xc.MODEL_ALLOC,
            src_blocks=[2],
            dst_blocks=[6],
        )
        assert r["status"] == 0 and r["results"] == [0], r
        expected["alloc"] = xc.expect_blocks(
            expected["alloc"],
            xc.reference(SEED, "reg"),
            xc.SPECS["alloc"].unit,
            [2],
            [6],
            (0, 0, 4),
        )
        for name, want in expected.items():
            got = await decoder.ok("digest", name=name)
            assert got["sha"] == xc.digests(want), name  # type: ignore[arg-type]
        # A cache the owner registers after linking, then frees: read, then refused.
        await prompt.ok("register", name="late", model_id=71, seed=500)
        r = await decoder.ok(
            "pull_blocks",
            cluster_id=PROMPT,
            model_id=71,
            dst="reg",
            src_blocks=[4],
            dst_blocks=[3],
            timeout=10,
        )
        assert r["path"] == engine, r
        late = xc.pattern(500, xc.Spec("late", True, False, (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE)))
        want_reg = xc.expect_blocks(
            expected["reg"], late, xc.SPECS["reg"].unit, [4], [3], (0, 0, 4)
        )
        assert (await decoder.ok("digest", name="reg"))["sha"] == xc.digests(want_reg)
        # Every lease was released: the owner frees at once (no LLM_LINK_BUSY).
        assert (await prompt.call("free", name="late")).get("ok")
        r = await decoder.call(
            "pull_blocks",
            cluster_id=PROMPT,
            model_id=71,
            dst="reg",
            src_blocks=[4],
            dst_blocks=[3],
            timeout=10,
        )
        assert not r.get("ok") and "NOT_EXIST" in str(r), r
        assert (await decoder.ok("unlink", cluster_id=PROMPT))["status"] == 0
