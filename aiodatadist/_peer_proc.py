"""A prompt process for cross-process pairs: ``python -m aiodatadist._peer_proc ...``.

Started by :class:`aiodatadist.testing.PeerProcess` (the demo, the bench, the pytest
fixtures). It initializes a PROMPT ``LLMDataDist`` listening on loopback, allocates
(or registers, on huge-page-advised memory: ``testing.host_buffer``) one blocks
cache described by a :class:`~aiodatadist.testing.PromptSpec`, fills it with the
seeded pattern, optionally flips one byte, and then serves links until its stdin
reaches EOF, it reads a ``quit`` line, or it gets SIGTERM.

It speaks JSON lines on stdout::

    {"event": "progress", "stage": "fill", "done": 3, "total": 64}
    {"event": "ready", "host": "127.0.0.1", "port": 40123, "pid": 1234, "cluster_id": 1,
     "cache_bytes": 8388608, "shm": true, "memory": "posix-shm"}
    {"event": "error", "error": "..."}
    {"event": "bye"}

Its stdin is the lifeline: when the parent dies, the pipe closes and this exits.

Every Python process the package starts (this one, the doctor's probes) is started with
:func:`python_argv` and :func:`python_env`, so that it imports the same aiodatadist as its
parent, whatever its current directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import site
import sys
import sysconfig
import threading
from collections.abc import Mapping, Sequence
from typing import Any

# The directory that holds the aiodatadist package this process imported.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_argv(*args: str) -> list[str]:
    """The command line of a Python child process: this interpreter, ``-P``, ``args``.

    ``-P`` (Python >= 3.11): the child's current directory (``-m``, ``-c``) does not go
    first on its ``sys.path``; from a source checkout's root it would otherwise import
    the checkout's ``aiodatadist/`` instead of the installation its parent uses.
    """
    return [sys.executable, "-P", *args]


def _site_dirs() -> set[str]:
    dirs = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    with contextlib.suppress(AttributeError):  # site may be trimmed (embedded Pythons)
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    return {os.path.realpath(d) for d in dirs if d}


def python_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a Python child: ours, ``extra``, and our package's location.

    The child must import the aiodatadist its parent imported. From a site-packages
    directory (an installed wheel) it does by itself, with :func:`python_argv`'s ``-P``;
    from anywhere else (a source tree that is built in place or editable-installed, a
    directory the parent put on ``sys.path``) that directory goes first on the child's
    ``PYTHONPATH``. A site directory is never put there: ahead of the standard library it
    could shadow it.
    """
    env = {**os.environ, **(extra or {})}
    if os.path.realpath(_PACKAGE_ROOT) not in _site_dirs():
        rest = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + rest if rest else "")
    return env


def _emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _watch_stdin(loop: asyncio.AbstractEventLoop, done: asyncio.Event) -> None:
    """Sets ``done`` (from a daemon thread) at EOF or on a ``quit`` line."""

    def run() -> None:
        try:
            for line in sys.stdin.buffer:
                if line.strip() == b"quit":
                    break
        except (OSError, ValueError):
            pass
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(done.set)

    threading.Thread(target=run, name="aiodatadist-peer-stdin", daemon=True).start()


async def _serve(args: argparse.Namespace) -> int:
    from .datadist import LLMDataDist
    from .errors import LLMException
    from .testing import PromptSpec, fill_pattern, make_blocks_cache
    from .types import LLMRole

    spec = PromptSpec.from_json(args.spec)
    options = {"llm.listenIpInfo": args.listen}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--option wants KEY=VALUE, got {item!r}")
        options[key] = value
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    _watch_stdin(loop, stop)

    dd = LLMDataDist(LLMRole.PROMPT, args.cluster_id)
    await dd.init(options)
    try:
        kw: dict[str, Any] = {
            "num_tensors": spec.num_tensors,
            "num_blocks": spec.num_blocks,
            "block_shape": spec.block_shape,
            "data_type": spec.data_type,
            "model_id": spec.model_id,
        }
        # Registered memory is what a serving process would register: anonymous,
        # 2 MiB-aligned and madvise(MADV_HUGEPAGE)'d (testing.host_buffer), so the cma
        # path is not slowed down by 4 KiB pages.
        in_shm = spec.allocate
        try:
            filled = make_blocks_cache(dd, allocate=spec.allocate, huge_pages=True, **kw)
        except LLMException as e:
            if not spec.allocate:
                raise
            # No usable shared memory here: serve registered memory (cma and tcp still apply).
            print(f"aiodatadist._peer_proc: allocate failed ({e}); registering", file=sys.stderr)
            filled = make_blocks_cache(dd, allocate=False, huge_pages=True, **kw)
            in_shm = False
        every = max(1, spec.num_tensors // 50)

        def progress(done: int, total: int) -> None:
            if done % every == 0 or done == total:
                _emit(event="progress", stage="fill", done=done, total=total)

        fill_pattern(filled.tensors, spec.seed, progress)
        if spec.corrupt is not None:
            t, b, off = spec.corrupt
            raw = filled.tensors[t].view("uint8").reshape(spec.num_blocks, -1)
            raw[b, off] ^= 0xFF
        address = dd.listen_address
        assert address is not None
        _emit(
            event="ready",
            host=address[0],
            port=address[1],
            pid=os.getpid(),
            cluster_id=dd.cluster_id,
            cache_bytes=spec.cache_bytes,
            shm=in_shm,
            memory="posix-shm" if in_shm else "anon-madv-hugepage",
        )
        await stop.wait()
        del filled
    finally:
        await dd.finalize()
    _emit(event="bye")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiodatadist._peer_proc", description=__doc__)
    parser.add_argument("--cluster-id", type=int, default=1)
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any)")
    parser.add_argument("--spec", required=True, help="a PromptSpec as JSON")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE init option")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(_serve(args))
    except (Exception, KeyboardInterrupt) as e:  # report to the parent, which is waiting
        _emit(event="error", error=f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
