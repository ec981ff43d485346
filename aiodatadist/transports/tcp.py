"""``tcp``: two-sided, any hosts.

The requester sends PULL (or PUSH) with the plan's segments on the control
connection; the serving side checks every segment against its registered
memory and ``sendmsg``s straight from it (or ``readv``s straight into it),
while the requester ``readv``s straight into its destination blocks (or sends
from its source): no staging copy on either side. The bytes travel on the
link's data streams of the requester's direction. Every stream starts with a
header naming the request, checked natively before a byte lands, and the
request names the epoch of the streams it uses. A transfer that does not end
cleanly retires those streams (the client connects a new epoch before the next
one) and sends CANCEL, so the serving side drops or aborts it too.

A small pull (at most ``STREAM_MAX_BYTES``) skips the control connection: it is asked on
the request stream and answered on it by the peer's native serving thread
(``tcp_requests``): one round trip, no DONE. An answer of at most
``STREAM_POLL_MAX_BYTES`` is taken by the loop on the calling task, a bigger one by a
worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .. import _native, _wire
from .._executor import quiesce
from ..config import DataPath
from ..errors import LLMException, LLMStatusCode, failure
from .base import Call, Lane, LayerCut, Path
from .peer import ControlLink
from .tcp_lane import (
    STREAM_POLL_MAX_BYTES,
    STREAM_SPIN_US,
    StreamPull,
    TcpLane,
    asked_of,
    deadline_ms,
    landing_in,
    peer_failure,
    usable_deadline,
)
from .tcp_requests import MAX_STREAM_SEGMENTS, STREAM_MAX_BYTES, decode_refusal
from .tcp_streams import LOOP_MAX_BYTES, LoopMove

if TYPE_CHECKING:
    from .._caches import CacheEntry, CacheTable
    from .tcp_streams import TcpStreams

__all__ = ["TcpLink", "TcpPath", "deadline_ms"]

Mover = Callable[[list[int], _native.Control, int], Any]
"""The requester's native job: ``mover(fds, control, req)``."""
Stepper = Callable[[int, int], _native.SockStep]
"""The requester's side of a tiny transfer, moved by the loop: ``stepper(fd, req)``."""


class TcpLink(ControlLink, Protocol):
    """A control connection with its tcp data streams (``_control.Peer``)."""

    streams: TcpStreams


