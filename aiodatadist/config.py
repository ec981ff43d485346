"""``LLMConfig``, the option builder, and ``parse_options``, its reader.

:class:`LLMConfig` (alias ``LlmConfig``) is upstream's option builder: each
attribute is a validated property and :meth:`LLMConfig.generate_options`
returns the ``Dict[str, str]`` that ``LLMDataDist.init`` takes, with a key
only for the attributes that were set.  Upstream keys are kept verbatim, so
an options dict built for upstream works here too.  This library's own
options use the ``aiodatadist.`` prefix:

* ``data_path`` -> ``aiodatadist.DataPath``: ``auto`` (default), ``inproc``,
  ``shm``, ``cma`` or ``tcp``;
* ``executor_threads`` -> ``aiodatadist.ExecutorThreads``: 1..64, default 2;
* ``shared_secret`` -> ``aiodatadist.SharedSecret``: when unset, the
  environment variable ``AIODATADIST_SECRET`` is used;
* ``tcp_streams`` -> ``aiodatadist.TcpStreams``: 1..16, default 2;
* ``mover_threads`` -> ``aiodatadist.MoverThreads``: 1..64, default 2;
* ``finalize_timeout`` -> ``aiodatadist.FinalizeTimeout``: ms, default 5000;
* ``serve_threads`` -> ``aiodatadist.ServeThreads``: 1..64, default 4: threads
  that serve peers' tcp requests (each peer has at most one running);
* ``serve_timeout`` -> ``aiodatadist.ServeTimeout``: ms, 1..2**31-1, default
  30000: the longest a peer's request may take here, whatever deadline it asks for;
* ``heartbeat_timeout`` -> ``aiodatadist.HeartbeatTimeout``: ms, 0 (off) or
  100..2**31-1, default 30000: a link whose peer says nothing for this long is lost.

:func:`parse_options` is what the engine calls in ``init``: it checks the
value of every key it knows and returns a frozen :class:`Options`.  It, the
option keys and :class:`DataPath` live in ``aiodatadist._options`` and are
re-exported here, their public home.
"""

from __future__ import annotations

from typing import Any

from ._config_attrs import (
    Option,
    check_backend,
    check_cluster_info,
    check_data_path,
    check_device_id,
    check_fraction,
    check_json_text,
    check_listen_ip_info,
    check_pool,
    check_secret,
    check_timeout_ms,
    int_in,
)
from ._options import (
    DATA_PATHS,
    DEFAULT_DATA_PATH,
    DEFAULT_EXECUTOR_THREADS,
    DEFAULT_FINALIZE_TIMEOUT_MS,
    DEFAULT_HEARTBEAT_TIMEOUT_MS,
    DEFAULT_MEM_UTILIZATION,
    DEFAULT_MOVER_THREADS,
    DEFAULT_SERVE_THREADS,
    DEFAULT_SERVE_TIMEOUT_MS,
    DEFAULT_SYNC_KV_TIMEOUT_MS,
    DEFAULT_TCP_STREAMS,
    KNOWN_OPTION_KEYS,
    LINK_RETRY_MAX,
    OPT_BUF_POOL_CFG,
    OPT_CLUSTER_INFO,
    OPT_DATA_PATH,
    OPT_DEPLOY_RES_PATH,
    OPT_DEVICE_ID,
    OPT_ENABLE_CACHE_MANAGER,
    OPT_ENABLE_REMOTE_CACHE_ACCESSIBLE,
    OPT_ENABLE_SWITCH_ROLE,
    OPT_ENGINES,
    OPT_EXECUTOR_THREADS,
    OPT_FINALIZE_TIMEOUT,
    OPT_FLOW_GRAPH_MEM_MAX_SIZE,
    OPT_GLOBAL_RESOURCE_CONFIG,
    OPT_HEARTBEAT_TIMEOUT,
    OPT_HOST_MEM_POOL_CONFIG,
    OPT_LINK_RETRY_COUNT,
    OPT_LINK_TOTAL_TIME,
    OPT_LISTEN_IP,
    OPT_LISTEN_IP_INFO,
    OPT_LISTEN_IP_INFO_CPP,
    OPT_LISTEN_PORT,
    OPT_LOCAL_COMM_RES,
    OPT_MEM_POOL_CONFIG,
    OPT_MEMORY_UTILIZATION,
    OPT_MOVER_THREADS,
    OPT_OUTPUT_MAX_SIZE,
    OPT_RDMA_SERVICE_LEVEL,
    OPT_RDMA_TRAFFIC_CLASS,
    OPT_ROLE,
    OPT_SERVE_THREADS,
    OPT_SERVE_TIMEOUT,
    OPT_SESSION_DEVICE_ID,
    OPT_SHARED_SECRET,
    OPT_SYNC_KV_TIMEOUT,
    OPT_TCP_STREAMS,
    OPT_TRANSFER_BACKEND,
    RDMA_SL_MAX,
    ROLE_OPTION_VALUES,
    SECRET_ENV,
    TCP_STREAMS_MAX,
    THREADS_MAX,
    TRANSFER_BACKENDS,
    DataPath,
    Options,
    check_rdma_traffic_class,
    opt_heartbeat_ms,
    parse_engines,
    parse_listen_ip_info,
    parse_options,
)
from ._validate import INT32_MAX, UINT32_MAX, check_bool, check_int, check_str, check_type


