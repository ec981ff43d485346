"""``aiodatadist bench``: the standard workloads over every data path, against baselines.

For each workload (DESIGN.md "Standard workloads") and each count of blocks per pull,
the engine pulls that many random non-contiguous blocks of every layer
(``await pull_blocks(...)``, the whole public path: validation, plan, link slot,
executor, native mover) over each data path that works here:

* ``inproc``: prompt and decoder in this process;
* ``shm``, ``cma``, ``tcp``: the prompt in a subprocess (its cache in shared memory),
  one decoder instance per path with ``aiodatadist.DataPath`` forced.

Baselines, measured in the same run on exactly the same segments (same block lists,
checked by hash): the plain-C movers of ``bench/c/baselines.c`` (``memcpy`` for inproc
and shm, ``process_vm_readv`` for cma, ``writev``/``readv`` over loopback for tcp), built
on demand with ``cc`` into a cache directory; where they cannot be built (no sources in
an installed wheel, no compiler), the native local mover alone (``_native.copy_local``,
the ceiling of every path), as the output says.

The block lists come from the splitmix64 generator that ``bench/workloads.py`` and the C
baselines share, so the C side draws the same blocks for the same seed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import hashlib
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cli import Progress
from .config import OPT_DATA_PATH
from .datadist import LLMDataDist
from .errors import LLMException, LLMStatusCode
from .testing import (
    PeerProcess,
    PromptSpec,
    cluster_info,
    inproc_pair,
    make_blocks_cache,
    pattern_mismatches,
)
from .types import BlocksCacheKey, LLMRole

__all__ = ["WORKLOADS", "Workload", "blocks_hash", "random_blocks", "run_bench"]

ALL_PATHS = ("inproc", "shm", "cma", "tcp")
_C_OP = {"inproc": "memcpy", "shm": "memcpy", "cma": "cma", "tcp": "tcp"}
_C_NAME = {"memcpy": "C memcpy", "cma": "C process_vm_readv", "tcp": "C writev/readv"}


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """One standard KV-cache layout (as ``bench/workloads.py``)."""

    name: str
    num_layers: int
    tensors_per_layer: int
    block_shape: tuple[int, ...]
    dtype: str

    @property
    def num_tensors(self) -> int:
        return self.num_layers * self.tensors_per_layer

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * {"fp16": 2, "bf16": 2}[self.dtype]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("llama8b-fp16", 32, 2, (128, 8, 128), "fp16"),
        Workload("small", 4, 2, (16, 2, 64), "fp16"),
        Workload("mla-like", 61, 1, (128, 1, 576), "bf16"),
    )
}

_M64 = (1 << 64) - 1


def _splitmix(state: list[int]) -> int:
    state[0] = (state[0] + 0x9E3779B97F4A7C15) & _M64
    z = state[0]
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def random_blocks(
    src_pool: int, dst_pool: int, count: int, seed: int
) -> tuple[list[int], list[int]]:
    """``count`` random blocks of each pool, no two ascending neighbours in either list.

    Bit for bit ``bench/workloads.py``'s ``random_blocks`` and the C baselines' ``pick``.
    """
    if not 1 <= count <= min(src_pool, dst_pool):
        raise ValueError(f"count must be in [1, {min(src_pool, dst_pool)}], got {count}")
    state = [seed & _M64]
    out = []
    for pool in (src_pool, dst_pool):
        for _ in range(10_000):
            a = list(range(pool))
            for i in range(count):
                j = i + _splitmix(state) % (pool - i)
                a[i], a[j] = a[j], a[i]
            blocks = a[:count]
            if count == 1 or pool < 3 or not any(b == x + 1 for x, b in itertools.pairwise(blocks)):
                break
        else:  # pragma: no cover - only for pathological (pool, count)
            raise ValueError(f"could not draw {count} non-contiguous blocks of {pool}")
        out.append(blocks)
    return out[0], out[1]


def blocks_hash(src_blocks: list[int], dst_blocks: list[int]) -> str:
    """FNV-1a 64 of the (src, dst) pairs, as the C baselines print it."""
    h = 0xCBF29CE484222325
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        for v in (s, d):
            for k in range(8):
                h ^= (v >> (8 * k)) & 0xFF
                h = (h * 0x100000001B3) & _M64
    return f"{h:016x}"


# --------------------------------------------------------------------------- results


@dataclass
class Point:
    """One (workload, path, blocks per pull) measurement and its baseline."""

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

    def as_json(self) -> dict[str, Any]:
        def r4(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

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
            "note": self.note,
        }


# --------------------------------------------------------------------------- C baselines


def _baselines_source() -> Path | None:
    src = Path(__file__).resolve().parent.parent / "bench" / "c" / "baselines.c"
    return src if src.is_file() else None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aiodatadist"


def find_c_baselines() -> tuple[Path | None, str]:
    """The C baselines executable (built on demand), or None and why not."""
    src = _baselines_source()
    if src is None:
        return None, "bench/c/baselines.c is not here (an installed package)"
    prebuilt = src.parent.parent / "bin" / "baselines"
    if prebuilt.is_file() and prebuilt.stat().st_mtime >= src.stat().st_mtime:
        return prebuilt, f"{prebuilt}"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    exe = _cache_dir() / f"baselines-{digest}"
    if exe.is_file():
        return exe, f"{exe}"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc) to build bench/c/baselines.c"
    exe.parent.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_name(f"{exe.name}.{os.getpid()}.tmp")
    cmd = [cc, "-std=c11", "-O2", "-pthread", "-o", str(tmp), str(src)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"building the C baselines failed: {e}"
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"building the C baselines failed: {last}"
    os.replace(tmp, exe)
    return exe, f"{exe} (built now)"


class CServer:
    """``baselines OP --serve``: set up once; :meth:`sample` times ``inner`` transfers.

    Raises (constructor):
        RuntimeError: it did not start.
    """

    def __init__(
        self, exe: Path, op: str, w: Workload, pool: int, blocks: int, seed: int, par: int
    ) -> None:
        self.name = _C_NAME[op]
        self.nbytes = blocks * w.num_tensors * w.block_bytes
        self.expect_hash = blocks_hash(*random_blocks(pool, pool, blocks, seed))
        cmd = [
            str(exe), op, "--serve",
            "--tensors", str(w.num_tensors),
            "--pool", str(pool),
            "--blocks", str(blocks),
            "--block-bytes", str(w.block_bytes),
            "--seed", str(seed),
            "--streams" if op == "tcp" else "--threads", str(par),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            err = self._kill()
            raise RuntimeError(f"the {op} baseline did not start: {err or 'no output'}")

    def sample(self, inner: int) -> float:
        """GB/s over ``inner`` transfers, as the baseline timed them."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("run\n" * inner)
        self.proc.stdin.flush()
        secs = 0.0
        for _ in range(inner):
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.name} baseline died: {self._kill()}")
            secs += float(line)
        return self.nbytes * inner / secs / 1e9

    def close(self) -> None:
        """Stops it and checks it moved the engine's segments and verified them.

        Raises:
            RuntimeError: it failed its check or moved other segments.
        """
        try:
            out, _ = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self._kill()
            raise RuntimeError(f"the {self.name} baseline did not stop") from None
        res = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        if res.get("blocks_hash") != self.expect_hash or not res.get("verified"):
            raise RuntimeError(f"the {self.name} baseline moved other segments or failed: {res}")

    def _kill(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        _, err = self.proc.communicate()
        return (err.strip().splitlines() or [""])[-1]


class NativeMover:
    """The native local mover alone (``_native.copy_local``) on the same plan."""

    name = "native copy_local"

    def __init__(self, w: Workload, pool: int, blocks: int, seed: int, src: Any, dst: Any) -> None:
        from . import _native

        self._native = _native
        src_ids, dst_ids = random_blocks(pool, pool, blocks, seed)
        geo = _native.Geometry(w.num_tensors, pool, w.block_bytes)
        self.plan = _native.Plan.blocks(geo, geo, src_ids, dst_ids, 0, 0, w.num_tensors)
        self.src = [t.ctypes.data for t in src]
        self.dst = [t.ctypes.data for t in dst]

    def sample(self, inner: int) -> float:
        nat = self._native
        t0 = time.perf_counter()
        for _ in range(inner):
            nat.copy_local(self.plan, self.src, self.dst, nat.Control(), 2)
        return self.plan.total_bytes * inner / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        pass


Baseline = CServer | NativeMover


# --------------------------------------------------------------------------- engine side


@dataclass
class Engine:
    """One linked decoder (one data path) pulling into the shared destination tensors."""

    path: str
    dd: LLMDataDist
    key: BlocksCacheKey
    cache: Any


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
) -> tuple[list[float], list[float]]:
    """Engine and baseline samples, alternated (ABBA) after one warm-up each.

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

    async def engine_sample() -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            await pull()
        return nbytes * inner / (time.perf_counter() - t0) / 1e9

    await pull()
    if baseline is not None:
        await asyncio.to_thread(baseline.sample, 1)
    mine: list[float] = []
    theirs: list[float] = []
    for r in range(args.repeats):
        if baseline is not None and r % 2:
            theirs.append(await asyncio.to_thread(baseline.sample, inner))
        mine.append(await engine_sample())
        if baseline is not None and not r % 2:
            theirs.append(await asyncio.to_thread(baseline.sample, inner))
    return mine, theirs


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
    """Decoders for every path, all registering ``dst``; the in-process prompt's tensors."""
    desc = PromptSpec(
        num_tensors=w.num_tensors, num_blocks=pool, block_shape=w.block_shape, dtype=w.dtype
    ).desc()
    engines: list[Engine] = []
    src: list[Any] | None = None
    if "inproc" in paths or local_src:
        pair = await stack.enter_async_context(inproc_pair(prompt_id=1, decoder_id=2))
        filled = make_blocks_cache(
            pair.prompt, model_id=0, seed=args.seed, allocate=False, pattern=True,
            num_tensors=w.num_tensors, num_blocks=pool, block_shape=w.block_shape,
            data_type=desc.data_type,
        )  # fmt: skip
        src = filled.tensors
        if "inproc" in paths:
            cache = pair.decoder.cache_manager.register_blocks_cache(desc, dst)
            engines.append(Engine("inproc", pair.decoder, pair.key(), cache))
    remote = [p for p in paths if p != "inproc" and p not in skipped]
    if not remote:
        return engines, src
    spec = PromptSpec(
        num_tensors=w.num_tensors, num_blocks=pool, block_shape=w.block_shape, dtype=w.dtype,
        seed=args.seed, allocate=True,
    )  # fmt: skip
    peer = await stack.enter_async_context(PeerProcess(spec, cluster_id=3, start_timeout=300))
    for i, path in enumerate(remote):
        dd = LLMDataDist(LLMRole.DECODER, 10 + i)
        await dd.init({OPT_DATA_PATH: path})
        stack.push_async_callback(dd.finalize)
        cache = dd.cache_manager.register_blocks_cache(desc, dst)
        status, _ = await dd.link_clusters([cluster_info(3, *peer.address)], 30_000)
        if status != LLMStatusCode.LLM_SUCCESS:
            skipped[path] = f"link_clusters failed: {status.name}"
            continue
        engines.append(Engine(path, dd, BlocksCacheKey(3, 0), cache))
    return engines, src