class TcpPath(Path):
    """The requesting half of ``tcp`` over one link (its serving half:
    :class:`~aiodatadist.transports.tcp_serve.TcpServing`)."""

    kinds = (DataPath.TCP,)

    def __init__(self, link: TcpLink) -> None:
        self.link = link
        self.streams = link.streams
        # A peer in this process answers from this very loop: waiting on it here is lost.
        self._spin = link.info.pid != os.getpid()

    @property
    def remote_table(self) -> CacheTable:
        return self.link.table

    async def refresh(self, deadline: float | None) -> bool:
        await self.link.refresh(deadline)
        return True

    def table_changed(self) -> None:
        self.link.table_changed()

    async def close(self) -> None:
        await self.link.unlink()

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        if plan.total_bytes <= STREAM_MAX_BYTES and plan.num_segments <= MAX_STREAM_SEGMENTS:
            if await self._stream_pull(plan, remote, local, call):
                return
        dst = local.addrs
        await self._transfer(
            _wire.MsgType.PULL,
            plan,
            remote,
            call,
            {"dst_geometry": [local.num_tensors, local.num_blocks, local.block_bytes]},
            lambda fds, c, req: _native.sock_recv(fds, plan, dst, c, tag=req),
            lambda fd, req: _native.SockStep(fd, plan, dst, False, tag=req),
        )

    async def pull_layers(
        self,
        plan: _native.Plan,
        remote: CacheEntry,
        local: CacheEntry,
        call: Call,
        cut: LayerCut,
    ) -> None:
        """One request for every layer: each stream carries its part of every layer, in
        layer order (the plan is reordered so), and a layer is signalled on ``cut.fd`` once
        every stream's part of it has landed. A pull of at most ``STREAM_MAX_BYTES`` is one
        :meth:`pull` (see ``Path.pull_at_once``): on the request stream its answer lands
        before a control-plane request's first layer would (and the layered receive has
        no tiny form: one moved by the loop is not cut into layers)."""
        if plan.total_bytes <= STREAM_MAX_BYTES:
            await self.pull_at_once(plan, remote, local, call, cut)
            return
        dst, bounds, efd = local.addrs, cut.bounds(plan), cut.fd

        def prepare(n: int) -> tuple[_native.Plan, Mover, int]:
            # A layer whose bytes do not divide by n: one stream, the plan's own order.
            striped = _native.plan_striped(plan, bounds, n) if n > 1 else None
            if striped is None:
                n, striped = 1, _native.plan_striped(plan, bounds, 1)
                assert striped is not None
            layered, ends = striped
            return (
                layered,
                lambda fds, c, req: _native.sock_recv_layered(
                    fds, layered, dst, c, tag=req, ends=ends, efd=efd
                ),
                n,
            )

        await self._transfer(
            _wire.MsgType.PULL,
            plan,
            remote,
            call,
            {"dst_geometry": [local.num_tensors, local.num_blocks, local.block_bytes]},
            None,
            lambda fd, req: _native.SockStep(fd, plan, dst, False, tag=req),
            prepare=prepare,
        )

    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        src = local.addrs
        await self._transfer(
            _wire.MsgType.PUSH,
            plan,
            remote,
            call,
            {"src_geometry": [local.num_tensors, local.num_blocks, local.block_bytes]},
            lambda fds, c, req: _native.sock_send(fds, plan, src, c, tag=req),
            lambda fd, req: _native.SockStep(fd, plan, src, True, tag=req),
        )

    async def _stream_pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> bool:
        """A small pull, asked and answered on the request stream (see ``tcp_requests``):
        one round trip, no control message; one of at most ``STREAM_POLL_MAX_BYTES`` moved
        by the loop on this task, a bigger one by a worker thread (the loop copies no more
        than that). False: the peer's set of streams came without a request stream
        (nothing was asked; the caller asks on the control connection).

        Raises:
            LLMTimeoutError: ``call.deadline`` passed.
            LLMException: the peer's refusal (its status), the stream's failure (another
                transfer's bytes: LLM_FAILED...; the peer closed it), a closed link.
            LeaseStale: the peer refused: the cache is gone or was re-bound (nothing moved).
            asyncio.CancelledError: the caller was cancelled (nothing moves after it).

        Unless it ends with the bytes or a refusal (either leaves the stream in step), the
        stream is retired and a CANCEL goes to the peer in the background.
        """
        link, streams = self.link, self.streams
        if link.closed.is_set():
            raise failure(
                LLMStatusCode.LLM_LINK_FAILED,
                f"the link to cluster {link.info.cluster_id} is closed",
            )
        loop = asyncio.get_running_loop()
        deadline = usable_deadline(call.deadline, loop.time())
        direction = streams.my_direction
        sock = streams.request_stream(direction)
        if sock is None:
            await self._connect(direction, deadline)
            sock = streams.request_stream(direction)
            if sock is None:  # (the peer's set came without one: the control plane asks)
                return False
        ask = StreamPull(self, sock, streams.epoch[direction])
        # An answer of at most STREAM_POLL_MAX_BYTES the loop takes itself, polling for it
        # first (a worker's wakeup and then the loop's cost more than its copy); a bigger
        # one a worker thread takes (the loop copies no more than that).
        polled = plan.total_bytes <= STREAM_POLL_MAX_BYTES
        spin = STREAM_SPIN_US * self._spin if polled else None
        if not ask.begin(plan, asked_of(remote), landing_in(local), deadline, loop.time(), spin):
            await ask.finish(deadline, None if polled else call)
        if ask.refused:
            assert ask.step is not None
            raise peer_failure(decode_refusal(ask.step.refusal))
        return True

    def lane(self, remote: CacheEntry, local: CacheEntry) -> Lane | None:
        # Host memory only (what the serving side refuses must take the whole path).
        if remote.device_id is not None or local.device_id is not None:
            return None
        return TcpLane(self, remote, local, STREAM_SPIN_US * self._spin)

    def broken(self, e: OSError) -> LLMException:
        return failure(
            LLMStatusCode.LLM_LINK_FAILED,
            f"the data stream to cluster {self.link.info.cluster_id} broke: {e}",
        )

    async def _connect(
        self, direction: int, deadline: float | None
    ) -> tuple[list[socket.socket], int]:
        """The streams of ``direction`` and their epoch (connected now if needed)."""
        try:
            return await self.streams.ensure(direction, deadline)
        except TimeoutError:
            raise failure(
                LLMStatusCode.LLM_TIMEOUT, "deadline passed while connecting data streams"
            ) from None
        except OSError as e:
            # The peer stopped listening (it is going away, or was killed): an engine
            # error like any other broken link, not a bare socket error.
            raise failure(
                LLMStatusCode.LLM_LINK_FAILED,
                f"cannot connect data streams to cluster {self.link.info.cluster_id}: {e}",
            ) from e

    async def _transfer(
        self,
        msg_type: _wire.MsgType,
        plan: _native.Plan,
        remote: CacheEntry,
        call: Call,
        extra: dict[str, Any],
        mover: Mover | None,
        stepper: Stepper,
        prepare: Callable[[int], tuple[_native.Plan, Mover, int]] | None = None,
    ) -> None:
        """Sends the request, runs ``mover(fds, control, req)`` on the link's streams of our
        direction (a transfer of at most ``LOOP_MAX_BYTES``: ``stepper(fd, req)`` on one
        stream, moved by the loop), and waits for the peer's DONE. ``prepare(streams)``
        (a transfer over the limit): the plan to ask for, its mover and how many of the
        streams it takes, given how many there are.

        Raises:
            LLMTimeoutError: ``call.deadline`` passed (connecting streams, sending the
                request, moving bytes or waiting for DONE); the native job has returned.
            LLMException: the peer's failure (its status), the mover's (e.g. a stream
                carrying another transfer's bytes), or a closed link (LLM_LINK_FAILED,
                also when the data streams cannot be connected).
            LeaseStale: the peer refused: the cache is gone or was re-bound (nothing moved).
            asyncio.CancelledError: the caller was cancelled; raised once the job has returned.

        Whenever it does not end with a clean DONE, the streams it used are retired (never
        reused) and a CANCEL goes to the peer in the background.
        """
        link, streams = self.link, self.streams
        loop = asyncio.get_running_loop()
        # Timers cannot take every float: inf, nan and far-off deadlines mean "none" here
        # (the wire's deadline_ms is clamped to its schema, and the server caps it anyway).
        deadline = usable_deadline(call.deadline, loop.time())
        direction = streams.my_direction
        clean = False
        held: list[socket.socket] = []
        req = 0
        done: asyncio.Future[dict[str, Any]] | None = None
        epoch = streams.epoch[direction]
        tiny = plan.total_bytes <= LOOP_MAX_BYTES
        try:
            socks, epoch = await self._connect(direction, deadline)
            if tiny:
                socks = socks[:1]  # moved by the loop on one stream (see LOOP_MAX_BYTES)
            elif prepare is not None:
                plan, mover, n = prepare(len(socks))
                socks = socks[:n]
            body = {
                "cache_id": remote.cache_id,
                "deadline_ms": deadline_ms(call.deadline, loop.time()),
                "streams": len(socks),
                "epoch": epoch,
                **extra,
            }
            if remote.lease is not None:
                body["gen"] = remote.lease[1]  # served only for this registration and binding
            # Held open until the mover has returned (the job is quiesced before `finally`):
            # a close meanwhile (link dropped, streams replaced) must not free the fd numbers.
            fds = streams.hold(socks)
            held = socks
            try:
                # A peer that stopped reading must not hold us past the deadline in drain().
                async with asyncio.timeout_at(deadline):
                    req, done = await link.request(
                        msg_type, body, _wire.segments_to_bytes(plan.segments())
                    )
            except TimeoutError:
                raise failure(
                    LLMStatusCode.LLM_TIMEOUT,
                    "deadline passed while sending the request (the peer is not reading)",
                ) from None
            if tiny:
                fd = fds[0]
                await self._await_loop(deadline, LoopMove(lambda: stepper(fd, req)), done)
            else:
                assert mover is not None
                await self._await(call, deadline, mover, fds, req, done)
            clean = True
        finally:
            streams.release(held)
            if done is not None:
                # Whatever ended the transfer, nobody awaits its DONE any more: a reply (or
                # the link's closing failure) arriving later must not be left unretrieved.
                link.forget_request(req)
                if not done.done():
                    done.cancel()
                elif not done.cancelled():
                    done.exception()
            if not clean:
                # Their position is unknown: never reused. The peer drops or aborts the
                # request and retires them too (CANCEL, sent in the background).
                with contextlib.suppress(Exception):
                    # Just the ones it used: the client may have connected a newer set.
                    streams.drop(direction, only=held or None)
                with contextlib.suppress(Exception):
                    link.cancel_soon(req, epoch)

    async def _await_loop(
        self, deadline: float | None, move: LoopMove, done: asyncio.Future[dict[str, Any]]
    ) -> None:
        """Moves a tiny transfer's bytes on this task (no thread, no second task), then
        waits for its DONE. A failed DONE, or the link closing, while the bytes are awaited
        aborts the move (the peer will not send or take them); its reason is raised."""

        def on_reply(f: asyncio.Future[dict[str, Any]]) -> None:
            if f.cancelled() or f.exception() is not None or int(f.result()["status"]) != 0:
                move.abort()

        done.add_done_callback(on_reply)
        try:
            await move.run(deadline)
        except LLMException as exc:
            if done.done() and not done.cancelled():
                error = done.exception()
                if error is not None:
                    raise error from exc
                if int(done.result()["status"]) != 0:
                    raise peer_failure(done.result()) from exc
            raise
        finally:
            done.remove_done_callback(on_reply)
        try:
            async with asyncio.timeout_at(deadline):
                reply = await done
        except TimeoutError:
            raise failure(
                LLMStatusCode.LLM_TIMEOUT, "deadline passed waiting for the peer's completion"
            ) from None
        if int(reply["status"]) != 0:
            raise peer_failure(reply)

    async def _await(
        self,
        call: Call,
        deadline: float | None,
        mover: Mover,
        fds: list[int],
        req: int,
        done: asyncio.Future[dict[str, Any]],
    ) -> None:
        """Runs the mover of request ``req`` and waits for its DONE; returns only once the
        mover has returned, whatever happens."""
        ctl = _native.Control()
        job = asyncio.get_running_loop().create_task(
            call.executor.run(lambda c: mover(fds, c, req), deadline=deadline, control=ctl)
        )
        try:
            first, _ = await asyncio.wait({job, done}, return_when=asyncio.FIRST_COMPLETED)
            if done in first and not job.done():
                reply = done.result()
                if int(reply["status"]) != 0:
                    ctl.abort()  # the peer will not send (or take) the bytes
            await quiesce(job)
            job.result()  # raises the mover's error (timeout, peer closed, stale, ...)
            try:
                async with asyncio.timeout_at(deadline):
                    reply = await done
            except TimeoutError:
                raise failure(
                    LLMStatusCode.LLM_TIMEOUT, "deadline passed waiting for the peer's completion"
                ) from None
            if int(reply["status"]) != 0:
                raise peer_failure(reply)
        except BaseException as exc:
            ctl.abort()
            await quiesce(job)
            if not job.cancelled():
                job.exception()  # retrieved: what propagates is decided below
            refusal = None
            if done.done() and not done.cancelled():
                if done.exception() is None and int(done.result()["status"]) != 0:
                    refusal = done.result()
            else:
                done.cancel()
            # A reply that says why beats our local symptom (e.g. the peer's refusal
            # made us abort the mover, which alone would read as a timeout).
            if refusal is not None and isinstance(exc, LLMException):
                raise peer_failure(refusal) from exc
            raise
