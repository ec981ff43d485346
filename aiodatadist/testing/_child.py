"""The child side of the one peer process (:mod:`aiodatadist.testing.peer`).

``python -P -m aiodatadist.testing`` runs :func:`main`: one instance, the optional
:class:`~aiodatadist.testing.caches.PromptSpec` cache, a suite's :class:`PeerCommands`
plugin, then JSON-line commands on stdin (and with ``--control`` on a loopback TCP port)
until stdin's EOF, ``quit`` or SIGTERM. The protocol is described in
:mod:`aiodatadist.testing.peer`, whose :class:`~aiodatadist.testing.peer.PeerProcess`
builds this command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

from ..datadist import LLMDataDist
from ..errors import LLMException
from ..types import LLMRole
from .caches import PromptSpec, make_blocks_cache
from .patterns import fill_pattern

__all__ = ["PeerCommands", "main"]


class PeerCommands:
    """The base of a test's commands in the peer process (``--plugin``).

    A subclass named ``Commands`` (or the ``:Name`` of ``--plugin``) is built once the
    instance is initialized; each ``async def cmd_NAME(self, c) -> dict`` method answers
    ``{"cmd": "NAME", ...}`` (``c`` is the whole command), ahead of the built-in commands
    (``pid``, ``quit``). A reply is a dict with ``ok``; an ``LLMException`` a command
    raises is answered ``{"ok": false, "status": code, "error": ...}``, any other
    exception ``{"ok": false, "error": ..., "tb": ...}``.

    Attributes:
        dd: the instance (initialized).
        config: the plugin's configuration (``PeerProcess(plugin_config=...)``).
    """

    def __init__(self, dd: LLMDataDist, config: dict[str, Any]) -> None:
        self.dd = dd
        self.config = config

    async def start(self) -> dict[str, Any]:
        """Runs before the ``ready`` line; returns fields to add to it."""
        return {}

    async def close(self) -> None:
        """Runs after the last command, before the instance is finalized."""


def _emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _read_stdin(loop: asyncio.AbstractEventLoop, lines: asyncio.Queue[bytes | None]) -> None:
    """Queues stdin's lines (from a daemon thread: any kind of stdin), then None at EOF.

    The thread reads the file descriptor itself (``os.read``), never ``sys.stdin``: a
    daemon thread blocked inside the buffered reader holds its lock, and the interpreter's
    shutdown then aborts the process trying to take it ("could not acquire lock for
    <stdin> at interpreter shutdown"), once in a while, when it exits mid-read.
    """

    def put(line: bytes | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(lines.put_nowait, line)

    def run() -> None:
        pending = b""
        with contextlib.suppress(OSError, ValueError):
            fd = sys.stdin.fileno()
            while chunk := os.read(fd, 65536):
                pending += chunk
                *whole, pending = pending.split(b"\n")
                for line in whole:
                    put(line + b"\n")
        if pending:
            put(pending)
        put(None)

    threading.Thread(target=run, name="aiodatadist-peer-stdin", daemon=True).start()


def _load_plugin(ref: str) -> type[PeerCommands]:
    where, _, name = ref.partition(":")
    if where.endswith(".py"):
        mod_name = "_aiodatadist_peer_plugin_" + os.path.basename(where)[:-3]
        spec = importlib.util.spec_from_file_location(mod_name, where)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load the plugin file {where!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    cls = getattr(module, name or "Commands")
    if not (isinstance(cls, type) and issubclass(cls, PeerCommands)):
        raise TypeError(f"{ref}: not a PeerCommands subclass")
    return cls


def _serve_spec(dd: LLMDataDist, spec: PromptSpec) -> tuple[Any, dict[str, Any]]:
    kw: dict[str, Any] = {
        "num_tensors": spec.num_tensors,
        "num_blocks": spec.num_blocks,
        "block_shape": spec.block_shape,
        "data_type": spec.data_type,
        "model_id": spec.model_id,
    }
    # Registered memory is what a serving process would register: anonymous,
    # 2 MiB-aligned and madvise(MADV_HUGEPAGE)'d (host_buffer), so the cma path is not
    # slowed down by 4 KiB pages.
    in_shm = spec.allocate
    try:
        filled = make_blocks_cache(dd, allocate=spec.allocate, huge_pages=True, **kw)
    except LLMException as e:
        if not spec.allocate:
            raise
        # No usable shared memory here: serve registered memory (cma and tcp still apply).
        print(f"aiodatadist peer: allocate failed ({e}); registering", file=sys.stderr)
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
    memory = "posix-shm" if in_shm else "anon-madv-hugepage"
    return filled, {"cache_bytes": spec.cache_bytes, "shm": in_shm, "memory": memory}


async def _answer(plugin: PeerCommands | None, c: dict[str, Any]) -> dict[str, Any]:
    name = str(c.get("cmd"))
    fn = getattr(plugin, "cmd_" + name, None) if plugin is not None else None
    if fn is None and name == "pid":
        return {"ok": True, "pid": os.getpid()}
    if fn is None:
        return {"ok": False, "error": f"unknown command {c.get('cmd')!r}"}
    try:
        return dict(await fn(c))
    except LLMException as e:
        return {"ok": False, "status": int(e.status_code), "error": str(e)}
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}


async def _converse(
    plugin: PeerCommands | None, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Answers the commands of one control connection, in order, until it closes."""
    try:
        while line := await reader.readline():
            c = json.loads(line)
            reply = {**await _answer(plugin, c), "cmd": c.get("cmd")}
            writer.write((json.dumps(reply) + "\n").encode())
            await writer.drain()
    except (OSError, ValueError):
        pass
    finally:
        writer.close()


async def _serve(args: argparse.Namespace) -> int:
    options = {"llm.listenIpInfo": args.listen} if args.listen else {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--option wants KEY=VALUE, got {item!r}")
        options[key] = value
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    lines: asyncio.Queue[bytes | None] = asyncio.Queue()
    _read_stdin(loop, lines)

    role = LLMRole.PROMPT if args.role == "prompt" else LLMRole.DECODER
    dd = LLMDataDist(role, args.cluster_id)
    await dd.init(options)
    plugin: PeerCommands | None = None
    try:
        ready: dict[str, Any] = {}
        filled = None
        server: asyncio.Server | None = None
        if args.spec:
            filled, ready = _serve_spec(dd, PromptSpec.from_json(args.spec))
        if args.plugin:
            plugin = _load_plugin(args.plugin)(dd, json.loads(args.plugin_config or "{}"))
            ready.update(await plugin.start())
        if args.control:
            server = await asyncio.start_server(
                lambda r, w: _converse(plugin, r, w), "127.0.0.1", 0
            )
            ready["control"] = server.sockets[0].getsockname()[1]
        address = dd.listen_address
        _emit(
            event="ready",
            host=None if address is None else address[0],
            port=None if address is None else address[1],
            pid=os.getpid(),
            cluster_id=dd.cluster_id,
            **ready,
        )
        stopped = loop.create_task(stop.wait())
        try:
            while True:
                get = loop.create_task(lines.get())
                await asyncio.wait({get, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    break
                line = get.result()
                if line is None or line.strip() == b"quit":
                    break
                try:
                    c = json.loads(line)
                except ValueError:
                    _emit(ok=False, error=f"not a JSON command: {line[:200]!r}")
                    continue
                if c.get("cmd") == "quit":
                    _emit(ok=True, cmd="quit")
                    break
                _emit(**{**await _answer(plugin, c), "cmd": c.get("cmd")})
        finally:
            stopped.cancel()
            if server is not None:
                server.close()
        del filled
    finally:
        try:
            if plugin is not None:
                await plugin.close()
        finally:
            await dd.finalize()
    _emit(event="bye")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The peer process's entry point (``python -m aiodatadist.testing``)."""
    parser = argparse.ArgumentParser(prog="python -m aiodatadist.testing", description=__doc__)
    parser.add_argument("--role", choices=["prompt", "decoder"], default="prompt")
    parser.add_argument("--cluster-id", type=int, default=1)
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any)")
    parser.add_argument("--spec", default="", help="a PromptSpec as JSON: the cache to serve")
    parser.add_argument("--plugin", default="", help="MODULE_OR_FILE[:NAME]: test commands")
    parser.add_argument("--plugin-config", default="", help="the plugin's JSON configuration")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE init option")
    parser.add_argument("--control", action="store_true", help="also answer on a TCP port")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(_serve(args))
    except (Exception, KeyboardInterrupt) as e:  # report to the parent, which may be waiting
        traceback.print_exc()
        _emit(event="error", error=f"{type(e).__name__}: {e}")
        return 1
