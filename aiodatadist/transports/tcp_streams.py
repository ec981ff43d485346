"""The tcp data streams of one link: two sets (one per direction), in epochs.

The client opens ``2 * tcp_streams`` extra connections that start with
DATA_HELLO {link_token, stream, epoch}; streams ``[0, n)`` carry the bytes of
requests the client starts, ``[n, 2n)`` those the server starts, so the two
directions never interleave bytes. A transfer that does not end cleanly leaves
its streams in an unknown state: they are retired (never reused) and the client
connects a new set with the next *epoch* (per direction). A retired epoch is
dead: no request naming it is served again.

A socket a native job uses is *held* (:meth:`TcpStreams.hold`): retiring it then
shuts it down (the job's wait ends at once) and closes it only once the job has
returned, so its fd number is never reused under the job.

Each direction also has a *request stream* (``REQUEST_STREAM + direction``), connected
with its set, before its data streams: the requester asks small pulls on it
(``tcp_requests``), and the serving side hands the peer's to its native serving thread
as it attaches (:meth:`TcpStreams.serve_requests`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import _native, _wire
from ..errors import LLMException, LLMStatusCode, failure, from_native

if TYPE_CHECKING:
    from .peer import ControlLink

__all__ = ["ACK", "LOOP_MAX_BYTES", "REQUEST_STREAM", "STREAM_SLOTS", "LoopMove", "TcpStreams"]

log = logging.getLogger("aiodatadist.transports.tcp")

ACK = b"\x01"
"""The server's one-byte answer to an accepted DATA_HELLO."""
STREAM_SLOTS = 8
"""DATA_HELLO.stream = direction * STREAM_SLOTS + i: the layout does not depend on
either side's ``tcp_streams``, so peers configured differently still agree on it."""
REQUEST_STREAM = 2 * STREAM_SLOTS  # (= _wire.MAX_STREAMS)
"""DATA_HELLO.stream = REQUEST_STREAM + direction: that direction's request stream, which
carries only stream requests (small pulls, ``tcp_requests``) and their answers; its
serving end hands it to a native serving thread (``tcp_serve``)."""
CONNECT_TIMEOUT = 10.0
"""How long a background reconnect of the peer-started streams may take."""
LOOP_MAX_BYTES = 256 * 1024
"""Transfers up to this size go on one stream, moved by the event loop itself in
non-blocking steps (:class:`LoopMove`), on both sides: no thread handoff, no thread
start, one wakeup per readiness. Each step copies at most this much (tens of
microseconds on the loop thread) and never waits: a peer that stops reading or
sending only leaves the loop waiting for readiness, under the same deadline. (A stream
request's answer of up to ``tcp_lane.STREAM_POLL_MAX_BYTES`` is taken in such steps
too, at most that much in all.)"""


class LoopMove:
    """One stream of a tiny transfer, moved on the loop thread (see :data:`LOOP_MAX_BYTES`).

    Args:
        make: builds the native stepper (``_native.SockStep``); its errors (a bad fd)
            are raised by :meth:`run`, like a native job's.

    The bytes move only inside ``step()`` calls on the loop thread: once :meth:`run` has
    returned or raised (timeout, cancel, abort), nothing touches the memory or the fd any
    more, so the quiescence rule holds without waiting for anything.
    """

    def __init__(self, make: Callable[[], _native.SockStep]) -> None:
        self._make = make
        self._fut: asyncio.Future[None] | None = None
        self._aborted = False

    def abort(self) -> None:
        """Ends the transfer as a native job's abort would (``ABORTED``). Called on the
        loop thread (a step never runs concurrently with it)."""
        self._aborted = True
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_exception(_native.NativeError(_native.Status.ABORTED, "transfer aborted"))

    async def run(self, deadline: float | None, api: str | None = None, spin_us: int = 0) -> None:
        """Moves every byte; returns once they all moved.

        ``spin_us``: when the first step cannot finish, wait up to this long for the socket
        on this thread (GIL released, ``SockStep.step_for``) before handing the wait to
        the loop: an answer that is microseconds away costs no loop round.

        Raises:
            LLMTimeoutError: ``deadline`` passed (nothing moves after it).
            LLMException: the stream failed (peer closed, another transfer's header, ...)
                or the move was aborted.
            asyncio.CancelledError: cancelled (nothing moves after it).
        """
        step: _native.SockStep | None = None
        try:
            if self._aborted:
                raise _native.NativeError(_native.Status.ABORTED, "transfer aborted")
            step = self._make()
            loop = asyncio.get_running_loop()
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError  # (not even a step: nothing is taken past the deadline)
            if spin_us > 0 and deadline is not None:  # (never past the deadline)
                spin_us = min(spin_us, int((deadline - loop.time()) * 1e6))
            if step.step_for(spin_us) if spin_us > 0 else step.step():
                return
            fut = self._fut = loop.create_future()
            stepper = step

            def ready() -> None:
                if fut.done():
                    return
                try:
                    if stepper.step():
                        fut.set_result(None)
                except Exception as exc:  # delivered to the awaiting task
                    fut.set_exception(exc)

            fd = step.fd
            if step.sending:
                loop.add_writer(fd, ready)
            else:
                loop.add_reader(fd, ready)
            try:
                async with asyncio.timeout_at(deadline):
                    await fut
            finally:
                if step.sending:
                    loop.remove_writer(fd)
                else:
                    loop.remove_reader(fd)
        except TimeoutError:
            moved = (step.bytes_done, step.total) if step is not None else (0, 0)
            raise failure(
                LLMStatusCode.LLM_TIMEOUT,
                f"deadline passed after {moved[0]} of {moved[1]} bytes",
                api=api,
            ) from None
        except _native.NativeError as err:
            raise from_native(err, api) from err


