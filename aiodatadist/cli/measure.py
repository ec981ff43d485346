"""The measurement behind ``aiodatadist bench``: the engine and a baseline, alternated.

:func:`run_workload` links one decoder per data path (``aiodatadist.DataPath`` forced),
all pulling into the same registered destination (one anonymous mapping, 2 MiB-aligned,
``MADV_HUGEPAGE``), from a prompt in this process (``inproc``) or in a subprocess
(``shm``: its cache allocated in POSIX shared memory; ``cma``, ``tcp``: registered
anonymous memory, huge-page-advised, as a serving process would register it). For each
count of random non-contiguous blocks it alternates engine samples
(``await pull_blocks(...)``, the whole public path) with samples of a baseline on the
same blocks, and checks every pulled byte.

The baseline is pluggable (:data:`BaselineFactory`); the default, and the only one the
installed command uses, is :class:`NativeMover` (``_native.copy_local`` on the same
plan). The source tree's ``bench/`` passes its plain-C movers and an ``observe`` hook
(memory accounting); this package never imports ``bench/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import OPT_DATA_PATH, DataPath
from ..datadist import LLMDataDist
from ..errors import LLMException, LLMStatusCode
from ..testing import (
    PeerProcess,
    PromptSpec,
    cluster_info,
    host_buffer,
    inproc_pair,
    make_blocks_cache,
    pattern_mismatches,
)
from ..types import BlocksCacheKey, LLMRole
from .progress import Progress
from .stats import SMALL_PULL_BYTES, Summary, disagree_warning, disagreement
from .stats import summarize as summary_of
from .workloads import Workload, random_blocks

__all__ = [
    "ALL_PATHS",
    "NATIVE_BASELINE",
    "Baseline",
    "BaselineCase",
    "BaselineFactory",
    "Engine",
    "NativeMover",
    "Observe",
    "Point",
    "run_workload",
    "summarize",
]

ALL_PATHS = (DataPath.INPROC, DataPath.SHM, DataPath.CMA, DataPath.TCP)
NATIVE_BASELINE = "native mover (_native.copy_local, same plan)"


# --------------------------------------------------------------------------- results


@dataclass
class Point:
    """One (workload, path, blocks per pull) measurement and its baseline.

    ``samples`` and ``baseline_samples`` are GB/s, one per round (a round spans
    :func:`_inner` transfers); for pulls of at most :data:`~.stats.SMALL_PULL_BYTES`,
    ``latencies_us`` holds the engine's per-pull latencies, one list per round. ``extra``
    holds what a caller's ``observe`` hook adds (``bench/``: the memory kind and its
    huge-page shares); :meth:`as_json` writes it as more keys.
    """

    workload: str
    path: str
    blocks: int
    bytes: int
    segments: int
    samples: list[float] = field(default_factory=list)  # GB/s
    verified: bool = False
    baseline: str | None = None
    baseline_samples: list[float] = field(default_factory=list)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    latencies_us: list[list[float]] = field(default_factory=list)  # engine, per round
    baseline_latencies_us: list[list[float]] = field(default_factory=list)  # where it times each

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    @property
    def baseline_median(self) -> float | None:
        return statistics.median(self.baseline_samples) if self.baseline_samples else None

    @property
    def ratio(self) -> float | None:
        m, b = self.median, self.baseline_median
        return None if m is None or not b else m / b

    @property
    def paired_ratio(self) -> float | None:
        """Median of engine_i / baseline_i over the alternated samples (robust to drift)."""
        if not self.samples or len(self.samples) != len(self.baseline_samples):
            return None
        pairs = zip(self.samples, self.baseline_samples, strict=True)
        return statistics.median(m / b for m, b in pairs)

    @property
    def small(self) -> bool:
        """A small pull: reported as latency too."""
        return self.bytes <= SMALL_PULL_BYTES

    @property
    def spread(self) -> Summary | None:
        """The engine's GB/s over the rounds."""
        return summary_of(self.samples)

    @property
    def baseline_spread(self) -> Summary | None:
        return summary_of(self.baseline_samples)

    @property
    def paired_spread(self) -> Summary | None:
        """The per-round ratios engine / baseline."""
        if not self.samples or len(self.samples) != len(self.baseline_samples):
            return None
        return summary_of(m / b for m, b in zip(self.samples, self.baseline_samples, strict=True))

    @property
    def latency(self) -> Summary | None:
        """The engine's per-pull latency (us) over every timed pull (small pulls only)."""
        return summary_of(x for r in self.latencies_us for x in r)

    @property
    def baseline_latency_kind(self) -> str | None:
        """``"per transfer"`` where the baseline timed each transfer, else ``"mean per round"``."""
        if not self.small or not self.baseline_samples:
            return None
        return "per transfer" if self.baseline_latencies_us else "mean per round"

    @property
    def baseline_latency(self) -> Summary | None:
        """The baseline's us per transfer (small pulls only): over every transfer where it
        timed each (:class:`NativeMover` does), else its mean per transfer in each round."""
        if not self.small:
            return None
        if self.baseline_latencies_us:
            return summary_of(x for r in self.baseline_latencies_us for x in r)
        return summary_of(self.bytes / (g * 1e3) for g in self.baseline_samples if g > 0)

    @property
    def latency_round_medians(self) -> list[float]:
        return [statistics.median(r) for r in self.latencies_us if r]

    @property
    def name(self) -> str:
        return f"{self.workload} {self.path} {self.blocks} block{'s' * (self.blocks != 1)}"

    @property
    def warnings(self) -> list[str]:
        """A WARNING line for each figure (engine GB/s and latency, baseline GB/s) whose
        rounds disagree."""
        out = [
            disagree_warning(f"{self.name}, engine GB/s", self.samples, "GB/s"),
            disagree_warning(
                f"{self.name}, engine latency", self.latency_round_medians, "us per pull"
            ),
        ]
        if self.baseline_samples:
            base = self.baseline or "baseline"
            out.append(disagree_warning(f"{self.name}, {base} GB/s", self.baseline_samples, "GB/s"))
        return [w for w in out if w]

    def as_json(self) -> dict[str, Any]:
        def r4(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        def js(s: Summary | None) -> dict[str, Any] | None:
            return None if s is None else s.as_json()

        return {
            "workload": self.workload,
            "path": self.path,
            "blocks_per_pull": self.blocks,
            "bytes_per_pull": self.bytes,
            "segments": self.segments,
            "median_gbps": r4(self.median),
            "samples_gbps": [round(s, 4) for s in self.samples],
            "verified": self.verified,
            "baseline": self.baseline,
            "baseline_median_gbps": r4(self.baseline_median),
            "baseline_samples_gbps": [round(s, 4) for s in self.baseline_samples],
            "ratio": r4(self.ratio),
            "paired_ratio": r4(self.paired_ratio),
            "spread_gbps": js(self.spread),
            "baseline_spread_gbps": js(self.baseline_spread),
            "paired_ratio_spread": js(self.paired_spread),
            "latency_us": js(self.latency),
            "latency_rounds_us": [[round(x, 2) for x in r] for r in self.latencies_us],
            "baseline_latency_us": js(self.baseline_latency),
            "baseline_latency_kind": self.baseline_latency_kind,
            "disagreement": {
                "engine": r4(disagreement(self.samples)),
                "engine_latency": r4(disagreement(self.latency_round_medians)),
                "baseline": r4(disagreement(self.baseline_samples)),
            },
            "warnings": self.warnings,
            **self.extra,
            "note": self.note,
        }


# --------------------------------------------------------------------------- baselines


class Baseline(Protocol):
    """What the engine is compared with: set up once, sampled alternately with it.

    A baseline that times each transfer may also expose ``latencies_us`` (a list: the
    us of each transfer of its last :meth:`sample`); small pulls then report its
    per-transfer percentiles, not only its mean.
    """

    name: str

    def sample(self, inner: int) -> float:
        """GB/s over ``inner`` transfers."""
        ...

    def close(self) -> None:
        """Stops it (and checks what it moved, where it can). Raises RuntimeError."""
        ...


@dataclass(frozen=True)
class BaselineCase:
    """What a baseline factory is asked for: one path, one workload, one pull size.

    ``src`` is the in-process prompt's tensors (None where only remote prompts run);
    ``dst`` the destination the engine pulls into.
    """

    path: str
    workload: Workload
    pool: int
    blocks: int
    seed: int
    src: list[Any] | None
    dst: list[Any]


BaselineFactory = Callable[[BaselineCase], Baseline]


class NativeMover:
    """The native local mover alone (``_native.copy_local``) on the same plan.

    The same blocks as the engine's pull, from the in-process prompt's cache into the
    engine's destination, 2 threads (the engine's default ``MoverThreads``).
    """

    name = NATIVE_BASELINE

    def __init__(self, w: Workload, pool: int, blocks: int, seed: int, src: Any, dst: Any) -> None:
        from .. import _native

        self.latencies_us: list[float] = []  # each transfer of the last sample (small pulls)
        self._native = _native
        src_ids, dst_ids = random_blocks(pool, pool, blocks, seed)
        geo = _native.Geometry(w.num_tensors, pool, w.block_bytes)
        self.plan = _native.Plan.blocks(geo, geo, src_ids, dst_ids, 0, 0, w.num_tensors)
        self.src = [t.ctypes.data for t in src]
        self.dst = [t.ctypes.data for t in dst]
        self.ranges = [(t.ctypes.data, t.nbytes) for t in (*src, *dst)]

    @classmethod
    def for_case(cls, case: BaselineCase) -> NativeMover:
        """The :data:`BaselineFactory` of the native mover (needs the in-process source)."""
        assert case.src is not None
        return cls(case.workload, case.pool, case.blocks, case.seed, case.src, case.dst)

    def sample(self, inner: int) -> float:
        nat = self._native
        t0 = time.perf_counter()
        if self.plan.total_bytes <= SMALL_PULL_BYTES:  # timed one by one, as the engine's
            clock, lats = time.perf_counter_ns, []
            for _ in range(inner):
                t = clock()
                nat.copy_local(self.plan, self.src, self.dst, nat.Control(), 2)
                lats.append((clock() - t) / 1e3)
            self.latencies_us = lats
        else:
            for _ in range(inner):
                nat.copy_local(self.plan, self.src, self.dst, nat.Control(), 2)
        return self.plan.total_bytes * inner / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- engine side


@dataclass
class Engine:
    """One linked decoder (one data path) pulling into the shared destination tensors."""

    path: str
    dd: LLMDataDist
    key: BlocksCacheKey
    cache: Any
    src_pid: int | None = None  # the prompt process (None: this one)
    src_ranges: list[tuple[int, int]] = field(default_factory=list)  # an in-process prompt's
    src_bytes: int = 0


def _inner(nbytes: int) -> int:
    """Transfers per sample: a sample spans >= ~16 MiB (per-call costs are amortized)."""
    return max(1, min(200, (16 << 20) // max(1, nbytes)))


async def _measure(
    engine: Engine,
    baseline: Baseline | None,
    src_ids: list[int],
    dst_ids: list[int],
    w: Workload,
    nbytes: int,
    args: argparse.Namespace,
) -> tuple[list[float], list[float], list[list[float]], list[list[float]]]:
    """Engine and baseline samples, alternated (ABBA) after one warm-up each.

    Returns GB/s per round of the engine and of the baseline, and for small pulls
    (:data:`~.stats.SMALL_PULL_BYTES`) the per-transfer latencies (us) per round of the
    engine and of the baseline (where it exposes them, see :class:`Baseline`).

    Raises:
        LLMException: a pull failed (LLM_FEATURE_NOT_ENABLED: the path does not work here).
        RuntimeError: the baseline failed.
    """
    cm = engine.dd.cache_manager
    inner = _inner(nbytes)

    async def pull() -> None:
        await cm.pull_blocks(
            engine.key, engine.cache, src_ids, dst_ids,
            tensor_num_per_layer=w.tensors_per_layer, timeout=args.timeout,
        )  # fmt: skip

    lats: list[list[float]] = []

    async def engine_sample() -> float:
        t0 = time.perf_counter()
        if nbytes <= SMALL_PULL_BYTES:  # each pull timed: ~0.1 us on a >= 10 us pull
            clock, mine = time.perf_counter_ns, []
            for _ in range(inner):
                t = clock()
                await pull()
                mine.append((clock() - t) / 1e3)
            lats.append(mine)
        else:
            for _ in range(inner):
                await pull()
        return nbytes * inner / (time.perf_counter() - t0) / 1e9

    await pull()
    if baseline is not None:
        await asyncio.to_thread(baseline.sample, 1)
    mine: list[float] = []
    theirs: list[float] = []
    base_lats: list[list[float]] = []

    async def baseline_sample() -> None:
        assert baseline is not None
        theirs.append(await asyncio.to_thread(baseline.sample, inner))
        got = getattr(baseline, "latencies_us", None)
        if nbytes <= SMALL_PULL_BYTES and isinstance(got, list) and got:
            base_lats.append(list(got))

    for r in range(args.repeats):
        if baseline is not None and r % 2:
            await baseline_sample()
        mine.append(await engine_sample())
        if baseline is not None and not r % 2:
            await baseline_sample()
    return mine, theirs, lats, base_lats if len(base_lats) == len(theirs) else []


def _zero(tensors: list[Any], dst_ids: list[int]) -> None:
    import numpy as np

    idx = np.asarray(dst_ids, dtype=np.intp)
    for t in tensors:
        t[idx] = 0


async def _link_engines(
    stack: contextlib.AsyncExitStack,
    w: Workload,
    pool: int,
    paths: list[str],
    args: argparse.Namespace,
    dst: list[Any],
    local_src: bool,
    skipped: dict[str, str],
) -> tuple[list[Engine], list[Any] | None]:
    """Decoders for every path, all registering ``dst``; the in-process prompt's tensors.

    The shm path's prompt allocates its cache in shared memory; the cma and tcp paths'
    prompt (another process) registers huge-page-advised memory, as a serving process
    would (a cache in shared memory would put those two paths on 4 KiB pages).
    """
    desc = PromptSpec(
        num_tensors=w.num_tensors, num_blocks=pool, block_shape=w.block_shape, dtype=w.dtype
    ).desc()
    cache_bytes = w.num_tensors * pool * w.block_bytes
    engines: list[Engine] = []
    src: list[Any] | None = None
    if DataPath.INPROC in paths or local_src:
        pair = await stack.enter_async_context(inproc_pair(prompt_id=1, decoder_id=2))
        filled = make_blocks_cache(
            pair.prompt, model_id=0, seed=args.seed, allocate=False, pattern=True,
            num_tensors=w.num_tensors, num_blocks=pool, block_shape=w.block_shape,
            data_type=desc.data_type, huge_pages=True,
        )  # fmt: skip
        src = filled.tensors
        if DataPath.INPROC in paths:
            cache = pair.decoder.cache_manager.register_blocks_cache(desc, dst)
            ranges = [(t.ctypes.data, t.nbytes) for t in src]
            engines.append(
                Engine(DataPath.INPROC, pair.decoder, pair.key(), cache, None, ranges, cache_bytes)
            )
    remote = [p for p in paths if p != DataPath.INPROC and p not in skipped]
    peers: dict[bool, PeerProcess] = {}  # allocate -> its prompt process
    for i, path in enumerate(remote):
        allocate = path == DataPath.SHM
        if allocate not in peers:
            spec = PromptSpec(
                num_tensors=w.num_tensors, num_blocks=pool, block_shape=w.block_shape,
                dtype=w.dtype, seed=args.seed, allocate=allocate,
            )  # fmt: skip
            cid = 3 if allocate else 4
            peers[allocate] = await stack.enter_async_context(
                PeerProcess(spec, cluster_id=cid, start_timeout=300)
            )
        peer = peers[allocate]
        dd = LLMDataDist(LLMRole.DECODER, 10 + i)
        await dd.init({**getattr(args, "decoder_options", {}), OPT_DATA_PATH: path})
        stack.push_async_callback(dd.finalize)
        cache = dd.cache_manager.register_blocks_cache(desc, dst)
        status, _ = await dd.link_clusters([cluster_info(peer.cluster_id, *peer.address)], 30_000)
        if status != LLMStatusCode.LLM_SUCCESS:
            skipped[path] = f"link_clusters failed: {status.name}"
            continue
        engines.append(
            Engine(path, dd, BlocksCacheKey(peer.cluster_id, 0), cache, peer.pid, [], cache_bytes)
        )
    return engines, src


Observe = Callable[[Point, Engine, Baseline | None, list[Any]], None]


async def run_workload(
    w: Workload,
    pool: int,
    counts: list[int],
    paths: list[str],
    args: argparse.Namespace,
    bar: Progress | None = None,
    skipped: dict[str, str] | None = None,
    *,
    baseline: BaselineFactory | None = None,
    observe: Observe | None = None,
) -> list[Point]:
    """Every path of one workload, each against its baseline, alternated in this run.

    For each count and each path, the baseline (``baseline(case)``; default: the
    native mover, :meth:`NativeMover.for_case`) is set up once and alternated with the
    engine (see :func:`_measure`). ``args`` needs ``seed``, ``repeats`` and ``timeout``
    (seconds per pull); optional: ``decoder_options`` are more ``init`` options of the
    cross-process decoders. ``observe(point, engine, baseline, dst)`` runs after each
    verified measurement, before the baseline stops (``bench/``: memory accounting).
    ``skipped`` collects the paths that do not work here.

    Raises:
        LLMException: a pull failed for another reason than its path being unavailable.
        RuntimeError, TimeoutError: a prompt process or a baseline did not start.
    """
    skipped = {} if skipped is None else skipped
    make_baseline: BaselineFactory = baseline or NativeMover.for_case
    points: list[Point] = []
    shape = (pool, *w.block_shape)
    dtype = PromptSpec(dtype=w.dtype).data_type.to_numpy()
    # Registered destination: one anonymous mapping, 2 MiB-aligned, MADV_HUGEPAGE, touched
    # (the C baselines' buffers are one mapping each, too).
    dst = list(host_buffer((w.num_tensors, *shape), dtype))
    async with contextlib.AsyncExitStack() as stack:
        engines, src = await _link_engines(
            stack, w, pool, paths, args, dst, baseline is None, skipped
        )
        for n in counts:
            src_ids, dst_ids = random_blocks(pool, pool, n, args.seed)
            nbytes = n * w.num_tensors * w.block_bytes
            for e in engines:
                if e.path in skipped:
                    continue
                base: Baseline | None = None
                note = ""
                case = BaselineCase(e.path, w, pool, n, args.seed, src, dst)
                try:
                    base = await asyncio.to_thread(make_baseline, case)
                except RuntimeError as why:
                    note = str(why)
                try:
                    p = Point(w.name, e.path, n, nbytes, n * w.num_tensors, note=note)
                    _zero(dst, dst_ids)
                    try:
                        (
                            p.samples,
                            p.baseline_samples,
                            p.latencies_us,
                            p.baseline_latencies_us,
                        ) = await _measure(e, base, src_ids, dst_ids, w, nbytes, args)
                    except LLMException as err:
                        if err.status_code != LLMStatusCode.LLM_FEATURE_NOT_ENABLED:
                            raise
                        skipped[e.path] = str(err)
                        continue
                    p.verified = not pattern_mismatches(dst, src_ids, dst_ids, args.seed, limit=1)
                    if base is not None:
                        p.baseline = base.name
                    if observe is not None:
                        observe(p, e, base, dst)
                    points.append(p)
                    if bar is not None:
                        bar.advance()
                finally:
                    if base is not None:
                        await asyncio.to_thread(base.close)
    return points


def _geomean(xs: list[float]) -> float:
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 4)


def summarize(points: list[Point]) -> dict[str, dict[str, Any]]:
    """Per path: the geometric mean, min and max of the ratios over the points."""
    out: dict[str, dict[str, Any]] = {}
    for path in ALL_PATHS:
        mine = [p for p in points if p.path == path and p.ratio]
        if not mine:
            continue
        ratios = [p.ratio for p in mine if p.ratio]
        paired = [p.paired_ratio for p in mine if p.paired_ratio]
        out[path] = {
            "ratio_geomean": _geomean(ratios),
            "paired_ratio_geomean": _geomean(paired) if paired else None,
            "ratio_min": round(min(ratios), 4),
            "ratio_max": round(max(ratios), 4),
            "points": len(ratios),
        }
    return out
