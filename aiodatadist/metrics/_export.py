"""Optional exporters: a Prometheus collector and OpenTelemetry spans.

``prometheus_client`` and ``opentelemetry`` are imported inside the functions that need
them, so ``import aiodatadist`` (and ``import aiodatadist.metrics``) never loads them.
Install them with the extras: ``pip install aiodatadist[prometheus]`` / ``[otel]``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from . import _core
from ._core import BUCKETS, PUSH, HistogramStats, Stats

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "PrometheusCollector",
    "disable_tracing",
    "enable_tracing",
    "prometheus_collector",
    "register_prometheus",
]

_INT64_MAX = (1 << 63) - 1


class _HasStats(Protocol):
    def stats(self) -> Stats: ...


Source = _HasStats | Callable[[], Stats]


def _live_instances() -> list[Stats]:
    # Imported here: the facade sits above this module (and imports the package below it).
    from ..datadist import _instances

    out = []
    for dd in list(_instances.values()):
        try:
            out.append(dd.stats())
        except RuntimeError:  # finalized meanwhile
            continue
    return out


def _read(sources: tuple[Source, ...]) -> list[Stats]:
    if not sources:
        return _live_instances()
    out = []
    for s in sources:
        out.append(s.stats() if hasattr(s, "stats") else s())
    return out


# ---------------------------------------------------------------- Prometheus


def _minus(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> None:
    """``a -= b`` for ``{kind: {path|code: n or {"transfers", "bytes"}}}`` (in place)."""
    for k, inner in b.items():
        mine = a.setdefault(k, {})
        for key, v in inner.items():
            if isinstance(v, dict):
                row = mine.setdefault(key, {"transfers": 0, "bytes": 0})
                for f in ("transfers", "bytes"):
                    row[f] -= v[f]
            else:
                mine[key] = mine.get(key, 0) - v


def _scopes(stats: Stats) -> Iterator[tuple[str, dict[str, Any]]]:
    """(remote label, numbers) per series group: one per active link, and ``remote=""``
    for the rest (local copies and links gone), so one instance's series sum to its
    totals."""
    rest: dict[str, Any] = {
        "by_kind_path": copy.deepcopy(stats.totals.by_kind_path),
        "errors_by_kind": copy.deepcopy(stats.totals.errors_by_kind),
        "in_flight": stats.totals.in_flight,
        "queue_wait": (list(stats.totals.queue_wait.counts), stats.totals.queue_wait.sum),
        "latency": (list(stats.totals.latency.counts), stats.totals.latency.sum),
    }
    for cid, link in stats.links.items():
        _minus(rest["by_kind_path"], link.by_kind_path)
        _minus(rest["errors_by_kind"], link.errors_by_kind)
        rest["in_flight"] -= link.in_flight
        for name in ("queue_wait", "latency"):
            counts, total = rest[name]
            h: HistogramStats = getattr(link, name)
            rest[name] = (
                [x - y for x, y in zip(counts, h.counts, strict=True)],
                total - h.sum,
            )
        yield (
            str(cid),
            {
                "by_kind_path": link.by_kind_path,
                "errors_by_kind": link.errors_by_kind,
                "in_flight": link.in_flight,
                "queue_wait": (link.queue_wait.counts, link.queue_wait.sum),
                "latency": (link.latency.counts, link.latency.sum),
            },
        )
    yield "", rest


def _buckets(counts: list[int]) -> list[tuple[str, float]]:
    out, seen = [], 0
    for bound, n in zip((*BUCKETS, float("inf")), counts, strict=True):
        seen += n
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(seen)))
    return out


class PrometheusCollector:
    """A ``prometheus_client`` custom collector over ``stats()`` snapshots, read at scrape.

    Families (labels ``cluster``, ``remote`` (``""``: local copies and links gone), ...):
    ``aiodatadist_transfers_total{kind,path}``, ``aiodatadist_transfer_bytes_total{kind,path}``,
    ``aiodatadist_transfer_errors_total{kind,code}``, ``aiodatadist_transfers_in_flight``,
    ``aiodatadist_transfer_seconds`` and ``aiodatadist_queue_wait_seconds`` (histograms).
    """

    def __init__(self, sources: tuple[Source, ...]) -> None:
        self._sources = sources

    def describe(self) -> list[Any]:
        return []  # families depend on the links present: no checks at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        base = ["cluster", "remote"]
        transfers = CounterMetricFamily(
            "aiodatadist_transfers", "Completed transfers.", labels=[*base, "kind", "path"]
        )
        nbytes = CounterMetricFamily(
            "aiodatadist_transfer_bytes",
            "Bytes moved by completed transfers.",
            labels=[*base, "kind", "path"],
        )
        errors = CounterMetricFamily(
            "aiodatadist_transfer_errors",
            "Failed transfers by LLMStatusCode name.",
            labels=[*base, "kind", "code"],
        )
        in_flight = GaugeMetricFamily(
            "aiodatadist_transfers_in_flight",
            "Transfers running or queued for their link.",
            labels=base,
        )
        latency = HistogramMetricFamily(
            "aiodatadist_transfer_seconds",
            "Whole-call time of completed transfers.",
            labels=base,
        )
        queue_wait = HistogramMetricFamily(
            "aiodatadist_queue_wait_seconds",
            "Time completed transfers waited for their link's FIFO slot.",
            labels=base,
        )
        for stats in _read(self._sources):
            cluster = str(stats.cluster_id)
            for remote, s in _scopes(stats):
                labels = [cluster, remote]
                for kind, paths in s["by_kind_path"].items():
                    for path, row in paths.items():
                        if row["transfers"] or row["bytes"]:
                            transfers.add_metric([*labels, kind, path], row["transfers"])
                            nbytes.add_metric([*labels, kind, path], row["bytes"])
                for kind, codes in s["errors_by_kind"].items():
                    for code, n in codes.items():
                        if n:
                            errors.add_metric([*labels, kind, code], n)
                in_flight.add_metric(labels, s["in_flight"])
                for family, name in ((latency, "latency"), (queue_wait, "queue_wait")):
                    counts, total = s[name]
                    family.add_metric(labels, _buckets(counts), total)
        yield from (transfers, nbytes, errors, in_flight, latency, queue_wait)


def prometheus_collector(*sources: Source) -> PrometheusCollector:
    """A collector over ``sources``: instances (anything with ``stats()``: an async or a
    ``sync`` ``LLMDataDist``) or callables returning :class:`~aiodatadist.metrics.Stats`;
    none: every initialized instance of this process, as found at each scrape.

    Register it yourself (``registry.register(collector)``) or use
    :func:`register_prometheus`.
    """
    return PrometheusCollector(sources)


def register_prometheus(
    *sources: Source, registry: CollectorRegistry | None = None
) -> PrometheusCollector:
    """Registers :func:`prometheus_collector` ``(*sources)`` with ``registry`` (default:
    ``prometheus_client.REGISTRY``); returns the collector (``registry.unregister`` it).

    Raises:
        ImportError: ``prometheus_client`` is not installed (``aiodatadist[prometheus]``).
    """
    import prometheus_client

    collector = PrometheusCollector(sources)
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector


# ---------------------------------------------------------------- OpenTelemetry


def _id(value: int) -> int | str:
    return value if value <= _INT64_MAX else str(value)  # OTel ints are int64


class _OtelTracer:
    """One span per transfer: ``aiodatadist.<api>`` (``aiodatadist.pull_blocks``, ...)."""

    def __init__(self, tracer: Any, status: Any, status_code: Any) -> None:
        self._tracer = tracer
        self._status = status
        self._error = status_code.ERROR

    def begin(self, api: str, kind: str, cluster: int, remote: int | None, request: Any) -> Any:
        attrs: dict[str, Any] = {
            "aiodatadist.kind": kind,
            "aiodatadist.cluster_id": _id(cluster),
        }
        if remote is not None:
            attrs["aiodatadist.remote_cluster_id"] = _id(remote)
        blocks = getattr(request, "src_blocks", None)
        if blocks:
            attrs["aiodatadist.blocks"] = len(blocks)
        layers = getattr(request, "src_layers", None)
        if layers is not None:
            attrs["aiodatadist.layers"] = len(layers)
        elif kind == PUSH:
            attrs["aiodatadist.layers"] = 1  # one transfer_cache_async layer
        elif hasattr(request, "tensors_per_layer"):
            per = max(1, request.tensors_per_layer)
            attrs["aiodatadist.layers"] = request.local.num_tensors // per
        return self._tracer.start_span(f"aiodatadist.{api}", attributes=attrs)

    def end(self, span: Any, path: str | None, nbytes: int, error: BaseException | None) -> None:
        if path is not None:
            span.set_attribute("aiodatadist.path", str(path))
        span.set_attribute("aiodatadist.bytes", nbytes)
        if error is None:
            span.set_attribute("aiodatadist.status", "LLM_SUCCESS")
        elif isinstance(error, Exception):
            span.set_attribute("aiodatadist.status", _core.error_code(error))
            span.record_exception(error)
            span.set_status(self._status(self._error, str(error)))
        else:
            span.set_attribute("aiodatadist.status", "CANCELLED")
            span.set_status(self._status(self._error, "cancelled"))
        span.end()


def enable_tracing(tracer_provider: Any = None) -> None:
    """One OpenTelemetry span per transfer from now on, from ``tracer_provider`` (default:
    the global one, ``opentelemetry.trace.get_tracer_provider()``).

    Spans are named ``aiodatadist.<api>`` (``aiodatadist.pull_blocks``,
    ``aiodatadist.transfer_cache_async`` per layer, ``aiodatadist.copy_blocks``, ...), are
    children of the caller's current span, and carry ``aiodatadist.kind``, ``.path``,
    ``.bytes``, ``.status`` (an ``LLMStatusCode`` name), ``.cluster_id``,
    ``.remote_cluster_id``, ``.blocks`` and ``.layers``; a failed transfer's span has
    status ERROR and the exception recorded.

    Raises:
        ImportError: ``opentelemetry-api`` is not installed (``aiodatadist[otel]``).
    """
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    from .._version import __version__

    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    _core.tracer = _OtelTracer(provider.get_tracer("aiodatadist", __version__), Status, StatusCode)


def disable_tracing() -> None:
    """No spans from now on (transfers in flight still end theirs)."""
    _core.tracer = None
