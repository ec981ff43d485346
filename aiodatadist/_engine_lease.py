"""Leases over the control plane, for engine transfers between hosts.

A one-sided engine transfer to another host has no lease page (no fd channel):
the requester asks the owner first, one round trip per transfer::

    LEASE {req, cache_id, gen, write?}  ->
                                        <-  LEASED {req, status, info, stale}
    (the engine moves the bytes)
    UNLEASE {req}               ->

The owner takes ``entry.hold()`` for a granted lease (so unregister, free and
re-registration see a transfer in flight exactly as with tcp serving: they
refuse with ``LLM_LINK_BUSY``) and releases it on ``UNLEASE`` or when the link
is lost. A freed cache or a stale generation answers ``LLM_KV_CACHE_NOT_EXIST``
marked ``stale``: the requester refreshes its table and retries once. A lease
for a push says ``write``: refused with ``LLM_LINK_BUSY`` while the cache is fenced
(an aborted engine transfer may still write into it; the lease names no blocks).
Messages of one link arrive in order, so an ``UNLEASE`` sent after a ``LEASE``
whose answer the requester gave up on still releases it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from . import _wire
from ._leases import LeaseHold, LeaseStale
from .errors import LLMException, LLMStatusCode, failure, to_status_code

if TYPE_CHECKING:
    from ._caches import CacheEntry
    from .transports.peer import ControlLink

__all__ = ["LEASE_TYPES", "remote_lease", "serve"]

LEASE_TYPES = (_wire.MsgType.LEASE, _wire.MsgType.UNLEASE)
"""The requests the owner's read loop hands to :func:`serve`."""

MAX_HELD = 256
"""Leases one link may hold at once. An honest requester holds one per transfer (its
link's transfers take turns) plus those whose UNLEASE is on its way; more are refused
(``LLM_LINK_BUSY``), so a peer cannot grow the owner's table without bound."""

# Owner side: per link, the leases granted and not yet released (req -> entry).
_held: weakref.WeakKeyDictionary[Any, dict[int, CacheEntry]] = weakref.WeakKeyDictionary()
_tasks: set[asyncio.Task[None]] = set()


def _background(coro: Any) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


async def _unlease(peer: ControlLink, req: int) -> None:
    with contextlib.suppress(LLMException):
        await peer.send(_wire.MsgType.UNLEASE, {"req": req})


def _unlease_from(loop: asyncio.AbstractEventLoop, peer: ControlLink, req: int) -> None:
    """Sends UNLEASE from any thread (a reaper's, once the request it kept ended)."""

    def send() -> None:
        _background(_unlease(peer, req))

    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here:
        send()  # (at once, in order with what this task sends next)
        return
    with contextlib.suppress(RuntimeError):  # the loop is closed: the link went with it
        loop.call_soon_threadsafe(send)


@contextlib.asynccontextmanager
async def remote_lease(
    peer: ControlLink, remote: CacheEntry, deadline: float | None, *, writes: bool = False
) -> AsyncIterator[LeaseHold]:
    """Holds the owner's lease on ``remote`` for the body (one round trip); yields its
    :class:`~aiodatadist._leases.LeaseHold`: an engine request aborted in flight and
    handed to a reaper keeps the lease (the UNLEASE waits) until it ended.

    ``writes`` (a push): the owner refuses while the cache is fenced (an aborted engine
    transfer may still write into it, over what this one would land).

    Raises:
        LeaseStale: the owner freed the cache or re-bound it since our table.
        LLMException: LLM_TIMEOUT (no answer by ``deadline``), LLM_LINK_FAILED,
            LLM_LINK_BUSY (the owner is freeing the cache; a write into a fenced one).
    """
    body: dict[str, Any] = {"cache_id": remote.cache_id}
    if remote.lease is not None:
        body["gen"] = remote.lease[1]
    if writes:
        body["write"] = True
    req, fut = await peer.request(_wire.MsgType.LEASE, body, b"")
    try:
        async with asyncio.timeout_at(deadline):
            reply = await fut
    except BaseException as e:
        peer.forget_request(req)
        _background(_unlease(peer, req))  # after the LEASE on the wire: releases it
        if isinstance(e, TimeoutError):
            raise failure(
                LLMStatusCode.LLM_TIMEOUT,
                f"deadline passed waiting for the lease of remote cache {remote.cache_id}",
            ) from None
        raise
    code = to_status_code(int(reply["status"]))
    if code != LLMStatusCode.LLM_SUCCESS:
        stale = code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST and reply.get("stale") is True
        raise failure(code, f"peer: {reply['info']}", kind=LeaseStale if stale else None)
    hold = LeaseHold(functools.partial(_unlease_from, asyncio.get_running_loop(), peer, req))
    try:
        yield hold
    finally:
        hold.close()


async def serve(peer: Any, msg: _wire.Message) -> None:
    """The owner's side: answers a ``LEASE``, releases on ``UNLEASE`` (``peer``:
    ``_control.Peer``, on its read loop)."""
    held = _held.get(peer)
    if held is None:
        held = _held[peer] = {}
        _background(_release_on_close(peer, held))
    req = int(msg.body["req"])
    if msg.type == _wire.MsgType.UNLEASE:
        entry = held.pop(req, None)
        if entry is not None:
            entry.release()
        return
    cache_id = int(msg.body["cache_id"])
    gen = msg.body.get("gen")
    entry = peer.rt.caches.entries.get(cache_id)
    reply: dict[str, Any] = {"req": req, "status": 0, "info": ""}
    try:
        if req in held or len(held) >= MAX_HELD:
            # A second grant under one req would replace (and so never release) the first:
            # the cache could then never be freed. Refused; nothing is held for it.
            raise failure(
                LLMStatusCode.LLM_LINK_BUSY,
                f"lease {req} is already held" if req in held else f"{MAX_HELD} leases held",
                api="lease",
            )
        if entry is None or (gen is not None and entry.lease is not None and entry.lease[1] != gen):
            raise failure(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"cache {cache_id} is not registered (generation {gen})",
                api="lease",
            )
        if time.monotonic() < entry.no_leases_until:
            raise failure(
                LLMStatusCode.LLM_LINK_BUSY,
                f"cache {cache_id} is being freed by its owner",
                api="lease",
            )
        if msg.body.get("write") is True:
            # The lease does not name the blocks: a write waits for every fence to lift.
            entry.check_no_late_writes("lease")
        entry.hold(api="lease")
    except LLMException as e:
        stale = e.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        reply.update(status=int(e.status_code), info=str(e)[:1000], stale=stale)
    else:
        held[req] = entry
    try:
        await peer.send(_wire.MsgType.LEASED, reply)
    except LLMException:
        pass  # the link closed: _release_on_close lets go


async def _release_on_close(peer: Any, held: dict[int, CacheEntry]) -> None:
    await peer.closed.wait()
    for entry in held.values():
        entry.release()
    held.clear()