def _check_heartbeat(name: str, value: Any) -> int:
    return opt_heartbeat_ms(name, check_int(name, value, min_value=0, max_value=INT32_MAX))


def _check_engines(name: str, value: Any) -> str | None:
    # A comma string or a sequence of names; stored as the comma string it emits.
    if value is None:
        return None
    if not isinstance(value, str):
        check_type(name, value, (list, tuple))
    return ",".join(e.value for e in parse_engines(name, value)) or None


__all__ = [
    "DATA_PATHS",
    "DEFAULT_DATA_PATH",
    "DEFAULT_EXECUTOR_THREADS",
    "DEFAULT_FINALIZE_TIMEOUT_MS",
    "DEFAULT_HEARTBEAT_TIMEOUT_MS",
    "DEFAULT_MEM_UTILIZATION",
    "DEFAULT_MOVER_THREADS",
    "DEFAULT_SERVE_THREADS",
    "DEFAULT_SERVE_TIMEOUT_MS",
    "DEFAULT_SYNC_KV_TIMEOUT_MS",
    "DEFAULT_TCP_STREAMS",
    "DataPath",
    "KNOWN_OPTION_KEYS",
    "LLMConfig",
    "LlmConfig",
    "OPT_BUF_POOL_CFG",
    "OPT_CLUSTER_INFO",
    "OPT_DATA_PATH",
    "OPT_ENGINES",
    "OPT_DEPLOY_RES_PATH",
    "OPT_DEVICE_ID",
    "OPT_ENABLE_CACHE_MANAGER",
    "OPT_ENABLE_REMOTE_CACHE_ACCESSIBLE",
    "OPT_ENABLE_SWITCH_ROLE",
    "OPT_EXECUTOR_THREADS",
    "OPT_FINALIZE_TIMEOUT",
    "OPT_FLOW_GRAPH_MEM_MAX_SIZE",
    "OPT_GLOBAL_RESOURCE_CONFIG",
    "OPT_HEARTBEAT_TIMEOUT",
    "OPT_HOST_MEM_POOL_CONFIG",
    "OPT_LINK_RETRY_COUNT",
    "OPT_LINK_TOTAL_TIME",
    "OPT_LISTEN_IP",
    "OPT_LISTEN_IP_INFO",
    "OPT_LISTEN_IP_INFO_CPP",
    "OPT_LISTEN_PORT",
    "OPT_LOCAL_COMM_RES",
    "OPT_MEMORY_UTILIZATION",
    "OPT_MEM_POOL_CONFIG",
    "OPT_MOVER_THREADS",
    "OPT_OUTPUT_MAX_SIZE",
    "OPT_RDMA_SERVICE_LEVEL",
    "OPT_RDMA_TRAFFIC_CLASS",
    "OPT_ROLE",
    "OPT_SERVE_THREADS",
    "OPT_SERVE_TIMEOUT",
    "OPT_SESSION_DEVICE_ID",
    "OPT_SHARED_SECRET",
    "OPT_SYNC_KV_TIMEOUT",
    "OPT_TCP_STREAMS",
    "OPT_TRANSFER_BACKEND",
    "Options",
    "ROLE_OPTION_VALUES",
    "SECRET_ENV",
    "TRANSFER_BACKENDS",
    "parse_listen_ip_info",
    "parse_options",
]


