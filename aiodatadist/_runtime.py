"""``Runtime``: what the parts of one initialized instance share.

``LLMDataDist.init`` builds one and hands it to the cache manager, the control
plane and the data paths, instead of the whole instance: its loop, parsed
options, executors, link and cache registries, and the table-change hook.
``finalize`` retires it; every part checks :meth:`Runtime.require_ready`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from ._caches import wait_unfenced
from ._executor import TransferExecutor
from ._registration import CacheRegistry
from .config import Options
from .errors import current_api
from .links import LinkRegistry
from .transports.base import Call
from .transports.engine import EngineAgent, start_engines
from .types import LLMRole

log = logging.getLogger("aiodatadist")


async def _on_thread(fn: Callable[[], bool]) -> bool:
    """``fn()`` on a thread of its own (never the loop's default executor), awaited."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[bool] = loop.create_future()

    def settle(result: bool) -> None:
        if not fut.done():
            fut.set_result(result)

    def run() -> None:
        result = fn()
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result)

    threading.Thread(target=run, name="aiodatadist-finalize-wait", daemon=True).start()
    return await asyncio.shield(fut)


__all__ = ["Runtime"]


class Runtime:
    """One initialized instance's shared state.

    Attributes:
        cluster_id: this instance's cluster id.
        role: its role (PROMPT, DECODER or MIX).
        options: the options of ``init``.
        loop: the event loop that ran ``init`` (the instance's home loop).
        executor: runs this instance's own transfers.
        serve_executor: runs peers' tcp requests (apart, so peers never starve ours).
        links: the link registry.
        caches: the local cache registry.
        engines: the transfer engines this instance runs (:meth:`start_engines`).
    """

    def __init__(
        self, cluster_id: int, role: LLMRole, options: Options, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.cluster_id = cluster_id
        self.role = role
        self.options = options
        self.loop = loop
        self.executor = TransferExecutor(options.executor_threads, name=str(cluster_id))
        self.serve_executor = TransferExecutor(options.serve_threads, name=f"{cluster_id}-serve")
        self._callbacks: TransferExecutor | None = None
        self.links = LinkRegistry(cluster_id)
        self.caches = CacheRegistry(cluster_id, on_change=self.table_changed)
        self.engines: list[EngineAgent] = []
        self.caches.engines = self.engines  # (the same list: registrations reach them)
        self.ready = True

    async def start_engines(self) -> None:
        """Starts the engines of ``aiodatadist.Engines`` on the executor (blocking setup).

        Raises:
            LLMException: LLM_FEATURE_NOT_ENABLED, an engine cannot run here (says why).
        """
        if self.options.engines:
            # No listen address (a decoder that only links out): "" lets an engine advertise
            # an address peers on other hosts can reach (Mooncake: the default route's).
            kinds, host = self.options.engines, self.options.listen_ip or ""
            self.engines[:] = await self.executor.run(
                lambda _c: start_engines(kinds, self.cluster_id, host), deadline=None
            )

    def free_all(self, timeout: float) -> None:
        """Finalize: frees every cache (see ``CacheRegistry.free_all``), then, every link
        and registration gone, stops the engines."""
        self.caches.free_all(timeout)
        self.close_engines()

    def close_engines(self) -> None:
        """Finalize, once every link is gone and every cache deregistered: stops them."""
        engines, self.engines[:] = list(self.engines), []
        for agent in engines:
            agent.close()

    def require_ready(self) -> None:
        """Raises upstream's ``RuntimeError`` once the instance was finalized."""
        if not self.ready:
            raise RuntimeError("llm datadist is not initialized")

    def callbacks(self) -> TransferExecutor:
        """The thread that runs plain (blocking) ``synchronize_layer`` callbacks."""
        self.require_ready()
        if self._callbacks is None:
            self._callbacks = TransferExecutor(1, name=f"{self.cluster_id}-sync")
        return self._callbacks

    def table_changed(self) -> None:
        """A registration changed: every link tells its peer (cross-process links)."""
        for link in self.links:
            link.path.table_changed()

    def deadline(self, timeout: float | None) -> float:
        """The loop time a call given ``timeout`` seconds (None: ``sync_kv_timeout``) ends."""
        if timeout is None:
            timeout = self.options.sync_kv_timeout_ms / 1000
        return asyncio.get_running_loop().time() + timeout

    def call(self, deadline: float | None) -> Call:
        """One public call's budget on this instance's executor.

        No readiness check: a transfer that got its link's slot while ``finalize``
        runs still completes (finalize waits for it) rather than failing half-way.
        """
        return Call(
            api=current_api(),
            deadline=deadline,
            executor=self.executor,
            mover_threads=self.options.mover_threads,
        )

    def shutdown_executors(self, timeout: float = 0) -> None:
        """Stops every executor and engine (a failed init)."""
        self.ready = False
        for ex in (self.executor, self.serve_executor, self._callbacks):
            if ex is not None:
                ex.shutdown(timeout)
        self._callbacks = None
        self.close_engines()

    async def aclose(self, deadline: float) -> bool:
        """Finalize: waits (until ``deadline``) for the executors' jobs; True when all returned."""
        self.ready = False
        loop = asyncio.get_running_loop()
        idle = await self.executor.aclose(max(0.0, deadline - loop.time()))
        extra = max((a.abort_wait_s for a in self.engines), default=0.0)
        if not idle and extra:
            # An engine that cannot cancel (Mooncake) may still write into memory the user
            # gets back at finalize: wait for its transfers to end (bounded by its timeouts).
            log.warning("finalize: waiting up to %.0f s more for engine transfers", extra)
            idle = await self.executor.aclose(extra)
        fenced = [e for e in self.caches.entries.values() if e.late_writes]
        if fenced:
            # An aborted NIXL request still on the wire may land in these (transports/nixl.py):
            # the user gets that memory back at finalize. Wait for it, bounded.
            bound = max(extra, deadline - loop.time(), 5.0)
            log.warning("finalize: waiting up to %.0f s for aborted engine requests", bound)
            if not await _on_thread(lambda: wait_unfenced(fenced, bound)):
                log.warning(
                    "finalize: caches %s may still receive bytes of an aborted engine "
                    "request (their peer never finished it); they stay allocated",
                    [e.cache_id for e in fenced],
                )
        served = await self.serve_executor.aclose(max(0.0, deadline - loop.time()))
        if self._callbacks is not None:
            self._callbacks.shutdown(0)
            self._callbacks = None
        return idle and served
