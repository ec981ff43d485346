"""``aiodatadist demo``: two processes exchange a KV cache over loopback, verified.

The prompt is a subprocess (``python -m aiodatadist.testing``): it allocates an
llama8b-fp16-shaped blocks cache in shared memory, fills it with a seeded pattern
and listens on 127.0.0.1. The decoder is this process: for each data path (shm,
cma, tcp) it makes one decoder instance forced to that path
(``aiodatadist.DataPath``), links it to the prompt, pulls one request's blocks
layer by layer (``pull_blocks`` with ``src_layer_range`` / ``dst_layer_range``),
checks every pulled byte against the pattern and reports the bandwidth.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import OPT_DATA_PATH, OPT_SYNC_KV_TIMEOUT
from ..datadist import LLMDataDist
from ..errors import LLMException, LLMStatusCode
from ..testing import (
    Mismatch,
    PeerProcess,
    PromptSpec,
    cluster_info,
    host_buffer,
    pattern_mismatches,
)
from ..types import BlocksCacheKey, LLMRole
from .progress import Progress

__all__ = ["run_demo"]

_FULL = {
    "layers": 32,
    "blocks": 64,
    "request_blocks": 32,
    "block_tokens": 128,
    "heads": 8,
    "head_dim": 128,
}
_SMALL = {
    "layers": 4,
    "blocks": 16,
    "request_blocks": 8,
    "block_tokens": 16,
    "heads": 2,
    "head_dim": 64,
}
PROMPT_ID = 1
DECODER_BASE_ID = 100


@dataclass
class PathResult:
    path: str
    status: str  # "ok", "mismatch", "unavailable", "error"
    detail: str = ""
    nbytes: int = 0  # bytes per round
    rounds: list[float] = field(default_factory=list)  # seconds of each round
    pull_seconds: list[float] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    link_path: str = ""

    def gbps(self, rnd: int) -> float:
        s = self.rounds[rnd]
        return self.nbytes / s / 1e9 if s > 0 else 0.0


def _mib(n: int) -> str:
    if n < 2**20:
        return f"{n / 2**10:.1f} KiB"
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _resolve(args: argparse.Namespace) -> dict[str, int]:
    base = _SMALL if args.small else _FULL
    out = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    for k, v in out.items():
        if v < 1:
            raise SystemExit(f"aiodatadist demo: --{k.replace('_', '-')} must be >= 1")
    out["request_blocks"] = min(out["request_blocks"], out["blocks"])
    return out


async def run_demo(args: argparse.Namespace) -> int:
    """Runs the demo; returns the exit status (0: every path that works verified).

    Raises:
        RuntimeError, TimeoutError: the prompt process did not start.

    Timeout: each pull is bounded by ``--timeout`` (a timed-out pull is reported as an
    error of its path). Cancel (Ctrl-C): the decoders are finalized and the prompt
    process is stopped before the cancel propagates.
    """
    import numpy as np

    dims = _resolve(args)
    layers, nblocks, nreq = dims["layers"], dims["blocks"], dims["request_blocks"]
    block_shape = (dims["block_tokens"], dims["heads"], dims["head_dim"])
    rng = random.Random(args.seed)
    src_ids = rng.sample(range(nblocks), nreq)
    dst_ids = rng.sample(range(nblocks), nreq)
    corrupt = None
    if args.corrupt_one_byte:
        tensor = rng.randrange(2 * layers)
        corrupt = (tensor, rng.choice(src_ids), rng.randrange(2 * int(np.prod(block_shape))))
    spec = PromptSpec(
        num_tensors=2 * layers,
        num_blocks=nblocks,
        block_shape=block_shape,
        dtype="fp16",
        model_id=0,
        seed=args.seed,
        allocate=True,
        corrupt=corrupt,
    )
    bb = spec.block_bytes
    request_bytes = nreq * 2 * layers * bb
    shape_name = "llama8b-fp16" if block_shape == (128, 8, 128) else "custom"
    if args.small and all(getattr(args, k) is None for k in _FULL):
        shape_name = "small"
    print("aiodatadist demo: a prompt process and a decoder process exchange KV-cache blocks")
    print(
        f"  cache    {shape_name} layout: {layers} layers x K,V = {2 * layers} tensors of "
        f"[{nblocks}, {', '.join(map(str, block_shape))}] fp16, {_mib(bb)} per block per "
        f"tensor: {_mib(spec.cache_bytes)} per side"
    )
    fill = Progress("prompt: filling cache", spec.num_tensors, enabled=args.progress)
    t0 = time.perf_counter()
    peer = PeerProcess(
        spec,
        cluster_id=PROMPT_ID,
        start_timeout=max(60.0, spec.cache_bytes / 50e6),
        progress=lambda _stage, done, total: fill.update(done, total),
    )
    async with peer:
        fill.close()
        host, port = peer.address
        print(
            f"  prompt   pid {peer.pid}, cluster {PROMPT_ID}, listening on {host}:{port}; "
            f"cache in shared memory, filled with a seeded pattern (seed {args.seed}) "
            f"in {time.perf_counter() - t0:.1f} s"
        )
        print(
            f"  decoder  pid {os.getpid()} (this process), one link per data path, "
            f"aiodatadist.DataPath forced on each"
        )
        print(
            f"  request  {nreq} random prompt blocks -> {nreq} random decoder blocks, pulled "
            f"layer by layer: {layers} pulls x 2 tensors x {nreq} blocks = {_mib(request_bytes)}"
        )
        if corrupt is not None:
            print(
                f"  corrupt  the prompt flipped byte {corrupt[2]} of block {corrupt[1]} of "
                f"tensor {corrupt[0]} after filling: verification must fail"
            )
        # The decoder's cache on huge-page-advised memory, as a serving process would have it.
        dst = list(host_buffer((spec.num_tensors, *spec.desc().shape), np.float16))
        results = []
        for i, path in enumerate(args.paths):
            results.append(
                await _run_path(
                    args, path, DECODER_BASE_ID + i, peer, spec, dst, src_ids, dst_ids, layers
                )
            )
    return _report(results, request_bytes)


async def _run_path(
    args: argparse.Namespace,
    path: str,
    cluster_id: int,
    peer: PeerProcess,
    spec: PromptSpec,
    dst: list[Any],
    src_ids: list[int],
    dst_ids: list[int],
    layers: int,
) -> PathResult:
    """One decoder instance forced to ``path``: link, pull layer by layer, verify."""
    import numpy as np

    timeout_ms = max(1, int(args.timeout * 1000))
    dd = LLMDataDist(LLMRole.DECODER, cluster_id)
    await dd.init({OPT_DATA_PATH: path, OPT_SYNC_KV_TIMEOUT: str(timeout_ms)})
    try:
        cache = dd.cache_manager.register_blocks_cache(spec.desc(), dst)
        idx = np.asarray(dst_ids, dtype=np.intp)
        for t in dst:
            t[idx] = 0  # the previous path's bytes must not pass this path's check
        host, port = peer.address
        status, _ = await dd.link_clusters(
            [cluster_info(PROMPT_ID, host, port)], timeout=min(timeout_ms, 30_000)
        )
        if status != LLMStatusCode.LLM_SUCCESS:
            return PathResult(path, "error", f"link_clusters failed: {status.name}")
        link_path = dd.links[0].data_path if dd.links else "?"
        result = PathResult(path, "ok", link_path=link_path)
        for rnd in range(args.rounds):
            if rnd:
                for t in dst:
                    t[idx] = 0
            try:
                seconds, pulls = await _pull_layers(args, dd, cache, spec, src_ids, dst_ids, layers)
            except LLMException as e:
                if e.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED:
                    return PathResult(path, "unavailable", str(e), link_path=link_path)
                return PathResult(path, "error", f"{type(e).__name__}: {e}", link_path=link_path)
            result.rounds.append(seconds)
            result.pull_seconds += pulls
            result.nbytes = len(src_ids) * 2 * layers * spec.block_bytes
            bad = _verify(args, path, dst, spec, src_ids, dst_ids)
            if bad:
                result.status = "mismatch"
                result.mismatches = bad
                break
        return result
    finally:
        await dd.finalize()


async def _pull_layers(
    args: argparse.Namespace,
    dd: LLMDataDist,
    cache: Any,
    spec: PromptSpec,
    src_ids: list[int],
    dst_ids: list[int],
    layers: int,
) -> tuple[float, list[float]]:
    """The request, one pull per layer; returns (seconds, seconds per pull)."""
    key = BlocksCacheKey(PROMPT_ID, spec.model_id)
    cm = dd.cache_manager
    pulls: list[float] = []
    with Progress(f"{dd.options.data_path}: pulling layers", layers, enabled=args.progress) as bar:
        t0 = time.perf_counter()
        for layer in range(layers):
            t = time.perf_counter()
            await cm.pull_blocks(
                key,
                cache,
                src_ids,
                dst_ids,
                src_layer_range=range(layer, layer + 1),
                dst_layer_range=range(layer, layer + 1),
                tensor_num_per_layer=2,
                timeout=args.timeout,
            )
            pulls.append(time.perf_counter() - t)
            bar.update(layer + 1)
        return time.perf_counter() - t0, pulls


def _verify(
    args: argparse.Namespace,
    path: str,
    dst: list[Any],
    spec: PromptSpec,
    src_ids: list[int],
    dst_ids: list[int],
) -> list[Mismatch]:
    """Every pulled byte against the pattern, tensor by tensor."""
    bad: list[Mismatch] = []
    with Progress(f"{path}: verifying", spec.num_tensors, enabled=args.progress) as bar:
        for t in range(spec.num_tensors):
            bad += pattern_mismatches(dst, src_ids, dst_ids, spec.seed, [(t, t)], limit=10)
            bar.update(t + 1)
    return bad


def _report(results: list[PathResult], request_bytes: int) -> int:
    print()
    print(f"  {'path':<5} {'pulls':>5} {'bytes/round':>11} {'first round':>20} "
          f"{'warm (best)':>20} {'per pull':>9}  verified")  # fmt: skip
    for r in results:
        if r.status in ("ok", "mismatch") and r.rounds:
            med = statistics.median(r.pull_seconds) * 1000
            verdict = "MISMATCH"
            if r.status == "ok":
                verdict = f"OK ({len(r.rounds)} x {r.nbytes} bytes)"
            first = f"{r.gbps(0):6.2f} GB/s {r.rounds[0]:.3f} s"
            best = max(range(len(r.rounds)), key=r.gbps)
            warm = "-" if len(r.rounds) < 2 else f"{r.gbps(best):6.2f} GB/s {r.rounds[best]:.3f} s"
            print(
                f"  {r.path:<5} {len(r.pull_seconds):>5} {_mib(r.nbytes):>11} {first:>20} "
                f"{warm:>20} {med:>6.2f} ms  {verdict}"
            )
        else:
            print(f"  {r.path:<5} {r.status}: {r.detail}")
    print()
    for r in results:
        for m in r.mismatches:
            print(f"MISMATCH on {r.path}: {m}")
    ok = [r for r in results if r.status == "ok"]
    bad = [r for r in results if r.status in ("mismatch", "error")]
    if bad:
        names = ", ".join(f"{r.path} ({r.status})" for r in bad)
        print(f"FAILED: {names}")
        return 1
    if not ok:
        print("FAILED: no data path worked here (see `aiodatadist doctor`)")
        return 1
    total = sum(r.nbytes * len(r.rounds) for r in ok)
    print(
        f"verified: every pulled byte matches the prompt's on {', '.join(r.path for r in ok)} "
        f"({len(ok)} path{'s' if len(ok) > 1 else ''}, {_mib(total)})"
    )
    return 0
