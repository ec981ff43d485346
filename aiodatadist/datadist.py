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
from typing import Any

from ._bridge import bridged
from ._executor import TransferExecutor
from ._validate import check_int, check_type, check_uint
from .cache_manager import CacheManager
from .config import Options, parse_options
from .errors import LLMException, LLMStatusCode, format_error
from .links import Link, LinkRegistry, _FifoSlot
from .transports.inproc import InprocChannel
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
        self._initialized = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: TransferExecutor | None = None
        self._callbacks: TransferExecutor | None = None
        # Serves peers' tcp requests: apart from _executor, so peers never starve our own pulls.
        self._serve_executor: TransferExecutor | None = None
        self._registry = LinkRegistry(self._cluster_id)
        self._cache_manager: CacheManager | None = None
        self._lifecycle = asyncio.Lock()
        self._server: Any = None

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
        return self._initialized

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
        return list(self._registry)

    def _home_loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def _require_initialized(self) -> None:
        if not self._initialized:
            raise RuntimeError("llm datadist is not initialized")

    def _executor_or_raise(self) -> TransferExecutor:
        self._require_initialized()
        assert self._executor is not None
        return self._executor

    def _serve_executor_or_raise(self) -> TransferExecutor:
        self._require_initialized()
        assert self._serve_executor is not None
        return self._serve_executor

    def _callbacks_or_raise(self) -> TransferExecutor:
        self._require_initialized()
        if self._callbacks is None:
            self._callbacks = TransferExecutor(1, name=f"{self._cluster_id}-sync")
        return self._callbacks

    def _table_changed(self) -> None:
        """A registration changed: peers over cross-process links hear about it."""
        for link in self._registry:
            notify = getattr(link.channel, "peer", None)
            if notify is not None:
                notify.table_changed()

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
            if self._initialized:
                return
            opts = parse_options(options or {})
            other = _instances.get(self._cluster_id)
            if other is not None and other is not self and other._initialized:
                raise LLMException(
                    format_error(
                        "init",
                        LLMStatusCode.LLM_FAILED,
                        f"cluster_id {self._cluster_id} is already used by another "
                        "initialized instance in this process",
                    ),
                    status_code=LLMStatusCode.LLM_FAILED,
                )
            self._options = opts
            self._loop = asyncio.get_running_loop()
            self._executor = TransferExecutor(opts.executor_threads, name=str(self._cluster_id))
            self._serve_executor = TransferExecutor(
                opts.serve_threads, name=f"{self._cluster_id}-serve"
            )
            self._cache_manager = CacheManager(self)
            self._registry = LinkRegistry(self._cluster_id)
            if opts.listen_ip is not None:
                try:
                    self._server = await self._start_server(opts)
                except BaseException:
                    # A failed init leaves the instance as it was: not initialized, no loop.
                    self._executor.shutdown(0)
                    self._executor = None
                    self._serve_executor.shutdown(0)
                    self._serve_executor = None
                    self._cache_manager = None
                    self._loop = None
                    raise
            self._initialized = True
            _instances[self._cluster_id] = self
            log.debug("initialized %s cluster %d", self._role.name, self._cluster_id)

    async def _start_server(self, opts: Options) -> Any:
        from ._control import ControlServer

        server = ControlServer(self)
        assert opts.listen_ip is not None
        await server.start(opts.listen_ip, opts.listen_port or 0)
        return server

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` the link server listens on (the real port when 0 was asked), or None."""
        return None if self._server is None else self._server.address

    async def _adopt_peer(self, peer: Any) -> None:
        """Registers a cross-process link (either side of the handshake) and starts serving it."""
        from .transports.remote import RemoteChannel

        remote_id = peer.info.cluster_id
        if remote_id in self._registry:
            await peer.close("already linked")
            raise LLMException(
                format_error("link_clusters", LLMStatusCode.LLM_ALREADY_LINK,
                             f"cluster {remote_id} is already linked"),
                status_code=LLMStatusCode.LLM_ALREADY_LINK,
            )
        channel = RemoteChannel(peer, self._options.data_path)
        link = Link(self._cluster_id, remote_id, channel)

        async def on_close(_peer: Any) -> None:
            self._registry.remove(link)
            channel.peer_closed()
            if self._server is not None:
                self._server.forget(_peer)

        peer.on_close = on_close
        self._registry.add(link)
        assert self._cache_manager is not None
        if peer.is_client:
            # Same host: the fd channel (segments, lease pages) goes up now, so the first
            # one-sided transfer finds it; without it the link still works (tcp).
            channel.connect_fds(peer.fd_socket, self._cache_manager.leases)
        elif peer.fd_socket is None:
            channel.fds_settled.set()  # none offered: none will come
        peer.start()
        log.debug("linked %d <-> %d over %s", self._cluster_id, remote_id, link.data_path)

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
            if not self._initialized:
                return
            self._initialized = False
            if _instances.get(self._cluster_id) is self:
                del _instances[self._cluster_id]
            assert self._cache_manager is not None and self._executor is not None
            bound = self._options.finalize_timeout_ms / 1000
            loop = asyncio.get_running_loop()
            # One deadline for everything: pipelines, links, the server, the executor.
            deadline = loop.time() + bound
            await self._cache_manager._shutdown(bound)
            for link in list(self._registry):
                await self._drop_link(link, deadline=deadline)
            if self._server is not None:
                await self._server.close(min(1.0, deadline - loop.time()))
                self._server = None
            idle = await self._executor.aclose(max(0.0, deadline - loop.time()))
            if self._serve_executor is not None:
                served = await self._serve_executor.aclose(max(0.0, deadline - loop.time()))
                idle, self._serve_executor = idle and served, None
            if self._callbacks is not None:
                self._callbacks.shutdown(0)
                self._callbacks = None
            if not idle:
                log.warning("finalize: transfers still running after %.1f s", bound)
            # Peers' one-sided copies are waited for (lease revocation) within the same bound.
            self._cache_manager._free_all(max(0.0, deadline - loop.time()))
            self._executor = None

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
    def _check_clusters(api: str, clusters: object, timeout: object) -> list[LLMClusterInfo]:
        check_type("clusters", clusters, (list, tuple))
        assert isinstance(clusters, (list, tuple))
        for i, c in enumerate(clusters):
            check_type(f"clusters[{i}]", c, LLMClusterInfo)
            if c.remote_cluster_id is None:
                raise LLMException(
                    format_error(
                        api,
                        LLMStatusCode.LLM_PARAM_INVALID,
                        f"clusters[{i}].remote_cluster_id is not set",
                    ),
                    status_code=LLMStatusCode.LLM_PARAM_INVALID,
                )
        check_int("timeout", timeout, min_value=1, max_value=2**31 - 1)
        return list(clusters)

    @bridged
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
        api = "link_clusters"
        self._require_initialized()
        infos = self._check_clusters(api, clusters, timeout)
        if len(infos) > _MAX_CLUSTERS_PER_CALL:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, [
                LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
            ] * len(infos)
        results = await asyncio.gather(*(self._link_one(c, timeout) for c in infos))
        return self._overall(results), list(results)

    @staticmethod
    def _overall(results: Sequence[LLMStatusCode]) -> LLMStatusCode:
        overall = LLMStatusCode.LLM_SUCCESS
        for r in results:
            if r != LLMStatusCode.LLM_SUCCESS:
                overall = r
        return overall

    async def _link_one(self, info: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        remote_id = info.remote_cluster_id
        assert remote_id is not None
        if remote_id == self._cluster_id:
            log.warning("link_clusters: cannot link cluster %d to itself", remote_id)
            return LLMStatusCode.LLM_PARAM_INVALID
        if remote_id in self._registry:
            return LLMStatusCode.LLM_ALREADY_LINK
        peer = _instances.get(remote_id)
        forced = self._options.data_path
        if peer is not None and peer._initialized and forced in ("auto", "inproc"):
            return self._link_inproc(peer)
        try:
            return await self._link_remote(info, timeout_ms)
        except LLMException as e:
            log.warning("link to cluster %d failed: %s", remote_id, e)
            return e.status_code

    def _link_inproc(self, peer: LLMDataDist) -> LLMStatusCode:
        if peer._loop is not self._loop:
            log.warning(
                "link_clusters: cluster %d lives on another event loop; in-process links "
                "need both instances on one loop",
                peer.cluster_id,
            )
            return LLMStatusCode.LLM_LINK_FAILED
        if self._cluster_id in peer._registry:
            return LLMStatusCode.LLM_ALREADY_LINK
        mine_secret, theirs_secret = self._options.shared_secret, peer._options.shared_secret
        if (mine_secret or theirs_secret) and not hmac.compare_digest(
            mine_secret or b"", theirs_secret or b""
        ):
            # The same rule as across processes: a secret, when set, is required of every peer.
            log.warning("link_clusters: cluster %d has a different shared secret", peer.cluster_id)
            return LLMStatusCode.LLM_LINK_FAILED
        assert self._cache_manager is not None and peer._cache_manager is not None
        slot = _FifoSlot()  # one slot for both ends: upstream's per-link mutex
        mine = Link(
            self._cluster_id, peer.cluster_id, InprocChannel(peer._cache_manager.table), slot
        )
        theirs = Link(
            peer.cluster_id, self._cluster_id, InprocChannel(self._cache_manager.table), slot
        )
        self._registry.add(mine)
        peer._registry.add(theirs)
        log.debug("linked %d <-> %d in-process", self._cluster_id, peer.cluster_id)
        return LLMStatusCode.LLM_SUCCESS

    async def _link_remote(self, info: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        from ._control import connect

        if not info.remote_ip_info_list:
            log.warning(
                "link_clusters: cluster %s is not in this process and has no remote_ip_info",
                info.remote_cluster_id,
            )
            return LLMStatusCode.LLM_LINK_FAILED
        host, port = info.remote_address()
        assert info.remote_cluster_id is not None
        peer = await connect(self, host, port, info.remote_cluster_id, timeout_ms / 1000)
        await self._adopt_peer(peer)
        return LLMStatusCode.LLM_SUCCESS

    async def _drop_link(
        self, link: Link, *, deadline: float | None, slot_held: bool = False
    ) -> None:
        """Closes a link at once (queued transfers then see LLM_NOT_YET_LINK), and its
        channel once the transfer in flight on it, if any, has returned.

        The channel holds the peer's mapped segments and the data sockets a running
        native job uses: it is closed only inside the link's slot. If the slot is not
        free by ``deadline`` the channel is left open (leaked, with a warning) rather
        than unmapped or closed under the job.
        """
        self._registry.remove(link)
        if isinstance(link.channel, InprocChannel):
            peer = _instances.get(link.remote_cluster_id)
            if peer is not None:
                other = peer._registry.find(self._cluster_id)
                if other is not None and other.slot is link.slot:
                    peer._registry.remove(other)
        if not slot_held:
            try:
                await link.slot.acquire(deadline, "unlink_clusters")
            except LLMException:
                log.warning(
                    "the link to cluster %d still runs a transfer; its channel is left open",
                    link.remote_cluster_id,
                )
                return
        try:
            # Closing says goodbye to a remote peer: bounded too (a peer that stopped
            # reading), and the connection is closed locally whatever the peer does.
            try:
                async with asyncio.timeout_at(deadline):
                    await link.channel.close()
            except TimeoutError:
                log.warning(
                    "closing the link to cluster %d ran past its deadline",
                    link.remote_cluster_id,
                )
        finally:
            if not slot_held:
                link.slot.release()

    @bridged
    async def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlinks each cluster; returns ``(status, [status per cluster])`` like ``link_clusters``.

        Unlink takes its place in the link's FIFO: transfers queued before it finish,
        transfers queued after it fail with LLM_NOT_YET_LINK. ``force=True`` closes the
        link to new and queued transfers at once, without waiting for its turn; the call
        returns once the transfer in flight, if any, has returned (at most ``timeout``
        ms), since its channel's memory and sockets are not closed under the native job.

        Returns LLM_NOT_YET_LINK for a cluster that is not linked, LLM_TIMEOUT when the
        link stayed busy past ``timeout`` ms.
        """
        api = "unlink_clusters"
        self._require_initialized()
        infos = self._check_clusters(api, clusters, timeout)
        check_type("force", force, bool)
        results = await asyncio.gather(*(self._unlink_one(c, timeout, force) for c in infos))
        return self._overall(results), list(results)

    async def _unlink_one(
        self, info: LLMClusterInfo, timeout_ms: int, force: bool
    ) -> LLMStatusCode:
        remote_id = info.remote_cluster_id
        assert remote_id is not None
        link = self._registry.find(remote_id)
        if link is None:
            return LLMStatusCode.LLM_NOT_YET_LINK
        deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
        if force:
            await self._drop_link(link, deadline=deadline)
            return LLMStatusCode.LLM_SUCCESS
        try:
            async with link.exclusive(deadline, "unlink_clusters"):
                await self._drop_link(link, deadline=deadline, slot_held=True)
        except LLMException as e:
            return e.status_code
        return LLMStatusCode.LLM_SUCCESS

    def __repr__(self) -> str:
        state = "initialized" if self._initialized else "not initialized"
        return f"<LLMDataDist {self._role.name} cluster_id={self._cluster_id} {state}>"
