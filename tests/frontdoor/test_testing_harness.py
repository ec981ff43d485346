"""``aiodatadist.testing``'s own parts: the reference model of a pull, and the one peer
process extended by a plugin (stdin commands and the control port).

The model is checked from tables and against a plain block-by-block loop (the
definition, written the slow way); every suite checks real bytes against the model.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from aiodatadist import LLMRole
from aiodatadist.testing import (
    PeerProcess,
    apply_segments,
    as_matrix,
    block_segments,
    layer_span,
    reference_pull,
)

# ------------------------------------------------------------------ the model


@pytest.mark.parametrize(
    ("src", "dst", "span", "nbytes", "want"),
    [
        # one run per stretch contiguous on both sides, per tensor
        ([0, 1, 2], [4, 5, 6], (0, 0, 1), None, [(0, 0, 0, 40, 30)]),
        ([0, 1, 5], [4, 5, 6], (0, 0, 1), None, [(0, 0, 0, 40, 20), (0, 50, 0, 60, 10)]),
        ([3, 2], [0, 1], (0, 0, 1), None, [(0, 30, 0, 0, 10), (0, 20, 0, 10, 10)]),
        # a tensor span: tensors 1, 2 -> 0, 1
        ([0, 1], [1, 2], (1, 0, 2), None, [(1, 0, 0, 10, 20), (2, 0, 1, 10, 20)]),
        # part of each block: nothing merges
        ([0, 1], [0, 1], (0, 0, 1), 4, [(0, 0, 0, 0, 4), (0, 10, 0, 10, 4)]),
        ([], [], (0, 0, 3), None, []),
    ],
)
def test_block_segments_table(
    src: list[int],
    dst: list[int],
    span: tuple[int, int, int],
    nbytes: int | None,
    want: list[tuple[int, int, int, int, int]],
) -> None:
    assert block_segments(10, src, dst, span, nbytes=nbytes) == want


def test_block_segments_refuses_unpaired_lists() -> None:
    with pytest.raises(ValueError):
        block_segments(10, [0, 1], [0], (0, 0, 1))


@pytest.mark.parametrize(
    ("src_layers", "dst_layers", "want"),
    [(None, None, (0, 0, 6)), ((1, 3), (0, 2), (2, 0, 4)), (None, (2, 3), (0, 4, 2))],
)
def test_layer_span_table(
    src_layers: tuple[int, int] | None,
    dst_layers: tuple[int, int] | None,
    want: tuple[int, int, int],
) -> None:
    assert layer_span(6, src_layers, dst_layers, 2) == want


def _slow_pull(
    src: np.ndarray,
    dst: np.ndarray,
    bb: int,
    sb: list[int],
    db: list[int],
    span: tuple[int, int, int],
) -> np.ndarray:
    out = dst.copy()
    s0, d0, n = span
    for k in range(n):
        for s, d in zip(sb, db, strict=True):
            out[d0 + k, d * bb : (d + 1) * bb] = src[s0 + k, s * bb : (s + 1) * bb]
    return out


@pytest.mark.parametrize("seed", range(40))
def test_reference_pull_is_the_block_by_block_copy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    nt, nb, bb = int(rng.integers(1, 5)), int(rng.integers(1, 9)), int(rng.integers(1, 17))
    src = rng.integers(0, 256, (nt, nb * bb), dtype=np.uint8)
    dst = rng.integers(0, 256, (nt, nb * bb), dtype=np.uint8)
    n = int(rng.integers(0, nb + 1))
    sb = rng.integers(0, nb, n).tolist()  # repeats allowed: a later pair wins
    db = rng.integers(0, nb, n).tolist()
    count = int(rng.integers(0, nt + 1))
    span = (int(rng.integers(0, nt - count + 1)), int(rng.integers(0, nt - count + 1)), count)
    before = dst.copy()
    want = _slow_pull(src, dst, bb, sb, db, span)
    assert np.array_equal(reference_pull(src, dst, bb, sb, db, span), want)
    segs = block_segments(bb, sb, db, span)
    assert np.array_equal(apply_segments(src, dst, np.array(segs, dtype=np.uint64)), want)
    assert np.array_equal(dst, before)  # the model never writes its inputs


def test_as_matrix_is_raw_bytes_of_any_shape() -> None:
    t = [np.arange(6, dtype=np.float16).reshape(2, 3), np.ones((2, 3), dtype=np.float16)]
    m = as_matrix(t)
    assert m.shape == (2, 12) and m.dtype == np.uint8
    assert np.array_equal(m[0], t[0].reshape(-1).view(np.uint8))


# ------------------------------------------------------------------ the peer process

PLUGIN = textwrap.dedent(
    """
    from typing import Any

    from aiodatadist.testing import PeerCommands


    class Commands(PeerCommands):
        async def start(self) -> dict[str, Any]:
            return {"greeting": self.config["greeting"], "role": int(self.dd.role)}

        async def cmd_echo(self, c: dict[str, Any]) -> dict[str, Any]:
            return {"ok": True, "echo": c["value"]}

        async def cmd_fail(self, c: dict[str, Any]) -> dict[str, Any]:
            raise KeyError("no such thing")
    """
)


@pytest.mark.asyncio
async def test_peer_process_runs_a_plugin(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    peer = PeerProcess(
        cluster_id=41,
        role=LLMRole.DECODER,
        host=None,
        serve_cache=False,
        plugin=str(plugin),
        plugin_config={"greeting": "hi"},
        control=True,
        start_timeout=30,
    )
    async with peer:
        assert peer.ready["greeting"] == "hi"
        assert peer.ready["role"] == int(LLMRole.DECODER)
        assert peer.ready["port"] is None  # not listening
        assert await peer.call("echo", value=[1, 2], timeout=10) == {
            "ok": True,
            "echo": [1, 2],
            "cmd": "echo",
        }
        bad = await peer.call("fail", timeout=10)
        assert not bad["ok"] and "KeyError" in bad["error"], bad
        unknown = await peer.call("nope", timeout=10)
        assert not unknown["ok"] and "unknown command" in unknown["error"], unknown
        assert (await peer.call("pid", timeout=10))["pid"] == peer.pid
        # the control port answers too, on its own connection
        reader, writer = await asyncio.open_connection("127.0.0.1", peer.ready["control"])
        try:
            writer.write(b'{"cmd": "echo", "value": 7}\n')
            await writer.drain()
            reply = json.loads(await asyncio.wait_for(reader.readline(), 10))
            assert reply == {"ok": True, "echo": 7, "cmd": "echo"}
        finally:
            writer.close()
    assert peer.returncode == 0  # quit, finalized and exited cleanly


def test_peer_process_without_an_event_loop(tmp_path: Path) -> None:
    """start_blocking: the process belongs to no loop; loops come and go around it."""
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    peer = PeerProcess(
        cluster_id=42,
        serve_cache=False,
        plugin=str(plugin),
        plugin_config={"greeting": "hello"},
        control=True,
        start_timeout=30,
    )
    try:
        host, port = peer.start_blocking()
        assert (host, port) == (peer.ready["host"], peer.ready["port"]) and port > 0
        assert peer.ready["greeting"] == "hello"

        async def echo(value: int) -> object:
            async with peer.connect(10) as control:
                return (await control.call("echo", value=value, timeout=10))["echo"]

        assert asyncio.run(echo(1)) == 1
        assert asyncio.run(echo(2)) == 2  # a second loop, the same process
        assert peer.returncode is None
        peer.kill()
        assert asyncio.run(peer.wait_exit(10)) < 0  # killed by a signal
        assert peer.killed
    finally:
        peer.stop_blocking(5)
    assert peer.returncode is not None


def test_peer_process_without_a_loop_reports_a_bad_start() -> None:
    bad = PeerProcess(options={"aiodatadist.DataPath": "nonsense"}, start_timeout=30)
    with pytest.raises(RuntimeError, match="the peer process failed"):
        bad.start_blocking()
    assert bad.returncode is not None  # reaped, not left running
