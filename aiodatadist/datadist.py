"""``LLMDataDist``: one instance (one cluster id) with its executor, links and caches.

Unlike upstream, several instances may live in one process, so a prompt and a
decoder can be paired inside one test or one embedded program; instances in
one process link through the ``inproc`` data path.

Threads: an instance belongs to the event loop that awaited ``init``. A
coroutine of the instance awaited on another loop (in another thread) is run
on the owner loop and its result handed back (a safe bridge); a cancel on the
awaiting side cancels it there. If the owner loop is not running any more, the
call raises ``RuntimeError``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import weakref
from collections.abc import Sequence
from types import TracebackType

from ._bridge import bridged, public
from ._control import ControlServer, link_to
from ._runtime import Runtime
from ._validate import check_int, check_type, check_uint
from .cache_manager import CacheManager
from .config import DataPath, Options, parse_options
from .errors import LLMException, LLMStatusCode, api_scope, failure
from .links import Link, _FifoSlot
from .transports.inproc import InprocPath
from .types import LLMClusterInfo, LLMRole

__all__ = ["LLMDataDist"]

log = logging.getLogger("aiodatadist.datadist")

_MAX_CLUSTERS_PER_CALL = 16

# Initialized instances of this process, by cluster id, for in-process links.
_instances: weakref.WeakValueDictionary[int, LLMDataDist] = weakref.WeakValueDictionary()


class LLMDataDist:
    """One LLM-DataDist instance: ``LLMDataDist(role, cluster_id)``, then ``await init(options)``.

    Args:
        role: ``LLMRole.PROMPT`` (prefill), ``DECODER`` or ``MIX``.
        cluster_id: uint64 naming this instance; unique among everything that links.

    Use as ``async with LLMDataDist(...) as dd:`` (init with no options; finalize at exit),
    or call ``await dd.init(options)`` / ``await dd.finalize()``.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_type("role", role, LLMRole)
        self._role = LLMRole(role)
        self._cluster_id = check_uint("cluster_id", cluster_id, 64)
        self._options = Options()
        # Everything an initialized instance's parts share; None until init, after finalize.
        self._rt: Runtime | None = None
        # The loop init ran on: the instance's home, kept after finalize (a call from
        # another thread's loop, finalize included, is still handed to it, or refused).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cache_manager: CacheManager | None = None
        self._lifecycle = asyncio.Lock()
        self._server: ControlServer | None = None

    # ----------------------------------------------------------- properties

    @property
    def role(self) -> LLMRole:
        return self._role

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def options(self) -> Options:
        """The parsed options of the last ``init``."""
        return self._options

    @property
    def is_initialized(self) -> bool:
        return self._rt is not None

    @property
    def cache_manager(self) -> CacheManager:
        """The instance's :class:`CacheManager`.

        Raises:
            RuntimeError: ``init`` has not completed (upstream's message).
        """
        self._require_initialized()
        assert self._cache_manager is not None
        return self._cache_manager

    @property
    def kv_cache_manager(self) -> CacheManager:
        """Alias of :attr:`cache_manager`."""
        return self.cache_manager

    @property
    def links(self) -> list[Link]:
        """The active links, one per remote cluster."""
        return [] if self._rt is None else list(self._rt.links)

    def _home_loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def _require_initialized(self) -> None:
        if self._rt is None:
            raise RuntimeError("llm datadist is not initialized")

    def _runtime(self) -> Runtime:
        if self._rt is None:
            raise RuntimeError("llm datadist is not initialized")
        return self._rt

    # ------------------------------------------------------------ lifecycle

    async def init(self, options: dict[str, str] | None = None) -> None:
        """Initializes the instance: executor, cache manager and, with
        ``llm.listenIpInfo``, the link server. Idempotent.

        Raises:
            TypeError, LLMParamError: bad options.
            LLMException: LLM_FAILED when another initialized instance of this process
                already uses this cluster id.
        """
        check_type("options", options if options is not None else {}, dict)
        async with self._lifecycle:
            if self._rt is not None:
                return
            with api_scope("init"):
                opts = parse_options(options or {})
                other = _instances.get(self._cluster_id)
                if other is not None and other is not self and other.is_initialized:
                    raise failure(
                        LLMStatusCode.LLM_FAILED,
                        f"cluster_id {self._cluster_id} is already used by another "
                        "initialized instance in this process",
                    )
                rt = Runtime(self._cluster_id, self._role, opts, asyncio.get_running_loop())
                self._options = opts
                if opts.listen_ip is not None:
                    server = ControlServer(rt)
                    try:
                        await server.start(opts.listen_ip, opts.listen_port or 0)
                    except BaseException:
                        # A failed init leaves the instance as it was: not initialized.
                        rt.shutdown_executors(0)
                        raise
                    self._server = server
            self._rt = rt
            self._loop = rt.loop
            self._cache_manager = CacheManager(rt)
            _instances[self._cluster_id] = self
            log.debug("initialized %s cluster %d", self._role.name, self._cluster_id)

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` the link server listens on (the real port when 0 was asked), or None."""
        return None if self._server is None else self._server.address

    @bridged
    async def finalize(self) -> None:
        """Unlinks everything, waits for transfers in flight, stops the executor and frees
        allocated caches. Idempotent.

        Timeout: ``aiodatadist.FinalizeTimeout`` bounds the whole call, one deadline for
        every step: cancelled ``transfer_cache_async`` pipelines (one blocked in a plain
        ``synchronize_layer`` ends only when that returns), the links (a transfer in
        flight, a peer that stopped reading the goodbye) and the executors. A cache
        still used by a native job when the deadline passes is not freed (it is leaked
        rather than freed under the job), and a warning is logged.
        """
        async with self._lifecycle:
            rt = self._rt
            if rt is None:
                return
            self._rt = None
            rt.ready = False
            if _instances.get(self._cluster_id) is self:
                del _instances[self._cluster_id]
            cm = self._cache_manager
            assert cm is not None
            bound = self._options.finalize_timeout_ms / 1000
            loop = asyncio.get_running_loop()
            # One deadline for everything: pipelines, links, the server, the executor.
            deadline = loop.time() + bound
            await cm._shutdown(bound)
            for link in list(rt.links):
                await self._drop_link(rt, link, deadline=deadline)
            if self._server is not None:
                await self._server.close(min(1.0, deadline - loop.time()))
                self._server = None
            if not await rt.aclose(deadline):
                log.warning("finalize: transfers still running after %.1f s", bound)
            # Peers' one-sided copies are waited for (lease revocation) within the same bound.
            rt.caches.free_all(max(0.0, deadline - loop.time()))

    async def __aenter__(self) -> LLMDataDist:
        await self.init()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.finalize()

    # ---------------------------------------------------------------- links

    @staticmethod
    def _check_clusters(clusters: object, timeout: object) -> list[LLMClusterInfo]:
        check_type("clusters", clusters, (list, tuple))
        assert isinstance(clusters, (list, tuple))
        for i, c in enumerate(clusters):
            check_type(f"clusters[{i}]", c, LLMClusterInfo)
            if c.remote_cluster_id is None:
                raise failure(
                    LLMStatusCode.LLM_PARAM_INVALID, f"clusters[{i}].remote_cluster_id is not set"
                )
        check_int("timeout", timeout, min_value=1, max_value=2**31 - 1)
        return list(clusters)

    @public("link_clusters")
    async def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Links to each cluster; returns ``(status, [status per cluster])``, never raises
        on a failed link (the overall status is the last failure, else LLM_SUCCESS).

        A cluster whose instance lives in this process (initialized, same event loop) is
        linked in-process; others are reached at their ``remote_ip_info``.

        Args:
            clusters: at most 16 ``LLMClusterInfo``.
            timeout: milliseconds for each link.

        Raises:
            TypeError, LLMParamError: bad arguments (no link is attempted).
        """
        rt = self._runtime()
        infos = self._check_clusters(clusters, timeout)
        if len(infos) > _MAX_CLUSTERS_PER_CALL:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, [
                LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
            ] * len(infos)
        results = await asyncio.gather(*(self._link_one(rt, c, timeout) for c in infos))
        return self._overall(results), list(results)

    @staticmethod
    def _overall(results: Sequence[LLMStatusCode]) -> LLMStatusCode:
        overall = LLMStatusCode.LLM_SUCCESS
        for r in results:
            if r != LLMStatusCode.LLM_SUCCESS:
                overall = r
        return overall

    async def _link_one(self, rt: Runtime, info: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        remote_id = info.remote_cluster_id
        assert remote_id is not None
        if remote_id == self._cluster_id:
            log.warning("link_clusters: cannot link cluster %d to itself", remote_id)
            return LLMStatusCode.LLM_PARAM_INVALID
        if remote_id in rt.links:
            return LLMStatusCode.LLM_ALREADY_LINK
        peer = _instances.get(remote_id)
        if (
            peer is not None
            and peer._rt is not None
            and rt.options.data_path in (DataPath.AUTO, DataPath.INPROC)
        ):
            return self._link_inproc(rt, peer._rt)
        if not info.remote_ip_info_list:
            log.warning(
                "link_clusters: cluster %s is not in this process and has no remote_ip_info",
                remote_id,
            )
            return LLMStatusCode.LLM_LINK_FAILED
        host, port = info.remote_address()
        try:
            await link_to(rt, host, port, remote_id, timeout_ms / 1000)
        except LLMException as e:
            log.warning("link to cluster %d failed: %s", remote_id, e)
            return e.status_code
        return LLMStatusCode.LLM_SUCCESS

    @staticmethod
    def _link_inproc(rt: Runtime, peer: Runtime) -> LLMStatusCode:
        if peer.loop is not rt.loop:
            log.warning(
                "link_clusters: cluster %d lives on another event loop; in-process links "
                "need both instances on one loop",
                peer.cluster_id,
            )
            return LLMStatusCode.LLM_LINK_FAILED
        if rt.cluster_id in peer.links:
            return LLMStatusCode.LLM_ALREADY_LINK
        mine_secret, theirs_secret = rt.options.shared_secret, peer.options.shared_secret
        if (mine_secret or theirs_secret) and not hmac.compare_digest(
            mine_secret or b"", theirs_secret or b""
        ):
            # The same rule as across processes: a secret, when set, is required of every peer.
            log.warning("link_clusters: cluster %d has a different shared secret", peer.cluster_id)
            return LLMStatusCode.LLM_LINK_FAILED
        slot = _FifoSlot()  # one slot for both ends: upstream's per-link mutex
        mine = Link(rt.cluster_id, peer.cluster_id, InprocPath(peer.caches.table), slot)
        theirs = Link(peer.cluster_id, rt.cluster_id, InprocPath(rt.caches.table), slot)
        rt.links.add(mine)
        peer.links.add(theirs)
        log.debug("linked %d <-> %d in-process", rt.cluster_id, peer.cluster_id)
        return LLMStatusCode.LLM_SUCCESS

    async def _drop_link(
        self, rt: Runtime, link: Link, *, deadline: float | None, slot_held: bool = False
    ) -> None:
        """Closes a link at once (queued transfers then see LLM_NOT_YET_LINK), and its
        path once the transfer in flight on it, if any, has returned.

        The path holds the peer's mapped segments and the data sockets a running
        native job uses: it is closed only inside the link's slot. If the slot is not
        free by ``deadline`` the path is left open (leaked, with a warning) rather
        than unmapped or closed under the job.
        """
        rt.links.remove(link)
        if isinstance(link.path, InprocPath):
            peer = _instances.get(link.remote_cluster_id)
            if peer is not None and peer._rt is not None:
                other = peer._rt.links.find(self._cluster_id)
                if other is not None and other.slot is link.slot:
                    peer._rt.links.remove(other)
        if not slot_held:
            try:
                await link.slot.acquire(deadline)
            except LLMException:
                log.warning(
                    "the link to cluster %d still runs a transfer; its path is left open",
                    link.remote_cluster_id,
                )
                return
        try:
            # Closing says goodbye to a remote peer: bounded too (a peer that stopped
            # reading), and the connection is closed locally whatever the peer does.
            try:
                async with asyncio.timeout_at(deadline):
                    await link.path.close()
            except TimeoutError:
                log.warning(
                    "closing the link to cluster %d ran past its deadline",
                    link.remote_cluster_id,
                )
        finally:
            if not slot_held:
                link.slot.release()

    @public("unlink_clusters")
    async def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlinks each cluster; returns ``(status, [status per cluster])`` like ``link_clusters``.

        Unlink takes its place in the link's FIFO: transfers queued before it finish,
        transfers queued after it fail with LLM_NOT_YET_LINK. ``force=True`` closes the
        link to new and queued transfers at once, without waiting for its turn; the call
        returns once the transfer in flight, if any, has returned (at most ``timeout``
        ms), since its path's memory and sockets are not closed under the native job.

        Returns LLM_NOT_YET_LINK for a cluster that is not linked, LLM_TIMEOUT when the
        link stayed busy past ``timeout`` ms.
        """
        rt = self._runtime()
        infos = self._check_clusters(clusters, timeout)
        check_type("force", force, bool)
        results = await asyncio.gather(*(self._unlink_one(rt, c, timeout, force) for c in infos))
        return self._overall(results), list(results)

    async def _unlink_one(
        self, rt: Runtime, info: LLMClusterInfo, timeout_ms: int, force: bool
    ) -> LLMStatusCode:
        remote_id = info.remote_cluster_id
        assert remote_id is not None
        link = rt.links.find(remote_id)
        if link is None:
            return LLMStatusCode.LLM_NOT_YET_LINK
        deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
        if force:
            await self._drop_link(rt, link, deadline=deadline)
            return LLMStatusCode.LLM_SUCCESS
        try:
            async with link.exclusive(deadline):
                await self._drop_link(rt, link, deadline=deadline, slot_held=True)
        except LLMException as e:
            return e.status_code
        return LLMStatusCode.LLM_SUCCESS

    def __repr__(self) -> str:
        state = "initialized" if self._rt is not None else "not initialized"
        return f"<LLMDataDist {self._role.name} cluster_id={self._cluster_id} {state}>"
