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
import logging
import weakref
from collections.abc import Mapping, Sequence
from types import TracebackType

from . import _comms
from ._bridge import bridged, note_home, public
from ._comms import Comms, Listening, drop_link, inproc_runtime, link_inproc
from ._control import ControlServer, link_to
from ._ranktable import parse_rank_table
from ._runtime import Runtime
from ._validate import check_int, check_str, check_type, check_uint, raise_param_error, require
from .cache_manager import CacheManager
from .config import Options, parse_options
from .errors import LLMException, LLMStatusCode, api_scope, failure
from .links import Link
from .metrics._core import InstanceMetrics, Stats
from .types import LLMClusterInfo, LLMRole, RegisterMemStatus

__all__ = ["LLMDataDist"]

log = logging.getLogger("aiodatadist.datadist")

_MAX_CLUSTERS_PER_CALL = 16
_MAX_COMM_NAME = 128
_MAX_COMM_MEMBERS = 4

# Initialized instances of this process, by cluster id, for in-process links.
_instances: weakref.WeakValueDictionary[int, LLMDataDist] = weakref.WeakValueDictionary()


class LLMDataDist:
    """One LLM-DataDist instance: ``LLMDataDist(role, cluster_id, options)``, then ``await init()``.

    Args:
        role: ``LLMRole.PROMPT`` (prefill), ``DECODER`` or ``MIX``.
        cluster_id: uint64 naming this instance; unique among everything that links.
        options: init options (checked by ``init``), used when ``init`` gets none.

    Use as ``async with LLMDataDist(...) as dd:`` (init with the constructor's options;
    finalize at exit), or call ``await dd.init(options)`` / ``await dd.finalize()``.
    """

    def __init__(
        self, role: LLMRole, cluster_id: int, options: dict[str, str] | None = None
    ) -> None:
        check_type("role", role, LLMRole)
        self._role = LLMRole(role)
        self._cluster_id = check_uint("cluster_id", cluster_id, 64)
        if options is not None:
            check_type("options", options, dict)
        self._ctor_options = None if options is None else dict(options)
        self._init_options: dict[str, str] | None = None  # what the last init used
        self._options = Options()
        # Everything an initialized instance's parts share; None until init, after finalize.
        self._rt: Runtime | None = None
        # The loop init ran on: the instance's home, kept after finalize (a call from
        # another thread's loop, finalize included, is still handed to it, or refused).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cache_manager: CacheManager | None = None
        self._lifecycle = asyncio.Lock()
        self._listening: Listening | None = None
        self._comms: Comms | None = None

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

    @property
    def _server(self) -> ControlServer | None:
        return None if self._listening is None else self._listening.server

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` the link server listens on (the real port when 0 was asked), or None."""
        return None if self._listening is None else self._listening.address

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
        ``llm.listenIpInfo``, the link server. ``options`` default to the constructor's.

        A second ``init`` with the same options (or none) does nothing.

        Raises:
            TypeError, LLMParamError: bad options; options given to the constructor and
                here that differ; an initialized instance given other options.
            LLMException: LLM_FAILED when another initialized instance of this process
                already uses this cluster id.
        """
        check_type("options", options if options is not None else {}, dict)
        with api_scope("init"):
            if options is not None and self._ctor_options is not None:
                _require_same(self._ctor_options, options, "options differ from the constructor's")
            wanted = dict(options) if options is not None else self._ctor_options
        async with self._lifecycle:
            if self._rt is not None:
                if wanted is not None:
                    with api_scope("init"):
                        assert self._init_options is not None
                        _require_same(
                            self._init_options, wanted, "already initialized with other options"
                        )
                return
            with api_scope("init"):
                opts = parse_options(wanted or {})
                other = _instances.get(self._cluster_id)
                if other is not None and other is not self and other.is_initialized:
                    raise failure(
                        LLMStatusCode.LLM_FAILED,
                        f"cluster_id {self._cluster_id} is already used by another "
                        "initialized instance in this process",
                    )
                rt = Runtime(self._cluster_id, self._role, opts, asyncio.get_running_loop())
                note_home(rt.loop)
                listening = Listening(rt)
                try:
                    await rt.start_engines()
                    if opts.listen_ip is not None:
                        await listening.start(
                            opts.listen_ip, opts.listen_port or 0, configured=True
                        )
                except BaseException:  # a failed init leaves the instance not initialized
                    rt.shutdown_executors(0)  # (and stops the engines started)
                    raise
            self._options = opts
            self._init_options = dict(wanted or {})
            self._rt = rt
            self._metrics = rt.links.metrics  # (kept after finalize)
            self._loop = rt.loop
            self._listening = listening
            self._comms = Comms(rt, listening)
            self._cache_manager = CacheManager(rt)
            _instances[self._cluster_id] = self
            _comms.register_runtime(rt)
            log.debug("initialized %s cluster %d", self._role.name, self._cluster_id)

    @bridged
    async def finalize(self) -> None:
        """Unlinks everything, waits for transfers in flight, stops the executor, frees
        allocated caches and stops the engines. Idempotent.

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
            _comms.unregister_runtime(rt)
            cm, comms, listening = self._cache_manager, self._comms, self._listening
            assert cm is not None and comms is not None and listening is not None
            bound = self._options.finalize_timeout_ms / 1000
            loop = asyncio.get_running_loop()
            # One deadline for everything: pipelines, links, the server, the executor.
            deadline = loop.time() + bound
            await comms.close()
            await cm._shutdown(bound)
            with api_scope("finalize"):  # names who unlinks, in the INFO log lines
                for link in list(rt.links):
                    await drop_link(rt, link, deadline=deadline)
            await listening.stop(min(1.0, deadline - loop.time()))
            if not await rt.aclose(deadline):
                log.warning("finalize: transfers still running after %.1f s", bound)
            # Peers' one-sided copies are waited for (lease revocation) within the same bound.
            rt.free_all(max(0.0, deadline - loop.time()))

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
        infos = _check_clusters(clusters, timeout)
        if len(infos) > _MAX_CLUSTERS_PER_CALL:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, [
                LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
            ] * len(infos)
        # A cluster named twice in one call is linked once; the repeats are ALREADY_LINK.
        first: dict[int | None, int] = {}
        for i, c in enumerate(infos):
            first.setdefault(c.remote_cluster_id, i)
        unique = [i for i, c in enumerate(infos) if first[c.remote_cluster_id] == i]
        linked = await asyncio.gather(*(self._link_one(rt, infos[i], timeout) for i in unique))
        results = [LLMStatusCode.LLM_ALREADY_LINK] * len(infos)
        for i, code in zip(unique, linked, strict=True):
            results[i] = code
        return _overall(results), results

    async def _link_one(self, rt: Runtime, info: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        remote_id = info.remote_cluster_id
        assert remote_id is not None
        if remote_id == self._cluster_id:
            log.warning("link_clusters: cannot link cluster %d to itself", remote_id)
            return LLMStatusCode.LLM_PARAM_INVALID
        if remote_id in rt.links:
            return LLMStatusCode.LLM_ALREADY_LINK
        peer = inproc_runtime(rt, remote_id)
        if peer is not None:
            return link_inproc(rt, peer)
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

        Returns LLM_NOT_YET_LINK for a cluster that is not linked (LLM_SUCCESS with
        ``force``: a forced unlink is idempotent teardown, so both sides may call it),
        LLM_TIMEOUT when the link stayed busy past ``timeout`` ms.
        """
        rt = self._runtime()
        infos = _check_clusters(clusters, timeout)
        check_type("force", force, bool)
        results = await asyncio.gather(*(self._unlink_one(rt, c, timeout, force) for c in infos))
        return _overall(results), list(results)

    async def _unlink_one(
        self, rt: Runtime, info: LLMClusterInfo, timeout_ms: int, force: bool
    ) -> LLMStatusCode:
        remote_id = info.remote_cluster_id
        assert remote_id is not None
        link = rt.links.find(remote_id)
        if link is None:
            return LLMStatusCode.LLM_SUCCESS if force else LLMStatusCode.LLM_NOT_YET_LINK
        deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
        if force:
            await drop_link(rt, link, deadline=deadline)
            return LLMStatusCode.LLM_SUCCESS
        try:
            async with link.exclusive(deadline):
                await drop_link(rt, link, deadline=deadline, slot_held=True)
        except LLMException as e:
            return e.status_code
        return LLMStatusCode.LLM_SUCCESS

    @public("check_link_status")
    def check_link_status(self, remote_cluster_id: int) -> None:
        """Returns None when ``remote_cluster_id`` is linked (v1's health check).

        Raises:
            LLMLinkError: LLM_NOT_YET_LINK when it is not.
        """
        rt = self._runtime()
        rt.links.get(check_uint("remote_cluster_id", remote_cluster_id, 64))

    _metrics: InstanceMetrics | None = None

    def stats(self) -> Stats:
        """Transfer metrics (:mod:`aiodatadist.metrics`), from any thread; kept after finalize."""
        return (self._metrics or InstanceMetrics(self._cluster_id)).snapshot()

    # ------------------------------------------------------- two-sided links

    @public("link")
    async def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Two-sided link: every member calls it with the same arguments; returns the
        comm id at once. Poll :meth:`query_register_mem_status` until OK (or FAILED)
        before transferring. How a rank is reached: :mod:`aiodatadist._ranktable`.

        Args:
            comm_name: non-empty, under 128 characters, unique among this instance's comms.
            cluster_rank_info: ``{cluster_id: rank_id}``, 2 to 4 members, ranks ascending
                in dict order; this instance's cluster id must be one of them.
            rank_table: upstream's rank table JSON (version "1.0" or "1.2").

        Raises:
            TypeError, LLMParamError: bad arguments or rank table (nothing started).
            LLMLinkError: LLM_ALREADY_LINK: ``comm_name`` in use, or a member already linked.
            LLMException: LLM_CLUSTER_NUM_EXCEED_LIMIT past 512 comms.
        """
        self._runtime()
        members = _check_link_args(comm_name, cluster_rank_info, rank_table)
        table = parse_rank_table(rank_table)
        table.check_ranks(members)
        assert self._comms is not None
        return self._comms.start(comm_name, members, table)

    @public("query_register_mem_status")
    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """PREPARING while the comm's links are made, then OK, or FAILED (deadline, refusal,
        a link lost after OK).

        Raises:
            TypeError, LLMParamError: ``comm_id`` is not a uint64.
            LLMLinkError: LLM_NOT_YET_LINK for an unknown comm id.
        """
        self._runtime()
        assert self._comms is not None
        return self._comms.status(check_uint("comm_id", comm_id, 64))

    @public("unlink")
    async def unlink(self, comm_id: int) -> None:
        """Ends a comm: its links are closed in their FIFO turn (transfers queued before
        finish), establishment still running is cancelled. Both sides may call it.

        Raises:
            TypeError, LLMParamError: ``comm_id`` is not a uint64.
            LLMLinkError: LLM_NOT_YET_LINK for an unknown comm id.
        """
        rt = self._runtime()
        comm_id = check_uint("comm_id", comm_id, 64)
        assert self._comms is not None
        await self._comms.unlink(comm_id, rt.deadline(None))

    @public("switch_role")
    async def switch_role(
        self, role: LLMRole, switch_options: dict[str, str] | None = None
    ) -> None:
        """Changes the role; with ``llm.listenIpInfo`` in ``switch_options`` the link server
        (re)starts there, otherwise a running one stops (a pure client).

        Raises:
            TypeError, LLMParamError: bad role or options (nothing changes).
            LLMLinkError: LLM_EXIST_LINK while a link exists or a comm is establishing.
        """
        rt = self._runtime()
        check_type("role", role, LLMRole)
        listen = _check_switch_options(switch_options)
        assert self._comms is not None and self._listening is not None
        if len(rt.links) or self._comms.establishing:
            raise failure(LLMStatusCode.LLM_EXIST_LINK, "unlink every link before switch_role")
        await self._listening.move(listen)
        log.info("switch_role %s -> %s", self._role.name, LLMRole(role).name)
        self._role = rt.role = LLMRole(role)

    def __repr__(self) -> str:
        state = "initialized" if self._rt is not None else "not initialized"
        return f"<LLMDataDist {self._role.name} cluster_id={self._cluster_id} {state}>"


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


def _overall(results: Sequence[LLMStatusCode]) -> LLMStatusCode:
    overall = LLMStatusCode.LLM_SUCCESS
    for r in results:
        if r != LLMStatusCode.LLM_SUCCESS:
            overall = r
    return overall


def _require_same(had: Mapping[str, str], given: Mapping[str, str], what: str) -> None:
    """LLMParamError naming the first key whose value differs between ``had`` and ``given``."""
    for key in sorted(set(had) | set(given)):
        if had.get(key) != given.get(key):
            raise_param_error(
                f"{what}: key {key!r} is {had.get(key)!r} there, {given.get(key)!r} here"
            )


def _check_link_args(
    comm_name: object, cluster_rank_info: object, rank_table: object
) -> dict[int, int]:
    """Upstream's checks of ``link``'s arguments; the members as a plain dict."""
    name = check_str("comm_name", comm_name, allow_empty=False)
    require(len(name) < _MAX_COMM_NAME, f"comm_name must be shorter than {_MAX_COMM_NAME}")
    check_type("cluster_rank_info", cluster_rank_info, dict)
    assert isinstance(cluster_rank_info, dict)
    members: dict[int, int] = {}
    for k, v in cluster_rank_info.items():
        check_type("cluster_rank_info key", k, int)
        check_type("cluster_rank_info value", v, int)
        members[check_uint("cluster_rank_info key", k, 64)] = check_uint(
            "cluster_rank_info value", v, 32
        )
    require(
        len(members) <= _MAX_COMM_MEMBERS,
        f"cluster_rank_info size can not be greater than {_MAX_COMM_MEMBERS}",
    )
    check_type("rank_table", rank_table, str)
    ranks = list(members.values())
    require(len(ranks) > 1, "cluster num must be bigger than 1")
    require(ranks == sorted(ranks), "rank in cluster_rank_info must be ordered")
    require(len(set(ranks)) == len(ranks), "rank in cluster_rank_info can not be duplicated")
    return members


def _check_switch_options(options: object) -> tuple[str, int] | None:
    """``switch_options`` checked as ``init``'s options are (upstream's samples pass all of
    ``LLMConfig.generate_options()``); the ``llm.listenIpInfo`` address, or None. Only the
    listen address acts: the other keys are validated and otherwise ignored."""
    if options is None:
        return None
    check_type("switch_options", options, dict)
    assert isinstance(options, dict)
    for key, value in options.items():
        check_type("switch_options key", key, str)
        check_type(f"switch_options[{key!r}]", value, str)
    opts = parse_options(options)
    return None if opts.listen_ip is None else (opts.listen_ip, opts.listen_port or 0)
