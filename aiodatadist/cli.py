"""The ``aiodatadist`` command line (also ``python -m aiodatadist``).

``DESCRIPTION`` is what ``aiodatadist --help`` says about it; each command's parser
describes the command (``demo``, ``bench``, ``doctor``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

__all__ = ["DESCRIPTION", "Progress", "main"]

# What ``aiodatadist --help`` prints above the commands: plain text (no reST markup).
DESCRIPTION = """\
Moves paged KV-cache blocks between LLM inference processes (asyncio, LLM-DataDist API).

Start with 'aiodatadist doctor' (which data paths work on this machine, and why not)
and 'aiodatadist demo --small' (two processes exchange a KV cache, every byte verified).
'aiodatadist COMMAND --help' describes a command's options.
"""


class Progress:
    """A one-line progress bar on stderr (drawn only when it is a terminal).

    Args:
        label: what is progressing.
        total: the count at completion.
        enabled: draw it; None = when ``stream`` is a terminal.
    """

    WIDTH = 28

    def __init__(
        self,
        label: str,
        total: int,
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label = label
        self.total = max(1, total)
        self.done = 0
        self._t0 = time.perf_counter()
        self._last = 0.0
        self._drawn = False

    def update(self, done: int, total: int | None = None) -> None:
        """Sets the count (redraws at most 20 times a second, and at completion)."""
        if total is not None:
            self.total = max(1, total)
        self.done = min(done, self.total)
        now = time.perf_counter()
        if self.enabled and (now - self._last >= 0.05 or self.done == self.total):
            self._last = now
            self._draw(now)

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total
        fill = int(frac * self.WIDTH)
        bar = "#" * fill + "." * (self.WIDTH - fill)
        self.stream.write(
            f"\r{self.label:<24} [{bar}] {frac * 100:5.1f}% "
            f"{self.done}/{self.total} {now - self._t0:6.1f}s"
        )
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Ends the line (clears it). Idempotent."""
        if self._drawn:
            self.stream.write("\r" + " " * (self.WIDTH + 60) + "\r")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _path_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in choices]
        if not out or bad:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {','.join(choices)}, got {text!r}"
            )
        return out

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
    from ._version import __version__

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
        type=_path_list(("shm", "cma", "tcp")),
        default=["shm", "cma", "tcp"],
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
        help="standard workloads over every data path, against baselines",
        description="Pulls (all layers, random non-contiguous blocks) of the standard "
        "workloads through the engine over every data path that works here, against "
        "baselines measured in the same run: the plain-C baselines of bench/c (built on "
        "demand with cc) or, without them, the native local mover alone.",
    )
    bench.add_argument("--quick", action="store_true", help="a small, fast run (for tests)")
    bench.add_argument(
        "--workload",
        action="append",
        choices=["llama8b-fp16", "small", "mla-like"],
        help="workloads to run (repeatable; default all)",
    )
    bench.add_argument(
        "--paths",
        type=_path_list(("inproc", "shm", "cma", "tcp")),
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
        choices=["auto", "c", "native"],
        default="auto",
        help="auto: the C baselines when they can be built, else the native mover",
    )
    bench.add_argument("--seed", type=int, default=20240601)
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
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
            from ._cli_demo import run_demo

            return asyncio.run(run_demo(args))
        if args.command == "bench":
            from ._cli_bench import run_bench

            return asyncio.run(run_bench(args))
        if args.command == "doctor":
            from ._cli_doctor import run_doctor

            return asyncio.run(run_doctor(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as e:  # LLMException is a RuntimeError
        print(f"aiodatadist {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 2  # pragma: no cover - argparse refuses other commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
