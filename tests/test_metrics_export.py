"""The optional exporters over real transfers: the Prometheus collector's text output,
parsed back with ``prometheus_client``'s own parser, and OpenTelemetry spans collected by
the SDK's in-memory exporter. Neither package is imported by ``import aiodatadist``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiodatadist import BlocksCacheKey, LLMCacheNotFoundError, LLMStatusCode
from aiodatadist.metrics import BUCKETS, disable_tracing, enable_tracing, register_prometheus
from aiodatadist.testing import Pair, cluster_info, inproc_pair, make_blocks_cache

P, D = 1, 2
SHAPE = (16, 2, 64)
BLOCK_BYTES = 16 * 2 * 64 * 2
TENSORS = 4


def _caches(pair: Pair, seed: int = 5) -> tuple[Any, Any]:
    src = pair.prompt_cache(seed=seed, num_tensors=TENSORS, num_blocks=8, block_shape=SHAPE)
    dst = pair.decoder_cache(num_tensors=TENSORS, num_blocks=8, block_shape=SHAPE)
    return src, dst


def _same(src: Any, dst: Any, s: list[int], d: list[int]) -> bool:
    return all(
        np.array_equal(
            dst.tensors[t].view(np.uint8).reshape(8, -1)[d],
            src.tensors[t].view(np.uint8).reshape(8, -1)[s],
        )
        for t in range(TENSORS)
    )


def test_import_aiodatadist_loads_no_exporter_package() -> None:
    code = (
        "import sys, aiodatadist, aiodatadist.metrics\n"
        "from aiodatadist import LLMDataDist, LLMRole\n"
        "LLMDataDist(LLMRole.DECODER, 3).stats()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('prometheus_client', "
        "'opentelemetry')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ----------------------------------------------------------------- Prometheus


def _samples(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _labels(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kw.items()))


@pytest.mark.asyncio
async def test_prometheus_text_output_parses_back_to_the_stats() -> None:
    pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
    from prometheus_client import CollectorRegistry

    async with inproc_pair(data_path="tcp") as pair:
        src, dst = _caches(pair)
        cm = pair.decoder.cache_manager
        for s, d in (([1, 2], [3, 4]), ([5], [6]), ([0], [7])):
            await cm.pull_blocks(pair.key(0), dst.cache, s, d)
            assert _same(src, dst, s, d)
        with pytest.raises(LLMCacheNotFoundError):
            await cm.pull_blocks(BlocksCacheKey(P, 9), dst.cache, [0], [0])

        registry = CollectorRegistry()
        register_prometheus(pair.decoder, registry=registry)
        got = _samples(registry)
        link = {"cluster": str(D), "remote": str(P)}
        want_bytes = 4 * TENSORS * BLOCK_BYTES
        assert got[("aiodatadist_transfers_total", _labels(**link, kind="pull", path="tcp"))] == 3
        assert (
            got[("aiodatadist_transfer_bytes_total", _labels(**link, kind="pull", path="tcp"))]
            == want_bytes
        )
        assert (
            got[
                (
                    "aiodatadist_transfer_errors_total",
                    _labels(**link, kind="pull", code="LLM_KV_CACHE_NOT_EXIST"),
                )
            ]
            == 1
        )
        assert got[("aiodatadist_transfers_in_flight", _labels(**link))] == 0
        for name in ("aiodatadist_transfer_seconds", "aiodatadist_queue_wait_seconds"):
            assert got[(f"{name}_count", _labels(**link))] == 3
            assert got[(f"{name}_sum", _labels(**link))] >= 0  # queue wait: 0, slot free
            buckets = [
                got[(f"{name}_bucket", _labels(**link, le=le))]
                for le in [*(repr(b) for b in BUCKETS), "+Inf"]
            ]
            assert buckets == sorted(buckets) and buckets[-1] == 3  # cumulative
        stats = pair.decoder.stats()
        assert got[("aiodatadist_transfer_seconds_sum", _labels(**link))] == pytest.approx(
            stats.links[P].latency.sum
        )

        # The link goes: its counts move to remote="" and the instance's sum stays.
        status, _ = await pair.decoder.unlink_clusters([cluster_info(P, *pair.extra["address"])])
        assert status == LLMStatusCode.LLM_SUCCESS
        got = _samples(registry)
        rest = {"cluster": str(D), "remote": ""}
        assert got[("aiodatadist_transfers_total", _labels(**rest, kind="pull", path="tcp"))] == 3
        assert ("aiodatadist_transfers_total", _labels(**link, kind="pull", path="tcp")) not in got
        assert got[("aiodatadist_transfer_seconds_count", _labels(**rest))] == 3


@pytest.mark.asyncio
async def test_prometheus_without_sources_reads_every_live_instance() -> None:
    pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
    from prometheus_client import CollectorRegistry

    async with inproc_pair() as pair:
        src = pair.prompt_cache(seed=2, num_tensors=TENSORS, num_blocks=8, block_shape=SHAPE)
        dst = make_blocks_cache(
            pair.decoder, model_id=4, num_tensors=TENSORS, num_blocks=8, block_shape=SHAPE
        )
        await pair.prompt.cache_manager.push_blocks(BlocksCacheKey(D, 4), src.cache, [1], [2])
        assert _same(src, dst, [1], [2])
        await pair.decoder.cache_manager.copy_blocks(dst.cache, {2: [5]})
        assert _same(dst, dst, [2], [5])
        registry = CollectorRegistry()
        collector = register_prometheus(registry=registry)
        got = _samples(registry)
        prompt = _labels(cluster=str(P), remote=str(D), kind="push", path="inproc")
        assert got[("aiodatadist_transfers_total", prompt)] == 1
        assert got[("aiodatadist_transfer_bytes_total", prompt)] == TENSORS * BLOCK_BYTES
        copy = _labels(cluster=str(D), remote="", kind="copy", path="local")
        assert got[("aiodatadist_transfer_bytes_total", copy)] == TENSORS * BLOCK_BYTES
        registry.unregister(collector)


# --------------------------------------------------------------- OpenTelemetry


@pytest.fixture
def spans() -> Iterator[Any]:
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    enable_tracing(provider)
    try:
        yield provider, exporter
    finally:
        disable_tracing()
        provider.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["inproc", "tcp"])
async def test_one_span_per_transfer_with_path_bytes_and_status(path: str, spans: Any) -> None:
    from opentelemetry.trace import StatusCode

    provider, exporter = spans
    async with inproc_pair(data_path=path) as pair:
        src, dst = _caches(pair, seed=9)
        cm = pair.decoder.cache_manager
        user = provider.get_tracer("the-caller")
        with user.start_as_current_span("request") as parent:
            await cm.pull_blocks(
                pair.key(0),
                dst.cache,
                [1, 2, 3],
                [4, 5, 6],
                src_layer_range=range(1, 2),
                dst_layer_range=range(1, 2),
            )
        assert all(
            np.array_equal(
                dst.tensors[t].view(np.uint8).reshape(8, -1)[[4, 5, 6]],
                src.tensors[t].view(np.uint8).reshape(8, -1)[[1, 2, 3]],
            )
            for t in (2, 3)
        )
        with pytest.raises(LLMCacheNotFoundError):
            await cm.pull_blocks(BlocksCacheKey(P, 9), dst.cache, [0], [0])
        await cm.copy_blocks(dst.cache, {4: [7]})
        disable_tracing()
        await cm.pull_blocks(pair.key(0), dst.cache, [0], [0])  # not traced

    got = [s for s in exporter.get_finished_spans() if s.name.startswith("aiodatadist.")]
    assert [s.name for s in got] == [
        "aiodatadist.pull_blocks",
        "aiodatadist.pull_blocks",
        "aiodatadist.copy_blocks",
    ]
    ok, failed, copied = got
    assert dict(ok.attributes) == {
        "aiodatadist.kind": "pull",
        "aiodatadist.cluster_id": D,
        "aiodatadist.remote_cluster_id": P,
        "aiodatadist.blocks": 3,
        "aiodatadist.layers": 1,
        "aiodatadist.path": path,
        "aiodatadist.bytes": 3 * 2 * BLOCK_BYTES,
        "aiodatadist.status": "LLM_SUCCESS",
    }
    assert ok.status.status_code == StatusCode.UNSET
    assert ok.parent is not None and ok.parent.span_id == parent.get_span_context().span_id
    assert failed.attributes["aiodatadist.status"] == "LLM_KV_CACHE_NOT_EXIST"
    assert failed.attributes["aiodatadist.bytes"] == 0
    assert failed.attributes["aiodatadist.layers"] == TENSORS // 2
    assert failed.status.status_code == StatusCode.ERROR
    assert any(e.name == "exception" for e in failed.events)
    assert copied.attributes["aiodatadist.kind"] == "copy"
    assert copied.attributes["aiodatadist.path"] == "local"
    assert copied.attributes["aiodatadist.bytes"] == TENSORS * BLOCK_BYTES
