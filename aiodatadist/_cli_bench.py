"""``aiodatadist bench``: the standard workloads over every data path, against baselines.

For each workload (DESIGN.md "Standard workloads") and each count of blocks per pull,
the engine pulls that many random non-contiguous blocks of every layer
(``await pull_blocks(...)``, the whole public path: validation, plan, link slot,
executor, native mover) over each data path that works here:

* ``inproc``: prompt and decoder in this process;
* ``shm``: the prompt in a subprocess, its cache allocated in POSIX shared memory;
* ``cma``, ``tcp``: the prompt in a subprocess, its cache registered (anonymous memory,
  ``madvise(MADV_HUGEPAGE)``, as a serving process would register it);

one decoder instance per path with ``aiodatadist.DataPath`` forced, all pulling into
the same registered destination (anonymous, ``MADV_HUGEPAGE``).

Baselines, measured in the same run on exactly the same segments (same block lists,
checked by hash) **and the same kind of memory**: the plain-C movers of
``bench/c/baselines.c``, built on demand with ``cc`` into a cache directory:

* inproc: ``memcpy`` between huge-page-advised buffers;
* shm: ``memcpy --src-shm``, from a POSIX shared-memory source (which gets huge pages
  only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows it: on 4 KiB
  pages where it says ``never``) into a huge-page-advised destination;
* cma: ``process_vm_readv`` between huge-page-advised buffers;
* tcp: ``writev``/``readv`` over loopback, huge-page-advised buffers.

Where they cannot be built (no sources in an installed wheel, no compiler), the native
local mover alone (``_native.copy_local``, the ceiling of every path) is the baseline,
as the output says. The table shows each path's memory kind, and how much of the
engine's and the baseline's buffers the kernel really backed with huge pages
(``/proc/PID/smaps``).

The block lists come from the splitmix64 generator defined here (``bench/workloads.py``
re-exports it) and mirrored in the C baselines, so the C side draws the same blocks for
the same seed.
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
import re
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
    host_buffer,
    inproc_pair,
    make_blocks_cache,
    pattern_mismatches,
)
from .types import BlocksCacheKey, LLMRole

__all__ = [
    "DEFAULT_SEED",
    "WORKLOADS",
    "SplitMix64",
    "Workload",
    "blocks_hash",
    "random_blocks",
    "run_bench",
    "run_workload",
]

ALL_PATHS = ("inproc", "shm", "cma", "tcp")
_C_OP = {"inproc": "memcpy", "shm": "memcpy", "cma": "cma", "tcp": "tcp"}
_C_NAME = {"memcpy": "C memcpy", "cma": "C process_vm_readv", "tcp": "C writev/readv"}
DEFAULT_SEED = 20240601


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


class SplitMix64:
    """splitmix64 (Steele, Lea, Flood 2014); mirrored in ``bench/c/baselines.c``."""

    _MASK = _M64

    def __init__(self, seed: int) -> None:
        self.state = seed & _M64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)


def _pick(rng: SplitMix64, pool: int, count: int) -> list[int]:
    # Partial Fisher-Yates: `count` distinct blocks of [0, pool) in random order.
    a = list(range(pool))
    for i in range(count):
        j = i + rng.next() % (pool - i)
        a[i], a[j] = a[j], a[i]
    return a[:count]


def random_blocks(
    src_pool: int, dst_pool: int, count: int, seed: int = DEFAULT_SEED
) -> tuple[list[int], list[int]]:
    """``count`` distinct random source blocks of ``[0, src_pool)`` and destination
    blocks of ``[0, dst_pool)``, neither list holding two ascending neighbours
    (``b[i+1] == b[i] + 1``), so no two pairs merge into one segment: every block is
    its own segment. Deterministic in ``seed``; bit for bit the C baselines' ``pick``.

    Raises:
        ValueError: ``count`` is not in ``[1, min(src_pool, dst_pool)]``.
    """
    if not 1 <= count <= min(src_pool, dst_pool):
        raise ValueError(f"count must be in [1, {min(src_pool, dst_pool)}], got {count}")
    rng = SplitMix64(seed)
    out = []
    for pool in (src_pool, dst_pool):
        for _ in range(10_000):
            blocks = _pick(rng, pool, count)
            if count == 1 or pool < 3 or not any(b == x + 1 for x, b in itertools.pairwise(blocks)):
                break
        else:  # pragma: no cover - only for pathological (pool, count)
            raise ValueError(f"could not draw {count} non-contiguous blocks of {pool}")
        out.append(blocks)
    return out[0], out[1]


def blocks_hash(src_blocks: list[int], dst_blocks: list[int]) -> str:
    """FNV-1a 64 over the (src, dst) pairs as little-endian uint64s, as the C baselines
    print it."""
    h = 0xCBF29CE484222325
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        for v in (s, d):
            for k in range(8):
                h ^= (v >> (8 * k)) & 0xFF
                h = (h * 0x100000001B3) & _M64
    return f"{h:016x}"


# --------------------------------------------------------------------------- memory


def thp_mode(name: str = "enabled") -> str | None:
    """The selected mode of ``/sys/kernel/mm/transparent_hugepage/<name>`` (``enabled``
    or ``shmem_enabled``), or None where there is none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage", name).read_text()
    except OSError:
        return None
    m = re.search(r"\[([^\]]+)\]", text)
    return m.group(1) if m else text.strip() or None


