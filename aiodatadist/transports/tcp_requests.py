"""``tcp`` stream requests: a tiny pull asked and answered on one data stream.

A pull of at most ``LOOP_MAX_BYTES`` (and ``MAX_STREAM_SEGMENTS`` segments) is asked on
the first data stream of the requester's direction, the one that carries its bytes
back: one round trip, no control message, no DONE. The requester (``tcp.TcpPath``)
sends the request and takes the answer with ``SockStep``; the serving side
(:class:`StreamRequests`, mixed into ``tcp_serve.TcpServing``) reads it when the stream
is readable and nothing uses it, and sends the answer at once from the loop's callback
when nothing else is being served, else in turn with the control connection's requests.

Only the answer's stream header (or refusal) with the request's tag is taken: the
bytes of an abandoned pull (its stream retired) can never land in a later one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import _native, _wire
from .._leases import LeaseStale
from ..errors import LLMException, LLMStatusCode, failure
from .tcp_streams import LOOP_MAX_BYTES, LoopMove

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._caches import CacheEntry, CacheTable
    from .peer import ControlLink
    from .tcp_streams import TcpStreams

__all__ = [
    "MAX_STREAM_SEGMENTS",
    "REQUEST_MAGIC",
    "ServeStats",
    "StreamJob",
    "StreamRequest",
    "StreamRequests",
    "decode_refusal",
    "decode_request",
    "encode_refusal",
    "encode_request",
]

log = logging.getLogger("aiodatadist.transports.tcp")

# A tiny pull (at most LOOP_MAX_BYTES, at most MAX_STREAM_SEGMENTS segments) asks on the
# data stream itself, the one that carries its bytes back: one round trip, no control
# message. The request is a fixed little-endian header and the segments table:
#   magic "aioddRQ1", tag u64, cache_id u64, gen u64, dst geometry 3 x u64
#   (num_tensors, num_blocks, block_bytes), deadline_ms u32, flags u32 (bit 0: gen
#   given), segment count u32, then 40 bytes per segment (as _wire's PULL tail).
# The answer is the stream header of transfer `tag` and the bytes, or a refusal
# (_native.SOCK_REFUSAL_MAGIC, tag, length, then a JSON body {status, info, stale}),
# after which the stream is still in step. Anything else retires the stream.

REQUEST_MAGIC = b"aioddRQ1"  # (its first byte is not the stream header's)
_REQUEST = struct.Struct("<8sQQQQQQIII")
_HAS_GEN = 1
MAX_STREAM_SEGMENTS = 1024
"""The most segments a stream request may carry (more: the control-plane request)."""
MAX_REQUEST_BYTES = _REQUEST.size + MAX_STREAM_SEGMENTS * _wire.SEGMENT_ROW_BYTES
_REFUSAL = struct.Struct("<8sQQ")
_U64 = 2**64 - 1


class StreamRequest(NamedTuple):
    """A decoded stream request (its numbers checked for range only: the serving side
    checks the segments against what it registered)."""

    tag: int
    cache_id: int
    gen: int | None
    dst_geometry: tuple[int, int, int]
    deadline_ms: int
    segments: bytes


def encode_request(
    tag: int,
    cache_id: int,
    gen: int | None,
    dst_geometry: tuple[int, int, int],
    deadline_ms: int,
    segments: bytes,
) -> bytes:
    """A stream request's bytes (``segments``: as ``_wire.segments_to_bytes`` gives).

    Raises:
        WireError: too many segments, or a number out of range.
    """
    nsegs, rest = divmod(len(segments), _wire.SEGMENT_ROW_BYTES)
    if rest or nsegs > MAX_STREAM_SEGMENTS:
        raise _wire.WireError(f"a stream request takes at most {MAX_STREAM_SEGMENTS} segments")
    try:
        head = _REQUEST.pack(
            REQUEST_MAGIC,
            tag,
            cache_id,
            0 if gen is None else gen,
            *dst_geometry,
            max(1, min(deadline_ms, _wire.MAX_DEADLINE_MS)),
            0 if gen is None else _HAS_GEN,
            nsegs,
        )
    except struct.error as e:
        raise _wire.WireError(f"stream request out of range: {e}") from None
    return head + segments


def decode_request(data: bytes) -> tuple[StreamRequest, int] | None:
    """The request at the start of ``data`` and its length, or None when more bytes are
    needed (never more than ``MAX_REQUEST_BYTES`` in all).

    Raises:
        WireError: not a request (wrong magic, flags, geometry or deadline), or too many
            segments.
    """
    if len(data) < _REQUEST.size:
        if not REQUEST_MAGIC.startswith(data[: len(REQUEST_MAGIC)]):
            raise _wire.WireError("not a stream request")
        return None
    magic, tag, cache_id, gen, nt, nb, bb, deadline_ms, flags, nsegs = _REQUEST.unpack_from(data)
    if magic != REQUEST_MAGIC:
        raise _wire.WireError("not a stream request")
    if flags & ~_HAS_GEN or not (nt and nb and bb) or not 1 <= deadline_ms <= _wire.MAX_DEADLINE_MS:
        raise _wire.WireError("malformed stream request")
    if nsegs > MAX_STREAM_SEGMENTS:
        raise _wire.WireError(f"{nsegs} segments exceed {MAX_STREAM_SEGMENTS}")
    end = _REQUEST.size + nsegs * _wire.SEGMENT_ROW_BYTES
    if len(data) < end:
        return None
    geo = (nt, nb, bb)
    req = StreamRequest(
        tag,
        cache_id,
        gen if flags & _HAS_GEN else None,
        geo,
        deadline_ms,
        data[_REQUEST.size : end],
    )
    return req, end


def encode_refusal(tag: int, status: int, info: str, stale: bool) -> bytes:
    """The refusal of stream request ``tag`` (what the requester's ``SockStep`` takes
    instead of the bytes). ASCII JSON, well under ``SOCK_MAX_REFUSAL_BYTES``."""
    body = json.dumps({"status": int(status), "info": info[:600], "stale": stale}).encode()
    return _REFUSAL.pack(_native.SOCK_REFUSAL_MAGIC, tag, len(body)) + body


def decode_refusal(body: bytes) -> dict[str, Any]:
    """A refusal's body as a DONE-like reply ``{status, info, stale}``; a malformed one
    (the peer is not well) reads as a bare failure."""
    try:
        d = json.loads(body)
        status, info, stale = d["status"], d["info"], d["stale"]
        if isinstance(status, int) and 0 <= status <= _U64 and isinstance(info, str):
            return {"status": status, "info": info[:1000], "stale": stale is True}
    except (ValueError, TypeError, KeyError):
        pass
    return {"status": int(LLMStatusCode.LLM_FAILED), "info": "malformed refusal", "stale": False}


@dataclass
class StreamJob:
    """A stream request taken off its stream (held, so unwatched, until the job ends);
    ``started``: its send and the cache it holds, once begun."""

    sock: socket.socket
    request: StreamRequest
    started: tuple[_native.SockStep, CacheEntry, float] | None = None
    held: bool = False  # (one served at once, from the callback, needs no hold)


@dataclass
class ServeStats:
    """What the serving side of one link did with the peer's requests (for tests and tools)."""

    served: int = 0  # ended with a successful DONE (a stream request: its bytes sent)
    failed: int = 0  # ended with a failed DONE or refusal (timed out, mover error, stale...)
    stale: int = 0  # of those: named streams of a retired epoch; no stream was touched
    cancelled_queued: int = 0  # CANCEL arrived while queued: never started
    cancelled_running: int = 0  # CANCEL arrived while running: aborted


