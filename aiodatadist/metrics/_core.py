"""Transfer metrics: counters and histograms per link, summed into instance totals.

Recording happens on the instance's loop thread, once per transfer, in the one path
(:mod:`aiodatadist._runner`): a counter bump, two histogram observations, no lock.
One lock guards only what changes shape (a link, a new (kind, path) pair or an error
code appearing, a link going), so :meth:`InstanceMetrics.snapshot` is safe from any
thread (a Prometheus scrape thread, a ``sync`` caller). A snapshot taken while a transfer
completes may see its count before its histogram observation: a reading, not a transaction.

A link that goes away (unlink, peer lost, finalize) is folded into the instance totals
once nothing of it is in flight, so totals never go down.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "BUCKETS",
    "COPY",
    "PULL",
    "PUSH",
    "HistogramStats",
    "InstanceMetrics",
    "LinkMetrics",
    "Stats",
    "Tracer",
    "TransferStats",
    "tracer",
]

_LOCK = threading.Lock()
"""Held while a metrics dict changes shape and while a snapshot copies them (rare, short)."""

PULL, PUSH, COPY = "pull", "push", "copy"
"""Transfer kinds: ``pull_blocks``/``pull_cache``; pushes (``push_*``, each layer of
``transfer_cache_async``); local copies (``copy_blocks``, ``copy_cache``, ``swap_blocks``)."""

LOCAL_PATH = "local"
"""The data path label of local copies (no link: a memcpy inside this process)."""

BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
)  # fmt: skip
"""Histogram upper bounds in seconds, 10 us .. 60 s, log-spaced (1, 2.5, 5 per decade).
A value above the last bound lands in the overflow (``+Inf``) bucket."""


class Histogram:
    """Fixed-bucket histogram: ``counts[i]`` holds values in ``(BUCKETS[i-1], BUCKETS[i]]``."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(BUCKETS, value)] += 1
        self.sum += value

    def add(self, other: Histogram) -> None:
        for i, n in enumerate(other.counts):
            self.counts[i] += n
        self.sum += other.sum

    def stats(self) -> HistogramStats:
        counts = list(self.counts)
        return HistogramStats(
            bounds=list(BUCKETS),
            counts=counts,
            sum=self.sum,
            count=sum(counts),
            p50=_quantile(counts, 0.50),
            p90=_quantile(counts, 0.90),
            p99=_quantile(counts, 0.99),
        )


def _quantile(counts: list[int], q: float) -> float | None:
    """Linear interpolation inside the bucket holding rank ``q`` (as Prometheus'
    ``histogram_quantile``); the last bound for the overflow bucket; None when empty."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(BUCKETS):
                return BUCKETS[-1]
            lo = BUCKETS[i - 1] if i else 0.0
            return lo + (BUCKETS[i] - lo) * max(0.0, rank - seen) / n
        seen += n
    return BUCKETS[-1]  # pragma: no cover - rank <= total always lands above


# ---------------------------------------------------------------- snapshots


@dataclass(frozen=True)
class HistogramStats:
    """A histogram's reading.

    Attributes:
        bounds: bucket upper bounds in seconds (:data:`BUCKETS`).
        counts: observations per bucket, not cumulative; one more entry than ``bounds``
            (the last: above the last bound).
        sum: sum of the observed values, in seconds.
        count: number of observations.
        p50, p90, p99: estimates interpolated inside the buckets (None when empty).
    """

    bounds: list[float]
    counts: list[int]
    sum: float
    count: int
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass(frozen=True)
class TransferStats:
    """Transfers of one link, or of a whole instance.

    Attributes:
        transfers: transfers that completed (every byte landed).
        bytes: bytes those moved.
        errors: transfers that failed, whatever the reason (cancels excluded).
        cancelled: transfers whose caller was cancelled.
        in_flight: transfers running or queued for their link's slot now.
        by_kind: ``{kind: {"transfers": n, "bytes": n}}``, kind ``pull``, ``push``, ``copy``.
        by_path: ``{path: {"transfers": n, "bytes": n}}``, the data path that moved the
            bytes: ``inproc``, ``shm``, ``cma``, ``tcp`` (``local`` for copies).
        by_kind_path: ``{kind: {path: {"transfers": n, "bytes": n}}}``.
        errors_by_code: ``{LLMStatusCode name: n}``.
        errors_by_kind: ``{kind: {LLMStatusCode name: n}}``.
        queue_wait: time completed transfers waited for their link's FIFO slot (0, in the
            first bucket, when it was free).
        latency: whole-call time of completed transfers (slot wait included).
        data_paths: the paths the link can use, preferred first (empty for totals).
    """

    transfers: int
    bytes: int
    errors: int
    cancelled: int
    in_flight: int
    by_kind: dict[str, dict[str, int]]
    by_path: dict[str, dict[str, int]]
    by_kind_path: dict[str, dict[str, dict[str, int]]]
    errors_by_code: dict[str, int]
    errors_by_kind: dict[str, dict[str, int]]
    queue_wait: HistogramStats
    latency: HistogramStats
    data_paths: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Stats:
    """``LLMDataDist.stats()``: one instance's transfer metrics.

    Attributes:
        cluster_id: the instance's cluster id.
        totals: every transfer of the instance: its links' (those gone included) and its
            local copies.
        links: the active links' own, by remote cluster id.
    """

    cluster_id: int
    totals: TransferStats
    links: dict[int, TransferStats]

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and lists (``json.dumps`` takes it; link keys become strings)."""
        return asdict(self)