def memory_kinds() -> dict[str, str]:
    """Labels of the two kinds of memory the paths use, as this kernel backs them.

    ``anon``: anonymous memory advised with ``MADV_HUGEPAGE`` (registered caches,
    destinations, the C buffers); ``shm``: POSIX shared memory (allocated caches),
    which nobody advises, so only ``shmem_enabled`` = always/within_size/force
    gives it huge pages.
    """
    anon = "THP" if thp_mode("enabled") in ("always", "madvise") else "4K"
    shm = "shm-THP" if thp_mode("shmem_enabled") in ("always", "within_size", "force") else "shm-4K"
    return {"anon": anon, "shm": shm}


def _smaps_huge(text: str) -> int:
    """Bytes in huge pages in an smaps(-rollup) text."""
    total = 0
    for key in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
        for m in re.finditer(rf"^{key}\s+(\d+) kB", text, re.M):
            total += int(m.group(1)) * 1024
    return total


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its children (one level: the C baselines fork one peer)."""
    pids = [pid]
    with contextlib.suppress(OSError, ValueError):
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            pids += [int(x) for x in text.split()]
    return pids


def huge_bytes_of_processes(pids: list[int]) -> int | None:
    """Bytes the kernel backs with huge pages in these processes (``smaps_rollup``)."""
    try:
        return sum(_smaps_huge(Path(f"/proc/{p}/smaps_rollup").read_text()) for p in pids)
    except OSError:
        return None


def huge_share_of_ranges(ranges: list[tuple[int, int]]) -> float | None:
    """Share of the resident memory in huge pages, over this process's mappings that
    overlap these ``(address, length)`` ranges (whole mappings: smaps says no more)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    huge = rss = 0
    for vma in re.split(r"^(?=[0-9a-f]+-[0-9a-f]+ )", text, flags=re.M):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", vma)
        if not m:
            continue
        lo, hi = int(m.group(1), 16), int(m.group(2), 16)
        if any(a < hi and a + n > lo for a, n in ranges):
            huge += _smaps_huge(vma)
            r = re.search(r"^Rss:\s+(\d+) kB", vma, re.M)
            rss += int(r.group(1)) * 1024 if r else 0
    return min(1.0, huge / rss) if rss else None


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
    memory: str = ""  # "SRC->DST" kinds, the same for the engine and its baseline
    huge_engine: float | None = None  # share of the engine's src + dst in huge pages
    huge_baseline: float | None = None  # share of the baseline's buffers in huge pages

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
            "memory": self.memory,
            "huge_pages_engine": r4(self.huge_engine),
            "huge_pages_baseline": r4(self.huge_baseline),
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


@dataclass(frozen=True)
class BaselineSpec:
    """Which C baseline a path is compared with, on which memory."""

    op: str  # memcpy | cma | tcp
    args: tuple[str, ...] = ()  # extra `baselines` arguments
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or _C_NAME[self.op]


def baseline_spec(path: str, tcp_batch_bytes: int = 0) -> BaselineSpec:
    """The C baseline of ``path``, on the memory the engine uses on that path."""
    if path == "shm":
        # The engine copies out of the prompt's POSIX shm segment: so does this one.
        return BaselineSpec("memcpy", ("--src-shm",), "C memcpy (shm source)")
    if path == "tcp" and tcp_batch_bytes:
        mib = f"{tcp_batch_bytes / 2**20:g} MiB"
        return BaselineSpec(
            "tcp", ("--batch-bytes", str(tcp_batch_bytes)), f"C writev/readv ({mib}/call)"
        )
    return BaselineSpec(_C_OP[path])


