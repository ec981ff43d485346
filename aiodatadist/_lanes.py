"""Fast lanes: small repeated pulls moved synchronously, without the one path's machinery.

A decoder pulls a request's few blocks from the same prompt cache into the same local
cache, call after call. Once a ``pull_blocks`` between a peer's cache and a local one went
the whole way (:func:`aiodatadist._runner.run`: plan, slot, holds, path, lease), the data
path may offer a :class:`~aiodatadist.transports.base.Lane` for that pair (the one-sided
paths do: ``inproc``, ``shm``, ``cma``; so does ``nixl`` on one host, once its small posts
complete inside the call: ``transports/engine_lane.py``). :class:`FastPulls` keeps it,
and takes the next pulls of at most :attr:`Lane.max_bytes` between the same two caches,
with the same layer ranges and tensors per layer, straight to it, **on the loop thread,
with no await**:

* nothing can get in between: the link's slot is free and nobody waits for it, so
  upstream's one-transfer-per-link rule holds without taking it (no other task runs
  until the call returns); the local cache is held (a free from another thread waits);
* everything the whole path would find is checked first, cheaply, and any doubt sends the
  call down the whole path instead, which then raises what it would raise: the instance
  is ready, the link active, the peer's cache table unchanged since the lane was made
  (a peer's re-registration or free changes it), the local cache live and unfenced, the
  lane's mappings and lease page up, no tracer running, the arguments plain (lists of
  ``int``, a ``float``/``int`` timeout of at least :data:`MIN_TIMEOUT_S`), and the plan
  (bounds- and overlap-checked natively) small enough;
* the copy runs under the remote cache's lease like any one-sided copy; a lease found
  stale before a byte moved drops the lane and the whole path refreshes and retries;
* such a pull never suspends, so once a millisecond one yields to the loop *after* its
  bytes landed (a yield before them would let a later call's pull run first: calls on a
  link keep their order); a cancel delivered there raises ``CancelledError`` as usual.

The deadline: a lane copy is bounded by its size (at most ``max_bytes`` of memcpy or
``process_vm_readv``, tens of microseconds) and cannot be aborted, like the inline jobs of
:mod:`aiodatadist._executor`; a call whose timeout is under :data:`MIN_TIMEOUT_S` goes
the whole way, so a deadline that small is still honoured. Counted in the link's metrics
like any transfer (the path, bytes, latency; no slot wait).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import TYPE_CHECKING, Any, Final

from ._executor import INLINE_YIELD_S
from ._plan import tensor_span
from .errors import API_CONTEXT, LLMException
from .links import LinkState
from .metrics import _core as _metrics
from .types import BlocksCacheKey

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from ._caches import CacheEntry
    from ._plan import PullRequest
    from ._runtime import Runtime
    from .links import Link
    from .metrics._core import LinkMetrics
    from .transports.base import Lane

__all__ = ["MAX_LANES", "MIN_TIMEOUT_S", "FastPulls"]

MIN_TIMEOUT_S: Final = 0.001
"""Calls with a smaller timeout take the whole path (it checks the deadline before a
byte moves); a lane copy takes tens of microseconds."""

MAX_LANES: Final = 64
"""Lanes kept per cache manager (the oldest goes first)."""

_API: Final = "pull_blocks"  # the one call lanes serve

MAX_TIMEOUT_S: Final = 86_400.0 * 365  # the checks' bound is larger; this one is cheap


def _same_layers(kept: range | None, given: object) -> bool:
    """``given`` is the kept layer range exactly: None, or a ``range`` of step 1 (range
    equality is sequence equality, ``range(1, 2, 7) == range(1, 2)``, and any object may
    claim to equal one; the whole path refuses both)."""
    if kept is None:
        return given is None
    return type(given) is range and given.step == 1 and given == kept


class _Route:
    """One kept lane and everything its pulls are checked against."""

    __slots__ = (
        "block_span",
        "dst_cache",
        "dst_id",
        "dst_layers",
        "key",
        "lane",
        "link",
        "local",
        "per_layer",
        "remote",
        "span",
        "src_layers",
        "version",
    )

    def __init__(
        self,
        key: BlocksCacheKey,
        dst_cache: object,
        request: PullRequest,
        link: Link,
        remote: CacheEntry,
        version: int,
        lane: Lane,
        span: tuple[int, int, int],
    ) -> None:
        self.key = key
        # Weakly: an unregistered cache, an ended link are not kept alive by a lane (a dead
        # reference, like a freed cache or a closed link, sends the pull the whole way).
        self.dst_cache = weakref.ref(dst_cache)
        self.dst_id = id(dst_cache)
        self.src_layers = request.src_layers
        self.dst_layers = request.dst_layers
        self.per_layer = request.tensors_per_layer
        self.local = weakref.ref(request.local)
        self.link = weakref.ref(link)
        self.remote = remote
        self.version = version
        self.lane = lane
        self.span = span
        self.block_span = span[2] * request.local.block_bytes  # bytes per block pulled


class FastPulls:
    """The lanes of one cache manager, by destination cache (see the module docstring)."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._routes: dict[int, list[_Route]] = {}  # id(dst_cache) -> routes
        self._count = 0
        self.yield_due = 0.0  # time.monotonic() from which the next lane pull yields after

    def __bool__(self) -> bool:
        return self._count > 0

    async def pause(self) -> None:
        """Yields to the loop once, after a lane pull landed: a caller's loop of lane
        pulls (which never suspend) then cannot starve the loop's other tasks (the link's
        messages, timers) for more than ``INLINE_YIELD_S``; called when :attr:`yield_due`
        has passed."""
        self.yield_due = time.monotonic() + INLINE_YIELD_S
        await asyncio.sleep(0)

    def pull(
        self,
        key: object,
        dst_cache: object,
        src_blocks: object,
        dst_blocks: object,
        src_layers: object,
        dst_layers: object,
        per_layer: object,
        timeout: object,
    ) -> bool | Awaitable[bool]:
        """Moves the pull through a kept lane now; False: take the whole path (nothing
        moved, nothing changed). An awaitable (a ``tcp`` answer still on its way): await
        it at once, then the same.

        Raises:
            LLMException: the lane's copy failed after bytes may have moved (the peer
                died, the owner revoked the lease mid-copy); counted as a failed pull.
        """
        routes = self._routes.get(id(dst_cache))
        if routes is None or asyncio.get_running_loop() is not self._rt.loop:
            return False  # (awaited from another loop: the whole path bridges it home)
        for r in routes:
            if r.dst_cache() is dst_cache and (
                r.key is key
                or (  # (a new key object per call is the common case: its two ints)
                    type(key) is BlocksCacheKey
                    and key._cluster_id == r.key._cluster_id
                    and key._model_id == r.key._model_id
                )
            ):
                break
        else:
            return False
        if (
            not _same_layers(r.src_layers, src_layers)
            or not _same_layers(r.dst_layers, dst_layers)
            or r.per_layer != per_layer
            or type(per_layer) is not int
        ):
            return False
        if timeout is not None and not (
            (type(timeout) is float or type(timeout) is int)
            and MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S  # (NaN fails both)
        ):
            return False
        if type(src_blocks) is not list or type(dst_blocks) is not list:
            return False
        for b in src_blocks:
            if type(b) is not int:
                return False
        for b in dst_blocks:
            if type(b) is not int:
                return False
        link, local, lane = r.link(), r.local(), r.lane
        if (
            link is None
            or local is None
            or not self._rt.ready
            or link.state is not LinkState.ACTIVE
            or link.slot.busy
            or link.slot.waiting
            or link.path.remote_table.version != r.version
            or local.freed
            or _metrics.tracer is not None
            or not lane.usable()
        ):
            self._drop(r)
            return False
        if local.late_writes:
            return False  # (the whole path checks the blocks against the fences; lane kept)
        nbytes = len(dst_blocks) * r.block_span
        if not 0 < nbytes <= lane.max_bytes or len(src_blocks) != len(dst_blocks):
            return False  # (a larger pull takes the whole path; the lane stays)
        try:
            local.hold()
        except LLMException:  # freed meanwhile, from another thread: nothing moved
            self._drop(r)
            return False  # (the whole path says so; nothing was counted)
        m = link.metrics
        m.started += 1
        start = time.perf_counter()
        token = API_CONTEXT.set(_API)  # (errors name the call, as under @public)
        pending = False
        try:
            landed = lane.pull(src_blocks, dst_blocks, r.span, self._rt.deadline(timeout))
            if not isinstance(landed, int):  # (tcp: the answer is on its way)
                pending = True
                return self._finish(r, link, local, landed, start)
        except BaseException as e:
            m.failed(_metrics.PULL, e)
            self._drop(r)
            raise
        finally:
            API_CONTEXT.reset(token)
            if not pending:
                local.release()
        return self._landed(r, m, landed, start)

    def _landed(self, r: _Route, m: LinkMetrics, landed: int, start: float) -> bool:
        if not landed:
            m.started -= 1  # not a transfer: the whole path makes it one (and says why)
            self._drop(r)
            return False
        m.done(_metrics.PULL, r.lane.kind, landed, 0.0, time.perf_counter() - start)
        return True

    async def _finish(
        self, r: _Route, link: Link, local: CacheEntry, landed: Awaitable[int], start: float
    ) -> bool:
        """The rest of a lane pull whose answer was not back at once: awaited holding the
        link's slot (free, and nothing ran since the lane checked it: taken at once), the
        local cache held, errors counted and named as the whole path's."""
        token = API_CONTEXT.set(_API)
        try:
            await link.slot.acquire(None)
            try:
                n = await landed
            finally:
                link.slot.release()
        except BaseException as e:
            link.metrics.failed(_metrics.PULL, e)
            self._drop(r)
            raise
        finally:
            API_CONTEXT.reset(token)
            local.release()
        return self._landed(r, link.metrics, n, start)

    def learn(
        self, dst_cache: object, request: PullRequest, link: Link, remote: CacheEntry | None
    ) -> None:
        """After a ``pull_blocks`` went the whole way: keeps a lane for its two caches
        when its path offers one (a ``BlocksCacheKey`` pull only)."""
        key = request.key
        if remote is None or type(key) is not BlocksCacheKey or not request.src_blocks:
            return
        for routes in list(self._routes.values()):  # (what can never run again goes)
            for r in list(routes):
                gone, entry = r.link(), r.local()
                if (
                    gone is None
                    or gone.state is not LinkState.ACTIVE
                    or entry is None
                    or entry.freed
                    or r.dst_cache() is None
                ):
                    self._drop(r)
        routes = self._routes.get(id(dst_cache), [])
        for r in routes:
            if r.dst_cache() is dst_cache and r.key == key:
                if (
                    r.version == link.path.remote_table.version
                    and r.link() is link
                    and r.remote is remote
                    and r.src_layers == request.src_layers
                    and r.dst_layers == request.dst_layers
                    and r.per_layer == request.tensors_per_layer
                ):
                    return  # kept already (it declined this pull: too large, say)
                self._drop(r)
                break
        table = link.path.remote_table
        version = table.version
        if table.blocks(key.model_id) is not remote:
            # The table changed while the pull ran (the key now names another cache, or
            # the cache went): a lane made now would keep the old cache at the new version.
            return
        try:
            lane = link.path.lane(remote, request.local)
        except LLMException:
            lane = None
        if lane is None:
            return
        span = tensor_span(
            remote.num_tensors,
            request.local.num_tensors,
            request.src_layers,
            request.dst_layers,
            request.tensors_per_layer,
        )
        if self._count >= MAX_LANES:
            self._drop(next(r for rs in self._routes.values() for r in rs))
        route = _Route(key, dst_cache, request, link, remote, version, lane, span)
        self._routes.setdefault(id(dst_cache), []).append(route)
        self._count += 1

    def _drop(self, route: _Route) -> None:
        routes = self._routes.get(route.dst_id)
        if routes is None or route not in routes:
            return
        routes.remove(route)
        if not routes:
            del self._routes[route.dst_id]
        self._count -= 1
        route.lane.close()

    def clear(self) -> None:
        """Drops every lane (finalize)."""
        for routes in list(self._routes.values()):
            for r in list(routes):
                self._drop(r)

    def snapshot(self) -> list[dict[str, Any]]:
        """The kept lanes (for tests and debugging)."""
        return [
            {"cluster_id": r.key.cluster_id, "model_id": r.key.model_id, "path": str(r.lane.kind)}
            for routes in self._routes.values()
            for r in routes
        ]