class TcpStreams:
    """The data-stream pool of one link (both directions, their epochs, the holds).

    Direction 0 carries transfers the client starts, 1 those the server starts. The
    client connects both sets; the server takes what comes.
    """

    def __init__(self, link: ControlLink, n_streams: int) -> None:
        self._link = link
        self.is_client = link.is_client
        self.n_streams = max(1, min(STREAM_SLOTS, n_streams))
        slots = self.n_streams if self.is_client else STREAM_SLOTS
        self.sockets: list[list[socket.socket | None]] = [[None] * slots, [None] * slots]
        self.ready = [asyncio.Event(), asyncio.Event()]
        # Per direction: the epoch of the current set, and the newest retired one (every
        # epoch up to it is dead). A socket's epoch is in _epoch_of.
        self.epoch = [0, 0]
        self._dead_epoch = [0, 0]
        self._epoch_of: dict[socket.socket, int] = {}
        # Set (and replaced) whenever a direction's streams change: wakes serve waits.
        self._changed = [asyncio.Event(), asyncio.Event()]
        self._connecting = [False, False]
        self._reconnect: asyncio.Task[None] | None = None
        # Sockets a native job is using (with a count), and those retired meanwhile:
        # closing one under the job would free its fd number for reuse, and the job's
        # bytes could then go to (or come from) whatever gets that number next.
        self._in_use: dict[socket.socket, int] = {}
        self._retired: set[socket.socket] = set()
        self._loop = asyncio.get_running_loop()
        # Each direction's request stream (of that direction's epoch); the peer's is
        # handed to the serving half (serve_requests' on_stream) as it attaches.
        self.req: list[socket.socket | None] = [None, None]
        self._on_stream: Callable[[socket.socket], None] | None = None

    @property
    def my_direction(self) -> int:
        """The direction carrying transfers this side starts."""
        return 0 if self.is_client else 1

    # ------------------------------------------------------------ epochs

    def is_dead(self, direction: int, epoch: int) -> bool:
        """Whether streams of ``epoch`` were retired (or replaced by a newer set)."""
        return epoch <= self._dead_epoch[direction] or epoch < self.epoch[direction]

    def of_epoch(self, direction: int, epoch: int, n: int) -> list[socket.socket] | None:
        """The first ``n`` streams of ``direction`` if all are in place and of ``epoch``."""
        socks = self.sockets[direction][:n]
        if len(socks) == n and all(s is not None and self._epoch_of.get(s) == epoch for s in socks):
            return [s for s in socks if s is not None]
        return None

    async def changed(self, direction: int) -> None:
        """Returns at the next change of ``direction``'s streams."""
        await self._changed[direction].wait()

    def _notify(self, direction: int) -> None:
        changed = self._changed[direction]
        self._changed[direction] = asyncio.Event()
        changed.set()

    def drop(self, direction: int, only: list[socket.socket] | None = None) -> None:
        """Retires the streams of ``direction`` (with ``only``: just those sockets, if they
        are still in place: the client may already have replaced them). A retired
        stream's epoch is dead: no request naming it is served again."""
        dropped = False
        for i, s in enumerate(self.sockets[direction]):
            if s is None or (only is not None and s not in only):
                continue
            self.ready[direction].clear()
            self._dead_epoch[direction] = max(self._dead_epoch[direction], self._epoch_of.pop(s, 0))
            self._close(s)
            self.sockets[direction][i] = None
            dropped = True
        r = self.req[direction]
        if r is not None and (only is None or r in only):
            self.ready[direction].clear()
            self._dead_epoch[direction] = max(self._dead_epoch[direction], self._epoch_of.pop(r, 0))
            # Shut down, not just closed: a serving thread holds its own fd of it.
            with contextlib.suppress(OSError):
                r.shutdown(socket.SHUT_RDWR)
            self._close(r)
            self.req[direction] = None
            dropped = True
        if only is None:
            self.ready[direction].clear()
            self._dead_epoch[direction] = max(self._dead_epoch[direction], self.epoch[direction])
        if dropped:
            self._notify(direction)
            if self.is_client and direction == 1 and not self._connecting[1]:
                # The peer starts transfers on these and cannot connect new ones itself.
                self.reconnect_soon()

    def cancel_epoch(self, direction: int, epoch: int) -> None:
        """The peer gave up its streams of ``epoch`` and older (CANCEL): retires them."""
        old = [
            s
            for s in (*self.sockets[direction], self.req[direction])
            if s is not None and self._epoch_of.get(s, 0) <= epoch
        ]
        if old:
            self.drop(direction, only=old)
        self._dead_epoch[direction] = max(
            self._dead_epoch[direction], min(epoch, self.epoch[direction])
        )
        if self.is_client and direction == 1 and not self.ready[1].is_set():
            self.reconnect_soon()  # we own the streams: the peer cannot make new ones
        self._notify(direction)

    # ------------------------------------------------------------ stream requests

    def serve_requests(self, on_stream: Callable[[socket.socket], None]) -> None:
        """Calls ``on_stream(sock)`` with each request stream of the peer's direction as it
        attaches (the one in place now, too)."""
        self._on_stream = on_stream
        r = self.req[1 - self.my_direction]
        if r is not None:
            on_stream(r)

    def request_stream(self, direction: int) -> socket.socket | None:
        """The request stream of ``direction`` when the current set is all connected."""
        if not self.ready[direction].is_set():
            return None
        r = self.req[direction]
        return r if r is not None and self._epoch_of.get(r) == self.epoch[direction] else None

    # ------------------------------------------------------------ holds

    def _close(self, s: socket.socket) -> None:
        """Closes a stream, or, while a native job uses it, shuts it down (which ends the
        job's wait at once) and closes it when the job has returned."""
        if s in self._in_use:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            self._retired.add(s)
            return
        with contextlib.suppress(OSError):
            s.close()

    def hold(self, socks: list[socket.socket]) -> list[int]:
        """Keeps ``socks`` open (their fd numbers ours) until :meth:`release`, which must
        come only after the native job given the returned fds has returned."""
        for s in socks:
            self._in_use[s] = self._in_use.get(s, 0) + 1
        return [s.fileno() for s in socks]

    def held(self, s: socket.socket) -> bool:
        """Whether a transfer holds ``s`` now."""
        return s in self._in_use

    def release(self, socks: list[socket.socket]) -> None:
        for s in socks:
            left = self._in_use.pop(s, 1) - 1
            if left:
                self._in_use[s] = left
            elif s in self._retired:
                self._retired.discard(s)
                with contextlib.suppress(OSError):
                    s.close()

    # ------------------------------------------------------------ connecting

    def attach(self, index: int, sock: socket.socket, epoch: int) -> bool:
        """Puts a connected stream of ``epoch`` in its slot. A newer epoch retires the
        direction's older streams; a stream of a dead or older epoch is refused."""
        if index in (REQUEST_STREAM, REQUEST_STREAM + 1):
            return self._attach_request(index - REQUEST_STREAM, sock, epoch)
        direction, i = divmod(index, STREAM_SLOTS)
        if direction > 1 or i >= len(self.sockets[direction]):
            return False
        if self.is_dead(direction, epoch):
            return False
        if epoch > self.epoch[direction]:
            self.drop(direction)  # the peer replaced the whole set
            self.epoch[direction] = epoch
        old = self.sockets[direction][i]
        if old is not None:
            self._epoch_of.pop(old, None)
            self._close(old)
        self.sockets[direction][i] = sock
        self._epoch_of[sock] = epoch
        # The client opened them all before it uses them; the server uses those that came.
        need = self.sockets[direction] if self.is_client else self.sockets[direction][:1]
        if all(s is not None for s in need):
            self.ready[direction].set()
        self._notify(direction)
        return True

    def _attach_request(self, direction: int, sock: socket.socket, epoch: int) -> bool:
        """A direction's request stream (connected before its data streams)."""
        if self.is_dead(direction, epoch):
            return False
        if epoch > self.epoch[direction]:
            self.drop(direction)  # the peer replaced the whole set
            self.epoch[direction] = epoch
        old = self.req[direction]
        if old is not None:
            self._epoch_of.pop(old, None)
            with contextlib.suppress(OSError):
                old.shutdown(socket.SHUT_RDWR)
            self._close(old)
        self.req[direction] = sock
        self._epoch_of[sock] = epoch
        if direction != self.my_direction and self._on_stream is not None:
            self._on_stream(sock)
        self._notify(direction)
        return True

    async def accept(self, index: int, epoch: int, sock: socket.socket) -> None:
        """Server side: a DATA_HELLO's connection (``sock``, ours to close) joins the pool
        and is acknowledged, or is closed when refused."""
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self.attach(index, sock, epoch):
                sock.close()
                return
            await self._loop.sock_sendall(sock, ACK)
        except OSError:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # (a request stream's serving thread ends)
            sock.close()

    async def connect(self, direction: int, deadline: float | None) -> None:
        """Client side: opens a new set of streams of one direction (the next epoch); the
        old set is retired first.

        Raises:
            TimeoutError: ``deadline`` passed.
            OSError: the peer cannot be reached.
            LLMException: LLM_LINK_FAILED, the peer refused a stream or the set was
                replaced meanwhile.
        """
        link = self._link
        assert self.is_client and link.endpoint is not None
        self._connecting[direction] = True
        try:
            self.drop(direction)
            self.epoch[direction] += 1
            epoch = self.epoch[direction]
            host, port = link.endpoint
            base = direction * STREAM_SLOTS
            async with asyncio.timeout_at(deadline):
                # The request stream first: it is in place once the set reads ready.
                await self._connect_one(host, port, REQUEST_STREAM + direction, epoch)
                for i in range(self.n_streams):
                    await self._connect_one(host, port, base + i, epoch)
        finally:
            self._connecting[direction] = False

    async def _connect_one(self, host: str, port: int, index: int, epoch: int) -> None:
        loop = self._loop
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, stype, proto, _, addr = infos[0]
        sock = socket.socket(family, stype, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, addr)
            frame = _wire.encode(
                _wire.MsgType.DATA_HELLO,
                {"link_token": self._link.link_token, "stream": index, "epoch": epoch},
            )
            await loop.sock_sendall(sock, frame)
            if await loop.sock_recv(sock, 1) != ACK:
                raise failure(LLMStatusCode.LLM_LINK_FAILED, "the peer refused a data stream")
            if self._link.closed.is_set() or not self.attach(index, sock, epoch):
                raise failure(
                    LLMStatusCode.LLM_LINK_FAILED, "the data streams were replaced meanwhile"
                )
        except BaseException:
            sock.close()
            raise

    async def ensure(
        self, direction: int, deadline: float | None
    ) -> tuple[list[socket.socket], int]:
        """The leading run of connected streams of ``direction`` (connecting them if
        needed) and their epoch; a job on them holds them with :meth:`hold`."""
        if not self.ready[direction].is_set():
            if self.is_client:
                await self.connect(direction, deadline)
            else:
                async with asyncio.timeout_at(deadline):
                    await self.ready[direction].wait()
        epoch = self.epoch[direction]
        socks = []
        for s in self.sockets[direction]:  # the leading run of connected streams
            if s is None or self._epoch_of.get(s) != epoch:
                break
            socks.append(s)
        return socks, epoch

    def reconnect_soon(self) -> None:
        """Client side: connects a new set of the peer-started direction (1) in the
        background (the peer is waiting for them and cannot connect them itself)."""
        if self._link.closed.is_set() or self._connecting[1]:
            return
        if self._reconnect is not None and not self._reconnect.done():
            return

        async def reconnect() -> None:
            try:
                await self.connect(1, self._loop.time() + CONNECT_TIMEOUT)
            except (OSError, TimeoutError, LLMException) as e:
                # The peer's next request naming a dead epoch fails; a later failure or
                # CANCEL tries again.
                log.warning(
                    "cannot reconnect data streams to cluster %d: %s",
                    self._link.info.cluster_id,
                    e,
                )

        self._reconnect = self._loop.create_task(reconnect(), name="aiodatadist-peer-streams")

    def close(self) -> None:
        """The link closed: every stream is retired (held ones once their job returned)."""
        task = self._reconnect
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        for d in (0, 1):
            self.drop(d)
