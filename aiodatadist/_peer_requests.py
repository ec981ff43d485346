"""What a link asks of its peer over the control connection (a mixin of ``_control.Peer``).

* requests answered by a DONE (``request``; the tcp path's PULL / PUSH), and their CANCEL
  (``cancel_soon``);
* a PING round trip that brings the peer's table up to date (``refresh``);
* the heartbeat (``_heartbeat``, ``aiodatadist.HeartbeatTimeout``): a silent peer is
  pinged, and one silent for the whole timeout loses the link.

The read loop that routes the answers (DONE, PONG) is ``Peer``'s, in :mod:`._control`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from . import _wire
from .errors import LLMException, LLMStatusCode, failure

__all__ = ["CANCEL_TIMEOUT", "PeerRequests", "next_req_id"]

CANCEL_TIMEOUT = 2.0
"""How long a requester tries to send a CANCEL (in the background) before closing the link."""
_req_ids = itertools.count(1)


def next_req_id() -> int:
    """A new request (or PING) id, unique in this process."""
    return next(_req_ids)


class PeerRequests:
    """Requests, cancels, refreshes and the heartbeat of one control connection."""

    closed: asyncio.Event
    _loop: asyncio.AbstractEventLoop
    _pending: dict[int, asyncio.Future[dict[str, Any]]]
    _pongs: dict[int, asyncio.Future[None]]
    # Since when the read loop has waited for the peer's next message (None while it
    # handles one): what the heartbeat measures silence by.
    _waiting_since: float | None

    if TYPE_CHECKING:  # Peer's own (the connection's plumbing)

        async def send(
            self, msg_type: _wire.MsgType, body: dict[str, Any], binary: bytes = b""
        ) -> None: ...

        async def close(self, reason: str = "closed") -> None: ...

        def _spawn(self, coro: Coroutine[Any, Any, None], name: str | None = None) -> None: ...

    async def refresh(self, deadline: float | None) -> None:
        """A PING round trip: every TABLE the peer sent before our PING is applied after it.

        Raises:
            LLMTimeoutError: the deadline passed before the peer answered (the table this
                side has may be behind the peer's: a key missing from it is no verdict).
        """
        t = next_req_id()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pongs[t] = fut
        try:
            async with asyncio.timeout_at(deadline):
                await self.send(_wire.MsgType.PING, {"t": t})
                await fut
        except TimeoutError:
            # Said by the refresh itself: on uvloop the timer may fire with loop.time()
            # still a fraction of a millisecond short of the deadline, so a caller
            # reading the clock afterwards could take the miss for the peer's verdict.
            raise failure(
                LLMStatusCode.LLM_TIMEOUT,
                "deadline passed while fetching the peer's cache table (the table this "
                "side has may not show what the peer registered last)",
            ) from None
        finally:
            self._pongs.pop(t, None)

    async def _heartbeat(self, timeout: float) -> None:
        """Loses the link when the peer has said nothing for ``timeout`` seconds
        (``aiodatadist.HeartbeatTimeout``); pings it after a third of that silence, so an
        idle link to a live peer always hears something (its PONG).

        Silence counts only while the read loop waits for a message: one that is busy (a
        flooding peer's requests wait for room) is not the peer's silence. The peer's own
        heartbeat and its requests count as words too. Found within ``timeout`` and a third.
        """
        interval = timeout / 3
        while not self.closed.is_set():
            await asyncio.sleep(interval)
            since = self._waiting_since
            if since is None:
                continue
            quiet = self._loop.time() - since
            if quiet >= timeout:
                await self.close(
                    f"no word from the peer in {quiet:.1f} s (aiodatadist.HeartbeatTimeout "
                    f"{timeout * 1000:.0f} ms): it is frozen, overloaded or unreachable"
                )
                return
            if quiet >= interval:
                # (A send that cannot finish, the peer not reading, is given up: the
                # silence goes on counting.)
                with contextlib.suppress(TimeoutError, LLMException):
                    async with asyncio.timeout(interval):
                        await self.send(_wire.MsgType.PING, {"t": next_req_id()})

    def cancel_soon(self, req: int, epoch: int) -> None:
        """Sends CANCEL {req, epoch} in the background (never blocking the caller, which may
        be unwinding a cancellation); a peer that does not take it in CANCEL_TIMEOUT is
        dropped."""
        if self.closed.is_set():
            return

        async def send_cancel() -> None:
            try:
                async with asyncio.timeout(CANCEL_TIMEOUT):
                    await self.send(_wire.MsgType.CANCEL, {"req": req, "epoch": epoch})
            except TimeoutError:
                await self.close("the peer did not take a CANCEL")
            except LLMException:
                pass  # the link is closed: nothing left to cancel

        self._spawn(send_cancel())

    async def request(
        self, msg_type: _wire.MsgType, body: dict[str, Any], binary: bytes
    ) -> tuple[int, asyncio.Future[dict[str, Any]]]:
        """Sends a request under a new id; the future gets the peer's DONE body (or the
        link's closing failure)."""
        req = next_req_id()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req] = fut
        try:
            await self.send(msg_type, {"req": req, **body}, binary)
        except BaseException:
            self._pending.pop(req, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # a failed send closed the link and failed it: retrieved
            fut.cancel()
            raise
        return req, fut

    def forget_request(self, req: int) -> None:
        """Stops tracking ``req``: its DONE, if one still comes, is dropped."""
        self._pending.pop(req, None)
