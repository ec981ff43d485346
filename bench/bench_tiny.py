"""Tiny pulls between two processes: per-pull latency against plain C, NIXL and Mooncake.

    .venv/bin/python bench/bench_tiny.py [--quick] [--repeats 2000] [--warmup 200]
                                          [--rounds 10] [--json PATH]

The measurement of issue 13, item 1: a decoder (this process) pulls one small piece of
a prompt's cache (a child process, ``aiodatadist.testing.PeerProcess`` with this file's
:class:`TinyPrompt` plugin) with ``await cache_manager.pull_blocks(...)``, one pull at a
time, over each data path (``aiodatadist.DataPath`` ``shm``, ``cma``, ``tcp``), and
baselines that move the same number of bytes, each timed per pull:

===============================  ===========================================================
row                              what one sample is
===============================  ===========================================================
aiodatadist shm / cma / tcp      ``await pull_blocks(key, cache, [1], [2], ...)`` of the
                                 case's tensors (``time.perf_counter_ns`` around the await)
C process_vm_readv               ``bench/c/tiny.c readv``: one ``process_vm_readv`` call of
                                 the same bytes **from the same child** (the cma/tcp prompt)
C TCP request/response           ``bench/c/tiny.c tcp``: a 16-byte request, then the bytes,
                                 over loopback TCP between two C processes (TCP_NODELAY)
NIXL CMA (UCX), polled tight     ``bench/engines.py``: a NIXL agent pair (UCX backend, DRAM),
                                 one READ handle posted again per pull, ``check_xfer_state``
                                 in a tight loop until ``DONE``
NIXL CMA (UCX), asyncio-polled   the same, polled from an asyncio event loop
                                 (``await asyncio.sleep(0)`` between two polls)
Mooncake TE TCP                  ``bench/engines.py``: ``TransferEngine`` pair, ``tcp``
                                 protocol, P2P handshake, ``transfer_sync_read``
===============================  ===========================================================

Cases: ``llama8b-fp16`` 1 block x 1 tensor (256 KiB, the issue's goals), 1 block x 1
layer (2 tensors, 512 KiB, two segments that are not neighbours), and ``small`` 1 block
x 1 tensor (4 KiB). Every row does ``--warmup`` pulls, then ``--repeats`` timed pulls in
``--rounds`` rounds; within a round each row does its share in turn, the order rotated
every round, so drift of the machine hits every row alike. Reported per row: p10, p50,
p90, p99 (us) and the spread of the round medians (a WARNING when they disagree by more
than 20%, :func:`aiodatadist.cli.stats.disagree_warning`); per aiodatadist row and
baseline: the ratio of medians and the paired ratio (median over rounds of the ratio of
the two round medians), next to the issue's goal. Every row's bytes are checked after
its warm-up and after its last round (destination cleared, one pull, compared).

A baseline that cannot be installed, built or run prints why in its row; the bench goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the prompt process loads this file as its plugin
    sys.path.insert(0, str(HERE))

from aiodatadist import LLMDataDist  # noqa: E402
from aiodatadist.cli.stats import (  # noqa: E402
    Summary,
    disagree_warning,
    disagreement,
    fmt_load,
    load_average,
    summarize,
)
from aiodatadist.cli.workloads import WORKLOADS, Workload  # noqa: E402
from aiodatadist.config import OPT_DATA_PATH  # noqa: E402
from aiodatadist.errors import LLMStatusCode  # noqa: E402
from aiodatadist.testing import (  # noqa: E402
    PeerCommands,
    PeerProcess,
    PromptSpec,
    cluster_info,
    make_blocks_cache,
)
from aiodatadist.testing.patterns import pattern_blocks, pattern_mismatches  # noqa: E402
from aiodatadist.types import BlocksCacheKey, LLMRole  # noqa: E402

POOL = 4  # blocks per tensor on both sides
SRC_BLOCK, DST_BLOCK = 1, 2
MODELS = {0: "llama8b-fp16", 1: "small"}  # model_id -> workload, both in each prompt
SEED = 1300  # + 10 for the shm prompt, + model_id: every prompt's bytes are its own
PATHS = ("shm", "cma", "tcp")


@dataclass(frozen=True)
class Case:
    """One pull shape: ``tensors`` tensors (one layer's worth) of block 1 into block 2."""

    name: str
    model_id: int
    tensors: int  # 1 (one tensor) or 2 (one layer of K and V)

    @property
    def workload(self) -> Workload:
        return WORKLOADS[MODELS[self.model_id]]

    @property
    def nbytes(self) -> int:
        return self.tensors * self.workload.block_bytes


CASES = (
    Case("llama8b-fp16, 1 block x 1 tensor", 0, 1),
    Case("llama8b-fp16, 1 block x 1 layer", 0, 2),
    Case("small, 1 block x 1 tensor", 1, 1),
)

# path -> (baseline row key, goal: at most this ratio, or None: for reference)
GOALS: dict[str, tuple[tuple[str, float | None], ...]] = {
    "shm": (("nixl", 0.8), ("nixl-async", None), ("c-readv", 2.0)),
    "cma": (("nixl", 0.8), ("nixl-async", None), ("c-readv", 2.0)),
    "tcp": (("c-tcp", 2.0), ("mooncake", 0.5)),
}
ROW_NAMES = {
    "shm": "aiodatadist shm",
    "cma": "aiodatadist cma",
    "tcp": "aiodatadist tcp",
    "c-readv": "C process_vm_readv",
    "c-tcp": "C TCP request/response",
    "nixl": "NIXL CMA (UCX), polled tight",
    "nixl-async": "NIXL CMA (UCX), asyncio-polled",
    "mooncake": "Mooncake TE TCP",
}


def _spec(w: Workload) -> PromptSpec:
    return PromptSpec(
        num_tensors=w.num_tensors, num_blocks=POOL, block_shape=w.block_shape, dtype=w.dtype
    )


class TinyPrompt(PeerCommands):
    """The prompt's side (``--plugin bench/bench_tiny.py:TinyPrompt``): one cache per model
    of :data:`MODELS`, in POSIX shared memory (``allocate``) or registered huge-page-advised
    memory, filled with the seeded pattern; the ``ready`` line says where each cache's
    first two tensors start (for the C ``process_vm_readv`` baseline)."""

    async def start(self) -> dict[str, Any]:
        allocate = bool(self.config["allocate"])
        self.filled = []
        addrs: dict[str, list[int]] = {}
        for model_id, name in MODELS.items():
            s = _spec(WORKLOADS[name])
            filled = make_blocks_cache(
                self.dd,
                num_tensors=s.num_tensors,
                num_blocks=POOL,
                block_shape=s.block_shape,
                data_type=s.data_type,
                model_id=model_id,
                seed=int(self.config["seed"]) + model_id,
                pattern=True,
                allocate=allocate,
                huge_pages=True,
            )
            self.filled.append(filled)
            addrs[str(model_id)] = [int(t.ctypes.data) for t in filled.tensors[:2]]
        return {"tensor_addrs": addrs}


# ------------------------------------------------------------------------------ rows


@dataclass
class Row:
    """One line of a case's table: its samples (us) per round, or why it has none."""

    key: str
    why: str = ""  # not empty: unavailable or failed
    rounds: list[list[float]] = field(default_factory=list)
    verified: list[bool] = field(default_factory=list)

    @property
    def name(self) -> str:
        return ROW_NAMES[self.key]

    async def run(self, k: int) -> list[float]:
        raise NotImplementedError

    async def verify(self) -> bool:
        raise NotImplementedError

    async def close(self) -> None:
        """Releases what the row started (the decoders live for the whole bench)."""

    def pause(self) -> None:
        """Between its turns: a row whose idle processes take CPU stops them."""

    def resume(self) -> None:
        """Before its turn."""

    def samples(self) -> list[float]:
        return [x for r in self.rounds for x in r]

    def round_medians(self) -> list[float]:
        return [statistics.median(r) for r in self.rounds if r]


class PullRow(Row):
    """``await pull_blocks`` of one case over one data path."""

    def __init__(
        self, key: str, dd: LLMDataDist, peer_id: int, dst: Any, case: Case, seed: int
    ) -> None:
        super().__init__(key)
        self.cm = dd.cache_manager
        self.src_key = BlocksCacheKey(peer_id, case.model_id)
        self.dst = dst
        self.case = case
        self.seed = seed
        self.layers = range(0, 1)

    async def run(self, k: int) -> list[float]:
        pull, key, cache, tpl = self.cm.pull_blocks, self.src_key, self.dst.cache, self.case.tensors
        src, dst, layers = [SRC_BLOCK], [DST_BLOCK], self.layers
        clock = time.perf_counter_ns
        out = [0.0] * k
        for j in range(k):
            t0 = clock()
            await pull(
                key,
                cache,
                src,
                dst,
                src_layer_range=layers,
                dst_layer_range=layers,
                tensor_num_per_layer=tpl,
                timeout=30.0,
            )
            out[j] = (clock() - t0) / 1e3
        return out

    async def verify(self) -> bool:
        pairs = [(t, t) for t in range(self.case.tensors)]
        for t, _ in pairs:
            self.dst.tensors[t][DST_BLOCK] = 0
        await self.run(1)
        return not pattern_mismatches(self.dst.tensors, [SRC_BLOCK], [DST_BLOCK], self.seed, pairs)


class TinyServer(Row):
    """``bench/c/tiny.c``: ``readv`` from the prompt or ``tcp`` request/response."""

    def __init__(self, key: str, argv: list[str], expected: int) -> None:
        super().__init__(key)
        self.expected = expected
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        if self._line() != "ready":
            raise RuntimeError(self._kill() or "it did not start")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def _ask(self, cmd: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self._line()
        if not line or line.startswith("error"):
            raise RuntimeError(f"{self.name}: {line or self._kill() or 'it died'}")
        return line

    def _kill(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        _, err = self.proc.communicate()
        return (err.strip().splitlines() or [""])[-1]

    async def run(self, k: int) -> list[float]:
        line = await asyncio.to_thread(self._ask, f"run {k}")
        return [int(x) / 1e3 for x in line.split()]

    async def verify(self) -> bool:
        await asyncio.to_thread(self._ask, "zero")
        await self.run(1)
        return int(await asyncio.to_thread(self._ask, "sum")) == self.expected

    async def close(self) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            await asyncio.to_thread(self.proc.wait, 20)
        except subprocess.TimeoutExpired:
            self._kill()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


class EngineRow(Row):
    """A row of :class:`engines.EngineServer` (NIXL's two polling styles share one server)."""

    def __init__(
        self, key: str, server: Any, asyncio_polled: bool = False, owner: bool = True
    ) -> None:
        super().__init__(key)
        self.server = server
        self.asyncio_polled = asyncio_polled
        self.owner = owner

    async def run(self, k: int) -> list[float]:
        out: list[float] = await asyncio.to_thread(self.server.run, k, self.asyncio_polled)
        return out

    async def verify(self) -> bool:
        ok: bool = await asyncio.to_thread(self.server.verify)
        return ok

    async def close(self) -> None:
        if self.owner:
            await asyncio.to_thread(self.server.close)

    def pause(self) -> None:
        self.server.pause()

    def resume(self) -> None:
        self.server.resume()


# ----------------------------------------------------------------------- set-up


@dataclass
class Decoders:
    """The prompt processes and one decoder per path (each with a cache per model)."""

    prompts: dict[bool, PeerProcess]  # allocate -> its process
    rows: dict[str, tuple[LLMDataDist, int, dict[int, Any]]]  # path -> dd, peer id, caches
    why: dict[str, str]


async def start_decoders(
    stack: contextlib.AsyncExitStack, paths: Sequence[str], registered: bool = False
) -> Decoders:
    """The prompt processes (``registered``: the registering one even without cma / tcp,
    for the C ``process_vm_readv`` row) and a linked decoder per path; what cannot start
    is in ``why``."""
    prompts: dict[bool, PeerProcess] = {}
    why: dict[str, str] = {}
    for allocate in sorted({p == "shm" for p in paths} | ({False} if registered else set())):
        cid = 3 if allocate else 4
        try:
            prompts[allocate] = await stack.enter_async_context(
                PeerProcess(
                    cluster_id=cid,
                    serve_cache=False,
                    plugin=f"{Path(__file__)}:TinyPrompt",
                    plugin_config={"allocate": allocate, "seed": _seed(allocate, 0)},
                    start_timeout=300,
                )
            )
        except Exception as e:  # the rows of its paths say why; the bench goes on
            for p in paths:
                if (p == "shm") == allocate:
                    why[p] = f"the prompt process did not start: {e}"
    rows: dict[str, tuple[LLMDataDist, int, dict[int, Any]]] = {}
    for i, path in enumerate(paths):
        peer = prompts.get(path == "shm")
        if peer is None:
            continue
        try:
            dd = LLMDataDist(LLMRole.DECODER, 10 + i)
            await dd.init({OPT_DATA_PATH: path})
            stack.push_async_callback(dd.finalize)
            caches = {}
            for model_id, name in MODELS.items():
                s = _spec(WORKLOADS[name])
                caches[model_id] = make_blocks_cache(
                    dd,
                    num_tensors=s.num_tensors,
                    num_blocks=POOL,
                    block_shape=s.block_shape,
                    data_type=s.data_type,
                    huge_pages=True,
                )
            info = cluster_info(peer.cluster_id, *peer.address)
            status, _ = await dd.link_clusters([info], 30_000)
        except Exception as e:
            why[path] = f"the decoder did not start: {e}"
            continue
        if status != LLMStatusCode.LLM_SUCCESS:
            why[path] = f"link_clusters failed: {status.name}"
            continue
        rows[path] = (dd, peer.cluster_id, caches)
    return Decoders(prompts, rows, why)


def _seed(allocate: bool, model_id: int) -> int:
    return SEED + (10 if allocate else 0) + model_id


def _expected_blocks(seed: int, case: Case) -> Any:
    import numpy as np

    bb = case.workload.block_bytes
    return np.concatenate(
        [pattern_blocks(seed, t, [SRC_BLOCK], bb)[0] for t in range(case.tensors)]
    )


async def make_rows(case: Case, dec: Decoders, keys: Sequence[str]) -> list[Row]:
    """The case's rows, in table order; those that cannot run say why."""
    import engines  # bench/engines.py
    from cbaselines import find_c_program

    rows: list[Row] = []
    for path in PATHS:
        if path not in keys:
            continue
        if path in dec.rows:
            dd, peer_id, caches = dec.rows[path]
            seed = _seed(path == "shm", case.model_id)
            rows.append(PullRow(path, dd, peer_id, caches[case.model_id], case, seed))
        else:
            rows.append(Row(path, why=dec.why.get(path, "not started")))
    exe, exe_why = find_c_program("tiny") if {"c-readv", "c-tcp"} & set(keys) else (None, "")
    bb = case.workload.block_bytes
    if "c-readv" in keys:
        reg = dec.prompts.get(False)
        if exe is None or reg is None:
            rows.append(Row("c-readv", why=exe_why or "no cma/tcp prompt process"))
        else:
            addrs = reg.ready["tensor_addrs"][str(case.model_id)]
            argv = [str(exe), "readv", "--pid", str(reg.pid)]
            for a in addrs[: case.tensors]:  # block SRC_BLOCK of each tensor pulled
                argv += ["--seg", f"{a + SRC_BLOCK * bb}:{bb}"]
            expected = engines.checksum(_expected_blocks(_seed(False, case.model_id), case))
            rows.append(_try(lambda: TinyServer("c-readv", argv, expected), "c-readv"))
    if "c-tcp" in keys:
        if exe is None:
            rows.append(Row("c-tcp", why=exe_why))
        else:
            expected = engines.checksum(engines.pattern_words(case.nbytes))
            rows.append(
                _try(
                    lambda: TinyServer(
                        "c-tcp", [str(exe), "tcp", "--len", str(case.nbytes)], expected
                    ),
                    "c-tcp",
                )
            )
    stride = POOL * bb  # tensor t's block starts t * POOL blocks further: not neighbours
    if "nixl" in keys or "nixl-async" in keys:
        try:
            srv = await asyncio.to_thread(engines.EngineServer, "nixl", bb, case.tensors, stride)
        except Exception as e:  # the row says why; the bench goes on
            rows += [Row(k, why=_why(e)) for k in ("nixl", "nixl-async") if k in keys]
        else:
            if "nixl" in keys:
                rows.append(EngineRow("nixl", srv))
            if "nixl-async" in keys:
                rows.append(EngineRow("nixl-async", srv, True, owner="nixl" not in keys))
    if "mooncake" in keys:
        try:
            srv = await asyncio.to_thread(
                engines.EngineServer, "mooncake", bb, case.tensors, stride
            )
        except Exception as e:
            rows.append(Row("mooncake", why=_why(e)))
        else:
            rows.append(EngineRow("mooncake", srv))
    return rows


def _why(e: BaseException) -> str:
    text = str(e).strip().replace("\n", " ")
    return f"unavailable: {text or type(e).__name__}"[:240]


def _try(make: Any, key: str) -> Row:
    try:
        row: Row = make()
        return row
    except Exception as e:
        return Row(key, why=_why(e))


# ---------------------------------------------------------------------- measure


async def measure(rows: list[Row], repeats: int, warmup: int, rounds: int) -> None:
    """Warm-up, check, ``rounds`` rotated rounds of ``repeats / rounds`` pulls each, check."""

    async def guarded(row: Row, fn: Any, *args: Any) -> Any:
        try:
            await asyncio.to_thread(row.resume)
            return await fn(*args)
        except Exception as e:  # a failing row stops; the others go on
            row.why = f"failed: {_why(e).removeprefix('unavailable: ')}"
            return None
        finally:
            row.pause()

    for r in rows:
        r.pause()

    live = [r for r in rows if not r.why]
    for r in live:
        if warmup:
            await guarded(r, r.run, warmup)
        if not r.why:
            r.verified.append(bool(await guarded(r, r.verify)))
    per_round = max(1, -(-repeats // rounds))
    for i in range(rounds):
        live = [r for r in rows if not r.why]
        if not live:
            break
        shift = i % len(live)
        for r in live[shift:] + live[:shift]:
            got = await guarded(r, r.run, per_round)
            if got is not None:
                r.rounds.append(got)
    for r in rows:
        if not r.why:
            r.verified.append(bool(await guarded(r, r.verify)))


def round_ratios(a: Row, b: Row) -> list[float]:
    """Per round, ``a``'s median over ``b``'s (empty unless both ran every round)."""
    ma, mb = a.round_medians(), b.round_medians()
    if len(ma) != len(mb):
        return []
    return [x / y for x, y in zip(ma, mb, strict=True)]


def paired_ratio(a: Row, b: Row) -> float | None:
    """The median of :func:`round_ratios`; None without them."""
    rr = round_ratios(a, b)
    return statistics.median(rr) if rr else None


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def report(case: Case, rows: list[Row]) -> tuple[str, dict[str, Any]]:
    """The case's table, warnings and comparisons, and the same as JSON."""
    lines = [f"== {case.name}: {case.nbytes} B ({case.nbytes / 1024:g} KiB) per pull"]
    hdr = (
        f"{'row':<32} {'n':>5} {'p10':>8} {'p50':>8} {'p90':>8} {'p99':>8}  "
        f"{'round p50 min..max':>19}  check"
    )
    lines += [hdr + "   (us)", "-" * (len(hdr) + 6)]
    warnings: list[str] = []
    out_rows: list[dict[str, Any]] = []
    by_key = {r.key: r for r in rows}
    for r in rows:
        s: Summary | None = summarize(r.samples())
        rm = r.round_medians()
        if s is None:
            lines.append(f"{r.name:<32} {r.why or 'no samples'}")
        else:
            span = f"{min(rm):.1f}..{max(rm):.1f}" if rm else "-"
            check = "ok" if r.verified and all(r.verified) else "DATA MISMATCH"
            tail = f"  ({r.why})" if r.why else ""
            lines.append(
                f"{r.name:<32} {s.n:>5} {s.p10:>8.1f} {s.p50:>8.1f} {s.p90:>8.1f} "
                f"{s.p99:>8.1f}  {span:>19}  {check}{tail}"
            )
            w = disagree_warning(f"{case.name}: {r.name}", rm, "us")
            if w:
                warnings.append(w)
        out_rows.append(
            {
                "key": r.key,
                "name": r.name,
                "why": r.why or None,
                "verified": r.verified,
                "summary_us": None if s is None else s.as_json(2),
                "round_medians_us": [round(x, 2) for x in rm],
                "disagreement": disagreement(rm),
                "samples_us": [round(x, 1) for x in r.samples()],
            }
        )
    lines += warnings
    comps: list[dict[str, Any]] = []
    clines = [
        f"  {'aiodatadist':<16} {'vs':<32} {'ratio':>6} {'paired':>6} {'(min-max)':>11}  goal"
    ]
    for path, goals in GOALS.items():
        a = by_key.get(path)
        if a is None or not a.samples():
            continue
        for bkey, goal in goals:
            b = by_key.get(bkey)
            if b is None:
                continue
            if not b.samples():
                clines.append(
                    f"  {a.name:<16} {b.name:<32} {'-':>6} {'-':>6} {'-':>11}  "
                    f"{_goal_text(goal, None)} ({b.why or 'no samples'})"
                )
                continue
            ratio = statistics.median(a.samples()) / statistics.median(b.samples())
            paired = paired_ratio(a, b)
            rr = round_ratios(a, b)
            span = f"{min(rr):.2f}-{max(rr):.2f}" if rr else "-"
            clines.append(
                f"  {a.name:<16} {b.name:<32} {ratio:>6.2f} {_f(paired, '.2f'):>6} {span:>11}  "
                f"{_goal_text(goal, ratio)}"
            )
            comps.append(
                {
                    "path": path,
                    "baseline": bkey,
                    "ratio": round(ratio, 4),
                    "paired": None if paired is None else round(paired, 4),
                    "round_ratios": [round(x, 4) for x in rr],
                    "goal_at_most": goal,
                    "met": None if goal is None else ratio <= goal,
                }
            )
    if len(clines) > 1:
        lines += [
            "",
            "  ratio = aiodatadist p50 / baseline p50; paired = median (min-max) over rounds "
            "of the ratio of round medians; goal on the ratio (the issue's 'medians')",
        ]
        lines += clines
    js = {
        "case": case.name,
        "bytes": case.nbytes,
        "tensors": case.tensors,
        "workload": case.workload.name,
        "rows": out_rows,
        "comparisons": comps,
        "warnings": warnings,
    }
    return "\n".join(lines), js


def _goal_text(goal: float | None, ratio: float | None) -> str:
    if goal is None:
        return "(reference)"
    if ratio is None:
        return f"<= {goal:g}x: no baseline"
    return f"<= {goal:g}x {'met' if ratio <= goal else 'MISSED'}"


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in ("aiodatadist", "numpy", "nixl-cu12", "mooncake-transfer-engine-non-cuda"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    keys = [k for k in ROW_NAMES if k in args.rows]
    cases = (
        [c for c in CASES if any(c.name.startswith(p) or c.name == p for p in args.case)]
        if args.case
        else list(CASES)
    )
    load0 = load_average()
    t0 = time.monotonic()
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    print(
        f"bench_tiny: {args.repeats} timed pulls per row in {args.rounds} rotated rounds, "
        f"after {args.warmup} warm-up; {started}"
    )
    print(fmt_load("start", load0), flush=True)
    results: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        paths = [p for p in PATHS if p in keys]
        dec = await start_decoders(stack, paths, registered="c-readv" in keys)
        for case in cases:
            rows = await make_rows(case, dec, keys)
            try:
                await measure(rows, args.repeats, args.warmup, args.rounds)
            finally:
                for r in rows:
                    with contextlib.suppress(Exception):
                        await r.close()
            text, js = report(case, rows)
            print("\n" + text, flush=True)
            results.append(js)
    load1 = load_average()
    print("\n" + fmt_load("end", load1))
    print(
        f"{time.monotonic() - t0:.0f} s; goals (issue 13, stated for the 1 block x 1 tensor "
        "case): shm and cma <= 0.8x NIXL's CMA pull and <= 2x C process_vm_readv; "
        "tcp <= 2x C TCP request/response and <= 0.5x Mooncake TE TCP"
    )
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "started": started,
        "seconds": round(time.monotonic() - t0, 1),
        "load_start": load0,
        "load_end": load1,
        "cpus": os.cpu_count(),
        "versions": _versions(),
        "options": {k: v for k, v in vars(args).items() if k != "json"},
        "cases": results,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=None, help="timed pulls per row (2000)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed pulls per row first (200)")
    ap.add_argument("--rounds", type=int, default=None, help="rotated rounds (10)")
    ap.add_argument("--quick", action="store_true", help="200 pulls, 20 warm-up, 4 rounds")
    ap.add_argument(
        "--rows",
        default=",".join(ROW_NAMES),
        help=f"comma-separated rows (default all: {','.join(ROW_NAMES)})",
    )
    ap.add_argument(
        "--case",
        action="append",
        default=[],
        help="only cases whose name starts with this (repeatable)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write everything here")
    args = ap.parse_args(argv)
    quick = (200, 20, 4) if args.quick else (2000, 200, 10)
    args.repeats = quick[0] if args.repeats is None else args.repeats
    args.warmup = quick[1] if args.warmup is None else args.warmup
    args.rounds = quick[2] if args.rounds is None else args.rounds
    args.rows = [k.strip() for k in args.rows.split(",") if k.strip()]
    bad = [k for k in args.rows if k not in ROW_NAMES]
    if bad or args.repeats < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error(f"unknown rows {bad}" if bad else "--repeats, --rounds >= 1, --warmup >= 0")
    result = asyncio.run(amain(args))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
