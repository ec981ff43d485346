"""The engine paths against the engines driven directly: 1 GiB and tiny pulls, same run.

    .venv/bin/python bench/bench_engines.py [--engines nixl,mooncake] [--quick]
        [--repeats 15] [--tiny-repeats 2000] [--tiny-rounds 10] [--warmup 200]
        [--nixl-modes fresh,reuse] [--mooncake-modes sync,window] [--breakdown K]
        [--json PATH]

The measurement of issue 12, item 7. For each engine, two *sides* pull the same bytes
of the ``llama8b-fp16`` workload (64 tensors ``[pool, 128, 8, 128]`` fp16, 256 KiB per
block per tensor) into the same kind of memory:

===========================  ==============================================================
side                         what one pull is
===========================  ==============================================================
aiodatadist ENGINE           ``await cache_manager.pull_blocks(...)`` by a decoder process
                             (:class:`EngineDecoder`) from a prompt process (both
                             ``aiodatadist.testing.PeerProcess``), both with
                             ``aiodatadist.DataPath=ENGINE``
ENGINE direct, MODE          the engine's own Python API (``bench/engines.py``, two
                             processes of their own): the same tensors on both sides, one
                             descriptor per block per tensor at the address aiodatadist
                             computes (``addrs[t] + block * 256 KiB``). NIXL modes:
                             ``fresh`` (descriptor lists and a READ handle made for each
                             pull, released after it: what a pull of new blocks costs),
                             ``reuse`` (one handle posted again: only a pull that repeats
                             itself can), ``chunked`` (not by default: one handle per
                             ``--nixl-chunk`` descriptors, as the aiodatadist path
                             posts them). Mooncake modes: ``sync`` (batches of at most
                             ``--mc-batch`` descriptors, one after the other), ``window``
                             (a request per descriptor, ``--mc-window`` in flight, the
                             oldest polled)
===========================  ==============================================================

Both prompts hold ``fill_pattern(tensors, seed)`` in one huge-page-advised mapping,
registered one region per tensor; both destinations are the same kind of memory.

Pulls: **1 GiB** = 64 random non-contiguous blocks of every tensor (4096 descriptors of
256 KiB, ``random_blocks(pool, pool, 64, seed)``), each sample one pull, in GB/s; the
sides take turns within a round, the order rotated each round. **tiny** = block 1 of
tensor 0 into block 2 (256 KiB), each pull timed on its own; ``--tiny-repeats`` pulls per
side in ``--tiny-rounds`` rotated rounds after ``--warmup``. **tinynew** = the same size,
but every pull names other blocks (the pool's ``pool * (pool - 1)`` block pairs of tensor
0, shuffled, in turn: ``engines.rotation``), as a decoder pulling each request's own
blocks does: what a request or handle cache keyed by blocks cannot hide. It is compared
with the direct modes that make their requests per pull (NIXL ``fresh``, Mooncake
``sync`` and ``window``); **tiny** with every mode (NIXL ``reuse``, one handle posted
again, is the honest peer of a repeated pull). Between its turns a side's
processes are stopped (SIGSTOP: an idle NIXL agent's progress thread polls); after a
resume it re-warms with 3 untimed tiny pulls. Every side's bytes are checked (a weighted
checksum of the destination blocks, against the pattern's) after the warm-up and at
the end of each pull kind.

Reported per engine and pull kind: each side's median and band (p10-p90, or min-max
under 10 samples), the round medians' spread with a WARNING when they disagree by more
than 20%; per direct mode, ratio = aiodatadist median / direct median (GB/s: higher is
better for aiodatadist; latency: lower is) and paired = the median (min-max) over rounds
of the per-round ratio. The goals (>= 0.95x on 1 GiB, tiny p50 <= 1.2x) are judged on
the ratio of medians, against every direct mode. ``--aiodatadist-path cma`` runs the
aiodatadist side over ``cma`` instead (for debugging the bench without the engine path).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import importlib.metadata
import inspect
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import engines  # noqa: E402  (bench/engines.py)

from aiodatadist.cli.stats import (  # noqa: E402
    disagree_warning,
    disagreement,
    fmt_load,
    fmt_num,
    load_average,
    summarize,
)
from aiodatadist.cli.workloads import DEFAULT_SEED, WORKLOADS, random_blocks  # noqa: E402
from aiodatadist.config import OPT_DATA_PATH  # noqa: E402
from aiodatadist.errors import LLMStatusCode  # noqa: E402
from aiodatadist.testing import (  # noqa: E402
    PeerCommands,
    PeerProcess,
    PromptSpec,
    cluster_info,
    host_buffer,
)
from aiodatadist.types import BlocksCacheKey, LLMRole  # noqa: E402

WORKLOAD = WORKLOADS["llama8b-fp16"]
BIG, TINY, TINY_NEW = "big", "tiny", "tinynew"
GOAL_BIG = 0.95  # aiodatadist GB/s >= this x direct
GOAL_TINY = 1.2  # aiodatadist p50 latency <= this x direct
MODES = {"nixl": engines.NIXL_MODES, "mooncake": engines.MOONCAKE_MODES}
NEW_BLOCK_MODES = {"nixl": ("fresh",), "mooncake": ("sync", "window")}
"""The direct modes that make their requests for each pull: the ones a pull of new blocks
(``tinynew``) is compared with (``reuse`` posts one handle of fixed blocks again)."""
ENGINE_NAMES = {"nixl": "NIXL", "mooncake": "Mooncake"}


def make_layout(pool: int, blocks: int, seed: int) -> dict[str, Any]:
    """The cache layout both sides hold and its two pulls (``engines.EngineServer``'s)."""
    src, dst = random_blocks(pool, pool, blocks, seed)
    return {
        "tensors": WORKLOAD.num_tensors,
        "pool": pool,
        "block_bytes": WORKLOAD.block_bytes,
        "seed": seed,
        "pulls": {
            BIG: {"src": src, "dst": dst, "tensors": [0, WORKLOAD.num_tensors]},
            TINY: {"src": [1], "dst": [2], "tensors": [0, 1]},
            TINY_NEW: {"src": [1], "dst": [2], "tensors": [0, 1], "rotate": seed},
        },
    }


def pull_bytes(layout: dict[str, Any], pull: str) -> int:
    return len(engines.layout_segments(layout, pull)) * int(layout["block_bytes"])


# --------------------------------------------------------------- where the time goes

# What --breakdown times in the decoder process, in print order: (depth, module, class
# or None for a module-level function, attribute, bucket). Depth 0 is aiodatadist's own
# steps of one pull_blocks (their sum with what is not wrapped is the pull's total);
# the engine connection's read is the executor job of one transfer, and inside it the
# engine's own calls and the poll's backoff sleeps. Coroutine functions are timed from
# call to return (their awaits included). Names that do not exist are skipped.
_TIMED: tuple[tuple[int, str, str | None, str, str], ...] = (
    (0, "aiodatadist.cache_manager", None, "blocks_pull_request", "checks + request"),
    (0, "aiodatadist._runner", None, "run", "runner: slot, path, transfer"),
    (0, "aiodatadist._lanes", "FastPulls", "pull", "fast lane (kept lanes, checks)"),
    (1, "aiodatadist.transports.engine_lane", "EngineLane", "pull", "engine lane pull"),
    (2, "aiodatadist.transports.engine_lane", "EngineLane", "_prepare", "lane: a new request"),
    (2, "aiodatadist.transports.nixl", "NixlConn", "post_inline", "nixl post, inline"),
    (1, "aiodatadist.transports.engine", "EnginePath", "pull", "engine path pull"),
    (2, "aiodatadist.transports.engine", "EnginePath", "_ready", "engine conn ready"),
    (2, "aiodatadist._fdchannel", "FdChannel", "peer_page", "lease page (fd channel)"),
    (2, "aiodatadist.transports.base", "Call", "run", "Call.run (job + hand-off)"),
    (3, "", None, "", "engine conn read (executor job)"),
    (4, "", None, "", "poll backoff sleeps"),
    (4, "nixl_cu12._api", "nixl_agent", "transfer", "nixl transfer (post)"),
    (4, "nixl_cu12._api", "nixl_agent", "check_xfer_state", "nixl check_xfer_state"),
    (4, "nixl_cu12._api", "nixl_agent", "initialize_xfer", "nixl initialize_xfer"),
    (4, "nixl_cu12._api", "nixl_agent", "make_prepped_xfer", "nixl make_prepped_xfer"),
    (4, "nixl_cu12._api", "nixl_agent", "release_xfer_handle", "nixl release_xfer_handle"),
    (4, "nixl_cu12._api", "nixl_agent", "get_xfer_descs", "nixl get_xfer_descs"),
    (4, "aiodatadist.transports.nixl", "NixlConn", "_requests", "nixl prepared-request lookup"),
    (4, "mooncake.engine", "TransferEngine", "transfer_sync_read", "mooncake sync read"),
    (4, "mooncake.engine", "TransferEngine", "batch_transfer_sync_read", "mooncake batch read"),
    (4, "mooncake.engine", "TransferEngine", "batch_transfer_async_read", "mooncake submit"),
    (4, "mooncake.engine", "TransferEngine", "transfer_check_status", "mooncake check_status"),
    (4, "mooncake.engine", "TransferEngine", "get_batch_transfer_status", "mooncake batch wait"),
)
READ_BUCKET = "engine conn read (executor job)"
SLEEP_BUCKET = "poll backoff sleeps"
BUCKET_DEPTH = {b: d for d, *_, b in _TIMED}


class Timers:
    """Wall time (ns) of each call per bucket of the wrapped callables (this process)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = {}
        self.installed: list[str] = []
        self.failed: list[str] = []

    def wrap(self, owner: Any, attr: str, bucket: str) -> None:
        fn = getattr(owner, attr)
        calls = self.calls
        clock = time.perf_counter_ns
        timed: Any
        if inspect.iscoroutinefunction(fn):

            async def timed(*a: Any, **kw: Any) -> Any:
                t0 = clock()
                try:
                    return await fn(*a, **kw)
                finally:
                    calls.setdefault(bucket, []).append(clock() - t0)

        else:

            def timed(*a: Any, **kw: Any) -> Any:
                t0 = clock()
                try:
                    return fn(*a, **kw)
                finally:
                    calls.setdefault(bucket, []).append(clock() - t0)

        try:
            setattr(owner, attr, timed)
            self.installed.append(bucket)
        except (AttributeError, TypeError) as e:
            self.failed.append(f"{bucket}: {e}")

    def install(self) -> None:
        """Wraps what :data:`_TIMED` names, every engine conn's ``read`` and the poll's sleep."""
        import importlib
        import types

        from aiodatadist.transports import engine as engine_mod

        for mod_name in ("aiodatadist.transports.nixl", "aiodatadist.transports.mooncake"):
            with contextlib.suppress(ImportError):
                importlib.import_module(mod_name)
        for cls in engine_mod.EngineConn.__subclasses__():
            if "read" in vars(cls):
                self.wrap(cls, "read", READ_BUCKET)
        # The polls sleep with their module's ``time.sleep``: each such module gets a copy
        # of ``time`` whose ``sleep`` is timed.
        for mod_name in ("engine", "nixl", "mooncake"):
            mod = sys.modules.get(f"aiodatadist.transports.{mod_name}")
            real = getattr(mod, "time", None)
            if real is time:
                proxy = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real)})
                setattr(mod, "time", proxy)  # noqa: B010  (mod: a module or None)
                self.wrap(proxy, "sleep", SLEEP_BUCKET)
        for _, mod_name, cls_name, attr, bucket in _TIMED:
            mod = sys.modules.get(mod_name) if mod_name else None
            owner = mod if cls_name is None or mod is None else getattr(mod, cls_name, None)
            if owner is not None and hasattr(owner, attr):
                self.wrap(owner, attr, bucket)

    def take(self) -> dict[str, list[float]]:
        """Per bucket since the last take: total ns, calls, median ns per call."""
        out = {k: [sum(v), len(v), statistics.median(v)] for k, v in self.calls.items() if v}
        self.calls.clear()
        return out


# ------------------------------------------------------------------------------ sides


@dataclass
class Side:
    """One way of pulling: its samples (us per pull) and checks, or why it has none."""

    key: str
    name: str
    why: str = ""
    samples: dict[str, list[list[float]]] = field(default_factory=dict)  # pull -> rounds
    verified: dict[str, list[bool]] = field(default_factory=dict)

    async def run(self, pull: str, k: int) -> list[float]:
        raise NotImplementedError

    async def verify(self, pull: str) -> bool:
        raise NotImplementedError

    def pause(self) -> None:
        """Between its turns."""

    async def resume(self) -> None:
        """Before its turn."""

    async def close(self) -> None:
        """Stops what it started."""


class DirectSide(Side):
    """The engine driven directly in one of its modes (``engines.EngineServer``; the
    modes of one engine share its two processes)."""

    def __init__(self, engine: str, mode: str, server: Any, owner: bool) -> None:
        super().__init__(f"direct-{mode}", f"{ENGINE_NAMES[engine]} direct, {mode}")
        self.mode, self.server, self.owner = mode, server, owner

    async def run(self, pull: str, k: int) -> list[float]:
        out: list[float] = await asyncio.to_thread(self.server.run, k, False, pull, self.mode)
        return out

    async def verify(self, pull: str) -> bool:
        ok: bool = await asyncio.to_thread(self.server.verify, pull, self.mode)
        return ok

    def pause(self) -> None:
        self.server.pause()

    async def resume(self) -> None:
        await asyncio.to_thread(self.server.resume, 0)
        await self.run(TINY, 3)

    async def close(self) -> None:
        if self.owner:
            await asyncio.to_thread(self.server.close)


class EngineDecoder(PeerCommands):
    """The aiodatadist side's decoder (``--plugin bench/bench_engines.py:EngineDecoder``,
    a process of its own, so that it can be stopped between its turns like the direct
    side's): registers the layout's destination (one huge-page-advised mapping), links
    to the prompt at ``config["prompt"]`` and answers ``run`` (``k`` timed pulls) and
    ``verify`` (clear, pull, checksum of the destination blocks)."""

    async def start(self) -> dict[str, Any]:
        self.layout = lay = self.config["layout"]
        w, pool = WORKLOAD, int(lay["pool"])
        spec = _prompt_spec(lay)
        self.dst = host_buffer((w.num_tensors, pool, *w.block_shape), spec.data_type.to_numpy())
        cm = self.dd.cache_manager
        self.cache = cm.register_blocks_cache(spec.desc(), list(self.dst))
        cid, host, port = self.config["prompt"]
        status, _ = await self.dd.link_clusters([cluster_info(cid, host, port)], 30_000)
        if status != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters failed: {status.name}")
        self.src_key = BlocksCacheKey(cid, spec.model_id)
        self.turns: dict[str, list[tuple[int, int]]] = {}
        self.turn: dict[str, int] = {}
        return {}

    async def _pull(self, pull: str) -> None:
        p = self.layout["pulls"][pull]
        t0, n = p["tensors"]
        tpl = WORKLOAD.tensors_per_layer if n == WORKLOAD.num_tensors else n
        layers = range(t0 // tpl, (t0 + n) // tpl)
        src, dst = p["src"], p["dst"]
        turns = self.turns.get(pull)
        if turns is None:
            turns = self.turns[pull] = engines.rotation(self.layout, pull)
            self.turn[pull] = 0
        if turns:  # a rotating pull: new blocks every time, as engines._Initiator takes them
            self.turn[pull] = i = (self.turn[pull] + 1) % len(turns)
            src, dst = [turns[i][0]], [turns[i][1]]
        await self.dd.cache_manager.pull_blocks(
            self.src_key, self.cache, src, dst, src_layer_range=layers,
            dst_layer_range=layers, tensor_num_per_layer=tpl, timeout=120.0,
        )  # fmt: skip

    async def cmd_run(self, c: dict[str, Any]) -> dict[str, Any]:
        pull, k = str(c["pull"]), int(c["k"])
        clock, out = time.perf_counter_ns, [0.0] * k
        for j in range(k):
            t0 = clock()
            await self._pull(pull)
            out[j] = (clock() - t0) / 1e3
        return {"ok": True, "us": out}

    async def cmd_breakdown(self, c: dict[str, Any]) -> dict[str, Any]:
        """``k`` pulls with :class:`Timers` on: their totals (us) and the buckets' sums."""
        if not hasattr(self, "timers"):
            self.timers = Timers()
            self.timers.install()
        self.timers.take()
        reply = await self.cmd_run(c)
        buckets = self.timers.take()
        return {**reply, "buckets": buckets, "failed": self.timers.failed}

    async def cmd_verify(self, c: dict[str, Any]) -> dict[str, Any]:
        pull = str(c["pull"])
        views = [self.dst[t, d] for t, _, d in engines.layout_segments(self.layout, pull)]
        for v in views:
            v[...] = 0
        if self.turns.get(pull):
            self.turn[pull] = len(self.turns[pull]) - 1  # the next pull takes the first pair
        await self._pull(pull)
        got = await asyncio.to_thread(engines.gathered_checksum, views)
        return {"ok": True, "sum": str(got)}


def _prompt_spec(layout: dict[str, Any]) -> PromptSpec:
    w = WORKLOAD
    return PromptSpec(
        num_tensors=w.num_tensors, num_blocks=int(layout["pool"]), block_shape=w.block_shape,
        dtype=w.dtype, seed=int(layout["seed"]), allocate=False,
    )  # fmt: skip


class AiodSide(Side):
    """``await pull_blocks`` by a decoder process (:class:`EngineDecoder`) from a prompt
    process, both with ``aiodatadist.DataPath=path``."""

    def __init__(self, path: str, layout: dict[str, Any]) -> None:
        super().__init__("aiodatadist", f"aiodatadist {path}")
        self.path, self.layout = path, layout
        self.procs: list[PeerProcess] = []
        self.stopped = False

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        opts = {OPT_DATA_PATH: self.path}
        # The engines log on stderr (Mooncake: a dozen lines per process): into a file.
        self.log = stack.enter_context(tempfile.TemporaryFile("w+"))
        prompt = await stack.enter_async_context(
            PeerProcess(
                _prompt_spec(self.layout), cluster_id=5, options=opts, start_timeout=300,
                stderr=self.log,
            )
        )  # fmt: skip
        self.procs.append(prompt)
        config = {"layout": self.layout, "prompt": [prompt.cluster_id, *prompt.address]}
        self.decoder = await stack.enter_async_context(
            PeerProcess(
                cluster_id=15, options=opts, start_timeout=300, host=None,
                role=LLMRole.DECODER, serve_cache=False,
                plugin=f"{Path(__file__)}:EngineDecoder", plugin_config=config,
                stderr=self.log,
            )
        )  # fmt: skip
        self.procs.append(self.decoder)
        stack.callback(self._cont)  # unwinds first: never stop a stopped process

    def log_tail(self) -> str:
        """The last error-looking line the two processes wrote on stderr, if any."""
        log = getattr(self, "log", None)
        if log is None or log.closed:
            return ""
        log.seek(0)
        lines = [ln.strip() for ln in log.read().splitlines() if ln.strip()]
        errs = [ln for ln in lines if "Error" in ln or "error" in ln or ln.startswith("E")]
        return str((errs or [""])[-1][:300])

    async def _call(self, cmd: str, pull: str, timeout: float, **kw: Any) -> dict[str, Any]:
        reply = await self.decoder.call(cmd, pull=pull, timeout=timeout, **kw)
        if not reply.get("ok"):
            raise RuntimeError(str(reply.get("error") or reply))
        return reply

    async def run(self, pull: str, k: int) -> list[float]:
        reply = await self._call("run", pull, 120.0 + 2.0 * k, k=k)
        return [float(x) for x in reply["us"]]

    async def breakdown(self, pull: str, k: int) -> dict[str, Any]:
        """``k`` pulls with the decoder's :class:`Timers` on (see ``cmd_breakdown``)."""
        return await self._call("breakdown", pull, 120.0 + 2.0 * k, k=k)

    async def verify(self, pull: str) -> bool:
        reply = await self._call("verify", pull, 300.0)
        return int(reply["sum"]) == engines.layout_expected(self.layout, pull)

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.pid and p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)

    def _cont(self) -> None:
        self._signal(signal.SIGCONT)
        self.stopped = False

    def pause(self) -> None:
        """Stops both processes (SIGSTOP): an idle NIXL agent's progress thread polls."""
        self._signal(signal.SIGSTOP)
        self.stopped = True

    async def resume(self) -> None:
        if self.stopped:
            self._cont()
            await self.run(TINY, 3)


