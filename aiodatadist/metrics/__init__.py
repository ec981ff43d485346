"""Observability: transfer metrics, ``LLMDataDist.stats()``, and optional exporters.

Every transfer (pulls, pushes, each ``transfer_cache_async`` layer, local copies) is
counted once, in the one path, per link and per instance: completed transfers and their
bytes by kind (``pull``, ``push``, ``copy``) and by the data path that moved the bytes
(``inproc``, ``shm``, ``cma``, ``tcp``; ``local`` for copies), failures by
``LLMStatusCode`` name, transfers in flight, and two histograms (queue wait for the link's
FIFO slot, whole-call latency) over fixed log-spaced buckets (:data:`BUCKETS`).

* ``dd.stats()`` returns a :class:`Stats` snapshot (``stats.to_dict()`` for JSON);
* :func:`register_prometheus` / :func:`prometheus_collector`: a ``prometheus_client``
  collector (extra ``aiodatadist[prometheus]``);
* :func:`enable_tracing`: one OpenTelemetry span per transfer (extra ``aiodatadist[otel]``).

The exporters' packages are imported only when these functions are called. See
``docs/observability.md``.
"""

from __future__ import annotations

from ._core import BUCKETS, HistogramStats, Stats, TransferStats
from ._export import (
    PrometheusCollector,
    disable_tracing,
    enable_tracing,
    prometheus_collector,
    register_prometheus,
)

__all__ = [
    "BUCKETS",
    "HistogramStats",
    "PrometheusCollector",
    "Stats",
    "TransferStats",
    "disable_tracing",
    "enable_tracing",
    "prometheus_collector",
    "register_prometheus",
]
