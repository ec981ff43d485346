"""The ``aiodatadist`` command line (also ``python -m aiodatadist``): arguments and dispatch.

``DESCRIPTION`` is what ``aiodatadist --help`` says about it; each command's parser
describes the command (``demo``, ``bench``, ``doctor``). The commands live in their own
modules, imported only when run (so ``--help`` stays fast); they never import this one.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence

from .._options import DataPath

__all__ = ["DESCRIPTION", "build_parser", "main"]

# What ``aiodatadist --help`` prints above the commands: plain text (no reST markup).
DESCRIPTION = """\
Moves paged KV-cache blocks between LLM inference processes (asyncio, LLM-DataDist API).

Start with 'aiodatadist doctor' (which data paths work on this machine, and why not)
and 'aiodatadist demo --small' (two processes exchange a KV cache, every byte verified).
'aiodatadist COMMAND --help' describes a command's options.
"""


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def _path_list(choices: Sequence[DataPath]) -> Callable[[str], list[DataPath]]:
    def parse(text: str) -> list[DataPath]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in choices]
        if not out or bad:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {','.join(choices)}, got {text!r}"
            )
        return [DataPath(x) for x in out]

    return parse


def _progress_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw progress bars on stderr (default: when stderr is a terminal)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``aiodatadist`` command."""
    from .._version import __version__
    from .workloads import DEFAULT_SEED, WORKLOADS

    parser = argparse.ArgumentParser(
        prog="aiodatadist",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="a prompt process and a decoder process exchange KV blocks, verified",
        description="A prompt process fills an llama8b-fp16-shaped blocks cache with seeded "
        "data; the decoder (this process) pulls a request's blocks layer by layer over "
        "each data path that works here (shm, cma, tcp; one link per path), verifies "
        "every byte and prints the bandwidth per path. Exit status 1 on any mismatch.",
    )
    demo.add_argument("--small", action="store_true", help="a tiny cache (the small workload)")
    demo.add_argument("--layers", type=int, help="layers (x K,V tensors); default 32")
    demo.add_argument("--blocks", type=int, help="blocks per tensor on each side; default 64")
    demo.add_argument(
        "--request-blocks", type=int, help="blocks the request pulls (random); default 32"
    )
    demo.add_argument("--block-tokens", type=int, help="tokens per block; default 128")
    demo.add_argument("--heads", type=int, help="KV heads; default 8")
    demo.add_argument("--head-dim", type=int, help="head dimension; default 128")
    demo.add_argument(
        "--paths",
        type=_path_list(DataPath.remote()),
        default=list(DataPath.remote()),
        help="data paths to try (default shm,cma,tcp)",
    )
    demo.add_argument("--seed", type=int, default=7, help="seed of the data and the request")
    demo.add_argument("--timeout", type=float, default=60.0, help="seconds per pull")
    demo.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="times the request runs on each path, verified each time; the first "
        "round maps the prompt's memory and faults its pages in (default 2)",
    )
    demo.add_argument("--corrupt-one-byte", action="store_true", help=argparse.SUPPRESS)
    _progress_flag(demo)

    bench = sub.add_parser(
        "bench",
        help="standard workloads over every data path, against the native mover",
        description="Pulls (all layers, random non-contiguous blocks) of the standard "
        "workloads through the engine over every data path that works here, against "
        "the native mover alone (aiodatadist._native.copy_local on the same plan, into "
        "the same destination), measured in the same run, alternated with the engine. "
        "The plain-C baselines, the huge-page accounting and the plots are the source "
        "tree's bench/ scripts (bench/README.md).",
    )
    bench.add_argument("--quick", action="store_true", help="a small, fast run (for tests)")
    bench.add_argument(
        "--workload",
        action="append",
        choices=list(WORKLOADS),
        help="workloads to run (repeatable; default all)",
    )
    bench.add_argument(
        "--paths",
        type=_path_list((DataPath.INPROC, *DataPath.remote())),
        default=None,
        help="data paths (default inproc,shm,cma,tcp)",
    )
    bench.add_argument(
        "--blocks-per-pull",
        type=_int_list,
        default=None,
        help="comma-separated blocks per pull (default 1,4,16,64; --quick 1,4)",
    )
    bench.add_argument("--repeats", type=int, default=None, help="timed samples (default 5)")
    bench.add_argument(
        "--baseline",
        choices=["native"],
        default="native",
        help="native: the native mover on the same plan (the only baseline here; "
        "bench/bench_paths.py compares with plain-C movers)",
    )
    bench.add_argument("--seed", type=int, default=DEFAULT_SEED)
    bench.add_argument(
        "--json", metavar="PATH", help="write the results as JSON (bench/plot.py draws them)"
    )
    _progress_flag(bench)

    doctor = sub.add_parser(
        "doctor",
        help="which data paths work here, and why not; versions and limits",
        description="Probes every data path (inproc, shm, cma, tcp) and says why one that "
        "does not work does not. Exit status 0 when at least one cross-process path works.",
    )
    doctor.add_argument(
        "--json", metavar="PATH", help="also write the report as JSON ('-': stdout)"
    )
    doctor.add_argument(
        "--no-pull",
        dest="pull",
        action="store_false",
        help="skip the end-to-end pull through a prompt process on each path",
    )
    doctor.add_argument(
        "--clean",
        action="store_true",
        help="remove the segments in /dev/shm that dead processes left (aiodd-PID-*; "
        "only those whose process is gone)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import run_demo

            return asyncio.run(run_demo(args))
        if args.command == "bench":
            from .bench import run_bench

            return asyncio.run(run_bench(args))
        if args.command == "doctor":
            from .doctor import run_doctor

            return asyncio.run(run_doctor(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as e:  # LLMException is a RuntimeError
        print(f"aiodatadist {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 2  # pragma: no cover - argparse refuses other commands