# ---------------------------------------------------------------------- measure


async def _turn(side: Side, pull: str, k: int, pause: bool) -> list[float] | None:
    """``k`` pulls by ``side`` (resumed first, paused after); None once it failed."""
    if side.why:
        return None
    try:
        if pause:
            await side.resume()
        return await side.run(pull, k)
    except Exception as e:  # a failing side stops; the others go on
        side.why = f"failed: {_why(e)}"
        return None
    finally:
        if pause:
            side.pause()


async def _check(side: Side, pull: str, pause: bool) -> None:
    if side.why:
        return
    try:
        if pause:
            await side.resume()
        side.verified.setdefault(pull, []).append(bool(await side.verify(pull)))
    except Exception as e:
        side.why = f"failed: {_why(e)}"
    finally:
        if pause:
            side.pause()


async def measure(
    sides: list[Side], pull: str, rounds: int, per_round: int, warmup: int, pause: bool
) -> None:
    """Warm-up and check each side, then ``rounds`` rounds (``per_round`` timed pulls per
    side, the order rotated every round), then check again."""
    for s in sides:
        if warmup:
            await _turn(s, pull, warmup, pause)
        await _check(s, pull, pause)
    for i in range(rounds):
        live = [s for s in sides if not s.why]
        if not live:
            break
        shift = i % len(live)
        for s in live[shift:] + live[:shift]:
            got = await _turn(s, pull, per_round, pause)
            if got is not None:
                s.samples.setdefault(pull, []).append(got)
    for s in sides:
        await _check(s, pull, pause)


