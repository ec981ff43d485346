"""The one path every transfer over a link takes, in one function (:func:`run`).

The facade has checked the arguments and fixed the call's deadline in a request
(:mod:`aiodatadist._plan`); from there a ``pull_blocks``, a ``pull_cache`` and each
layer of ``transfer_cache_async`` read the same page:

1. plan against the peer's table; a key the peer registered a moment ago is fetched
   with one round trip on the link before ``LLM_KV_CACHE_NOT_EXIST`` is raised;
2. the link's FIFO slot, under the deadline (upstream: one transfer per link at a time);
3. re-plan if the peer's table changed while the call queued;
4. hold both caches (a free waits for, or refuses, a cache in use);
5. the data path's pull or push on the instance's executor, under the deadline;
6. a one-sided path that found the peer's lease stale (the peer re-registered or
   freed the cache before a byte moved): one refresh and one retry.

Timeout and cancel: the path aborts the native job and waits for it to return
(:class:`~aiodatadist._executor.TransferExecutor`), so the slot and the holds are let
go only once no byte moves any more; then ``LLMTimeoutError`` or ``CancelledError``.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING

from . import _native
from ._caches import Region
from ._leases import LeaseStale
from ._plan import (
    CopyRequest,
    LocalCopyRequest,
    PushRequest,
    Request,
    copy_plan,
    local_copy_plan,
    plan,
)
from .errors import LLMException, LLMStatusCode, current_api
from .metrics import _core as _metrics

if TYPE_CHECKING:
    from ._caches import CacheEntry
    from ._runtime import Runtime
    from .links import Link
    from .transports.base import LayerCut

__all__ = ["copy", "run"]


async def run(rt: Runtime, link: Link, request: Request, cut: LayerCut | None = None) -> CacheEntry:
    """Moves the bytes ``request`` names over ``link``; returns once they all landed,
    with the peer's cache entry the bytes came from or went to (a pull's fast lane is
    made for it: :mod:`aiodatadist._lanes`).

    ``cut`` (a pull only): the transfer is layered (``pull_blocks_layerwise``): still one
    transfer (one slot, one hold of each cache, one deadline, counted once), moved by
    the path's :meth:`~aiodatadist.transports.base.Path.pull_layers`, which signals each
    layer on ``cut.fd`` as it lands.

    Counted once in the link's metrics (and traced when tracing is on): the data path
    that moved the bytes, how many, the time waited for the slot and in all, or the
    failure (:mod:`aiodatadist.metrics`).

    Raises:
        LLMCacheNotFoundError: the peer has no such cache (after one refresh), or one
            of the caches was freed meanwhile.
        LLMParamError: the request does not fit the peer's cache.
        LLMTimeoutError: the deadline passed (waiting for the slot, or for the refresh of
            the peer's table after a miss, included); the job
            was aborted and has returned, the link stays usable.
        LLMLinkError: the link was closed while the call waited for it.
        asyncio.CancelledError: cancelled; raised once the native job has returned.
    """
    m = link.metrics
    kind = _metrics.PUSH if isinstance(request, PushRequest) else _metrics.PULL
    tracer = _metrics.tracer
    span = None
    if tracer is not None:
        span = tracer.begin(current_api(), kind, rt.cluster_id, link.remote_cluster_id, request)
    m.started += 1
    start = perf_counter()
    try:
        deadline, local = request.deadline, request.local
        version = link.path.remote_table.version
        try:
            remote, moves = plan(request, link.path.remote_table)
        except LLMException as e:
            if e.status_code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                raise
            # A peer that does not answer within the deadline raises LLMTimeoutError
            # here: the key may just not have reached us, no verdict on it.
            if not await link.path.refresh(deadline):
                raise
            version = link.path.remote_table.version
            remote, moves = plan(request, link.path.remote_table)  # the peer's verdict
        async with link.exclusive(deadline):
            if link.path.remote_table.version != version:  # the peer re-registered meanwhile
                remote, moves = plan(request, link.path.remote_table)
            if isinstance(request, PushRequest):
                if remote.late_writes:
                    # In one process (inproc) the peer's entry is its own, fences and
                    # all; other paths' owners check theirs (tcp serving: the blocks;
                    # a lease page: the cache).
                    remote.check_no_late_writes(None, Region.of(remote.addrs, moves, "dst"))
            elif local.late_writes:
                # An aborted engine pull may still land in the blocks it named.
                local.check_no_late_writes(None, Region.of(local.addrs, moves, "dst"))
            local.hold()
            try:
                for retry in (False, True):
                    held = remote
                    held.hold()
                    try:
                        call = rt.call(deadline)
                        if isinstance(request, PushRequest):
                            await link.path.push(moves, local, held, call)
                        elif cut is not None:
                            await link.path.pull_layers(moves, held, local, call, cut)
                        else:
                            await link.path.pull(moves, held, local, call)
                        # Counted here, once: the path this transfer took, its bytes, the
                        # slot's wait (still held: nobody else set it) and the whole call.
                        used, nbytes = link.path.used or link.data_path, moves.total_bytes
                        m.done(kind, used, nbytes, link.slot.waited, perf_counter() - start)
                        if span is not None:
                            tracer.end(span, used, nbytes, None)  # type: ignore[union-attr]
                        return held
                    except LeaseStale:
                        # Stale again after the refresh: LLM_KV_CACHE_NOT_EXIST (this exception).
                        if retry:
                            raise
                        await link.path.refresh(deadline)
                        remote, moves = plan(request, link.path.remote_table)
                    finally:
                        held.release()
                raise AssertionError("not reached: the second try returned or raised")
            finally:
                local.release()
    except BaseException as e:
        m.failed(kind, e)
        if span is not None:
            tracer.end(span, None, 0, e)  # type: ignore[union-attr]
        raise


async def copy(rt: Runtime, request: CopyRequest | LocalCopyRequest) -> None:
    """A local copy (``copy_blocks``, ``copy_cache``, ``swap_blocks``) on the executor,
    under the deadline.

    No link, so no slot: the caches' holds alone keep a free from unmapping them.

    Raises:
        LLMCacheNotFoundError: a cache was freed meanwhile.
        LLMTimeoutError: the deadline passed (the copy was aborted and has returned).
        asyncio.CancelledError: cancelled, once the copy has returned.
    """
    if isinstance(request, CopyRequest):
        moves = copy_plan(request)
        src = dst = request.entry
        holds: tuple[CacheEntry, ...] = (request.entry,)
    else:
        moves = local_copy_plan(request)
        src, dst, holds = request.src, request.dst, request.holds
    held: list[CacheEntry] = []
    m = rt.links.metrics.local
    tracer = _metrics.tracer
    span = None
    if tracer is not None:
        span = tracer.begin(current_api(), _metrics.COPY, rt.cluster_id, None, request)
    m.started += 1
    start = perf_counter()
    try:
        if any(entry.late_writes for entry in holds):
            # An aborted engine pull may still land in the blocks it named: no copy from
            # or into them.
            touched = (Region.of(src.addrs, moves, "src"), Region.of(dst.addrs, moves, "dst"))
            for entry in holds:
                entry.check_no_late_writes(None, *touched)
        for entry in holds:
            entry.hold()
            held.append(entry)
        src_addrs, dst_addrs = src.addrs, dst.addrs
        threads = rt.options.mover_threads
        await rt.call(request.deadline).run(
            lambda ctl: _native.copy_local(moves, src_addrs, dst_addrs, ctl, threads)
        )
    except BaseException as e:
        m.failed(_metrics.COPY, e)
        if span is not None:
            tracer.end(span, None, 0, e)  # type: ignore[union-attr]
        raise
    finally:
        for entry in held:
            entry.release()
    m.copied(moves.total_bytes, perf_counter() - start)
    if span is not None:
        tracer.end(span, _metrics.LOCAL_PATH, moves.total_bytes, None)  # type: ignore[union-attr]
