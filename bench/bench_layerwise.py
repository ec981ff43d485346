"""Layer-by-layer streaming against one ``pull_blocks`` of the same blocks, same run.

    .venv/bin/python bench/bench_layerwise.py [--paths inproc,shm,cma,tcp] [--rounds 3]
        [--repeats 7] [--blocks 16] [--workload llama8b-fp16|small] [--depth 2] [--json PATH]

Workload ``llama8b-fp16`` (32 layers x K,V = 64 tensors of 256 KiB blocks; ``small``: 4
layers x K,V of 4 KiB blocks, where ``--blocks 8`` is 256 KiB in all, moved whole by one
pull on every path but ``inproc``, see ``Path.pull_at_once``): ``--blocks``
blocks (default 16, shuffled, non-contiguous pairing) of every layer, from a prompt in
another process (``shm``: its cache allocated in shared memory; ``cma`` / ``tcp``: its
cache registered) or in this one (``inproc``). Per path, the two transfers alternate
(ABBA) ``--repeats`` times per round, ``--rounds`` rounds:

* ``pull``: ``await cm.pull_blocks(key, dst, src_blocks, dst_blocks)`` (the baseline);
* ``layerwise``: ``async for layer in cm.pull_blocks_layerwise(...)``, an empty body;
  ``whole`` = call to the last layer, ``first`` = call to the first layer;
* ``native floor`` (``inproc`` and ``cma``, after each pair): the same plan moved by the
  native layered job alone, started from this thread, its first layer awaited by a
  blocking read of the eventfd: no checks, no event loop, no task in between. Its
  ``first - whole / layers`` is what the machine itself costs the first layer (a mover
  thread's wake-up, the second thread joining, the reader's wake-up with both CPUs
  copying): when that alone is near the goal's 100 us, no asyncio call can meet it.
* ``blocking floor`` (the same paths, after it): layer 0 alone, copied by this thread at
  once with two mover threads (the kernel the whole copy takes), nothing else running:
  the earliest any design, even one that blocks its event loop for the layer, can have
  layer 0. Its excess over ``pull / layers`` is the goal's bound on this machine (a
  standing start: the second thread's wake-up, cold caches and TLB).

Goals (issue 13, item 3): ``whole`` <= 1.05x ``pull`` (judged on the median of the
per-pair ratios), ``first`` <= ``pull / layers + 100 us``. Every figure is printed with
its p10-p90 band (min-max below 10 samples); a ``WARNING`` line says when the round
medians of a figure disagree by more than 20%. The bytes of both transfers are checked
against the prompt's pattern after the first pair of each path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from workloads import WORKLOADS

from aiodatadist import _native, _runner
from aiodatadist._checks import blocks_pull_request
from aiodatadist._executor import WORKER_NICE
from aiodatadist.cli.stats import disagree_warning, fmt, fmt_load, load_average, summarize
from aiodatadist.testing import (
    PromptSpec,
    inproc_pair,
    make_blocks_cache,
    pattern_mismatches,
    remote_pair,
)

W = WORKLOADS["llama8b-fp16"]
SEED = 0x1A7E
FIRST_SLACK_MS = 0.1  # the goal's + 100 us
FLOOR_PATHS = ("inproc", "cma")


class Side:
    """A linked decoder and what it pulls from: ``key``, ``dst``, the check."""

    def __init__(self, decoder: Any, key: Any, dst: Any, seed: int) -> None:
        self.decoder, self.key, self.dst, self.seed = decoder, key, dst, seed


async def _open(stack: AsyncExitStack, path: str, nblocks: int) -> Side:
    shape = {"num_tensors": W.num_tensors, "block_shape": tuple(W.block_shape)}
    if path == "inproc":
        pair = await stack.enter_async_context(inproc_pair())
        make_blocks_cache(
            pair.prompt, model_id=0, seed=SEED, pattern=True, num_blocks=nblocks, **shape
        )
        dst = make_blocks_cache(pair.decoder, num_blocks=nblocks, **shape)
        return Side(pair.decoder, pair.key(), dst, SEED)
    spec = PromptSpec(
        num_tensors=W.num_tensors,
        num_blocks=nblocks,
        block_shape=tuple(W.block_shape),
        dtype="fp16",
        seed=SEED,
        allocate=(path == "shm"),
    )
    rp = await stack.enter_async_context(remote_pair(spec, data_path=path))
    link = rp.decoder._rt.links.find(rp.prompt_id)
    if link is None or link.data_path != path:
        raise SystemExit(f"{path}: the link uses {getattr(link, 'data_path', None)}")
    return Side(rp.decoder, rp.key(), rp.decoder_cache(), SEED)


def _check(side: Side, sb: list[int], db: list[int], what: str) -> None:
    bad = pattern_mismatches(side.dst.tensors, sb, db, side.seed)
    if bad:
        raise SystemExit(f"{what}: wrong bytes: {bad[0]}")
    for t in side.dst.tensors:  # clear, so the next check sees this transfer's bytes only
        t.view("uint8")[...] = 0


async def _pull(side: Side, sb: list[int], db: list[int]) -> float:
    t0 = time.perf_counter()
    await side.decoder.cache_manager.pull_blocks(side.key, side.dst.cache, sb, db)
    return (time.perf_counter() - t0) * 1e3


async def _layerwise(side: Side, sb: list[int], db: list[int], depth: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = -1.0
    async for _ in side.decoder.cache_manager.pull_blocks_layerwise(
        side.key, side.dst.cache, sb, db, depth=depth
    ):
        if first < 0:
            first = time.perf_counter() - t0
    return first * 1e3, (time.perf_counter() - t0) * 1e3


class Floor:
    """The native layered job of one pull, timed without the library around it."""

    def __init__(self, side: Side, path: str, sb: list[int], db: list[int], layers: int) -> None:
        rt = side.decoder._rt
        cm = side.decoder.cache_manager
        request = blocks_pull_request(
            rt, cm._caches, side.key, side.dst.cache, sb, db, 2, None, None, None
        )
        link = rt.links.get(request.cluster_id)
        self.pid = 0
        if path == "cma":
            cma = getattr(link.path, "cma", None)
            if cma is None:
                raise SystemExit("cma: the link has no cma path")
            self.pid = cma.pid
        remote, self.plan = _runner.plan(request, link.path.remote_table)
        self.src, self.dst = list(remote.addrs), list(request.local.addrs)
        self.bounds = self.plan.layer_bounds(0, 2, layers)
        segments = self.plan.segments()
        self.layer0 = _native.Plan.from_segments(
            self.plan.src, self.plan.dst, segments[: self.bounds[0]].copy()
        )
        # The kernel the whole transfer's copy takes (non-temporal stores from
        # STREAM_THRESHOLD bytes on): layer 0 alone is under it, and would take memcpy.
        self.stream = (
            self.pid == 0
            and _native.STREAM_SUPPORTED
            and _native.copy_mode() == "auto"
            and self.plan.total_bytes >= _native.STREAM_THRESHOLD
        )

    def blocking(self) -> float:
        """Layer 0 alone, copied by this thread at once with both movers (no job to
        start, no signal, no reader to wake): the fastest any design delivers it, ms."""
        if self.stream:
            _native.set_copy_mode("stream")
        try:
            t0 = time.perf_counter()
            if self.pid == 0:
                _native.copy_local(self.layer0, self.src, self.dst, _native.Control(), threads=2)
            else:
                _native.cma_read(
                    self.pid, self.layer0, self.src, self.dst, _native.Control(), threads=2
                )
            return (time.perf_counter() - t0) * 1e3
        finally:
            if self.stream:
                _native.set_copy_mode("auto")

    def run(self) -> tuple[float, float]:
        """(first layer, whole) in ms."""
        fd = os.eventfd(0, os.EFD_CLOEXEC)  # blocking
        try:
            t0 = time.perf_counter()
            job = _native.start_layered(
                self.pid,
                self.plan,
                self.src,
                self.dst,
                self.bounds,
                _native.Control(),
                threads=2,
                efd=fd,
                lease_addr=0,
                lease_gen=0,
                nice=WORKER_NICE,
            )
            os.eventfd_read(fd)
            first = time.perf_counter() - t0
            job.wait()
            return first * 1e3, (time.perf_counter() - t0) * 1e3
        finally:
            os.close(fd)


async def measure(path: str, args: argparse.Namespace) -> dict[str, Any]:
    n = args.blocks
    rng = random.Random(SEED)
    sb, db = rng.sample(range(n), n), rng.sample(range(n), n)
    layers = W.num_tensors // 2
    async with AsyncExitStack() as stack:
        side = await _open(stack, path, n)
        await _pull(side, sb, db)
        _check(side, sb, db, f"{path} pull")
        await _layerwise(side, sb, db, args.depth)
        _check(side, sb, db, f"{path} layerwise")
        floor = Floor(side, path, sb, db, layers) if path in FLOOR_PATHS else None
        if floor is not None:
            floor.run()
            _check(side, sb, db, f"{path} native floor")
            floor.blocking()
            bad = pattern_mismatches(side.dst.tensors, sb, db, side.seed, [(0, 0), (1, 1)])
            if bad:
                raise SystemExit(f"{path} blocking floor: wrong bytes: {bad[0]}")
        pulls: list[list[float]] = []
        wholes: list[list[float]] = []
        firsts: list[list[float]] = []
        ratios: list[list[float]] = []
        floor_over: list[float] = []  # floor first - floor whole / layers, ms
        blocking_over: list[float] = []  # layer 0 copied at once - pull / layers, ms
        for _ in range(args.rounds):
            p_r, w_r, f_r, r_r = [], [], [], []
            for i in range(args.repeats):
                if i % 2 == 0:  # ABBA
                    p = await _pull(side, sb, db)
                    f, w = await _layerwise(side, sb, db, args.depth)
                else:
                    f, w = await _layerwise(side, sb, db, args.depth)
                    p = await _pull(side, sb, db)
                p_r.append(p)
                w_r.append(w)
                f_r.append(f)
                r_r.append(w / p)
                if floor is not None:
                    ff, fw = floor.run()
                    floor_over.append(ff - fw / layers)
                    blocking_over.append(floor.blocking() - p / layers)
            pulls.append(p_r)
            wholes.append(w_r)
            firsts.append(f_r)
            ratios.append(r_r)
    flat = lambda xs: [x for r in xs for x in r]  # noqa: E731
    pull_s, whole_s = summarize(flat(pulls)), summarize(flat(wholes))
    first_s, ratio_s = summarize(flat(firsts)), summarize(flat(ratios))
    assert pull_s and whole_s and first_s and ratio_s
    first_goal = pull_s.p50 / layers + FIRST_SLACK_MS
    warnings = [
        w
        for name, rounds in (
            ("pull ms", pulls),
            ("layerwise whole ms", wholes),
            ("first layer ms", firsts),
            ("whole/pull", ratios),
        )
        if (w := disagree_warning(f"{path} {name}", [statistics.median(r) for r in rounds]))
    ]
    return {
        "round_medians_ms": {
            "pull": [statistics.median(r) for r in pulls],
            "whole": [statistics.median(r) for r in wholes],
            "first": [statistics.median(r) for r in firsts],
            "ratio": [statistics.median(r) for r in ratios],
        },
        "path": path,
        "bytes": n * W.num_tensors * W.block_bytes,
        "layers": layers,
        "pull_ms": pull_s,
        "whole_ms": whole_s,
        "first_ms": first_s,
        "ratio": ratio_s,
        "first_goal_ms": first_goal,
        "floor_first_over_ms": summarize(floor_over) if floor_over else None,
        "blocking_first_over_ms": summarize(blocking_over) if blocking_over else None,
        "whole_ok": ratio_s.p50 <= 1.05,
        "first_ok": first_s.p50 <= first_goal,
        "warnings": warnings,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="inproc,shm,cma,tcp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--workload", choices=("llama8b-fp16", "small"), default="llama8b-fp16")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.repeats < 7:
        ap.error("--repeats must be >= 7")
    global W
    W = WORKLOADS[args.workload]
    load0 = load_average()
    total = args.blocks * W.num_tensors * W.block_bytes
    size = f"{total / 2**20:.0f} MiB" if total >= 2**20 else f"{total / 2**10:.0f} KiB"
    print(
        f"{W.name}, {args.blocks} blocks x {W.num_tensors // 2} layers "
        f"({size}), depth {args.depth}, "
        f"{args.rounds} rounds x {args.repeats} ABBA pairs; {fmt_load('start', load0)}"
    )
    results = []
    for path in args.paths.split(","):
        r = asyncio.run(measure(path, args))
        results.append(r)
        print(f"\n[{path}]")
        print(f"  pull_blocks            {fmt(r['pull_ms'], 'ms')}")
        print(f"  layerwise, whole       {fmt(r['whole_ms'], 'ms')}")
        print(
            f"  whole / pull (paired)  {fmt(r['ratio'], 'x')}   goal <= 1.05x: "
            f"{'met' if r['whole_ok'] else 'NOT met'}"
        )
        print(
            f"  first layer            {fmt(r['first_ms'], 'ms')}   goal <= "
            f"{r['first_goal_ms']:.3f} ms (pull/{r['layers']} + 0.1): "
            f"{'met' if r['first_ok'] else 'NOT met'}"
        )
        if r["floor_first_over_ms"] is not None:
            print(
                f"  native floor: first - whole/{r['layers']}  "
                f"{fmt(r['floor_first_over_ms'], 'ms')}   (the goal allows 0.100)"
            )
            print(
                f"  blocking floor: layer 0 at once - pull/{r['layers']}  "
                f"{fmt(r['blocking_first_over_ms'], 'ms')}"
            )
        for w in r["warnings"]:
            print(f"  {w}")
    print(fmt_load("end", load_average()))
    if args.json:
        out = {
            "meta": {"loadavg_start": load0, "loadavg_end": load_average(), **vars(args)},
            "results": [
                {k: (v.as_json() if hasattr(v, "as_json") else v) for k, v in r.items()}
                for r in results
            ],
            "warnings": [w for r in results for w in r["warnings"]],
        }
        out["meta"]["json"] = str(args.json)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