def _new_block_sides(engine: str, sides: list[Side]) -> list[Side]:
    """The sides a pull of new blocks (``tinynew``) is measured on: aiodatadist and the
    direct modes that make their requests per pull (:data:`NEW_BLOCK_MODES`)."""
    keep = NEW_BLOCK_MODES[engine]
    return [s for s in sides if not isinstance(s, DirectSide) or s.mode in keep]


def _why(e: BaseException) -> str:
    return (str(e).strip().replace("\n", " ") or type(e).__name__)[:300]


# ----------------------------------------------------------------------- report


def _round_figures(side: Side, pull: str, nbytes: int) -> list[float]:
    """Per round: GB/s (1 GiB: the round's pulls' bytes over their time) or median us."""
    rounds = side.samples.get(pull, [])
    if pull == BIG:
        return [nbytes * len(r) / (sum(r) * 1e3) for r in rounds if r]
    return [statistics.median(r) for r in rounds if r]


def report(
    engine: str, layout: dict[str, Any], sides: list[Side], pull: str
) -> tuple[list[str], dict[str, Any]]:
    """The table of one engine and pull kind, its comparisons and goals, and its JSON."""
    nbytes = pull_bytes(layout, pull)
    segs = len(engines.layout_segments(layout, pull))
    big = pull == BIG
    title = "1 GiB pull" if big and nbytes == 1 << 30 else f"{nbytes / (1 << 20):g} MiB pull"
    what = f"{title}: {segs} descriptors of {layout['block_bytes'] // 1024} KiB"
    if not big:
        what = f"tiny pull (1 block x 1 tensor): {nbytes // 1024} KiB"
    if pull == TINY_NEW:
        pairs = len(engines.rotation(layout, pull))
        what = (
            f"tiny pull of new blocks (1 block x 1 tensor, {nbytes // 1024} KiB; {pairs} "
            "block pairs in turn)"
        )
    unit = "GB/s" if big else "us"
    lines = [f"-- {ENGINE_NAMES[engine]}, {what}"]
    if big:
        hdr = f"{'side':<30} {'n':>4} {'GB/s p50':>9} {'p10-p90 or min-max':>19}"
    else:
        hdr = f"{'side':<30} {'n':>5} {'p10':>8} {'p50':>8} {'p90':>8} {'p99':>8}"
    hdr += f"  {'round ' + ('GB/s' if big else 'p50') + ' min..max':>21}  check"
    lines += [hdr + ("" if big else "   (us)"), "-" * (len(hdr) + 6)]
    warnings: list[str] = []
    rows: list[dict[str, Any]] = []
    for s in sides:
        flat = [x for r in s.samples.get(pull, []) for x in r]
        vals = [nbytes / (x * 1e3) for x in flat] if big else flat
        summ = summarize(vals)
        rf = _round_figures(s, pull, nbytes)
        checks = s.verified.get(pull, [])
        check = "ok" if checks and all(checks) else "DATA MISMATCH" if checks else "-"
        tail = f"  ({s.why})" if s.why else ""
        if summ is None:
            lines.append(f"{s.name:<30} {s.why or 'no samples'}")
        else:
            span = f"{fmt_num(min(rf))}..{fmt_num(max(rf))}" if rf else "-"
            if big:
                kind, lo, hi = summ.band
                band = f"{kind} {fmt_num(lo)}-{fmt_num(hi)}"
                cells = f"{summ.n:>4} {summ.p50:>9.2f} {band:>19}"
            else:
                cells = (
                    f"{summ.n:>5} {summ.p10:>8.1f} {summ.p50:>8.1f} {summ.p90:>8.1f} "
                    f"{summ.p99:>8.1f}"
                )
            lines.append(f"{s.name:<30} {cells}  {span:>21}  {check}{tail}")
            w = disagree_warning(f"{ENGINE_NAMES[engine]} {pull}: {s.name}", rf, unit)
            if w:
                warnings.append(w)
        rows.append(
            {
                "key": s.key, "name": s.name, "why": s.why or None, "verified": checks,
                ("gbps" if big else "latency_us"): None if summ is None else summ.as_json(4),
                "round_figures": [round(x, 4) for x in rf], "disagreement": disagreement(rf),
                "samples_us": [round(x, 1) for x in flat],
            }
        )  # fmt: skip
    lines += warnings
    comps, goal_lines = _compare(engine, sides, pull, nbytes)
    if comps:
        lines += [
            "",
            f"  ratio = aiodatadist {'GB/s' if big else 'p50'} / direct "
            f"{'GB/s' if big else 'p50'}; paired = median (min-max) over rounds of the "
            "ratio of the round figures",
        ]
        lines += [c["line"] for c in comps]
    lines += goal_lines
    for c in comps:
        c.pop("line")
    js = {"pull": pull, "bytes": nbytes, "descriptors": segs, "sides": rows}
    js |= {"comparisons": comps, "warnings": warnings, "goals": goal_lines}
    return lines, js