async def _run_workload(
    w: Workload,
    pool: int,
    counts: list[int],
    paths: list[str],
    args: argparse.Namespace,
    exe: Path | None,
    bar: Progress,
    skipped: dict[str, str],
) -> list[Point]:
    """Every path of one workload: for each count, each baseline is set up once and
    alternated with the engine on each path it is the baseline of."""
    import numpy as np

    points: list[Point] = []
    shape = (pool, *w.block_shape)
    dtype = PromptSpec(dtype=w.dtype).data_type.to_numpy()
    dst = [np.zeros(shape, dtype=dtype) for _ in range(w.num_tensors)]
    for t in dst:
        t.view(np.uint8).fill(1)  # touched: no page faults while timing
    async with contextlib.AsyncExitStack() as stack:
        engines, src = await _link_engines(stack, w, pool, paths, args, dst, exe is None, skipped)
        for n in counts:
            src_ids, dst_ids = random_blocks(pool, pool, n, args.seed)
            nbytes = n * w.num_tensors * w.block_bytes
            for op in ("memcpy", "cma", "tcp"):
                mine = [e for e in engines if _C_OP[e.path] == op and e.path not in skipped]
                if not mine:
                    continue
                baseline: Baseline | None = None
                note = ""
                try:
                    if exe is not None:
                        baseline = await asyncio.to_thread(
                            CServer, exe, op, w, pool, n, args.seed, 2
                        )
                    else:
                        assert src is not None
                        baseline = NativeMover(w, pool, n, args.seed, src, dst)
                except RuntimeError as why:
                    note = str(why)
                try:
                    for e in mine:
                        p = Point(w.name, e.path, n, nbytes, n * w.num_tensors, note=note)
                        _zero(dst, dst_ids)
                        try:
                            p.samples, p.baseline_samples = await _measure(
                                e, baseline, src_ids, dst_ids, w, nbytes, args
                            )
                        except LLMException as err:
                            if err.status_code != LLMStatusCode.LLM_FEATURE_NOT_ENABLED:
                                raise
                            skipped[e.path] = str(err)
                            continue
                        p.verified = not pattern_mismatches(
                            dst, src_ids, dst_ids, args.seed, limit=1
                        )
                        p.baseline = None if baseline is None else baseline.name
                        points.append(p)
                        bar.advance()
                finally:
                    if baseline is not None:
                        await asyncio.to_thread(baseline.close)
    return points


