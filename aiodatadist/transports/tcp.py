"""``tcp``: two-sided, any hosts.

The requester sends PULL (or PUSH) with the plan's segments on the control
connection; the serving side checks every segment against its registered
memory and ``sendmsg``s straight from it (or ``readv``s straight into it),
while the requester ``readv``s straight into its destination blocks (or sends
from its source): no staging copy on either side. The bytes travel on the
link's data streams of the requester's direction; a transfer that does not
end cleanly makes the client replace those streams before the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING, Any

from .. import _native, _wire
from ..errors import LLMException, LLMStatusCode, format_error, to_status_code
from .base import Call

if TYPE_CHECKING:
    from .._caches import CacheEntry
    from .._control import Peer

__all__ = ["TcpPath"]


def _peer_failure(api: str, reply: dict[str, Any]) -> LLMException:
    """The peer's DONE failure as an LLMException (a status it made up: LLM_FAILED)."""
    code = to_status_code(int(reply["status"]))
    if code == LLMStatusCode.LLM_SUCCESS:
        code = LLMStatusCode.LLM_FAILED
    return LLMException(format_error(api, code, f"peer: {reply['info']}"), status_code=code)


class TcpPath:
    """Requests and data streams over one peer connection."""

    name = "tcp"

    def __init__(self, peer: Peer) -> None:
        self.peer = peer

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        dst = local.addrs
        await self._transfer(
            _wire.MsgType.PULL,
            plan,
            remote,
            call,
            {"dst_geometry": [local.num_tensors, local.num_blocks, local.block_bytes]},
            lambda fds, c: _native.sock_recv(fds, plan, dst, c),
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
            lambda fds, c: _native.sock_send(fds, plan, src, c),
        )

    async def _transfer(
        self,
        msg_type: _wire.MsgType,
        plan: _native.Plan,
        remote: CacheEntry,
        call: Call,
        extra: dict[str, Any],
        mover: Any,
    ) -> None:
        from .._control import quiesce

        peer = self.peer
        loop = asyncio.get_running_loop()
        direction = peer.my_direction
        clean = False
        held: list[socket.socket] = []
        try:
            try:
                socks = await peer.ensure_streams(direction, call.deadline)
            except TimeoutError:
                raise LLMException(
                    format_error(
                        call.api,
                        LLMStatusCode.LLM_TIMEOUT,
                        "deadline passed while connecting data streams",
                    ),
                    status_code=LLMStatusCode.LLM_TIMEOUT,
                ) from None
            left_ms = (
                1 if call.deadline is None else max(1, int((call.deadline - loop.time()) * 1000))
            )
            body = {
                "cache_id": remote.cache_id,
                "deadline_ms": min(left_ms, 2**31 - 1),
                "streams": len(socks),
                **extra,
            }
            # Held open until the mover has returned (the job is quiesced before `finally`):
            # a close meanwhile (link dropped, streams replaced) must not free the fd numbers.
            fds = peer.hold_streams(socks)
            held = socks
            try:
                # A peer that stopped reading must not hold us past the deadline in drain().
                async with asyncio.timeout_at(call.deadline):
                    _, done = await peer.request(
                        msg_type, body, _wire.segments_to_bytes(plan.segments())
                    )
            except TimeoutError:
                raise LLMException(
                    format_error(
                        call.api,
                        LLMStatusCode.LLM_TIMEOUT,
                        "deadline passed while sending the request (the peer is not reading)",
                    ),
                    status_code=LLMStatusCode.LLM_TIMEOUT,
                ) from None
            ctl = _native.Control()
            job = loop.create_task(
                call.executor.run(
                    lambda c: mover(fds, c), deadline=call.deadline, api=call.api, control=ctl
                )
            )
            try:
                first, _ = await asyncio.wait({job, done}, return_when=asyncio.FIRST_COMPLETED)
                if done in first and not job.done():
                    reply = done.result()
                    if int(reply["status"]) != 0:
                        ctl.abort()  # the peer will not send (or take) the bytes
                await quiesce(job)
                job.result()  # raises the mover's error (timeout, peer closed, ...)
                try:
                    async with asyncio.timeout_at(call.deadline):
                        reply = await done
                except TimeoutError:
                    raise LLMException(
                        format_error(
                            call.api,
                            LLMStatusCode.LLM_TIMEOUT,
                            "deadline passed waiting for the peer's completion",
                        ),
                        status_code=LLMStatusCode.LLM_TIMEOUT,
                    ) from None
                if int(reply["status"]) != 0:
                    raise _peer_failure(call.api, reply)
                clean = True
            except BaseException as exc:
                ctl.abort()
                await quiesce(job)
                refusal = None
                if done.done() and not done.cancelled():
                    if done.exception() is None and int(done.result()["status"]) != 0:
                        refusal = done.result()
                else:
                    done.cancel()
                # A reply that says why beats our local symptom (e.g. the peer's refusal
                # made us abort the mover, which alone would read as a timeout).
                if refusal is not None and isinstance(exc, LLMException):
                    raise _peer_failure(call.api, refusal) from exc
                raise
        finally:
            peer.release_streams(held)
            if not clean:
                with contextlib.suppress(Exception):
                    peer._drop_streams(direction)