def _flat(side: Side, pull: str) -> list[float]:
    return [x for r in side.samples.get(pull, []) for x in r]


def _compare(
    engine: str, sides: list[Side], pull: str, nbytes: int
) -> tuple[list[dict[str, Any]], list[str]]:
    big = pull == BIG
    a = next((s for s in sides if s.key == "aiodatadist"), None)
    direct = [s for s in sides if s.key != "aiodatadist"]
    goal = GOAL_BIG if big else GOAL_TINY
    goal_text = f"aiodatadist >= {goal:g}x direct GB/s" if big else f"p50 <= {goal:g}x direct"
    head = f"GOAL {ENGINE_NAMES[engine]} {pull} ({goal_text})"

    def figure(s: Side) -> float | None:
        flat = _flat(s, pull)
        if not flat:
            return None
        med = statistics.median(flat)
        return nbytes / (med * 1e3) if big else med

    mine = None if a is None else figure(a)
    if a is None or mine is None:
        why = "no aiodatadist side" if a is None else a.why or "no samples"
        return [], [f"{head}: not measured ({why})"]
    comps: list[dict[str, Any]] = []
    verdicts: list[str] = []
    for d in direct:
        theirs = figure(d)
        if theirs is None:
            verdicts.append(f"vs {d.name}: not measured ({d.why or 'no samples'})")
            continue
        ratio = mine / theirs
        ra, rd = _round_figures(a, pull, nbytes), _round_figures(d, pull, nbytes)
        rr = [x / y for x, y in zip(ra, rd, strict=True)] if len(ra) == len(rd) else []
        paired = statistics.median(rr) if rr else None
        met = ratio >= goal if big else ratio <= goal
        # Tiny: the tails' ratios too (p90, p99), for reference.
        tail_ratios: dict[str, float] = {}
        if not big:
            sa, sd = summarize(_flat(a, pull)), summarize(_flat(d, pull))
            if sa is not None and sd is not None:
                tail_ratios = {"p90": round(sa.p90 / sd.p90, 4), "p99": round(sa.p99 / sd.p99, 4)}
        tails = "".join(f"  {k} {v:.2f}" for k, v in tail_ratios.items())
        span = f"{min(rr):.2f}-{max(rr):.2f}" if rr else "-"
        # How far off: the GB/s still missing, or the share of the p50 that must go.
        short = (
            f"needs {100 * (goal / ratio - 1):.0f}% more GB/s"
            if big
            else f"its p50 must drop {100 * (1 - goal / ratio):.0f}%"
        )
        verdicts.append(
            f"vs {d.name}: {ratio:.2f}x {'met' if met else 'MISSED'}"
            + ("" if met else f" ({short})")
        )
        comps.append(
            {
                "line": f"  {a.name:<24} vs {d.name:<28} ratio {ratio:>5.2f}  paired "
                f"{'-' if paired is None else f'{paired:.2f}'} ({span}){tails}",
                "direct": d.key, "ratio": round(ratio, 4), "tail_ratios": tail_ratios,
                "paired": None if paired is None else round(paired, 4),
                "round_ratios": [round(x, 4) for x in rr], "goal": goal, "met": met,
            }
        )  # fmt: skip
    return comps, [f"{head}: " + "; ".join(verdicts)]


