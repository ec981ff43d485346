"""The serving half of ``tcp``: the peer's PULL / PUSH requests against our memory.

The control connection's read loop hands every PULL, PUSH and CANCEL here.
Serving is bounded: each peer's requests run one at a time on the instance's
serving executor (``aiodatadist.ServeThreads``, apart from its own transfers), at
most MAX_QUEUED_REQUESTS wait, a request's deadline is capped by
``aiodatadist.ServeTimeout``, and a reply the peer does not take within that bound
closes its link.

Transfer identity: a request names the epoch of the streams it uses; it is served
only on streams of that epoch (waited for within its deadline) and answered with a
failed DONE, touching no stream, when that epoch was retired. A CANCEL {req, epoch}
drops the request if queued, aborts it if running, and retires the streams of that
epoch and older.

Stream requests (small pulls, ``tcp_requests``) arrive on the request stream of the
peer's direction, which this side hands to a native serving thread of the link's own
(``_native.StreamServer``, ``ext/serve.cpp``) as it attaches: no loop, no GIL, no task,
no DONE. It checks each request against the instance's serve book (every registered
cache, its geometry and lease; ``_lease_book.LeaseBook.serve``) and answers with the stream
header and the bytes, sent under the cache's lease (a free waits for them, or refuses,
as for a peer's one-sided copy), or with a refusal frame naming the status; a stream
that misbehaves (not a request, a second request before the answer, a request not all
sent within ``ServeTimeout``, a send that fails or outlasts the deadline) is shut down.
The thread ends with the link.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import _native, _wire
from .._caches import Region, require_host_memory
from .._leases import LeaseStale
from ..errors import NATIVE_STATUS_TABLE, LLMException, LLMStatusCode, failure, from_native
from .tcp_requests import STREAM_MAX_BYTES, ServeStats
from .tcp_streams import LOOP_MAX_BYTES, LoopMove

if TYPE_CHECKING:
    from .._caches import CacheEntry, CacheTable
    from .._executor import TransferExecutor
    from .peer import ControlLink
    from .tcp_streams import TcpStreams

__all__ = ["MAX_QUEUED_REQUESTS", "ServeStats", "TcpServing"]

log = logging.getLogger("aiodatadist.transports.tcp")

MAX_QUEUED_REQUESTS = 8
"""Requests of one peer waiting to be served; past it the link's reading stops."""

# The status a native refusal carries for each native error (the one mapping, errors.py).
_REFUSAL_CODES = [
    int(NATIVE_STATUS_TABLE.get(int(s), LLMStatusCode.LLM_FAILED))
    for s in range(len(_native.Status))
]
_NOT_EXIST = int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