# ---------------------------------------------------------------- recording


class LinkMetrics:
    """The counters of one link (or of an instance's local copies, or gone links).

    Attributes:
        started: transfers that entered the one path (the runner counts them); those
            not done, failed or cancelled yet are in flight.
    """

    __slots__ = (
        "_last_kind",
        "_last_path",
        "_last_row",
        "cancelled",
        "counts",
        "data_paths",
        "errors",
        "latency",
        "queue_wait",
        "started",
    )

    def __init__(self) -> None:
        self.data_paths: tuple[str, ...] = ()  # set when the link is registered
        self.counts: dict[tuple[str, str], list[int]] = {}  # (kind, path) -> [n, bytes]
        self.errors: dict[tuple[str, str], int] = {}  # (kind, code name) -> n
        self.cancelled = 0
        self.started = 0
        self._last_kind: str | None = None
        self._last_path: str | None = None
        self._last_row: list[int] = []
        self.queue_wait = Histogram()
        self.latency = Histogram()

    def done(
        self,
        kind: str,
        path: str,
        nbytes: int,
        waited: float,
        took: float,
        _bucket: Any = bisect_left,
        _bounds: tuple[float, ...] = BUCKETS,
    ) -> None:
        """One completed transfer: ``waited`` s for the slot, ``took`` s in all.

        Runs once per transfer on the loop thread: the histograms' ``observe`` is inlined,
        and a transfer that found its slot free (``waited == 0``, the common case) is not
        recorded in ``queue_wait`` at all: the snapshot counts it into the first bucket
        (transfers minus recorded waits). The count goes first, so a snapshot between the
        two never sees more recorded waits than transfers.
        """
        if path is self._last_path and kind is self._last_kind:
            c = self._last_row  # the same kind and path as the link's previous transfer
        else:
            row = self.counts.get((kind, path))
            if row is None:
                with _LOCK:  # a new key: the dict changes shape (snapshots copy it locked)
                    row = self.counts.setdefault((kind, str(path)), [0, 0])
            c = row
            self._last_kind, self._last_path, self._last_row = kind, path, c
        c[0] += 1
        c[1] += nbytes
        if waited:
            h = self.queue_wait
            h.counts[_bucket(_bounds, waited)] += 1
            h.sum += waited
        h = self.latency
        h.counts[_bucket(_bounds, took)] += 1
        h.sum += took

    def copied(self, nbytes: int, took: float) -> None:
        """One completed local copy (no link, no slot)."""
        c = self.counts.get((COPY, LOCAL_PATH))
        if c is None:
            with _LOCK:
                c = self.counts.setdefault((COPY, LOCAL_PATH), [0, 0])
        c[0] += 1
        c[1] += nbytes
        self.latency.observe(took)

    def failed(self, kind: str, error: BaseException) -> None:
        """One failed (or cancelled) transfer."""
        if not isinstance(error, Exception):  # CancelledError, KeyboardInterrupt, ...
            self.cancelled += 1
            return
        key = (kind, error_code(error))
        with _LOCK:
            self.errors[key] = self.errors.get(key, 0) + 1

    def add(self, other: LinkMetrics) -> None:
        """Folds ``other`` into this one (``_LOCK`` held by the caller).

        Waits are read before counts: a transfer completing meanwhile is then at worst
        counted as one that found its slot free, never as a wait without a transfer.
        """
        self.queue_wait.add(other.queue_wait)
        self.latency.add(other.latency)
        for key, (n, b) in list(other.counts.items()):
            c = self.counts.setdefault(key, [0, 0])
            c[0] += n
            c[1] += b
        for key, n in list(other.errors.items()):
            self.errors[key] = self.errors.get(key, 0) + n
        self.cancelled += other.cancelled
        self.started += other.started

    def in_flight(self) -> int:
        """Transfers started and not ended (one counter bump per transfer instead of two)."""
        ended = sum(n for n, _ in list(self.counts.values()))
        return max(0, self.started - ended - sum(list(self.errors.values())) - self.cancelled)

    def waits(self) -> Histogram:
        """``queue_wait`` with the transfers that found the slot free in its first bucket."""
        h = Histogram()
        h.add(self.queue_wait)
        slotted = sum(n for (kind, _), (n, _) in self.counts.items() if kind != COPY)
        h.counts[0] += max(0, slotted - sum(h.counts))
        return h

    def stats(self, parts: Iterable[LinkMetrics] = ()) -> TransferStats:
        """The reading of this one plus ``parts`` (``_LOCK`` held by the caller)."""
        total = LinkMetrics()
        in_flight = 0
        for m in (self, *parts):
            total.add(m)
            in_flight += m.in_flight()
        by_kind: dict[str, dict[str, int]] = {}
        by_path: dict[str, dict[str, int]] = {}
        by_kind_path: dict[str, dict[str, dict[str, int]]] = {}
        for (kind, path), (n, b) in sorted(total.counts.items()):
            for row in (
                by_kind.setdefault(kind, {"transfers": 0, "bytes": 0}),
                by_path.setdefault(path, {"transfers": 0, "bytes": 0}),
            ):
                row["transfers"] += n
                row["bytes"] += b
            by_kind_path.setdefault(kind, {})[path] = {"transfers": n, "bytes": b}
        by_code: dict[str, int] = {}
        errors_by_kind: dict[str, dict[str, int]] = {}
        for (kind, code), n in sorted(total.errors.items()):
            by_code[code] = by_code.get(code, 0) + n
            errors_by_kind.setdefault(kind, {})[code] = n
        return TransferStats(
            transfers=sum(r["transfers"] for r in by_kind.values()),
            bytes=sum(r["bytes"] for r in by_kind.values()),
            errors=sum(by_code.values()),
            cancelled=total.cancelled,
            in_flight=in_flight,
            by_kind=by_kind,
            by_path=by_path,
            by_kind_path=by_kind_path,
            errors_by_code=by_code,
            errors_by_kind=errors_by_kind,
            queue_wait=total.waits().stats(),
            latency=total.latency.stats(),
            data_paths=list(self.data_paths) if not parts else [],
        )


