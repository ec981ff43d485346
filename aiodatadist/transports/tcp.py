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
from ..errors import LLMException, LLMStatusCode, format_error
from .base import Call

if TYPE_CHECKING:
    from .._caches import CacheEntry
    from .._control import Peer

__all__ = ["TcpPath"]


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
            _, done = await peer.request(msg_type, body, _wire.segments_to_bytes(plan.segments()))
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
                status = int(reply["status"])
                if status != 0:
                    raise LLMException(
                        format_error(call.api, LLMStatusCode(status), f"peer: {reply['info']}"),
                        status_code=status,
                    )
                clean = True
            except BaseException:
                ctl.abort()
                await quiesce(job)
                if done.done() and not done.cancelled():
                    done.exception()
                else:
                    done.cancel()
                # A reply that says why beats our local symptom (e.g. the peer's refusal).
                raise
        finally:
            peer.release_streams(held)
            if not clean:
                with contextlib.suppress(Exception):
                    peer._drop_streams(direction)