# --------------------------------------------------------------------------- output


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}" if r >= 0.1 else f"{r:.3f}"


def _table(points: list[Point]) -> str:
    hdr = (f"{'workload':<13} {'path':<6} {'blocks':>6} {'bytes':>10} {'engine GB/s':>11}  "
           f"{'baseline':<20} {'GB/s':>6} {'ratio':>6} {'paired':>6}  check")  # fmt: skip
    lines = [hdr, "-" * len(hdr)]
    for p in points:
        size = f"{p.bytes / 2**20:.1f} MiB" if p.bytes >= 2**20 else f"{p.bytes / 1024:.0f} KiB"
        med = "-" if p.median is None else f"{p.median:.2f}"
        bmed = "-" if p.baseline_median is None else f"{p.baseline_median:.2f}"
        check = "ok" if p.verified else "MISMATCH"
        lines.append(
            f"{p.workload:<13} {p.path:<6} {p.blocks:>6} {size:>10} {med:>11}  "
            f"{p.baseline or '-':<20} {bmed:>6} {_fmt_ratio(p.ratio):>6} "
            f"{_fmt_ratio(p.paired_ratio):>6}  {check}" + (f"  ({p.note})" if p.note else "")
        )
    return "\n".join(lines)


def _geomean(xs: list[float]) -> float:
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 4)


