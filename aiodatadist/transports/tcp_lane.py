"""``tcp`` small pulls: one asked on the request stream (:class:`StreamPull`), and tcp's fast lane.

A pull of at most ``STREAM_MAX_BYTES`` (and ``MAX_STREAM_SEGMENTS`` segments) is asked on
the request stream of the requester's direction (``tcp_streams.REQUEST_STREAM``) and
answered on it by the peer's native serving thread
(:mod:`~aiodatadist.transports.tcp_requests`): one round trip, no control message, no
DONE. :class:`StreamPull` is that exchange, in two halves: :meth:`StreamPull.begin`
sends the request and polls up to ``spin_us`` for the answer on the calling thread
(GIL released), :meth:`StreamPull.finish` awaits the rest: on the loop for an answer of
at most ``STREAM_POLL_MAX_BYTES``, on a worker thread of the instance's executor for a
bigger one (the loop copies no megabytes). The whole path
(``tcp.TcpPath._stream_pull``) uses them; so does :class:`TcpLane`, tcp's fast lane
(:mod:`aiodatadist._lanes`): a repeated small pull between the same two caches skips
the runner (plan, slot, holds) and asks at once; an answer that is not back within the
spin makes the lane's pull an awaitable, which takes the link's slot (free: the lane
runs only then) until the answer is in.

Unless an exchange ends with the bytes or a refusal (either leaves the stream in step),
its stream is retired and a CANCEL goes to the peer in the background: the bytes of an
abandoned pull can never land in a later one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import socket
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from .. import _native, _wire
from .._leases import LeaseStale
from ..config import DataPath
from ..errors import LLMException, LLMStatusCode, failure, from_native, to_status_code
from .base import Lane
from .tcp_requests import MAX_STREAM_SEGMENTS, decode_refusal, encode_request
from .tcp_streams import LoopMove

if TYPE_CHECKING:
    from .._caches import CacheEntry
    from .base import Call
    from .peer import ControlLink
    from .tcp_streams import TcpStreams


class TcpPath(Protocol):
    """What a stream request needs of the requesting half (``tcp.TcpPath``)."""

    @property
    def link(self) -> ControlLink: ...

    @property
    def streams(self) -> TcpStreams: ...

    def broken(self, e: OSError) -> LLMException: ...

    async def refresh(self, deadline: float | None) -> bool: ...


__all__ = [
    "STREAM_POLL_MAX_BYTES",
    "STREAM_SPIN_US",
    "StreamPull",
    "TcpLane",
    "deadline_ms",
    "peer_failure",
    "usable_deadline",
]

STREAM_SPIN_US = 100
"""How long a tiny pull polls for its answer on the loop's thread (non-blocking steps,
yielding the CPU between them, GIL released, never past its deadline) before the loop
waits for it: an answer that comes within it costs no loop round trip and no wakeup
(0: the loop waits from the start)."""

STREAM_POLL_MAX_BYTES = 1024 * 1024
"""A stream pull's answer of at most this size is taken by the loop, as a tiny one's:
polled for (``STREAM_SPIN_US``), then awaited and moved in non-blocking steps (at most
this much copied on the loop's thread, ~0.1 ms here): a worker thread's wakeup and then
the loop's cost more (512 KiB: 0.08-0.14 ms p50 against ~0.28 ms through a worker, on the
dev VM). A bigger answer a worker thread takes (:meth:`StreamPull.finish`)."""

# Stream requests' tags: apart from the control requests' ids (both name transfers in
# CANCEL and in the serving side's bookkeeping).
_stream_tags = itertools.count(1 << 40)
# A deadline further away than this (~31 years) is treated as none: loop timers (uvloop's
# in particular) overflow on huge or infinite times.
_FOREVER_S = 1e9


def usable_deadline(deadline: float | None, now: float) -> float | None:
    """``deadline`` as a loop time the timers can take: None for none, inf, nan or huge;
    ``now`` for -inf (already passed)."""
    if deadline is not None and deadline == -math.inf:
        return now
    if deadline is None or not math.isfinite(deadline) or deadline - now > _FOREVER_S:
        return None
    return deadline


def deadline_ms(deadline: float | None, now: float) -> int:
    """The wire's ``deadline_ms`` for ``deadline``: at least 1, at most the schema's maximum
    (None, inf or huge: the maximum; the server caps it with its own ServeTimeout)."""
    if deadline is not None and deadline == -math.inf:
        return 1
    if deadline is None or not math.isfinite(deadline):
        return _wire.MAX_DEADLINE_MS
    left = (deadline - now) * 1000
    if left >= _wire.MAX_DEADLINE_MS:
        return _wire.MAX_DEADLINE_MS
    return max(1, int(left))


def peer_failure(reply: dict[str, Any]) -> LLMException:
    """The peer's DONE failure as an LLMException (a status it made up: LLM_FAILED).

    A refusal the peer marks ``stale`` (the cache is gone, or was re-bound since our
    table) comes as :class:`LeaseStale`: nothing moved, and the caller refreshes its table
    and retries once.
    """
    code = to_status_code(int(reply["status"]))
    if code == LLMStatusCode.LLM_SUCCESS:
        code = LLMStatusCode.LLM_FAILED
    stale = code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST and reply.get("stale") is True
    return failure(code, f"peer: {reply['info']}", kind=LeaseStale if stale else None)


def asked_of(remote: CacheEntry) -> tuple[int, int | None]:
    """What a stream request names of the peer's cache: its id, and the generation of its
    lease (served only for that registration and binding; None: none)."""
    return remote.cache_id, None if remote.lease is None else remote.lease[1]


def landing_in(local: CacheEntry) -> tuple[tuple[int, int, int], list[int]]:
    """What a stream request needs of our cache: its geometry and tensor addresses."""
    return (local.num_tensors, local.num_blocks, local.block_bytes), local.addrs


class StreamPull:
    """One small pull asked on ``sock`` (the request stream of the requester's direction, of
    ``epoch``), answered on it. :meth:`begin`, then :meth:`finish` unless it ended."""

    __slots__ = ("_clean", "_epoch", "_path", "_rest", "_sock", "_tag", "step")

    def __init__(self, path: TcpPath, sock: socket.socket, epoch: int) -> None:
        self._path = path
        self._sock = sock
        self._epoch = epoch
        self._tag = 0
        self._rest: memoryview | None = None
        self._clean: bool | None = None  # None: under way (the stream is held)
        self.step: _native.SockStep | None = None

    @property
    def refused(self) -> bool:
        """The peer answered with a refusal (nothing landed; :attr:`step`'s ``refusal``)."""
        return self.step is not None and self.step.refused

    def begin(
        self,
        plan: _native.Plan,
        remote: tuple[int, int | None],
        local: tuple[tuple[int, int, int], list[int]],
        deadline: float | None,
        now: float,
        spin_us: int | None,
    ) -> bool:
        """Sends the request and takes what of the answer comes within ``spin_us`` (never
        past ``deadline``); True once the exchange ended (the bytes landed, or a refusal).
        ``remote``: the peer's cache id and lease generation (:func:`asked_of`); ``local``:
        our cache's geometry and tensor addresses (:func:`landing_in`). ``spin_us`` None:
        sends the request only, takes nothing (a worker thread takes the answer:
        :meth:`finish` given a call; a step here would copy on the loop thread for as long
        as the peer keeps sending).

        Raises:
            LLMException: the stream failed (it is retired; CANCEL is sent).
        """
        streams = self._path.streams
        self._tag = tag = next(_stream_tags)
        frame = encode_request(
            tag, *remote, local[0], deadline_ms(deadline, now), _native.plan_segment_bytes(plan)
        )
        fd = streams.hold([self._sock])[0]
        try:
            try:
                step = self.step = _native.SockStep(fd, plan, local[1], False, tag=tag)
            except _native.NativeError as e:
                raise from_native(e) from e
            try:
                sent = self._sock.send(frame)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                raise self._path.broken(e) from e
            if sent < len(frame):  # (its buffer is full: the peer does not read)
                self._rest = memoryview(frame)[sent:]
                return False
            if spin_us is None or (deadline is not None and deadline <= now):
                return False  # (past its deadline: finish raises, taking nothing)
            if deadline is not None:
                spin_us = min(spin_us, int((deadline - now) * 1e6))
            try:
                done = step.step_for(spin_us) if spin_us > 0 else step.step()
            except _native.NativeError as e:
                raise from_native(e) from e
        except BaseException:
            self.end(False)
            raise
        if done:
            self.end(True)
        return done

    async def finish(self, deadline: float | None, call: Call | None = None) -> None:
        """Awaits the rest of the exchange (after :meth:`begin` returned False): on the
        loop, or, given ``call``, on a worker thread of its executor (``SockStep.run``,
        GIL released, under ``call``'s deadline: a bigger answer, which the loop must not
        copy).

        Raises:
            LLMTimeoutError: the deadline passed (nothing moves after it; a worker's job
                has returned).
            LLMException: the stream failed, or the link closed.
            asyncio.CancelledError: cancelled (nothing moves after it).
        """
        step = self.step
        assert step is not None and self._clean is None
        try:
            if call is None:
                await self._send_rest(deadline)
                await LoopMove(lambda: step).run(deadline)
            else:
                await self._send_rest(call.deadline)
                await call.run(step.run)
        except BaseException:
            self.end(False)
            raise
        self.end(True)

    async def _send_rest(self, deadline: float | None) -> None:
        """The rest of a request the socket did not take at once (:meth:`begin`)."""
        if self._rest is None:
            return
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(usable_deadline(deadline, loop.time())):
                await loop.sock_sendall(self._sock, self._rest)
        except TimeoutError:
            raise failure(
                LLMStatusCode.LLM_TIMEOUT,
                "deadline passed while sending the request (the peer is not reading)",
            ) from None
        except OSError as e:
            raise self._path.broken(e) from e
        self._rest = None

    def end(self, clean: bool) -> None:
        """Lets go of the stream; not ``clean``: its position is unknown, so it is retired
        (never reused) and the peer is told (CANCEL, in the background). Idempotent."""
        if self._clean is not None:
            return
        self._clean = clean
        streams, link = self._path.streams, self._path.link
        streams.release([self._sock])
        if not clean:
            with contextlib.suppress(Exception):
                streams.drop(streams.my_direction, only=[self._sock])
            with contextlib.suppress(Exception):
                link.cancel_soon(self._tag, self._epoch)


class TcpLane(Lane):
    """tcp's fast lane between one remote and one local cache (see the module docstring).

    A pull it takes is asked at once on the request stream of our direction; ``pull``
    returns the bytes landed when the answer came within the spin, else an awaitable of
    them. 0 (or an awaitable of 0): not taken, nothing landed (no stream up, a plan the
    whole path must judge, a stale refusal: the peer's table is fetched again first). The
    peer's other refusals are raised as the whole path raises them.
    """

    kind = DataPath.TCP
    max_bytes = STREAM_POLL_MAX_BYTES  # (what the loop takes itself)

    def __init__(self, path: TcpPath, remote: CacheEntry, local: CacheEntry, spin_us: int) -> None:
        # Values, not our entry: a lane never keeps a cache of ours (or its KvCache) alive
        # (the peer's entry is kept by the lane's route anyway).
        self._path = path
        self._peer = remote
        self._remote = asked_of(remote)
        self._local = landing_in(local)
        self._src = remote.geometry
        self._dst = local.geometry
        self._spin = spin_us
        self._loop = asyncio.get_running_loop()

    def usable(self) -> bool:
        return not self._path.link.closed.is_set()

    def pull(
        self,
        src_blocks: list[int],
        dst_blocks: list[int],
        span: tuple[int, int, int],
        deadline: float | None = None,
    ) -> int | Awaitable[int]:
        path = self._path
        streams = path.streams
        direction = streams.my_direction
        sock = streams.request_stream(direction)
        if sock is None or streams.held(sock) or self._peer.device_id is not None:
            return 0  # (the whole path connects the streams, waits its turn, or refuses)
        try:
            plan = _native.Plan.blocks(self._src, self._dst, src_blocks, dst_blocks, *span)
        except (_native.NativeError, TypeError, OverflowError, ValueError):
            return 0
        if plan.total_bytes > STREAM_POLL_MAX_BYTES or plan.num_segments > MAX_STREAM_SEGMENTS:
            return 0
        now = self._loop.time()
        if deadline is not None and deadline <= now:
            return 0
        ask = StreamPull(path, sock, streams.epoch[direction])
        if ask.begin(plan, self._remote, self._local, deadline, now, self._spin):
            return self._answer(ask, plan.total_bytes, deadline)
        return self._rest(ask, deadline, plan.total_bytes)

    async def _rest(self, ask: StreamPull, deadline: float | None, nbytes: int) -> int:
        await ask.finish(deadline)
        got = self._answer(ask, nbytes, deadline)
        return got if isinstance(got, int) else await got

    def _answer(self, ask: StreamPull, nbytes: int, deadline: float | None) -> int | Awaitable[int]:
        """The bytes landed, or the peer's refusal raised as the whole path raises it; a
        stale one (the cache went or was re-bound since our table): nothing landed, the
        table is fetched anew and the whole path takes the pull (0)."""
        if not ask.refused:
            return nbytes
        assert ask.step is not None
        err = peer_failure(decode_refusal(ask.step.refusal))
        if isinstance(err, LeaseStale):
            return self._refreshed(deadline)
        raise err

    async def _refreshed(self, deadline: float | None) -> int:
        await self._path.refresh(deadline)  # (LLMTimeoutError: the deadline passed first)
        return 0
