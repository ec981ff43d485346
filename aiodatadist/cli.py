"""``aiodatadist`` command line: ``demo`` (more commands come with the front-door work)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]


async def _demo(args: argparse.Namespace) -> int:
    import numpy as np

    from .testing import inproc_pair

    async with inproc_pair() as pair:
        shape = (args.block_tokens, args.heads, args.head_dim)
        src = pair.prompt_cache(
            num_tensors=2 * args.layers,
            num_blocks=args.blocks,
            block_shape=shape,
            allocate=True,
            seed=7,
        )
        dst = pair.decoder_cache(
            num_tensors=2 * args.layers, num_blocks=args.blocks, block_shape=shape
        )
        rng = np.random.default_rng(0)
        n = min(args.request_blocks, args.blocks)
        src_ids = sorted(rng.choice(args.blocks, n, replace=False).tolist())
        dst_ids = rng.permutation(args.blocks)[:n].tolist()
        nbytes = 0
        t0 = time.perf_counter()
        for layer in range(args.layers):
            await pair.decoder.cache_manager.pull_blocks(
                pair.key(),
                dst.cache,
                src_ids,
                dst_ids,
                src_layer_range=range(layer, layer + 1),
                dst_layer_range=range(layer, layer + 1),
                timeout=10,
            )
            nbytes += 2 * n * src.tensors[0][0].nbytes
        dt = time.perf_counter() - t0
        bad = sum(
            not np.array_equal(dst.tensors[t][d].view(np.uint8), src.tensors[t][s].view(np.uint8))
            for t in range(2 * args.layers)
            for s, d in zip(src_ids, dst_ids, strict=True)
        )
        print(
            f"inproc: pulled {n} blocks x {args.layers} layers layer by layer, "
            f"{nbytes / 2**20:.1f} MiB in {dt * 1000:.1f} ms "
            f"({nbytes / dt / 1e9:.2f} GB/s), mismatched blocks: {bad}"
        )
        return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiodatadist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a prompt and a decoder exchange KV blocks, verified")
    demo.add_argument("--layers", type=int, default=32)
    demo.add_argument("--blocks", type=int, default=64)
    demo.add_argument("--request-blocks", type=int, default=16)
    demo.add_argument("--block-tokens", type=int, default=128)
    demo.add_argument("--heads", type=int, default=8)
    demo.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return asyncio.run(_demo(args))
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