class StreamRequests:
    """The serving side of stream requests, mixed into ``tcp_serve.TcpServing`` (whose
    state it shares: the queue, the running request, CANCEL's bookkeeping, the stats)."""

    _link: ControlLink
    _streams: TcpStreams
    _table: Callable[[], CacheTable]
    _cap: float
    _require_ready: Callable[[], None]
    _requests: asyncio.Queue[tuple[Any, float]]
    _queued: dict[int, int]
    _cancelled: set[int]
    _running: tuple[int, _native.Control | LoopMove] | None
    _busy: bool
    _partial: dict[socket.socket, bytes]
    _loop: asyncio.AbstractEventLoop
    _stats: ServeStats

    def _resolve(
        self,
        cache_id: int,
        gen: int | None,
        pull: bool,
        peer_geometry: Any,
        segments: bytes,
        api: str,
    ) -> tuple[CacheEntry, _native.Plan]:
        raise NotImplementedError

    def _readable(self, sock: socket.socket) -> None:
        """A stream of the peer's direction is readable while nothing uses it: a stream
        request (or part of one) came, or the peer closed it."""
        peer_dir = 1 - self._streams.my_direction
        have = self._partial.pop(sock, b"")
        try:
            if not have and sock.recv(1, socket.MSG_PEEK)[:1] not in (b"", REQUEST_MAGIC[:1]):
                # The bytes of a transfer asked for on the control connection (a PUSH we
                # have not read yet): left for it; its serving watches the stream again.
                self._streams.unwatch(sock)
                return
            data = sock.recv(MAX_REQUEST_BYTES - len(have))
        except (BlockingIOError, InterruptedError):
            if have:
                self._partial[sock] = have
            return
        except OSError:
            data = b""
        try:
            if not data or self._link.closed.is_set():
                raise _wire.WireError("the stream closed")
            data = have + data if have else data
            got = decode_request(data)
            if got is None:
                self._partial[sock] = data
                return
            request, end = got
            if end != len(data):
                raise _wire.WireError("a second request before the first one's answer")
        except _wire.WireError as e:
            log.debug("data stream from cluster %d retired: %s", self._link.info.cluster_id, e)
            self._streams.drop(peer_dir, only=[sock])
            return
        job = StreamJob(sock, request)
        now = self._loop.time()
        # Nothing else being served: sent now, from this callback; most often it all
        # fits in the socket and the request ends here.
        try:
            later = self._busy or not self._requests.empty() or self._start_stream(job, now)
        except Exception:  # (a bug: the stream is out of step, the loop goes on)
            log.exception(
                "serving a stream request from cluster %d failed", self._link.info.cluster_id
            )
            self._end_stream(job, ok=False)
            return
        if later:
            job.held = True
            self._streams.hold([sock])  # one request at a time: unwatched until it ends
            self._queued[request.tag] = self._queued.get(request.tag, 0) + 1
            self._requests.put_nowait((job, now))

    def _start_stream(self, job: StreamJob, arrived: float) -> bool:
        """Checks a stream request and sends what the socket takes; True when the rest
        must wait for the socket (``job.started`` is set then), False when it ended
        (sent, refused or failed)."""
        r, api = job.request, "serve_pull"
        deadline = arrived + min(r.deadline_ms / 1000, self._cap)
        try:
            if self._loop.time() >= deadline:
                raise failure(
                    LLMStatusCode.LLM_TIMEOUT, "request arrived after its deadline", api=api
                )
            entry, plan = self._resolve(r.cache_id, r.gen, True, r.dst_geometry, r.segments, api)
            if plan.total_bytes > LOOP_MAX_BYTES:
                raise failure(
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"a stream request moves at most {LOOP_MAX_BYTES} bytes",
                    api=api,
                )
            self._require_ready()
            entry.hold(api)
        except LeaseStale as e:
            self._refuse(job, e.status_code, str(e), stale=True)
            return False
        except LLMException as e:
            self._refuse(job, e.status_code, str(e))
            return False
        except _wire.WireError as e:
            self._refuse(job, LLMStatusCode.LLM_PARAM_INVALID, str(e))
            return False
        except RuntimeError as e:  # finalized
            self._refuse(job, LLMStatusCode.LLM_FAILED, str(e))
            return False
        try:
            step = _native.SockStep(job.sock.fileno(), plan, entry.addrs, True, tag=r.tag)
            done = step.step()
        except _native.NativeError as e:
            entry.release()
            log.debug("serving stream request %d failed: %s", r.tag, e)
            self._end_stream(job, ok=False)
            return False
        if not done:
            job.started = (step, entry, deadline)
            return True
        entry.release()
        self._end_stream(job, ok=True)
        return False

    async def _serve_stream(self, job: StreamJob, arrived: float) -> None:
        """Serves a queued stream request (or the rest of one begun at once)."""
        r = job.request
        if not self._streams.in_place(job.sock):  # retired meanwhile: nobody to answer
            self._end_stream(job, ok=False)
            return
        if job.started is None and not self._start_stream(job, arrived):
            return
        assert job.started is not None
        step, _, deadline = job.started
        move = LoopMove(lambda: step)
        self._running = (r.tag, move)
        ok = False
        try:
            await move.run(deadline, "serve_pull")
            ok = True
        except LLMException as e:  # timed out, the peer went away, or CANCEL aborted it
            log.debug("serving stream request %d failed: %s", r.tag, e)
        finally:
            self._running = None
            cancelled = r.tag in self._cancelled
            self._cancelled.discard(r.tag)
            if cancelled:
                self._stats.cancelled_running += 1
            self._end_stream(job, ok=ok, count=not cancelled)

    def _refuse(
        self, job: StreamJob, status: LLMStatusCode, info: str, stale: bool = False
    ) -> None:
        """Answers a stream request with a refusal frame (nothing else was sent on it)."""
        self._stats.failed += 1
        frame = encode_refusal(job.request.tag, int(status), info, stale)
        try:
            sent = job.sock.send(frame)
        except OSError:
            sent = -1
        # Its receive buffer is empty (it reads every answer before it asks again): a
        # refusal that does not fit whole leaves the stream out of step.
        self._end_stream(job, ok=sent == len(frame), count=False)

    def _end_stream(self, job: StreamJob, *, ok: bool, count: bool = True) -> None:
        """Ends a stream request: its cache released, its stream watched again (``ok``:
        still in step) or retired."""
        if job.started is not None:
            job.started[1].release()
            job.started = None
        if count:
            if ok:
                self._stats.served += 1
            else:
                self._stats.failed += 1
        if not ok:
            self._streams.drop(1 - self._streams.my_direction, only=[job.sock])
        if job.held:
            job.held = False
            self._streams.release([job.sock])

    def _abandon_queued(self) -> None:
        """The serve loop ended (the link closed): queued stream requests let go of their
        caches and streams."""
        while not self._requests.empty():
            item, _ = self._requests.get_nowait()
            if isinstance(item, StreamJob):
                self._end_stream(item, ok=False, count=False)