class CServer:
    """``baselines OP --serve``: set up once; :meth:`sample` times ``inner`` transfers.

    ``extra`` are more ``baselines`` arguments (``--src-shm``, ``--no-huge``, ...).

    Raises (constructor):
        RuntimeError: it did not start.
    """

    def __init__(
        self,
        exe: Path,
        op: str,
        w: Workload,
        pool: int,
        blocks: int,
        seed: int,
        par: int,
        extra: tuple[str, ...] | list[str] = (),
        name: str | None = None,
    ) -> None:
        self.name = name or _C_NAME[op]
        self.nbytes = blocks * w.num_tensors * w.block_bytes
        self.buffer_bytes = 2 * pool * w.num_tensors * w.block_bytes  # source + destination
        self.expect_hash = blocks_hash(*random_blocks(pool, pool, blocks, seed))
        cmd = [
            str(exe), op, "--serve",
            "--tensors", str(w.num_tensors),
            "--pool", str(pool),
            "--blocks", str(blocks),
            "--block-bytes", str(w.block_bytes),
            "--seed", str(seed),
            "--streams" if op == "tcp" else "--threads", str(par),
            *extra,
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

    def huge_share(self) -> float | None:
        """Share of its source and destination the kernel backs with huge pages now."""
        got = huge_bytes_of_processes(_process_tree(self.proc.pid))
        return None if got is None else min(1.0, got / self.buffer_bytes)

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
        self.ranges = [(t.ctypes.data, t.nbytes) for t in (*src, *dst)]

    def sample(self, inner: int) -> float:
        nat = self._native
        t0 = time.perf_counter()
        for _ in range(inner):
            nat.copy_local(self.plan, self.src, self.dst, nat.Control(), 2)
        return self.plan.total_bytes * inner / (time.perf_counter() - t0) / 1e9

    def huge_share(self) -> float | None:
        return huge_share_of_ranges(self.ranges)

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
    src_memory: str = ""  # the kind of the prompt's cache
    src_pid: int | None = None  # the prompt process (None: this one)
    src_ranges: list[tuple[int, int]] = field(default_factory=list)  # an in-process prompt's
    src_bytes: int = 0

    def huge_share(self, dst: list[Any]) -> float | None:
        """Share of the prompt's cache and the destination in huge pages now."""
        dst_ranges = [(int(t.ctypes.data), int(t.nbytes)) for t in dst]
        dst_bytes = sum(n for _, n in dst_ranges)
        d = huge_share_of_ranges(dst_ranges)
        if self.src_pid is not None:  # the prompt's cache is most of its process
            got = huge_bytes_of_processes([self.src_pid])
            s = None if got is None else min(1.0, got / max(1, self.src_bytes))
        else:
            s = huge_share_of_ranges(self.src_ranges)
        if d is None or s is None:
            return None
        return (s * self.src_bytes + d * dst_bytes) / (self.src_bytes + dst_bytes)


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
    """Decoders for every path, all registering ``dst``; the in-process prompt's tensors.

    The shm path's prompt allocates its cache in shared memory; the cma and tcp paths'
    prompt (another process) registers huge-page-advised memory, as a serving process
    would (a cache in shared memory would put those two paths on 4 KiB pages).
    """
    kinds = memory_kinds()
    desc = PromptSpec(
        num_tensors=w.num_tensors, num_blocks=pool, block_shape=w.block_shape, dtype=w.dtype
    ).desc()
    cache_bytes = w.num_tensors * pool * w.block_bytes
    engines: list[Engine] = []
    src: list[Any] | None = None
    if "inproc" in paths or local_src:
        pair = await stack.enter_async_context(inproc_pair(prompt_id=1, decoder_id=2))
        filled = make_blocks_cache(
            pair.prompt, model_id=0, seed=args.seed, allocate=False, pattern=True,
            num_tensors=w.num_tensors, num_blocks=pool, block_shape=w.block_shape,
            data_type=desc.data_type, huge_pages=True,
        )  # fmt: skip
        src = filled.tensors
        if "inproc" in paths:
            cache = pair.decoder.cache_manager.register_blocks_cache(desc, dst)
            ranges = [(t.ctypes.data, t.nbytes) for t in src]
            engines.append(
                Engine("inproc", pair.decoder, pair.key(), cache, kinds["anon"], None, ranges,
                       cache_bytes)
            )  # fmt: skip
    remote = [p for p in paths if p != "inproc" and p not in skipped]
    peers: dict[bool, PeerProcess] = {}  # allocate -> its prompt process
    for i, path in enumerate(remote):
        allocate = path == "shm"
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
        kind = kinds["shm"] if allocate else kinds["anon"]
        engines.append(
            Engine(path, dd, BlocksCacheKey(peer.cluster_id, 0), cache, kind, peer.pid, [],
                   cache_bytes)
        )  # fmt: skip
    return engines, src


async def run_workload(
    w: Workload,
    pool: int,
    counts: list[int],
    paths: list[str],
    args: argparse.Namespace,
    exe: Path | None,
    bar: Progress | None = None,
    skipped: dict[str, str] | None = None,
) -> list[Point]:
    """Every path of one workload, each against its own baseline on the same memory.

    For each count and each path, the path's baseline (:func:`baseline_spec`) is set up
    once and alternated with the engine (see :func:`_measure`). ``args`` needs ``seed``,
    ``repeats`` and ``timeout`` (seconds per pull); optional: ``tcp_batch_bytes`` caps
    the C TCP baseline's calls, ``decoder_options`` are more ``init`` options of the
    cross-process decoders. ``skipped`` collects the paths that do not work here.

    Raises:
        LLMException: a pull failed for another reason than its path being unavailable.
        RuntimeError, TimeoutError: a prompt process or a baseline did not start.
    """
    skipped = {} if skipped is None else skipped
    points: list[Point] = []
    shape = (pool, *w.block_shape)
    dtype = PromptSpec(dtype=w.dtype).data_type.to_numpy()
    # Registered destination: one anonymous mapping, 2 MiB-aligned, MADV_HUGEPAGE, touched
    # (the C baselines' buffers are one mapping each, too).
    dst = list(host_buffer((w.num_tensors, *shape), dtype))
    anon = memory_kinds()["anon"]
    tcp_batch = int(getattr(args, "tcp_batch_bytes", 0) or 0)
    async with contextlib.AsyncExitStack() as stack:
        engines, src = await _link_engines(stack, w, pool, paths, args, dst, exe is None, skipped)
        for n in counts:
            src_ids, dst_ids = random_blocks(pool, pool, n, args.seed)
            nbytes = n * w.num_tensors * w.block_bytes
            for e in engines:
                if e.path in skipped:
                    continue
                spec = baseline_spec(e.path, tcp_batch)
                baseline: Baseline | None = None
                note = ""
                try:
                    if exe is not None:
                        baseline = await asyncio.to_thread(
                            CServer, exe, spec.op, w, pool, n, args.seed, 2, spec.args, spec.label
                        )
                    else:
                        assert src is not None
                        baseline = NativeMover(w, pool, n, args.seed, src, dst)
                except RuntimeError as why:
                    note = str(why)
                try:
                    p = Point(w.name, e.path, n, nbytes, n * w.num_tensors, note=note)
                    p.memory = f"{e.src_memory}->{anon}"
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
                    p.verified = not pattern_mismatches(dst, src_ids, dst_ids, args.seed, limit=1)
                    p.huge_engine = e.huge_share(dst)
                    if baseline is not None:
                        p.baseline = baseline.name
                        p.huge_baseline = baseline.huge_share()
                    points.append(p)
                    if bar is not None:
                        bar.advance()
                finally:
                    if baseline is not None:
                        await asyncio.to_thread(baseline.close)
    return points


# --------------------------------------------------------------------------- output


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}" if r >= 0.1 else f"{r:.3f}"


