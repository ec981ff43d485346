"""``tcp`` stream requests: the format of a small pull asked and answered on one stream.

A pull of at most ``STREAM_MAX_BYTES`` (and ``MAX_STREAM_SEGMENTS`` segments) is asked on
the request stream of the requester's direction (``tcp_streams.REQUEST_STREAM``), which
carries its bytes back: one round trip, no control message, no DONE. The requester
(``tcp_lane.StreamPull``) sends the request and takes the answer with ``SockStep``: on
the loop thread up to ``tcp_lane.STREAM_POLL_MAX_BYTES``, on a worker thread above it.
The serving side's native thread (``ext/serve.cpp``, started by ``tcp_serve.TcpServing``)
reads each request, checks it against the instance's serve book and answers it.

Only the answer's stream header (or refusal) with the request's tag is taken: the
bytes of an abandoned pull (its stream retired) can never land in a later one.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import _native, _wire
from ..errors import LLMStatusCode

if TYPE_CHECKING:
    pass

__all__ = [
    "MAX_STREAM_SEGMENTS",
    "REQUEST_MAGIC",
    "STREAM_MAX_BYTES",
    "ServeStats",
    "StreamRequest",
    "decode_refusal",
    "decode_request",
    "encode_refusal",
    "encode_request",
]

log = logging.getLogger("aiodatadist.transports.tcp")

# A small pull (at most STREAM_MAX_BYTES, at most MAX_STREAM_SEGMENTS segments) asks on the
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
STREAM_MAX_BYTES = 4 * 1024 * 1024
"""The most bytes a stream request may move (more: the control-plane request, over the
link's data streams in parallel). Below it the control plane's fixed cost (a PULL on the
control connection, the peer's loop and serving executor, a DONE back: ~0.5 ms on the
2-core dev VM) outweighs what parallel streams gain (docs/performance.md)."""
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
class ServeStats:
    """What the serving side of one link did with the peer's requests (for tests and tools)."""

    served: int = 0  # ended with a successful DONE (a stream request: its bytes sent)
    failed: int = 0  # ended with a failed DONE or refusal (timed out, mover error, stale...)
    stale: int = 0  # of those: named streams of a retired epoch; no stream was touched
    cancelled_queued: int = 0  # CANCEL arrived while queued: never started
    cancelled_running: int = 0  # CANCEL arrived while running: aborted