def breakdown_lines(engine: str, pull: str, reply: dict[str, Any], sides: list[Side]) -> list[str]:
    """Where one pull kind's time goes on the aiodatadist side (``--breakdown``)."""
    us = [float(x) for x in reply["us"]]
    n = len(us)
    big = pull == BIG
    unit, div = ("ms", 1e6) if big else ("us", 1e3)
    total = statistics.fmean(us) * 1e3 / div  # per pull, in unit
    lines = [
        f"  {pull}, {n} pulls: total p50 {fmt_num(statistics.median(us) * 1e3 / div)} {unit}, "
        f"mean {fmt_num(total)} {unit} per pull"
    ]
    buckets: dict[str, list[float]] = reply["buckets"]
    lines.append(f"    {'':<40} {'mean/pull':>9}  {'p50/call':>9}  calls/pull   ({unit})")
    shown = 0.0
    for name in sorted(buckets, key=lambda b: list(BUCKET_DEPTH).index(b)):
        ns, calls, med = buckets[name]
        depth = BUCKET_DEPTH[name]
        shown += ns / n / div if depth == 0 else 0.0
        lines.append(
            f"    {'  ' * depth + name:<40} {fmt_num(ns / n / div):>9}  "
            f"{fmt_num(med / div):>9}  {calls / n:>10.2f}"
        )
    lines.append(f"    {'rest (await, public entry, unwrapped)':<40} {fmt_num(total - shown):>9}")
    for s in sides:
        flat = [x for r in s.samples.get(pull, []) for x in r]
        if s.key != "aiodatadist" and flat:
            lines.append(
                f"    for comparison, {s.name} p50: "
                f"{fmt_num(statistics.median(flat) * 1e3 / div)} {unit}"
            )
    if reply.get("failed"):
        lines.append(f"    (not timed: {'; '.join(reply['failed'])})")
    return lines


