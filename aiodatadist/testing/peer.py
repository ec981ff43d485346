"""The one peer process: an ``LLMDataDist`` in a child process that obeys JSON-line commands.

Every test suite, the demo, the bench and the doctor start their other process here.
The parent side is :class:`PeerProcess`; the child is ``python -P -m aiodatadist.testing``
(:mod:`aiodatadist.testing._child`), which

1. initializes one instance (``--role``, ``--cluster-id``, listening on ``--listen``
   unless it is empty, ``--option KEY=VALUE`` init options);
2. with ``--spec``, allocates (or registers on huge-page-advised memory:
   :func:`~aiodatadist.testing.caches.host_buffer`) the blocks cache a
   :class:`~aiodatadist.testing.caches.PromptSpec` describes, fills it with the seeded
   pattern and optionally flips one byte;
3. with ``--plugin MODULE_OR_FILE[:NAME]`` (default name ``Commands``), builds the
   test's ``PeerCommands`` subclass (``--plugin-config`` is its JSON configuration):
   a suite's own commands and caches live there, not in a second process harness;
4. prints one ``ready`` line, then answers one JSON command per stdin line with one
   JSON line, in order, until its stdin reaches EOF (its lifeline: when the parent
   dies, the pipe closes and the child exits), it reads ``quit`` or
   ``{"cmd": "quit"}``, or it gets SIGTERM / SIGINT. With ``--control`` it also
   answers commands on a loopback TCP port (``"control"`` in the ``ready`` line), on
   any number of connections at once, so that tests on any event loop, or a process
   started without one, can talk to it.

What it prints on stdout, one JSON object a line::

    {"event": "progress", "stage": "fill", "done": 3, "total": 64}
    {"event": "ready", "host": "127.0.0.1", "port": 40123, "pid": 1234, "cluster_id": 1,
     "cache_bytes": 8388608, "shm": true, "memory": "posix-shm", ...the plugin's fields}
    {"event": "error", "error": "..."}       (it could not start)
    {"cmd": "pid", "ok": true, "pid": 1234}  (a reply: "ok", and on failure "status"
                                             for an LLMException, else "error")
    {"event": "bye"}

Every Python process the package starts (this one, the doctor's probes) is started with
:func:`python_argv` and :func:`python_env`, so that it imports the same aiodatadist as its
parent, whatever its current directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import select
import signal
import site
import subprocess
import sys
import sysconfig
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from ..types import LLMRole
from .caches import PromptSpec

__all__ = ["PeerControl", "PeerProcess", "python_argv", "python_env"]

log = logging.getLogger("aiodatadist.testing")

# The directory that holds the aiodatadist package this process imported.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CHILD_MODULE = "aiodatadist.testing"


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


def _kill_quietly(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


class PeerProcess:
    """An ``LLMDataDist`` in a subprocess (by default a prompt serving one pattern-filled
    blocks cache), driven by JSON-line commands.

    ``async with PeerProcess(spec) as peer:`` starts it (``python -m aiodatadist.testing``)
    and waits until it is ready (listening on loopback); the exit stops it (SIGKILL if it
    does not stop in time). :meth:`call` sends one command and returns its reply.

    A process that must outlive the event loop that started it (a module-scoped fixture
    whose tests run on several loops) is started with :meth:`start_blocking` instead
    (no event loop: its commands then go over the control port, :meth:`connect`) and
    stopped with :meth:`stop_blocking`.

    Args:
        spec: the cache it serves.
        cluster_id: its cluster id.
        options: extra ``init`` options (``llm.listenIpInfo`` is set from ``host``).
        env: extra environment variables (e.g. ``AIODATADIST_SECRET``).
        start_timeout: seconds to wait for it to be ready.
        progress: called with ``(stage, done, total)`` while it fills its cache.
        host: where it listens (on an ephemeral port); None: it does not listen.
        role: its role.
        serve_cache: False: it serves no ``spec`` cache (a plugin makes its own).
        plugin: a module name or ``.py`` file, optionally ``:Name``, whose
            ``PeerCommands`` subclass adds the test's commands in the child.
        plugin_config: that plugin's configuration (JSON-serializable).
        stderr: where its stderr goes (a file or descriptor); None: ours.
        prefix: words before its command line (``ip netns exec NS``).
        new_session: start it in its own session (a signal to our group misses it).
        drop_env: variables of our environment it does not inherit.
        control: it also answers commands on a loopback TCP port (``ready["control"]``).
    """

    def __init__(
        self,
        spec: PromptSpec | None = None,
        *,
        cluster_id: int = 1,
        options: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 60.0,
        progress: Callable[[str, int, int], None] | None = None,
        host: str | None = "127.0.0.1",
        role: LLMRole = LLMRole.PROMPT,
        serve_cache: bool = True,
        plugin: str | None = None,
        plugin_config: Mapping[str, Any] | None = None,
        stderr: Any = None,
        prefix: Sequence[str] = (),
        new_session: bool = False,
        drop_env: Sequence[str] = (),
        control: bool = False,
    ) -> None:
        self.spec = spec or PromptSpec()
        self.cluster_id = cluster_id
        self.options = dict(options or {})
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.progress = progress
        self.host = host
        self.role = role
        self.serve_cache = serve_cache
        self.plugin = plugin
        self.plugin_config = dict(plugin_config or {})
        self.stderr = stderr
        self.prefix = list(prefix)
        self.new_session = new_session
        self.drop_env = tuple(drop_env)
        self.control = control
        self.address: tuple[str, int] = ("", 0)
        self.ready: dict[str, Any] = {}
        self.pid = 0
        self.killed = False
        self._proc: asyncio.subprocess.Process | None = None
        self.popen: subprocess.Popen[bytes] | None = None  # started by start_blocking()

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (negative: killed by that signal), else None."""
        if self.popen is not None:
            return self.popen.poll()
        return None if self._proc is None else self._proc.returncode

    def argv(self) -> list[str]:
        """The command line that starts it."""
        # The child imports this installation, whatever the current directory (-P, PYTHONPATH).
        cmd = [*self.prefix, *python_argv("-m", _CHILD_MODULE)]
        cmd += ["--role", "prompt" if self.role == LLMRole.PROMPT else "decoder"]
        cmd += ["--cluster-id", str(self.cluster_id)]
        cmd += ["--listen", "" if self.host is None else f"{self.host}:0"]
        if self.serve_cache:
            cmd += ["--spec", self.spec.to_json()]
        if self.plugin is not None:
            cmd += ["--plugin", self.plugin, "--plugin-config", json.dumps(self.plugin_config)]
        if self.control:
            cmd += ["--control"]
        for k, v in self.options.items():
            cmd += ["--option", f"{k}={v}"]
        return cmd

    def environment(self) -> dict[str, str]:
        """The environment it starts with (:func:`python_env`, ``env``, less ``drop_env``)."""
        env = python_env({**self.env, "PYTHONUNBUFFERED": "1"})
        for name in self.drop_env:
            if name not in self.env:
                env.pop(name, None)
        return env

    async def start(self) -> tuple[str, int]:
        """Starts the process and waits until it is ready; returns its ``(host, port)``.

        Raises:
            RuntimeError: it exited or reported an error before it was ready.
            TimeoutError: it was not ready within ``start_timeout``; it is killed and
                reaped first.

        Cancel: the process is killed and reaped, then the cancel propagates.
        """
        if self._proc is not None or self.popen is not None:
            raise RuntimeError("the peer process was already started")
        # uvloop runs Python in the forked child before its exec (PyOS_AfterFork_Child),
        # where a garbage collection would finalize this process's objects in a copy
        # without their threads (an engine's, say): one such child segfaulted here, and
        # the parent aborted after it. CPython's subprocess disables the collector around
        # its fork the same way.
        collecting = gc.isenabled()
        gc.disable()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=self.stderr,
                env=self.environment(),
                start_new_session=self.new_session,
            )
        finally:
            if collecting:
                gc.enable()
        self._proc = proc
        self.pid = proc.pid
        ok = False
        try:
            async with asyncio.timeout(self.start_timeout):
                self.ready = await self._read_until_ready()
            if self.ready.get("port") is not None:
                self.address = (str(self.ready["host"]), int(self.ready["port"]))
            ok = True
            return self.address
        finally:
            if not ok:
                await self._reap(kill=True)

    async def _next(self) -> dict[str, Any]:
        """The next JSON object it prints (other lines are skipped: a stray print)."""
        assert self._proc is not None and self._proc.stdout is not None
        while True:
            line = await self._proc.stdout.readline()
            if not line:
                rc = await self._proc.wait()
                raise RuntimeError(f"the peer process exited ({rc})")
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    return event

    def _until_ready(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The ``ready`` event, or None for an event before it (progress is reported)."""
        kind = event.get("event")
        if kind == "progress" and self.progress is not None:
            self.progress(str(event["stage"]), int(event["done"]), int(event["total"]))
        elif kind == "error":
            raise RuntimeError(f"the peer process failed: {event.get('error')}")
        elif kind == "ready":
            return dict(event)
        return None

    async def _read_until_ready(self) -> dict[str, Any]:
        while True:
            try:
                event = await self._next()
            except RuntimeError as e:
                raise RuntimeError(f"{e} before it was ready") from None
            ready = self._until_ready(event)
            if ready is not None:
                return ready

    def start_blocking(self) -> tuple[str, int]:
        """:meth:`start` without an event loop: it blocks until the process is ready.

        The process then belongs to no loop: talk to it over its control port (made with
        ``control=True``; :meth:`connect`), from any loop; stop it with
        :meth:`stop_blocking`.

        Raises:
            RuntimeError: it exited or reported an error before it was ready.
            TimeoutError: it was not ready within ``start_timeout``.

        Whatever fails, the process is killed and reaped first.
        """
        if self._proc is not None or self.popen is not None:
            raise RuntimeError("the peer process was already started")
        self.popen = proc = subprocess.Popen(
            self.argv(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=self.environment(),
            start_new_session=self.new_session,
        )
        self.pid = proc.pid
        assert proc.stdout is not None
        end = time.monotonic() + self.start_timeout
        buf = b""
        try:
            while True:
                line, nl, rest = buf.partition(b"\n")
                if nl:
                    buf = rest
                    with contextlib.suppress(ValueError):
                        event = json.loads(line)
                        if isinstance(event, dict) and (ready := self._until_ready(event)):
                            self.ready = ready
                            break
                    continue
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the peer process was not ready in {self.start_timeout} s")
                if select.select([proc.stdout], [], [], left)[0]:
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    if not chunk:
                        rc = proc.wait(5)
                        raise RuntimeError(f"the peer process exited ({rc}) before it was ready")
                    buf += chunk
        except BaseException:
            self.stop_blocking(0)
            raise
        if self.ready.get("port") is not None:
            self.address = (str(self.ready["host"]), int(self.ready["port"]))
        return self.address

    def stop_blocking(self, timeout: float = 10.0) -> int | None:
        """:meth:`stop` for a process started by :meth:`start_blocking` (it blocks).

        Closes its stdin (it finalizes and exits); after ``timeout`` seconds, SIGKILL.
        Idempotent; never raises for the process's sake.
        """
        proc = self.popen
        if proc is None:
            return None
        try:
            if proc.poll() is None and proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout)
            if proc.poll() is None:
                self.kill()
                proc.wait()
        finally:
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
        return proc.returncode

    @contextlib.asynccontextmanager
    async def connect(self, timeout: float | None = None) -> AsyncIterator[PeerControl]:
        """A connection to its control port (``control=True``), on the running loop.

        Raises:
            RuntimeError: it has no control port.
            OSError, TimeoutError: no connection within ``timeout`` seconds.
        """
        if "control" not in self.ready:
            raise RuntimeError("the peer process has no control port (control=True)")
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", self.ready["control"])
        try:
            yield PeerControl(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await writer.wait_closed()

    async def send(self, cmd: str, **kw: Any) -> None:
        """Sends one command without waiting for its reply (:meth:`reply` reads it).

        Raises:
            RuntimeError: not started. OSError: its stdin is closed.
        """
        if self._proc is None or self._proc.stdin is None:
            raise RuntimeError("the peer process is not started")
        self._proc.stdin.write((json.dumps({"cmd": cmd, **kw}) + "\n").encode())
        await self._proc.stdin.drain()

    async def reply(self, timeout: float | None = None) -> dict[str, Any]:
        """The next reply (replies come in the order of the commands).

        Raises:
            RuntimeError: the process exited first.
            TimeoutError: none within ``timeout`` seconds.
        """
        async with asyncio.timeout(timeout):
            return await self._next()

    async def call(self, cmd: str, *, timeout: float | None = None, **kw: Any) -> dict[str, Any]:
        """Sends one command and returns its reply (see :meth:`send` and :meth:`reply`)."""
        await self.send(cmd, **kw)
        return await self.reply(timeout)

    def kill(self) -> None:
        """SIGKILLs the process now (a crash: no unlink, no goodbye). Idempotent."""
        if (self._proc is not None or self.popen is not None) and self.returncode is None:
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    async def wait_exit(self, timeout: float | None = None) -> int:
        """Waits for the process to exit; returns its exit status.

        Raises:
            TimeoutError: still running after ``timeout`` seconds (it keeps running).

        Cancel: stops waiting; the process keeps running.
        """
        async with asyncio.timeout(timeout):
            if self.popen is not None:
                # No loop watches a process started without one, and a thread blocked in
                # wait() would outlive a cancel: poll.
                while (rc := self.popen.poll()) is None:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                return rc
            assert self._proc is not None
            return await self._proc.wait()

    async def stop(self, timeout: float = 10.0) -> int | None:
        """Asks the process to finalize and exit (closes its stdin). Idempotent.

        Returns:
            Its exit status (negative: killed by that signal).

        Never raises for the process's sake. Timeout: after ``timeout`` seconds it is
        SIGKILLed and reaped. Cancel: it is SIGKILLed, then the cancel propagates.
        """
        return await self._reap(kill=False, timeout=timeout)

    async def _reap(self, *, kill: bool, timeout: float = 10.0) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        try:
            if kill:
                self.kill()
            elif proc.stdin is not None and not proc.stdin.is_closing():
                with contextlib.suppress(OSError):
                    proc.stdin.write(b"quit\n")
                proc.stdin.close()
            try:
                async with asyncio.timeout(timeout):
                    await proc.wait()
            except TimeoutError:
                log.warning("peer process %d did not stop in %.1f s: killed", proc.pid, timeout)
                self.kill()
                await proc.wait()
            if proc.stdout is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(timeout):
                        await proc.stdout.read()  # to EOF: lets the transport close
        except BaseException:
            _kill_quietly(proc)
            raise
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            # Nothing to reap after a crash: segments are nameless memfds (none in /dev/shm).
        return proc.returncode

    async def __aenter__(self) -> PeerProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class PeerControl:
    """One connection to a peer process's control port (:meth:`PeerProcess.connect`).

    Commands on one connection are answered in order; several connections (from any
    loops) are served at once.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def call(self, cmd: str, *, timeout: float | None = None, **kw: Any) -> dict[str, Any]:
        """Sends one command and returns its reply.

        Raises:
            ConnectionError: the process closed the connection (it exited).
            TimeoutError: no reply within ``timeout`` seconds.
        """
        self.writer.write((json.dumps({"cmd": cmd, **kw}) + "\n").encode())
        async with asyncio.timeout(timeout):
            await self.writer.drain()
            line = await self.reader.readline()
        if not line:
            raise ConnectionError("the peer process closed its control connection")
        return dict(json.loads(line))
