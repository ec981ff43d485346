"""Cross-host over TCP: prompt and decoder in two network namespaces joined by a veth pair.

The test makes its own namespaces (``ip netns add``), gives the veth ends
10.200.7.1/24 (prompt) and 10.200.7.2/24 (decoder) inside them, runs one
``peer_main.py`` in each (``ip netns exec``), and deletes everything afterwards.
No traffic leaves those two namespaces. Needs root and iproute2; elsewhere it
is skipped, saying which is missing.

Separate network namespaces mean separate host identities, so ``auto`` must
pick ``tcp`` even for the prompt's shared-memory cache.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.xproc import xproc_common as xc
from tests.xproc.xproc_harness import Harness

PROMPT_IP, DECODER_IP = "10.200.7.1", "10.200.7.2"
PROMPT, DECODER = 61, 62
SEED = 17
_names = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def _why_not() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


@dataclass
class Pair:
    prompt_ns: str
    decoder_ns: str


@pytest.fixture
def netns_pair() -> Iterator[Pair]:
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}x{next(_names)}"
    pns, dns = f"adxp{tag}", f"adxd{tag}"
    pv, dv = f"adxp{tag}"[:15], f"adxd{tag}"[:15]
    made: list[str] = []
    try:
        for ns in (pns, dns):
            r = _ip("netns", "add", ns, check=False)
            if r.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {r.stderr.strip()}")
            made.append(ns)
        r = _ip("link", "add", pv, "type", "veth", "peer", "name", dv, check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot create a veth pair: {r.stderr.strip()}")
        _ip("link", "set", pv, "netns", pns)
        _ip("link", "set", dv, "netns", dns)
        for ns, dev, addr in ((pns, pv, PROMPT_IP), (dns, dv, DECODER_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield Pair(pns, dns)
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)  # takes its veth end (and the pair) along


@pytest.mark.asyncio
async def test_cross_host_tcp_between_network_namespaces(netns_pair: Pair) -> None:
    async with Harness() as h:
        prompt = await h.peer(
            cluster_id=PROMPT, seed=SEED, listen=f"{PROMPT_IP}:0", netns=netns_pair.prompt_ns
        )
        decoder = await h.peer(
            cluster_id=DECODER, role="decoder", listen=None, netns=netns_pair.decoder_ns
        )
        assert prompt.host == PROMPT_IP
        assert prompt.ready["host_id"] != decoder.ready["host_id"]

        r = await decoder.ok("link", cluster_id=PROMPT, host=PROMPT_IP, port=prompt.port)
        assert r["status"] == 0 and r["statuses"] == [0], (r, prompt.stderr_tail())
        assert (await decoder.ok("links"))["links"] == [{"cluster_id": PROMPT, "data_path": "tcp"}]
        assert (await prompt.ok("links"))["links"] == [{"cluster_id": DECODER, "data_path": "tcp"}]

        # pull_blocks from the shared-memory cache and the registered one: tcp for both.
        expected: dict[str, object] = {}
        for name in ("alloc", "reg"):
            spec = xc.SPECS[name]
            ref = xc.reference(SEED, name)
            want = xc.reference(None, name)
            r = await decoder.ok(
                "pull_blocks",
                cluster_id=PROMPT,
                model_id=spec.model_id,
                dst=name,
                src_blocks=[0, 3, 5],
                dst_blocks=[7, 1, 2],
                timeout=10,
            )
            assert r["path"] == "tcp", r
            want = xc.expect_blocks(want, ref, spec.unit, [0, 3, 5], [7, 1, 2], (0, 0, 4))
            r = await decoder.ok(
                "pull_blocks",
                cluster_id=PROMPT,
                model_id=spec.model_id,
                dst=name,
                src_blocks=[6],
                dst_blocks=[4],
                src_layers=[1, 3],
                dst_layers=[0, 2],
                tpl=1,
                timeout=10,
            )
            want = xc.expect_blocks(want, ref, spec.unit, [6], [4], (1, 0, 2))
            expected[name] = want
        # pull_cache of a row.
        r = await decoder.ok(
            "pull_cache",
            cluster_id=PROMPT,
            req_id=xc.ROWS_ALLOC_REQ + 3,
            dst="rows_reg",
            batch_index=0,
            timeout=10,
        )
        assert r["path"] == "tcp", r
        expected["rows_reg"] = xc.expect_row(
            xc.reference(None, "rows_reg"),
            xc.reference(SEED, "rows_alloc"),
            xc.SPECS["rows_reg"].unit,
            3,
            0,
            (0, 0, 4),
        )
        # transfer_cache_async: the prompt pushes across the namespaces into the decoder.
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
        r = await decoder.ok("unlink", cluster_id=PROMPT)
        assert r["status"] == 0, r
