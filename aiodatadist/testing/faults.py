"""Faults on a real link: a loopback TCP proxy that stalls, drops and kills.

:class:`FaultInjector` sits between a decoder and a prompt (``remote_pair(faults=True)``
puts it there), so a test can make a transfer in flight hit its deadline, break a link
mid-transfer, or SIGKILL the prompt process, and check that the library answers with
an ``LLMException`` rather than a hang or wrong bytes.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .peer import PeerProcess

__all__ = ["FaultInjector"]


class _Proxied:
    """One proxied connection: the accepted side and the upstream side."""

    def __init__(self, down: asyncio.StreamWriter, up: asyncio.StreamWriter) -> None:
        self.down = down
        self.up = up
        self.tasks: list[asyncio.Task[None]] = []

    def abort(self) -> None:
        for w in (self.down, self.up):
            w.transport.abort()
        current = asyncio.current_task()
        for t in self.tasks:
            if t is not current:
                t.cancel()


class FaultInjector:
    """A loopback TCP proxy between a decoder and a prompt that injects faults.

    Link the decoder to :attr:`address` instead of the prompt's own address: the link's
    control connection and its TCP data streams then pass through this proxy (real
    sockets, real bytes), and the test can

    * :meth:`pause` / :meth:`resume` / :meth:`delay`: stall every byte in both directions
      (a transfer in flight then hits its deadline: ``LLMTimeoutError``);
    * :meth:`drop`: abort every proxied connection (the link breaks: ``LLMException``);
    * :meth:`kill_peer`: SIGKILL the prompt process, when it was given one.

    Through the proxy the prompt's pid does not hold the decoder's connection, so the
    one-sided paths (``shm``, ``cma``) are refused on such a link and every transfer
    goes over ``tcp`` (the bytes the injector can stall). To test a one-sided path's
    error handling, link directly (``remote_pair(faults=False)``) and kill the peer
    with ``pair.prompt.kill()``.

    It lives on the event loop that calls :meth:`start`; use it as ``async with``.

    Args:
        target: the prompt's ``(host, port)``.
        peer: the prompt's :class:`PeerProcess`, for :meth:`kill_peer`.
        host: where the proxy listens.
    """

    def __init__(
        self,
        target: tuple[str, int],
        *,
        peer: PeerProcess | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.target = target
        self.peer = peer
        self.host = host
        self.refuse_new = False
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._conns: set[_Proxied] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._resume_at: asyncio.TimerHandle | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._closing = False

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the proxy listens on.

        Raises:
            RuntimeError: not started.
        """
        if self._server is None:
            raise RuntimeError("the fault injector is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    @property
    def paused(self) -> bool:
        return not self._flowing.is_set()

    @property
    def connections(self) -> int:
        """Proxied connections open now."""
        return len(self._conns)

    async def start(self) -> tuple[str, int]:
        """Starts listening; returns :attr:`address`. Idempotent.

        Raises:
            OSError: cannot listen.

        Cancel: propagates; nothing is left listening.
        """
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self.host, 0)
        return self.address

    def pause(self) -> None:
        """Stalls every proxied byte, both directions, until :meth:`resume`."""
        self._cancel_resume()
        self._flowing.clear()

    def resume(self) -> None:
        """Lets bytes flow again (what was held is delivered in order)."""
        self._cancel_resume()
        self._flowing.set()

    def delay(self, seconds: float) -> None:
        """Stalls every proxied byte for ``seconds`` from now (a loop timer resumes)."""
        self.pause()
        self._resume_at = asyncio.get_running_loop().call_later(seconds, self.resume)

    def _cancel_resume(self) -> None:
        if self._resume_at is not None:
            self._resume_at.cancel()
            self._resume_at = None

    async def drop(self, *, refuse_new: bool = False) -> int:
        """Aborts every proxied connection (both sides see a reset); returns how many.

        Args:
            refuse_new: also refuse connections from now on (a relink fails) until
                :attr:`refuse_new` is set back to False.

        Never raises; does not wait for the peers to notice. A pause stays in force
        (a relink through a paused proxy times out): :meth:`resume` first.
        """
        self.refuse_new = refuse_new
        conns = list(self._conns)
        self._conns.clear()
        for c in conns:
            c.abort()
        await asyncio.sleep(0)  # let the aborts' connection_lost callbacks run
        return len(conns)

    def kill_peer(self) -> None:
        """SIGKILLs the prompt process (its sockets close, the link breaks).

        Raises:
            RuntimeError: the injector was made without ``peer``.
        """
        if self.peer is None:
            raise RuntimeError("FaultInjector(peer=...) is needed to kill the peer")
        self.peer.kill()

    async def close(self) -> None:
        """Stops listening and aborts every proxied connection. Idempotent.

        Never raises; waits at most 5 s for its connection handlers to end. Cancel:
        propagates after the connections were aborted.
        """
        self._cancel_resume()
        self._flowing.set()
        if self._server is not None:
            self._server.close()
            self._server = None
        self._closing = True
        for c in list(self._conns):
            c.abort()
        self._conns.clear()
        for t in list(self._handlers):
            t.cancel()  # those still connecting upstream; the others end with their pumps
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5)

    async def __aenter__(self) -> FaultInjector:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._proxy(reader, writer)
        except asyncio.CancelledError:
            writer.transport.abort()
            if not self._closing:
                raise
            # our own cancel from close(): end quietly (asyncio logs a cancelled handler)
        finally:
            self._handlers.discard(task)

    async def _proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse_new:
            writer.transport.abort()
            return
        try:
            async with asyncio.timeout(10):
                up_reader, up_writer = await asyncio.open_connection(*self.target)
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        conn = _Proxied(writer, up_writer)
        self._conns.add(conn)
        self.accepted += 1
        loop = asyncio.get_running_loop()
        conn.tasks = [
            loop.create_task(self._pump(reader, up_writer, conn)),
            loop.create_task(self._pump(up_reader, writer, conn)),
        ]
        try:
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            self._conns.discard(conn)
            conn.abort()

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, conn: _Proxied
    ) -> None:
        try:
            while True:
                data = await src.read(1 << 20)
                await self._flowing.wait()
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()
        except (OSError, ConnectionError):
            conn.abort()