class TcpServing:
    """Serves one link's peer requests, in order, one at a time.

    Args:
        link: the control connection (DONE replies go on it).
        streams: the link's data streams (requests use the peer's direction).
        table: our cache table (what requests may name).
        executor: the instance's serving executor.
        cap_s: ``ServeTimeout`` in seconds: the most any request (and its reply) may take.
        require_ready: raises once the instance was finalized.
        book: what the native serving thread of the peer's request stream may read (the
            instance's ``_lease_book.LeaseBook.serve``).
    """

    def __init__(
        self,
        link: ControlLink,
        streams: TcpStreams,
        *,
        table: Callable[[], CacheTable],
        executor: TransferExecutor,
        cap_s: float,
        require_ready: Callable[[], None],
        book: _native.ServeBook,
    ) -> None:
        self._link = link
        self._streams = streams
        self._table = table
        self._executor = executor
        self._cap = cap_s
        self._require_ready = require_ready
        # (request, loop time it arrived): its deadline counts from arrival, queueing
        # included. A well-behaved peer has at most one request in flight per direction
        # (its link slot orders them); a full queue stops reading from a peer that floods us.
        self._requests: asyncio.Queue[tuple[_wire.Message, float]] = asyncio.Queue()
        self._room = asyncio.Semaphore(MAX_QUEUED_REQUESTS)
        # For CANCEL: req ids queued (with a count), cancelled while queued, and the
        # running one (req, its abort token).
        self._queued: dict[int, int] = {}
        self._cancelled: set[int] = set()
        self._running: tuple[int, _native.Control | LoopMove] | None = None
        self._loop = asyncio.get_running_loop()
        self._stats = ServeStats()
        # The request stream's serving thread (made with the first one; ``book``: what it
        # may read, the instance's lease book's).
        self._book = book
        self._native: _native.StreamServer | None = None
        streams.serve_requests(self._request_stream)

    @property
    def stats(self) -> ServeStats:
        """What was served so far (the native serving thread's requests included)."""
        srv = self._native
        if srv is None:
            return self._stats
        return dataclasses.replace(
            self._stats,
            served=self._stats.served + srv.served,
            failed=self._stats.failed + srv.failed,
        )

    def _request_stream(self, sock: socket.socket) -> None:
        """The peer's request stream attached: its native serving thread serves it (on a
        dup of its fd; the one before it is shut down)."""
        if self._link.closed.is_set():
            return
        if self._native is None:
            self._native = _native.StreamServer(
                self._book, self._cap, STREAM_MAX_BYTES, _REFUSAL_CODES, _NOT_EXIST
            )
        self._native.serve(os.dup(sock.fileno()))

    def close(self) -> None:
        """The link closed: the serving thread ends (its counts kept). Idempotent."""
        srv, self._native = self._native, None
        if srv is not None:
            srv.stop()
            self._stats.served += srv.served
            self._stats.failed += srv.failed

    async def enqueue(self, msg: _wire.Message) -> None:
        """Queues a PULL or PUSH (waits while MAX_QUEUED_REQUESTS wait: the peer floods us)."""
        req = int(msg.body["req"])
        await self._room.acquire()
        self._queued[req] = self._queued.get(req, 0) + 1
        self._requests.put_nowait((msg, asyncio.get_running_loop().time()))

    def on_cancel(self, req: int, epoch: int) -> None:
        """The peer gave up ``req`` and its streams of ``epoch`` and older: drops or
        aborts the request, retires those streams (they are never used again)."""
        if req in self._queued:
            self._cancelled.add(req)
        running = self._running
        if running is not None and running[0] == req:
            self._cancelled.add(req)
            running[1].abort()
        self._streams.cancel_epoch(1 - self._streams.my_direction, epoch)

    async def run(self) -> None:
        """The serve loop (until the link closes)."""
        try:
            await self._run()
        finally:
            self.close()

    async def _run(self) -> None:
        while not self._link.closed.is_set():  # _serve may close the link (a peer not reading)
            msg, arrived = await self._requests.get()
            self._room.release()
            req = int(msg.body["req"])
            left = self._queued.pop(req, 1) - 1
            if left > 0:
                self._queued[req] = left
            try:
                if req in self._cancelled:
                    self._cancelled.discard(req)
                    self._stats.cancelled_queued += 1
                    continue  # the requester gave up on it: nothing to send, nothing to answer
                await self._serve(msg, arrived)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(
                    "serving a request from cluster %d failed", self._link.info.cluster_id
                )

    async def _serve(self, msg: _wire.Message, arrived: float) -> None:
        """Serves one PULL (we send) or PUSH (we receive) against our registered memory.

        Its deadline is the one the peer asked for, capped by ``aiodatadist.ServeTimeout``,
        counted from its arrival. Waiting for its streams, the native job and the DONE
        reply are all bounded: a peer that stops reading cannot hold this loop, or a
        serving thread, past that (the reply's bound closes the link).
        """
        body = msg.body
        req = int(body["req"])
        deadline = arrived + min(int(body["deadline_ms"]) / 1000, self._cap)
        pull = msg.type == _wire.MsgType.PULL
        api = "serve_pull" if pull else "serve_push"
        status, info = LLMStatusCode.LLM_SUCCESS, ""
        peer_dir = 1 - self._streams.my_direction
        # The streams this job used: a failure retires just these (the requester may
        # already have connected their replacements).
        held: list[socket.socket] = []
        # Refused (LeaseStale) because the requester's table is stale: the DONE says so,
        # and the requester refreshes its table and retries once.
        stale = False
        try:
            entry, plan = self._check(msg, api)
            if asyncio.get_running_loop().time() >= deadline:
                raise failure(
                    LLMStatusCode.LLM_TIMEOUT, "request arrived after its deadline", api=api
                )
            socks = await self._streams_of(
                peer_dir, int(body["epoch"]), int(body["streams"]), req, deadline, api
            )
            entry.hold(api)
            try:
                gen = body.get("gen")
                if gen is not None and entry.lease is not None and entry.lease[1] != gen:
                    # Re-bound while we waited for the streams (none touched yet).
                    raise failure(
                        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                        f"cache {body['cache_id']} was re-bound since the requester's table",
                        api=api,
                        kind=LeaseStale,
                    )
                self._require_ready()
                held[:] = socks
                await self._move(req, pull, plan, entry.addrs, held, deadline, api)
            finally:
                entry.release()
        except LeaseStale as e:
            stale = True
            status, info = e.status_code, str(e)
        except TimeoutError as e:
            status, info = LLMStatusCode.LLM_TIMEOUT, str(e) or "deadline passed"
            self._streams.drop(peer_dir, only=held)
        except LLMException as e:
            status, info = e.status_code, str(e)
            if status not in (
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                LLMStatusCode.LLM_PARAM_INVALID,
            ):
                self._streams.drop(peer_dir, only=held)
        except _wire.WireError as e:
            status, info = LLMStatusCode.LLM_PARAM_INVALID, str(e)
        await self._reply(req, status, info, stale)

    def _check(self, msg: _wire.Message, api: str) -> tuple[CacheEntry, _native.Plan]:
        """The cache a PULL / PUSH names and its plan (see :meth:`_resolve`)."""
        body = msg.body
        pull = msg.type == _wire.MsgType.PULL
        geo = body["dst_geometry" if pull else "src_geometry"]
        return self._resolve(int(body["cache_id"]), body.get("gen"), pull, geo, msg.binary, api)

    def _resolve(
        self,
        cache_id: int,
        gen: int | None,
        pull: bool,
        peer_geometry: Any,
        segments: bytes,
        api: str,
    ) -> tuple[CacheEntry, _native.Plan]:
        """The cache a request names and its plan, checked against our registration.

        Raises:
            LeaseStale: no such cache, or it was re-bound since the requester's table.
            LLMException: a segment outside the cache (LLM_PARAM_INVALID, ...).
            _wire.WireError: malformed segments.
        """
        entry = self._table().by_id(cache_id)
        if entry is None:
            raise failure(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"no cache with id {cache_id}",
                api=api,
                kind=LeaseStale,
            )
        if gen is not None and entry.lease is not None and entry.lease[1] != gen:
            # The requester resolved its key through a binding this cache has lost (a
            # later registration took its model_id, a row key was removed): it would get
            # (or overwrite) another registration's bytes under that key.
            raise failure(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"cache {cache_id} was re-bound since the requester's table "
                f"(generation {gen}, now {entry.lease})",
                api=api,
                kind=LeaseStale,
            )
        # Device memory is moved by engines only: never read or written here, whatever a
        # peer asks (its table said the cache is on a device).
        require_host_memory("tcp", entry)
        try:
            geo = _native.Geometry(*(int(x) for x in peer_geometry))
            # Every segment is checked against *our* registered geometry: a peer can never
            # make us read or write outside registered memory.
            if pull:
                return entry, _native.plan_from_segment_bytes(entry.geometry, geo, segments)
            plan = _native.plan_from_segment_bytes(geo, entry.geometry, segments)
        except _native.NativeError as e:
            raise from_native(e, api) from e
        if entry.late_writes:  # an aborted engine pull may still land in the blocks it named
            entry.check_no_late_writes(api, Region.of(entry.addrs, plan, "dst"))
        return entry, plan

    async def _move(
        self,
        req: int,
        pull: bool,
        plan: _native.Plan,
        addrs: list[int],
        socks: list[socket.socket],
        deadline: float,
        api: str,
    ) -> None:
        """Sends (pull) or receives (push) the plan's bytes on ``socks``, abortable by CANCEL.

        A tiny request on one stream is moved by this loop in non-blocking steps (see
        ``LOOP_MAX_BYTES``): a peer that stops reading or sending cannot block the loop,
        only make this request wait for readiness until its (capped) deadline.
        """
        fds = self._streams.hold(socks)
        try:
            if len(fds) == 1 and plan.total_bytes <= LOOP_MAX_BYTES:
                fd = fds[0]
                move = LoopMove(lambda: _native.SockStep(fd, plan, addrs, pull, tag=req))
                self._running = (req, move)
                await move.run(deadline, api)
                return
            ctl = _native.Control()
            self._running = (req, ctl)
            if pull:
                job = lambda c: _native.sock_send(fds, plan, addrs, c, tag=req)  # noqa: E731
            else:
                job = lambda c: _native.sock_recv(fds, plan, addrs, c, tag=req)  # noqa: E731
            await self._executor.run(job, deadline=deadline, api=api, control=ctl)
        finally:
            # Both return (even when cancelled) only once nothing moves any more.
            self._running = None
            self._streams.release(socks)

    async def _reply(self, req: int, status: LLMStatusCode, info: str, stale: bool) -> None:
        if req in self._cancelled:
            # The requester gave up (CANCEL) and will not read a reply.
            self._cancelled.discard(req)
            self._stats.cancelled_running += 1
            return
        if status == LLMStatusCode.LLM_SUCCESS:
            self._stats.served += 1
        else:
            self._stats.failed += 1
        try:
            # A peer that stopped reading must not hold this loop: the reply is bounded.
            async with asyncio.timeout(self._cap):
                done: dict[str, Any] = {"req": req, "status": int(status), "info": info[:1000]}
                if stale and status == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                    done["stale"] = True
                await self._link.send(_wire.MsgType.DONE, done)
        except TimeoutError:
            await self._link.close("the peer did not take a reply in time")
        except LLMException:
            pass  # the link is closed

    async def _streams_of(
        self, direction: int, epoch: int, n: int, req: int, deadline: float, api: str
    ) -> list[socket.socket]:
        """The first ``n`` data streams of ``direction``, all of ``epoch``: waits for them
        until ``deadline``; refuses (touching none) when that epoch was retired."""
        streams = self._streams
        while True:
            if req in self._cancelled:
                raise failure(LLMStatusCode.LLM_FAILED, "cancelled by the requester", api=api)
            if streams.is_dead(direction, epoch):
                self._stats.stale += 1
                raise failure(
                    LLMStatusCode.LLM_FAILED,
                    f"stale request {req}: its data streams (epoch {epoch}) were replaced "
                    f"(current epoch {streams.epoch[direction]}); nothing was sent",
                    api=api,
                )
            socks = streams.of_epoch(direction, epoch, n)
            if socks is not None:
                return socks
            if n > len(streams.sockets[direction]):
                raise failure(
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"{n} data streams asked for, {len(streams.sockets[direction])} exist",
                    api=api,
                )
            if streams.is_client and not streams.ready[direction].is_set():
                streams.reconnect_soon()  # ours to connect: the peer is waiting for them
            async with asyncio.timeout_at(deadline):
                await streams.changed(direction)