class LLMConfig:
    """Builder of the options dict for ``LLMDataDist.init``.

    Every attribute is a validated property; assigning a wrong type raises
    :class:`TypeError`, a bad value :class:`~aiodatadist.errors.LLMParamError`.
    Reading an attribute that was never set gives its default.  See
    :meth:`generate_options` for what is emitted.
    """

    def __init__(self) -> None:
        self._options: dict[str, str] = {}
        self._ge_options: dict[str, str] = {}

    # -- output ---------------------------------------------------------------

    def generate_options(self) -> dict[str, str]:
        """Return the options dict for ``LLMDataDist.init``.

        ``ge_options`` are merged first, so explicit attributes override them.
        A key is emitted only for an attribute that was set, except
        ``llm.MemoryUtilization``, which is always emitted (as upstream).
        ``llm.LocalCommRes`` is emitted once set, even to ``""``: its presence
        selects cache-manager mode.  Like upstream, this updates and returns
        the same internal dict each time.

        Returns:
            The option dict (``str`` to ``str``).
        """
        opts = self._options
        opts.update(self._ge_options)
        device_id = self.device_id
        if device_id is not None:
            if isinstance(device_id, int):
                opts[OPT_DEVICE_ID] = str(device_id)
                opts[OPT_SESSION_DEVICE_ID] = str(device_id)
            else:
                opts[OPT_DEVICE_ID] = ";".join(str(d) for d in device_id)
                opts[OPT_SESSION_DEVICE_ID] = str(device_id[0])
        for option in vars(LLMConfig).values():
            if isinstance(option, Option):
                text = option.emitted(self)
                if text is not None:
                    opts[option.key] = text
        return opts

    def gen_options(self) -> dict[str, str]:
        """Alias of :meth:`generate_options`."""
        return self.generate_options()

    @property
    def options(self) -> dict[str, str]:
        """The dict last filled by :meth:`generate_options`."""
        return self._options

    # -- upstream attributes (in the order generate_options emits them) -------

    @property
    def ge_options(self) -> dict[str, str]:
        """Extra options merged verbatim before the others; default ``{}``."""
        return self._ge_options

    @ge_options.setter
    def ge_options(self, value: dict[str, str]) -> None:
        check_type("ge_options", value, dict)
        for k, v in value.items():
            check_type("ge_options key", k, str)
            check_type(f"ge_options[{k!r}]", v, str)
        self._ge_options = value

    device_id: Option[int | list[int] | tuple[int, ...] | None] = Option(
        OPT_DEVICE_ID,
        check_device_id,
        default=None,
        emit="never",
        doc="""Device id (int32 >= 0) or a list/tuple of them; ``None`` until set.

        Emits ``ge.exec.deviceId`` and ``ge.session_device_id``; a list gives
        ``"a;b"`` and its first id respectively.
        """,
    )
    sync_kv_timeout: Option[int] = Option(
        OPT_SYNC_KV_TIMEOUT,
        check_timeout_ms,
        default=DEFAULT_SYNC_KV_TIMEOUT_MS,
        doc="""Timeout of each pull/push (and of each layer of ``transfer_cache_async``), in ms.

        An ``int`` or a digit string, > 0 and int32.  Reads as 1000 when unset
        (the engine's default); read back as an ``int``.  Emits
        ``llm.SyncKvCacheWaitTime``.
        """,
    )
    deploy_res_path: Option[str] = Option(
        OPT_DEPLOY_RES_PATH,
        check_str,
        default="",
        emit="truthy",
        doc=('Upstream v1 deployment resource path; ``""`` if none.  Emits ``llm.deployResPath``.'),
    )
    buf_pool_cfg: Option[str] = Option(
        OPT_BUF_POOL_CFG,
        check_str,
        default="",
        emit="truthy",
        doc="""Upstream v1 buffer-pool JSON; ``""`` if none.  Emits ``llm.BufPoolCfg``.""",
    )
    mem_pool_cfg: Option[str] = Option(
        OPT_MEM_POOL_CONFIG,
        check_pool,
        default="",
        emit="truthy",
        doc="""Device pool JSON ``{"memory_size": bytes, "page_shift": 10..30}``; ``""`` if none.

        Emits ``llm.MemPoolConfig`` when non-empty.
        """,
    )
    host_mem_pool_cfg: Option[str] = Option(
        OPT_HOST_MEM_POOL_CONFIG,
        check_pool,
        default="",
        emit="truthy",
        doc="""Host pool JSON, same form as :attr:`mem_pool_cfg`.

        Emits ``llm.HostMemPoolConfig`` when non-empty.
        """,
    )
    enable_cache_manager: Option[bool] = Option(
        OPT_ENABLE_CACHE_MANAGER,
        check_bool,
        default=False,
        doc="""Cache-manager (v2) mode; default ``False``.  Emits ``llm.EnableCacheManager``.""",
    )
    enable_remote_cache_accessible: Option[bool] = Option(
        OPT_ENABLE_REMOTE_CACHE_ACCESSIBLE,
        check_bool,
        default=False,
        doc="""One-sided pulls and pushes; default ``False``.

        Emits ``llm.EnableRemoteCacheAccessible``.
        """,
    )
    listen_ip_info: Option[str] = Option(
        OPT_LISTEN_IP_INFO,
        check_listen_ip_info,
        default="",
        emit="truthy",
        doc="""``"ip:port"`` (IPv4, or ``"[ipv6]:port"``) to accept links on; ``""`` if none.

        Emits ``llm.listenIpInfo`` when non-empty.  Port 0 picks a free port.
        """,
    )
    link_total_time: Option[int] = Option(
        OPT_LINK_TOTAL_TIME,
        int_in(0, UINT32_MAX),
        default=0,
        doc="""Total link-setup time in seconds, ``[0, 2**32-1]``; reads 0 when unset.

        Emits ``llm.LinkTotalTime``.
        """,
    )
    link_retry_count: Option[int] = Option(
        OPT_LINK_RETRY_COUNT,
        int_in(1, LINK_RETRY_MAX),
        default=1,
        doc=(
            "Link-setup attempts, ``[1, 100]``; reads 1 when unset.  Emits ``llm.LinkRetryCount``."
        ),
    )
    rdma_traffic_class: Option[int | None] = Option(
        OPT_RDMA_TRAFFIC_CLASS,
        check_rdma_traffic_class,
        default=None,
        doc=(
            "RDMA traffic class, ``[0, 255]`` and a multiple of 4.  Emits ``llm.RdmaTrafficClass``."
        ),
    )
    rdma_service_level: Option[int | None] = Option(
        OPT_RDMA_SERVICE_LEVEL,
        int_in(0, RDMA_SL_MAX),
        default=None,
        doc="""RDMA service level, ``[0, 7]``.  Emits ``llm.RdmaServiceLevel``.""",
    )
    local_comm_res: Option[str] = Option(
        OPT_LOCAL_COMM_RES,
        check_str,
        default="",
        doc="""Local communication resources (JSON or ``""``); reads ``""`` when unset.

        Emits ``llm.LocalCommRes`` once set, even to ``""``; its presence
        turns on cache-manager and remote-accessible mode by default.
        """,
    )
    transfer_backend: Option[str] = Option(
        OPT_TRANSFER_BACKEND,
        check_backend,
        default="",
        doc="""Transfer backend; only ``"hixl"`` is accepted.  Emits ``llm.TransferBackend``.""",
    )
    global_resource_config: Option[str] = Option(
        OPT_GLOBAL_RESOURCE_CONFIG,
        check_json_text,
        default="",
        doc="""JSON passed through to the HIXL backend; reads ``""`` when unset.

        Emits ``llm.GlobalResourceConfig`` once set.
        """,
    )
    cluster_info: Option[str] = Option(
        OPT_CLUSTER_INFO,
        check_cluster_info,
        default="",
        emit="truthy",
        doc="""Upstream v1 cluster JSON; ``""`` if none.  Emits ``llm.ClusterInfo``.

        As upstream, string IPs under ``listen_ip_info[].ip`` are converted
        to the integer form.
        """,
    )
    output_max_size: Option[int | None] = Option(
        OPT_OUTPUT_MAX_SIZE,
        int_in(0),
        default=None,
        doc="""Upstream v1 output size limit (int >= 0).  Emits ``llm.OutputMaxSize``.""",
    )
    enable_switch_role: Option[bool] = Option(
        OPT_ENABLE_SWITCH_ROLE,
        check_bool,
        default=False,
        emit="truthy",
        doc=(
            'Upstream v1 switch: emits ``llm.EnableSwitchRole="1"`` when true; default ``False``.'
        ),
    )
    mem_utilization: Option[float] = Option(
        OPT_MEMORY_UTILIZATION,
        check_fraction,
        default=DEFAULT_MEM_UTILIZATION,
        emit="always",
        doc="""Upstream v1 memory fraction in ``[0, 1]``; default 0.95, always emitted.

        Emits ``llm.MemoryUtilization``.
        """,
    )

    # -- this library's attributes -------------------------------------------

    data_path: Option[DataPath] = Option(
        OPT_DATA_PATH,
        check_data_path,
        default=DEFAULT_DATA_PATH,
        doc="""How bytes move: one of ``auto``, ``inproc``, ``shm``, ``cma``, ``tcp``,
        ``nixl``, ``mooncake``.

        ``auto`` (default) picks the fastest path that works for each peer (an engine
        for device memory). ``nixl``/``mooncake`` force that engine (and start it).
        Emits ``aiodatadist.DataPath``.
        """,
    )
    engines: Option[str | None] = Option(
        OPT_ENGINES,
        _check_engines,
        default=None,
        doc="""Transfer engines to start at ``init``: ``"nixl"``, ``"mooncake"`` or both, as
        a comma string or a list of names (stored as the comma string).

        A link uses an engine only when both sides run it. Emits ``aiodatadist.Engines``.
        """,
    )
    executor_threads: Option[int] = Option(
        OPT_EXECUTOR_THREADS,
        int_in(1, THREADS_MAX),
        default=DEFAULT_EXECUTOR_THREADS,
        doc="""Worker threads for blocking native calls, ``[1, 64]``; default 2.

        Emits ``aiodatadist.ExecutorThreads``.
        """,
    )
    shared_secret: Option[str | None] = Option(
        OPT_SHARED_SECRET,
        check_secret,
        default=None,
        doc="""Secret both sides must share to link (non-empty ``str``); ``None`` when unset.

        When unset, the engine uses the environment variable
        ``AIODATADIST_SECRET`` if it is set.  Emits ``aiodatadist.SharedSecret``.
        """,
    )
    tcp_streams: Option[int] = Option(
        OPT_TCP_STREAMS,
        int_in(1, TCP_STREAMS_MAX),
        default=DEFAULT_TCP_STREAMS,
        doc="""Parallel TCP connections per link on the ``tcp`` path, ``[1, 16]``; default 2.

        Emits ``aiodatadist.TcpStreams``.
        """,
    )
    mover_threads: Option[int] = Option(
        OPT_MOVER_THREADS,
        int_in(1, THREADS_MAX),
        default=DEFAULT_MOVER_THREADS,
        doc="""Native threads that copy the bytes of one transfer, ``[1, 64]``; default 2.

        Emits ``aiodatadist.MoverThreads``.
        """,
    )
    finalize_timeout: Option[int] = Option(
        OPT_FINALIZE_TIMEOUT,
        int_in(0, INT32_MAX),
        default=DEFAULT_FINALIZE_TIMEOUT_MS,
        doc="""How long ``finalize`` waits for running transfers, in ms, ``[0, 2**31-1]``.

        Default 5000.  Emits ``aiodatadist.FinalizeTimeout``.
        """,
    )
    serve_threads: Option[int] = Option(
        OPT_SERVE_THREADS,
        int_in(1, THREADS_MAX),
        default=DEFAULT_SERVE_THREADS,
        doc="""Threads that serve peers' tcp requests, ``[1, 64]``; default 4.

        They are separate from ``executor_threads``, so peers can never starve this
        instance's own transfers; each peer has at most one request running on them.
        Emits ``aiodatadist.ServeThreads``.
        """,
    )
    serve_timeout: Option[int] = Option(
        OPT_SERVE_TIMEOUT,
        int_in(1, INT32_MAX),
        default=DEFAULT_SERVE_TIMEOUT_MS,
        doc="""The longest a peer's request may take here, in ms, ``[1, 2**31-1]``; default 30000.

        A request's deadline is the smaller of the one the peer asks for and this,
        counted from its arrival: a peer that stops reading holds a serving thread
        for at most this long.  Emits ``aiodatadist.ServeTimeout``.
        """,
    )
    heartbeat_timeout: Option[int] = Option(
        OPT_HEARTBEAT_TIMEOUT,
        _check_heartbeat,
        default=DEFAULT_HEARTBEAT_TIMEOUT_MS,
        doc="""How long a link may hear nothing from its peer, in ms: 0 (off) or
        ``[100, 2**31-1]``; default 30000.

        A link that heard nothing on its control connection for a third of it pings the
        peer (any message back will do); one that heard nothing for all of it is lost
        (``LLM_LINK_FAILED`` for what waits on it, an INFO log line with the reason):
        a peer host that died or was cut off, or a peer process that is frozen, is found
        without a transfer having to time out first.  Emits ``aiodatadist.HeartbeatTimeout``.
        """,
    )


LlmConfig = LLMConfig

# The public home of the names defined in aiodatadist._options (reprs, pickles, docs).
for _public in (DataPath, Options, parse_listen_ip_info, parse_options):
    _public.__module__ = __name__
del _public