def error_code(error: BaseException) -> str:
    """The :class:`LLMStatusCode` name a failure counts under (``LLM_FAILED`` for one that
    is not an engine error: an OS error from a data path, a bug)."""
    if isinstance(error, LLMException):
        try:
            return LLMStatusCode(error.status_code).name
        except ValueError:
            return str(int(error.status_code))
    return LLMStatusCode.LLM_FAILED.name


class InstanceMetrics:
    """One instance's metrics: its active links', the gone links' and local copies'.

    Links register and retire on the loop thread; :meth:`snapshot` may run on any.
    """

    def __init__(self, cluster_id: int) -> None:
        self.cluster_id = cluster_id
        self.local = LinkMetrics()  # local copies
        self._retired = LinkMetrics()  # gone links, folded
        self._links: dict[int, LinkMetrics] = {}
        self._leaving: list[LinkMetrics] = []  # gone links with transfers still in flight

    def register(
        self, remote_cluster_id: int, metrics: LinkMetrics, data_paths: Iterable[str]
    ) -> None:
        """A new link's counters, shown under ``remote_cluster_id`` until it retires."""
        with _LOCK:
            metrics.data_paths = tuple(str(p) for p in data_paths)
            self._links[remote_cluster_id] = metrics

    def retire(self, remote_cluster_id: int, metrics: LinkMetrics) -> None:
        """The link went away: its counters move into the totals (idempotent)."""
        with _LOCK:
            if self._links.get(remote_cluster_id) is metrics:
                del self._links[remote_cluster_id]
                self._leaving.append(metrics)
            self._fold()

    def _fold(self) -> None:
        # A transfer still in flight on a gone link records into that link's counters
        # when it ends: fold a gone link only once nothing of it runs.
        keep = []
        for m in self._leaving:
            if m.in_flight():
                keep.append(m)
            else:
                self._retired.add(m)
        self._leaving = keep

    def snapshot(self) -> Stats:
        """The reading (see :class:`Stats`); safe from any thread."""
        with _LOCK:
            self._fold()
            # Each link is read once: its own reading and its share of the totals agree
            # even while its transfers complete (series per link sum to the totals).
            links = {}
            for cid, m in sorted(self._links.items()):
                links[cid] = read = LinkMetrics()
                read.add(m)
                read.data_paths = m.data_paths
            return Stats(
                cluster_id=self.cluster_id,
                totals=self.local.stats([self._retired, *self._leaving, *links.values()]),
                links={cid: m.stats() for cid, m in links.items()},
            )


# ------------------------------------------------------------------ tracing


class Tracer(Protocol):
    """What the one path calls when tracing is on (one span per transfer)."""

    def begin(self, api: str, kind: str, cluster: int, remote: int | None, request: Any) -> Any:
        """Starts a span; its handle."""

    def end(self, span: Any, path: str | None, nbytes: int, error: BaseException | None) -> None:
        """Ends ``span``: the path that moved the bytes, how many, and the failure if any."""


tracer: Tracer | None = None
"""The active tracer (:func:`aiodatadist.metrics.enable_tracing`); None: tracing off, and
the one path pays a None check."""