def _fmt_share(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def _table(points: list[Point]) -> str:
    hdr = (f"{'workload':<13} {'path':<6} {'blocks':>6} {'bytes':>10} {'memory':<11} "
           f"{'engine GB/s':>11}  {'baseline':<22} {'GB/s':>6} {'ratio':>6} {'paired':>6}  "
           f"{'huge e/b':<9}  check")  # fmt: skip
    lines = [hdr, "-" * len(hdr)]
    for p in points:
        size = f"{p.bytes / 2**20:.1f} MiB" if p.bytes >= 2**20 else f"{p.bytes / 1024:.0f} KiB"
        med = "-" if p.median is None else f"{p.median:.2f}"
        bmed = "-" if p.baseline_median is None else f"{p.baseline_median:.2f}"
        check = "ok" if p.verified else "MISMATCH"
        huge = f"{_fmt_share(p.huge_engine)}/{_fmt_share(p.huge_baseline)}"
        lines.append(
            f"{p.workload:<13} {p.path:<6} {p.blocks:>6} {size:>10} {p.memory:<11} {med:>11}  "
            f"{p.baseline or '-':<22} {bmed:>6} {_fmt_ratio(p.ratio):>6} "
            f"{_fmt_ratio(p.paired_ratio):>6}  {huge:<9}  {check}"
            + (f"  ({p.note})" if p.note else "")
        )
    return "\n".join(lines)


def memory_note() -> str:
    """What the memory column means on this machine (printed under the table)."""
    kinds = memory_kinds()
    enabled, shmem = thp_mode("enabled"), thp_mode("shmem_enabled")
    text = (
        f"memory = source->destination, the same for the engine and its baseline: "
        f"{kinds['anon']} = anonymous, 2 MiB-aligned, madvise(MADV_HUGEPAGE) "
        f"(transparent_hugepage/enabled = {enabled}); {kinds['shm']} = POSIX shared memory "
        f"(shmem_enabled = {shmem})"
    )
    if kinds["shm"] == "shm-4K":
        text += (
            ":\n  POSIX shm cannot get huge pages here, so the shm path copies from 4 KiB "
            "pages, and so does its baseline (C memcpy from a POSIX shm source)"
        )
    return (
        text + ";\nhuge e/b = share of the engine's / the baseline's source and destination "
        "that the kernel backed with huge pages (/proc/PID/smaps)"
    )


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
            if not pts:
                continue
            ax.plot([p.blocks for p in pts], [p.median for p in pts], "o-",
                    color=colors[path], label=f"{path} ({pts[0].memory})")  # fmt: skip
            base = [p for p in pts if p.baseline_median]
            if base:
                ax.plot([p.blocks for p in base], [p.baseline_median for p in base], "--",
                        color=colors[path], alpha=0.5,
                        label=f"baseline of {path}: {base[0].baseline}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_title(wname)
        ax.set_xlabel("blocks per pull (all layers)")
        ax.set_ylabel("GB/s (1e9 B/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
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


def host_meta() -> dict[str, Any]:
    """Versions and the memory settings, for a JSON report."""
    from . import __version__, _native

    return {
        "aiodatadist": __version__,
        "native": _native.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "thp_enabled": thp_mode("enabled"),
        "thp_shmem_enabled": thp_mode("shmem_enabled"),
        "thp_defrag": thp_mode("defrag"),
        "memory_kinds": memory_kinds(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


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
        kind = f"plain-C movers of bench/c ({why}), 2 threads / 2 streams"
    else:
        kind = f"the native local mover alone, _native.copy_local ({why})"
    print(
        f"aiodatadist bench{' --quick' if quick else ''}: pull_blocks of N random non-contiguous "
        f"blocks, all layers, pool of {pool} blocks per tensor;\n"
        f"  GB/s = 1e9 B/s, median of {args.repeats} samples after a warm-up; every pull "
        f"checked byte for byte\n  baseline: {kind}, same segments, same kind of memory, "
        f"measured in this run"
    )
    skipped: dict[str, str] = {}
    points: list[Point] = []
    total = len(workloads) * len(counts) * len(paths)
    t_start = time.perf_counter()
    with Progress("bench", total, enabled=args.progress) as bar:
        for wname in workloads:
            points += await run_workload(
                WORKLOADS[wname], pool, counts, paths, args, exe, bar, skipped
            )
    elapsed = time.perf_counter() - t_start
    order = {name: i for i, name in enumerate(ALL_PATHS)}
    points.sort(key=lambda p: (workloads.index(p.workload), order[p.path], p.blocks))
    print()
    print(_table(points))
    summary = _summary(points)
    print()
    print(memory_note())
    print(
        "ratio = engine median / baseline median, paired = median of per-sample ratios "
        "(engine and baseline alternated);\nper path, geometric mean of the ratios over the "
        "points: " + ", ".join(f"{k} {v['ratio_geomean']:.2f}" for k, v in summary.items())
    )
    for path, reason in skipped.items():
        print(f"skipped {path}: {reason}")
    print(f"({elapsed:.0f} s)")

    if args.json:
        doc = {
            "meta": {
                "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "command": " ".join(["aiodatadist", *sys.argv[1:]]),
                **host_meta(),
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
            "baselines": {p: baseline_spec(p).label for p in paths},
            "memory_note": memory_note(),
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