async def breakdown(
    engine: str, aiod: AiodSide, sides: list[Side], k: int, pause: bool
) -> tuple[list[str], dict[str, Any]]:
    """``k`` tiny pulls (of each kind) and ``max(2, k // 100)`` big ones with timers on
    (aiodatadist side)."""
    lines = [
        f"-- where aiodatadist's time goes ({ENGINE_NAMES[engine]}; timers on, which adds a "
        "little to every timed call)"
    ]
    out: dict[str, Any] = {}
    if aiod.why:
        return [*lines, f"  not measured ({aiod.why})"], out
    try:
        if pause:
            await aiod.resume()
        for pull, n in ((TINY, k), (TINY_NEW, k), (BIG, max(2, k // 100))):
            reply = await aiod.breakdown(pull, n)
            out[pull] = {"us": reply["us"], "buckets": reply["buckets"]}
            lines += breakdown_lines(engine, pull, reply, sides)
    except Exception as e:
        lines.append(f"  failed: {_why(e)}")
    finally:
        if pause:
            aiod.pause()
    return lines, out


# ------------------------------------------------------------------------- main


async def bench_engine(engine: str, args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """Both sides of one engine, both pull kinds; what cannot run says why."""
    layout = make_layout(args.pool, args.blocks, args.seed)
    apath = args.aiodatadist_path or engine
    modes = args.modes[engine]
    sides: list[Side] = []
    bd_lines: list[str] = []
    out: dict[str, Any] = {"engine": engine, "aiodatadist_path": apath, "modes": modes}
    lines = [f"== {ENGINE_NAMES[engine]}: aiodatadist DataPath={apath} vs {engine} direct"]
    async with contextlib.AsyncExitStack() as stack:
        aiod = AiodSide(apath, layout)
        try:
            await aiod.start(stack)
        except Exception as e:
            tail = aiod.log_tail()
            aiod.why = f"unavailable: {_why(e)}" + (f" (stderr: {tail})" if tail else "")
        sides.append(aiod)
        try:
            server = await asyncio.to_thread(
                engines.EngineServer, engine, layout=layout, mc_batch=args.mc_batch,
                mc_window=args.mc_window, nixl_chunk=args.nixl_chunk, start_timeout=300,
            )  # fmt: skip
        except Exception as e:
            sides += [
                Side(
                    f"direct-{m}",
                    f"{ENGINE_NAMES[engine]} direct, {m}",
                    why=f"unavailable: {_why(e)}",
                )
                for m in modes
            ]
        else:
            for i, m in enumerate(modes):
                sides.append(DirectSide(engine, m, server, owner=i == 0))
        try:
            pause = not args.no_pause
            for s in sides:
                if pause and not s.why:
                    s.pause()
            await measure(sides, BIG, args.repeats, args.big_per_round, 1, pause)
            per_round = max(1, -(-args.tiny_repeats // args.tiny_rounds))
            await measure(sides, TINY, args.tiny_rounds, per_round, args.warmup, pause)
            new = _new_block_sides(engine, sides)
            await measure(new, TINY_NEW, args.tiny_rounds, per_round, args.warmup, pause)
            if args.breakdown:
                bd_lines, out["breakdown"] = await breakdown(
                    engine, aiod, sides, args.breakdown, pause
                )
        finally:
            for s in reversed(sides):
                with contextlib.suppress(Exception):
                    await s.close()
    out["pulls"] = []
    for pull in (BIG, TINY, TINY_NEW):
        text, js = report(
            engine, layout, _new_block_sides(engine, sides) if pull == TINY_NEW else sides, pull
        )
        lines += ["", *text]
        out["pulls"].append(js)
    if bd_lines:
        lines += ["", *bd_lines]
    return lines, out


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in ("aiodatadist", "numpy", "nixl-cu12", "mooncake-transfer-engine-non-cuda"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    load0 = load_average()
    t0 = time.monotonic()
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    layout = make_layout(args.pool, args.blocks, args.seed)
    print(
        f"bench_engines: {WORKLOAD.name}, pool {args.pool} blocks per tensor; "
        f"{pull_bytes(layout, BIG) / (1 << 20):g} MiB pull x {args.repeats} rounds, tiny "
        f"{args.tiny_repeats} pulls per side in {args.tiny_rounds} rounds after "
        f"{args.warmup} warm-up; {started}"
    )
    print(fmt_load("start", load0), flush=True)
    results: list[dict[str, Any]] = []
    goals: list[str] = []
    for engine in args.engines:
        lines, js = await bench_engine(engine, args)
        print("\n" + "\n".join(lines), flush=True)
        results.append(js)
        goals += [g for p in js["pulls"] for g in p["goals"]]
    load1 = load_average()
    print("\n" + fmt_load("end", load1))
    print(f"{time.monotonic() - t0:.0f} s; goals (issue 12, item 7):")
    print("\n".join("  " + g for g in goals))
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "started": started,
        "seconds": round(time.monotonic() - t0, 1),
        "load_start": load0,
        "load_end": load1,
        "cpus": os.cpu_count(),
        "versions": _versions(),
        "options": {k: v for k, v in vars(args).items() if k != "json"},
        "engines": results,
        "goals": goals,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="nixl,mooncake", help="comma-separated (nixl,mooncake)")
    ap.add_argument("--quick", action="store_true", help="8-block pull, 3 rounds, 60 tiny pulls")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per big pull (64: 1 GiB)")
    ap.add_argument(
        "--pool", type=int, default=None, help="blocks per tensor (--blocks; --quick: 16)"
    )
    ap.add_argument("--repeats", type=int, default=None, help="big-pull rounds (15)")
    ap.add_argument(
        "--big-per-round", type=int, default=1, help="big pulls per side in each round (1)"
    )
    ap.add_argument("--tiny-repeats", type=int, default=None, help="tiny pulls per side (2000)")
    ap.add_argument("--tiny-rounds", type=int, default=None, help="tiny rounds (10)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed tiny pulls first (200)")
    ap.add_argument("--nixl-modes", default="fresh,reuse", help="NIXL direct modes")
    ap.add_argument("--mooncake-modes", default="sync,window", help="Mooncake direct modes")
    ap.add_argument("--mc-batch", type=int, default=1024, help="Mooncake descriptors per batch")
    ap.add_argument("--mc-window", type=int, default=64, help="Mooncake requests in flight")
    ap.add_argument(
        "--nixl-chunk", type=int, default=32, help="NIXL mode chunked: descriptors per handle"
    )
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--no-pause", action="store_true", help="never SIGSTOP an idle side")
    ap.add_argument(
        "--breakdown",
        type=int,
        default=0,
        metavar="K",
        help="then K tiny pulls (and K/100 big ones) timed inside the aiodatadist decoder",
    )
    ap.add_argument(
        "--aiodatadist-path", default=None, help="debugging: this DataPath instead of the engine"
    )
    ap.add_argument("--json", type=Path, default=None, help="write everything here")
    args = ap.parse_args(argv)
    q = args.quick
    for name, full, quick in (
        ("blocks", 64, 8), ("repeats", 15, 3), ("tiny_repeats", 2000, 60),
        ("tiny_rounds", 10, 3), ("warmup", 200, 10),
    ):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.pool is None:
        # At least 16: tinynew's 240 block pairs outnumber the requests aiodatadist keeps.
        args.pool = max(args.blocks, 16) if q else args.blocks
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.modes = {
        "nixl": [m.strip() for m in args.nixl_modes.split(",") if m.strip()],
        "mooncake": [m.strip() for m in args.mooncake_modes.split(",") if m.strip()],
    }
    bad = [e for e in args.engines if e not in engines.ENGINES]
    bad += [m for e, ms in args.modes.items() for m in ms if m not in MODES[e]]
    if bad:
        ap.error(f"unknown engines or modes: {bad}")
    counts = (args.blocks, args.repeats, args.big_per_round, args.tiny_repeats, args.tiny_rounds)
    if min(*counts, args.mc_batch, args.mc_window, args.nixl_chunk) < 1:
        ap.error("--blocks, --repeats, --tiny-repeats, --tiny-rounds, --mc-* must be >= 1")
    if args.pool < max(args.blocks, 3) or args.warmup < 0:
        ap.error("--pool must be >= --blocks and >= 3; --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(amain(args))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