def _summary(points: list[Point]) -> dict[str, dict[str, Any]]:
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


def _plot(out: str, points: list[Point], workloads: list[str], baseline_kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4.2), squeeze=False)
    colors = {"inproc": "tab:blue", "shm": "tab:green", "cma": "tab:orange", "tcp": "tab:red"}
    for ax, wname in zip(axes[0], workloads, strict=True):
        mine = [p for p in points if p.workload == wname]
        for path in ALL_PATHS:
            pts = sorted((p for p in mine if p.path == path and p.median), key=lambda p: p.blocks)
            if pts:
                ax.plot([p.blocks for p in pts], [p.median for p in pts], "o-",
                        color=colors[path], label=path)  # fmt: skip
        op_color = {"memcpy": "tab:blue", "cma": "tab:orange", "tcp": "tab:red"}
        for op, name in _C_NAME.items():
            for label in (name, "native copy_local"):
                pts = sorted(
                    (q for q in mine
                     if q.baseline == label and _C_OP[q.path] == op and q.baseline_median),
                    key=lambda q: q.blocks,
                )  # fmt: skip
                xs = sorted({q.blocks for q in pts})
                if not xs or (label == "native copy_local" and op != "memcpy"):
                    continue
                ys = [next(q.baseline_median for q in pts if q.blocks == x) for x in xs]
                ax.plot(xs, ys, "--", color=op_color[op], alpha=0.5, label=f"baseline: {label}")
        ax.set_xscale("log", base=2)
        ax.set_title(wname)
        ax.set_xlabel("blocks per pull (all layers)")
        ax.set_ylabel("GB/s (1e9 B/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"aiodatadist pull_blocks bandwidth per data path (baseline: {baseline_kind})",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------- command


def _write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


async def run_bench(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (1 when a pulled byte was wrong).

    Raises:
        LLMException: a pull failed for another reason than its path being unavailable.
        RuntimeError, TimeoutError: a prompt process did not start.

    Timeout: each pull is bounded by 120 s, each C baseline run by 300 s. Cancel
    (Ctrl-C): decoders are finalized and prompt processes stopped before it propagates.
    """
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install 'aiodatadist[bench]'", file=sys.stderr)
            return 2
    quick = args.quick
    workloads = args.workload or list(WORKLOADS)
    paths = args.paths or list(ALL_PATHS)
    counts = args.blocks_per_pull or ([1, 4] if quick else [1, 4, 16, 64])
    args.repeats = args.repeats or (3 if quick else 5)
    args.timeout = 120.0
    pool = max(max(counts), 8 if quick else 64)

    exe: Path | None = None
    why = "--baseline native"
    if args.baseline != "native":
        exe, why = find_c_baselines()
        if exe is None and args.baseline == "c":
            print(f"aiodatadist bench: no C baselines: {why}", file=sys.stderr)
            return 2
    if exe is not None:
        kind = f"plain-C movers of bench/c ({why})"
    else:
        kind = f"the native local mover alone, _native.copy_local ({why})"
    print(
        f"aiodatadist bench{' --quick' if quick else ''}: pull_blocks of N random non-contiguous "
        f"blocks, all layers, pool of {pool} blocks per tensor;\n"
        f"  GB/s = 1e9 B/s, median of {args.repeats} samples after a warm-up; every pull "
        f"checked byte for byte\n  baseline: {kind}, same segments, measured in this run"
    )
    skipped: dict[str, str] = {}
    points: list[Point] = []
    total = len(workloads) * len(counts) * len(paths)
    t_start = time.perf_counter()
    with Progress("bench", total, enabled=args.progress) as bar:
        for wname in workloads:
            points += await _run_workload(
                WORKLOADS[wname], pool, counts, paths, args, exe, bar, skipped
            )
    elapsed = time.perf_counter() - t_start
    order = {name: i for i, name in enumerate(ALL_PATHS)}
    points.sort(key=lambda p: (workloads.index(p.workload), order[p.path], p.blocks))
    print()
    print(_table(points))
    summary = _summary(points)
    print()
    print(
        "ratio = engine median / baseline median, paired = median of per-sample ratios "
        "(engine and baseline alternated);\nper path, geometric mean of the ratios over the "
        "points: " + ", ".join(f"{k} {v['ratio_geomean']:.2f}" for k, v in summary.items())
    )
    for path, reason in skipped.items():
        print(f"skipped {path}: {reason}")
    print(f"({elapsed:.0f} s)")

    if args.json:
        from . import __version__, _native

        doc = {
            "meta": {
                "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "command": " ".join(["aiodatadist", *sys.argv[1:]]),
                "aiodatadist": __version__,
                "native": _native.__version__,
                "python": platform.python_version(),
                "kernel": platform.release(),
                "cpus": os.cpu_count(),
                "quick": quick,
                "pool_blocks": pool,
                "blocks_per_pull": counts,
                "repeats": args.repeats,
                "seed": args.seed,
                "unit": "GB/s = 1e9 bytes/s; median of the samples",
                "elapsed_s": round(elapsed, 1),
            },
            "baseline_kind": "c" if exe is not None else "native",
            "baseline": kind,
            "workloads": {
                n: WORKLOADS[n].__dict__ | {"block_bytes": WORKLOADS[n].block_bytes}
                for n in workloads
            },
            "paths": [p for p in paths if p not in skipped],
            "skipped": skipped,
            "results": [p.as_json() for p in points],
            "summary": summary,
        }
        _write(args.json, json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        _plot(args.plot, points, workloads, "C" if exe is not None else "native copy_local")
        print(f"wrote {args.plot}")
    return 0 if all(p.verified for p in points) else 1
