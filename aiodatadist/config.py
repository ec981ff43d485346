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
  30000: the longest a peer's request may take here, whatever deadline it asks for.

:func:`parse_options` is what the engine calls in ``init``: it checks the
value of every key it knows and returns a frozen :class:`Options`.
"""

from __future__ import annotations

import enum
import ipaddress
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._validate import (
    INT32_MAX,
    UINT16_MAX,
    UINT32_MAX,
    check_bool,
    check_int,
    check_str,
    check_type,
    raise_param_error,
    require,
)
from .errors import LLMParamError
from .types import ip_to_int

__all__ = [
    "DATA_PATHS",
    "SECRET_ENV",
    "DataPath",
    "LLMConfig",
    "LlmConfig",
    "Options",
    "parse_listen_ip_info",
    "parse_options",
]

# Upstream option keys.
OPT_DEVICE_ID = "ge.exec.deviceId"
OPT_SESSION_DEVICE_ID = "ge.session_device_id"
OPT_FLOW_GRAPH_MEM_MAX_SIZE = "ge.flowGraphMemMaxSize"
OPT_ROLE = "llm.Role"
OPT_SYNC_KV_TIMEOUT = "llm.SyncKvCacheWaitTime"
OPT_LISTEN_IP_INFO = "llm.listenIpInfo"
OPT_LISTEN_IP_INFO_CPP = "llm.ListenIpInfo"  # the C++ API's spelling
OPT_LISTEN_IP = "llm.ListenIp"
OPT_LISTEN_PORT = "llm.ListenPort"
OPT_ENABLE_CACHE_MANAGER = "llm.EnableCacheManager"
OPT_ENABLE_REMOTE_CACHE_ACCESSIBLE = "llm.EnableRemoteCacheAccessible"
OPT_MEM_POOL_CONFIG = "llm.MemPoolConfig"
OPT_HOST_MEM_POOL_CONFIG = "llm.HostMemPoolConfig"
OPT_BUF_POOL_CFG = "llm.BufPoolCfg"
OPT_LINK_TOTAL_TIME = "llm.LinkTotalTime"
OPT_LINK_RETRY_COUNT = "llm.LinkRetryCount"
OPT_RDMA_TRAFFIC_CLASS = "llm.RdmaTrafficClass"
OPT_RDMA_SERVICE_LEVEL = "llm.RdmaServiceLevel"
OPT_LOCAL_COMM_RES = "llm.LocalCommRes"
OPT_TRANSFER_BACKEND = "llm.TransferBackend"
OPT_GLOBAL_RESOURCE_CONFIG = "llm.GlobalResourceConfig"
OPT_ENABLE_SWITCH_ROLE = "llm.EnableSwitchRole"
OPT_MEMORY_UTILIZATION = "llm.MemoryUtilization"
OPT_CLUSTER_INFO = "llm.ClusterInfo"
OPT_OUTPUT_MAX_SIZE = "llm.OutputMaxSize"
OPT_DEPLOY_RES_PATH = "llm.deployResPath"

# This library's option keys.
OPT_DATA_PATH = "aiodatadist.DataPath"
OPT_EXECUTOR_THREADS = "aiodatadist.ExecutorThreads"
OPT_SHARED_SECRET = "aiodatadist.SharedSecret"
OPT_TCP_STREAMS = "aiodatadist.TcpStreams"
OPT_MOVER_THREADS = "aiodatadist.MoverThreads"
OPT_FINALIZE_TIMEOUT = "aiodatadist.FinalizeTimeout"
OPT_SERVE_THREADS = "aiodatadist.ServeThreads"
OPT_SERVE_TIMEOUT = "aiodatadist.ServeTimeout"

SECRET_ENV = "AIODATADIST_SECRET"
"""Environment variable holding the shared secret when ``shared_secret`` is not set."""



class DataPath(enum.StrEnum):
    """A data path: how a link moves bytes (``aiodatadist.DataPath`` forces one).

    The one name of each path, used by the options, the wire, the CLI and ``Link``.
    Being a ``str`` enum, a member equals its value (``DataPath.TCP == "tcp"``).
    """

    AUTO = "auto"
    """Pick per transfer: in-process, else same host ``shm``/``cma``, else ``tcp``."""
    INPROC = "inproc"
    """Both instances in this process: memcpy."""
    SHM = "shm"
    """Same host, the peer's cache in shared memory we map: memcpy."""
    CMA = "cma"
    """Same host, the peer's registered memory: ``process_vm_readv/writev``."""
    TCP = "tcp"
    """Any hosts: the peer serves the request over data streams."""

    @classmethod
    def remote(cls) -> tuple[DataPath, ...]:
        """The cross-process paths, fastest first (the order ``auto`` tries them in)."""
        return (cls.SHM, cls.CMA, cls.TCP)


DATA_PATHS = tuple(p.value for p in DataPath)
"""Accepted values of ``data_path``."""

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
DEFAULT_DATA_PATH = DataPath.AUTO
DEFAULT_EXECUTOR_THREADS = 2
DEFAULT_TCP_STREAMS = 2
DEFAULT_MOVER_THREADS = 2
DEFAULT_FINALIZE_TIMEOUT_MS = 5000
DEFAULT_SERVE_THREADS = 4
DEFAULT_SERVE_TIMEOUT_MS = 30000
DEFAULT_MEM_UTILIZATION = 0.95
TRANSFER_BACKENDS = ("hixl",)
ROLE_OPTION_VALUES = ("Prompt", "Decoder", "Mix")

_THREADS_MAX = 64
_TCP_STREAMS_MAX = 16
_LINK_RETRY_MAX = 100
_RDMA_TC_MAX = 255
_RDMA_SL_MAX = 7
_PAGE_SHIFT_RANGE = range(10, 31)


def parse_listen_ip_info(value: str, name: str = "listen_ip_info") -> tuple[str, int]:
    """Split ``"ip:port"`` into ``(ip, port)``.

    Args:
        value: ``"a.b.c.d:port"`` or ``"[ipv6]:port"``; port in ``[0, 65535]``
            (0 asks for a free port).
        name: Argument or option name for messages.

    Returns:
        ``(ip, port)`` with the IPv6 brackets removed.

    Raises:
        TypeError: ``value`` is not a ``str``.
        LLMParamError: ``value`` is not of that form.
    """
    check_str(name, value)
    error = (
        f"{name} must be 'ipv4:port' or '[ipv6]:port' with port in [0, {UINT16_MAX}], got {value!r}"
    )
    host, sep, port_text = value.rpartition(":")
    if not sep or not _is_decimal(port_text) or int(port_text) > UINT16_MAX:
        raise_param_error(error)
    try:
        if host.startswith("[") and host.endswith("]"):
            host = str(ipaddress.IPv6Address(host[1:-1]))
        else:
            host = str(ipaddress.IPv4Address(host))
    except ValueError:
        raise LLMParamError(error) from None
    return host, int(port_text)


def _is_decimal(text: str) -> bool:
    # str.isdigit() alone accepts non-ASCII digits such as "²".
    return text.isascii() and text.isdigit()


def _check_json(name: str, value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        raise LLMParamError(f"{name} must be a JSON string, got {value!r}") from None


def _check_pool_cfg(name: str, value: str) -> None:
    # {"memory_size": int > 0 (bytes), "page_shift": int in [10, 31)}
    cfg = _check_json(name, value)
    require(isinstance(cfg, dict), f"{name} must be a JSON object, got {value!r}")
    size = cfg.get("memory_size")
    if size is not None:
        require(
            type(size) is int and size > 0,
            f"{name}: memory_size must be an int > 0, got {size!r}",
        )
    shift = cfg.get("page_shift")
    if shift is not None:
        require(
            type(shift) is int and shift in _PAGE_SHIFT_RANGE,
            f"{name}: page_shift must be an int in [10, 31), got {shift!r}",
        )


def _check_rdma_traffic_class(name: str, value: object) -> int:
    tc = check_int(name, value, min_value=0, max_value=_RDMA_TC_MAX)
    require(tc % 4 == 0, f"{name} must be a multiple of 4, got {tc}")
    return tc


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
        self._device_id: int | list[int] | tuple[int, ...] | None = None
        self._sync_kv_timeout: int | None = None
        self._listen_ip_info = ""
        self._deploy_res_path = ""
        self._enable_cache_manager: bool | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._mem_pool_cfg = ""
        self._host_mem_pool_cfg = ""
        self._buf_pool_cfg = ""
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._rdma_traffic_class: int | None = None
        self._rdma_service_level: int | None = None
        self._local_comm_res: str | None = None
        self._transfer_backend: str | None = None
        self._global_resource_config: str | None = None
        self._enable_switch_role = False
        self._mem_utilization = DEFAULT_MEM_UTILIZATION
        self._cluster_info = ""
        self._output_max_size: int | None = None
        self._data_path: str | None = None
        self._executor_threads: int | None = None
        self._shared_secret: str | None = None
        self._tcp_streams: int | None = None
        self._mover_threads: int | None = None
        self._finalize_timeout: int | None = None
        self._serve_threads: int | None = None
        self._serve_timeout: int | None = None

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
        if self._device_id is not None:
            if isinstance(self._device_id, int):
                opts[OPT_DEVICE_ID] = str(self._device_id)
                opts[OPT_SESSION_DEVICE_ID] = str(self._device_id)
            else:
                opts[OPT_DEVICE_ID] = ";".join(str(d) for d in self._device_id)
                opts[OPT_SESSION_DEVICE_ID] = str(self._device_id[0])
        if self._sync_kv_timeout is not None:
            opts[OPT_SYNC_KV_TIMEOUT] = str(self._sync_kv_timeout)
        if self._deploy_res_path:
            opts[OPT_DEPLOY_RES_PATH] = self._deploy_res_path
        if self._buf_pool_cfg:
            opts[OPT_BUF_POOL_CFG] = self._buf_pool_cfg
        if self._mem_pool_cfg:
            opts[OPT_MEM_POOL_CONFIG] = self._mem_pool_cfg
        if self._host_mem_pool_cfg:
            opts[OPT_HOST_MEM_POOL_CONFIG] = self._host_mem_pool_cfg
        if self._enable_cache_manager is not None:
            opts[OPT_ENABLE_CACHE_MANAGER] = "1" if self._enable_cache_manager else "0"
        if self._enable_remote_cache_accessible is not None:
            opts[OPT_ENABLE_REMOTE_CACHE_ACCESSIBLE] = (
                "1" if self._enable_remote_cache_accessible else "0"
            )
        if self._listen_ip_info:
            opts[OPT_LISTEN_IP_INFO] = self._listen_ip_info
        if self._link_total_time is not None:
            opts[OPT_LINK_TOTAL_TIME] = str(self._link_total_time)
        if self._link_retry_count is not None:
            opts[OPT_LINK_RETRY_COUNT] = str(self._link_retry_count)
        if self._rdma_traffic_class is not None:
            opts[OPT_RDMA_TRAFFIC_CLASS] = str(self._rdma_traffic_class)
        if self._rdma_service_level is not None:
            opts[OPT_RDMA_SERVICE_LEVEL] = str(self._rdma_service_level)
        if self._local_comm_res is not None:
            opts[OPT_LOCAL_COMM_RES] = self._local_comm_res
        if self._transfer_backend is not None:
            opts[OPT_TRANSFER_BACKEND] = self._transfer_backend
        if self._global_resource_config is not None:
            opts[OPT_GLOBAL_RESOURCE_CONFIG] = self._global_resource_config
        if self._cluster_info:
            opts[OPT_CLUSTER_INFO] = self._cluster_info
        if self._output_max_size is not None:
            opts[OPT_OUTPUT_MAX_SIZE] = str(self._output_max_size)
        if self._enable_switch_role:
            opts[OPT_ENABLE_SWITCH_ROLE] = "1"
        opts[OPT_MEMORY_UTILIZATION] = str(self._mem_utilization)
        own: list[tuple[str, object]] = [
            (OPT_DATA_PATH, self._data_path),
            (OPT_EXECUTOR_THREADS, self._executor_threads),
            (OPT_SHARED_SECRET, self._shared_secret),
            (OPT_TCP_STREAMS, self._tcp_streams),
            (OPT_MOVER_THREADS, self._mover_threads),
            (OPT_FINALIZE_TIMEOUT, self._finalize_timeout),
            (OPT_SERVE_THREADS, self._serve_threads),
            (OPT_SERVE_TIMEOUT, self._serve_timeout),
        ]
        for key, value in own:
            if value is not None:
                opts[key] = str(value)
        return opts

    def gen_options(self) -> dict[str, str]:
        """Alias of :meth:`generate_options`."""
        return self.generate_options()

    @property
    def options(self) -> dict[str, str]:
        """The dict last filled by :meth:`generate_options`."""
        return self._options

    # -- upstream attributes -------------------------------------------------

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

    @property
    def device_id(self) -> int | list[int] | tuple[int, ...] | None:
        """Device id (int32 >= 0) or a list/tuple of them; ``None`` until set.

        Emits ``ge.exec.deviceId`` and ``ge.session_device_id``; a list gives
        ``"a;b"`` and its first id respectively.
        """
        return self._device_id

    @device_id.setter
    def device_id(self, value: int | list[int] | tuple[int, ...]) -> None:
        if isinstance(value, (list, tuple)):
            require(len(value) > 0, "device_id must not be an empty list")
            for i, dev in enumerate(value):
                check_int(f"device_id[{i}]", dev, min_value=0, max_value=INT32_MAX)
        else:
            check_type("device_id", value, (int, list, tuple))
            check_int("device_id", value, min_value=0, max_value=INT32_MAX)
        self._device_id = value

    @property
    def sync_kv_timeout(self) -> int:
        """Timeout of each pull/push (and of each layer of ``transfer_cache_async``), in ms.

        An ``int`` or a digit string, > 0 and int32.  Reads as 1000 when unset
        (the engine's default); read back as an ``int``.  Emits
        ``llm.SyncKvCacheWaitTime``.
        """
        return (
            DEFAULT_SYNC_KV_TIMEOUT_MS if self._sync_kv_timeout is None else self._sync_kv_timeout
        )

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, value: int | str) -> None:
        check_type("sync_kv_timeout", value, (int, str))
        if isinstance(value, str):
            require(_is_decimal(value), f"sync_kv_timeout must be digits, got {value!r}")
            value = int(value)
        self._sync_kv_timeout = check_int(
            "sync_kv_timeout", value, min_value=1, max_value=INT32_MAX
        )

    @property
    def listen_ip_info(self) -> str:
        """``"ip:port"`` (IPv4, or ``"[ipv6]:port"``) to accept links on; ``""`` if none.

        Emits ``llm.listenIpInfo`` when non-empty.  Port 0 picks a free port.
        """
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, value: str) -> None:
        check_str("listen_ip_info", value)
        if value:
            parse_listen_ip_info(value)
        self._listen_ip_info = value

    @property
    def enable_cache_manager(self) -> bool:
        """Cache-manager (v2) mode; default ``False``.  Emits ``llm.EnableCacheManager``."""
        return bool(self._enable_cache_manager)

    @enable_cache_manager.setter
    def enable_cache_manager(self, value: bool) -> None:
        self._enable_cache_manager = check_bool("enable_cache_manager", value)

    @property
    def enable_remote_cache_accessible(self) -> bool:
        """One-sided pulls and pushes; default ``False``.

        Emits ``llm.EnableRemoteCacheAccessible``.
        """
        return bool(self._enable_remote_cache_accessible)

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, value: bool) -> None:
        self._enable_remote_cache_accessible = check_bool("enable_remote_cache_accessible", value)

    @property
    def mem_pool_cfg(self) -> str:
        """Device pool JSON ``{"memory_size": bytes, "page_shift": 10..30}``; ``""`` if none.

        Emits ``llm.MemPoolConfig`` when non-empty.
        """
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, value: str) -> None:
        check_str("mem_pool_cfg", value)
        if value:
            _check_pool_cfg("mem_pool_cfg", value)
        self._mem_pool_cfg = value

    @property
    def host_mem_pool_cfg(self) -> str:
        """Host pool JSON, same form as :attr:`mem_pool_cfg`.

        Emits ``llm.HostMemPoolConfig`` when non-empty.
        """
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, value: str) -> None:
        check_str("host_mem_pool_cfg", value)
        if value:
            _check_pool_cfg("host_mem_pool_cfg", value)
        self._host_mem_pool_cfg = value

    @property
    def buf_pool_cfg(self) -> str:
        """Upstream v1 buffer-pool JSON; ``""`` if none.  Emits ``llm.BufPoolCfg``."""
        return self._buf_pool_cfg

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, value: str) -> None:
        self._buf_pool_cfg = check_str("buf_pool_cfg", value)

    @property
    def link_total_time(self) -> int:
        """Total link-setup time in seconds, ``[0, 2**32-1]``; reads 0 when unset.

        Emits ``llm.LinkTotalTime``.
        """
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, value: int) -> None:
        self._link_total_time = check_int(
            "link_total_time", value, min_value=0, max_value=UINT32_MAX
        )

    @property
    def link_retry_count(self) -> int:
        """Link-setup attempts, ``[1, 100]``; reads 1 when unset.  Emits ``llm.LinkRetryCount``."""
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, value: int) -> None:
        self._link_retry_count = check_int(
            "link_retry_count", value, min_value=1, max_value=_LINK_RETRY_MAX
        )

    @property
    def rdma_traffic_class(self) -> int | None:
        """RDMA traffic class, ``[0, 255]`` and a multiple of 4.  Emits ``llm.RdmaTrafficClass``."""
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, value: int) -> None:
        self._rdma_traffic_class = _check_rdma_traffic_class("rdma_traffic_class", value)

    @property
    def rdma_service_level(self) -> int | None:
        """RDMA service level, ``[0, 7]``.  Emits ``llm.RdmaServiceLevel``."""
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, value: int) -> None:
        self._rdma_service_level = check_int(
            "rdma_service_level", value, min_value=0, max_value=_RDMA_SL_MAX
        )

    @property
    def local_comm_res(self) -> str:
        """Local communication resources (JSON or ``""``); reads ``""`` when unset.

        Emits ``llm.LocalCommRes`` once set, even to ``""``; its presence
        turns on cache-manager and remote-accessible mode by default.
        """
        return "" if self._local_comm_res is None else self._local_comm_res

    @local_comm_res.setter
    def local_comm_res(self, value: str) -> None:
        self._local_comm_res = check_str("local_comm_res", value)

    @property
    def transfer_backend(self) -> str:
        """Transfer backend; only ``"hixl"`` is accepted.  Emits ``llm.TransferBackend``."""
        return "" if self._transfer_backend is None else self._transfer_backend

    @transfer_backend.setter
    def transfer_backend(self, value: str) -> None:
        check_str("transfer_backend", value)
        require(
            value in TRANSFER_BACKENDS,
            f"transfer_backend must be one of {list(TRANSFER_BACKENDS)}, got {value!r}",
        )
        self._transfer_backend = value

    @property
    def global_resource_config(self) -> str:
        """JSON passed through to the HIXL backend; reads ``""`` when unset.

        Emits ``llm.GlobalResourceConfig`` once set.
        """
        return "" if self._global_resource_config is None else self._global_resource_config

    @global_resource_config.setter
    def global_resource_config(self, value: str) -> None:
        check_str("global_resource_config", value)
        if value:
            _check_json("global_resource_config", value)
        self._global_resource_config = value

    @property
    def enable_switch_role(self) -> bool:
        """Upstream v1 switch: emits ``llm.EnableSwitchRole="1"`` when true; default ``False``."""
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, value: bool) -> None:
        self._enable_switch_role = check_bool("enable_switch_role", value)

    @property
    def mem_utilization(self) -> float:
        """Upstream v1 memory fraction in ``[0, 1]``; default 0.95, always emitted.

        Emits ``llm.MemoryUtilization``.
        """
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, value: float) -> None:
        check_type("mem_utilization", value, (float, int))
        require(0.0 <= value <= 1.0, f"mem_utilization must be in [0, 1], got {value!r}")
        self._mem_utilization = float(value)

    @property
    def cluster_info(self) -> str:
        """Upstream v1 cluster JSON; ``""`` if none.  Emits ``llm.ClusterInfo``.

        As upstream, string IPs under ``listen_ip_info[].ip`` are converted
        to the integer form.
        """
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, value: str) -> None:
        check_str("cluster_info", value)
        if not value:
            self._cluster_info = ""
            return
        info = _check_json("cluster_info", value)
        require(isinstance(info, dict), f"cluster_info must be a JSON object, got {value!r}")
        entries = info.get("listen_ip_info", [])
        require(
            isinstance(entries, list) and all(isinstance(e, dict) for e in entries),
            f"cluster_info: listen_ip_info must be a list of objects, got {entries!r}",
        )
        for entry in entries:
            if "ip" in entry:
                entry["ip"] = ip_to_int("cluster_info: listen_ip_info[].ip", entry["ip"])
        self._cluster_info = json.dumps(info)

    @property
    def output_max_size(self) -> int | None:
        """Upstream v1 output size limit (int >= 0).  Emits ``llm.OutputMaxSize``."""
        return self._output_max_size

    @output_max_size.setter
    def output_max_size(self, value: int) -> None:
        self._output_max_size = check_int("output_max_size", value, min_value=0)

    @property
    def deploy_res_path(self) -> str:
        """Upstream v1 deployment resource path; ``""`` if none.  Emits ``llm.deployResPath``."""
        return self._deploy_res_path

    @deploy_res_path.setter
    def deploy_res_path(self, value: str) -> None:
        self._deploy_res_path = check_str("deploy_res_path", value)

    # -- this library's attributes -------------------------------------------

    @property
    def data_path(self) -> str:
        """How bytes move: one of ``auto``, ``inproc``, ``shm``, ``cma``, ``tcp``.

        ``auto`` (default) picks the fastest path that works for each peer.
        Emits ``aiodatadist.DataPath``.
        """
        return DEFAULT_DATA_PATH if self._data_path is None else self._data_path

    @data_path.setter
    def data_path(self, value: str) -> None:
        check_str("data_path", value)
        require(value in DATA_PATHS, f"data_path must be one of {list(DATA_PATHS)}, got {value!r}")
        self._data_path = value

    @property
    def executor_threads(self) -> int:
        """Worker threads for blocking native calls, ``[1, 64]``; default 2.

        Emits ``aiodatadist.ExecutorThreads``.
        """
        return (
            DEFAULT_EXECUTOR_THREADS if self._executor_threads is None else self._executor_threads
        )

    @executor_threads.setter
    def executor_threads(self, value: int) -> None:
        self._executor_threads = check_int(
            "executor_threads", value, min_value=1, max_value=_THREADS_MAX
        )

    @property
    def shared_secret(self) -> str | None:
        """Secret both sides must share to link (non-empty ``str``); ``None`` when unset.

        When unset, the engine uses the environment variable
        ``AIODATADIST_SECRET`` if it is set.  Emits ``aiodatadist.SharedSecret``.
        """
        return self._shared_secret

    @shared_secret.setter
    def shared_secret(self, value: str) -> None:
        self._shared_secret = check_str("shared_secret", value, allow_empty=False)

    @property
    def tcp_streams(self) -> int:
        """Parallel TCP connections per link on the ``tcp`` path, ``[1, 16]``; default 2.

        Emits ``aiodatadist.TcpStreams``.
        """
        return DEFAULT_TCP_STREAMS if self._tcp_streams is None else self._tcp_streams

    @tcp_streams.setter
    def tcp_streams(self, value: int) -> None:
        self._tcp_streams = check_int("tcp_streams", value, min_value=1, max_value=_TCP_STREAMS_MAX)

    @property
    def mover_threads(self) -> int:
        """Native threads that copy the bytes of one transfer, ``[1, 64]``; default 2.

        Emits ``aiodatadist.MoverThreads``.
        """
        return DEFAULT_MOVER_THREADS if self._mover_threads is None else self._mover_threads

    @mover_threads.setter
    def mover_threads(self, value: int) -> None:
        self._mover_threads = check_int("mover_threads", value, min_value=1, max_value=_THREADS_MAX)

    @property
    def finalize_timeout(self) -> int:
        """How long ``finalize`` waits for running transfers, in ms, ``[0, 2**31-1]``.

        Default 5000.  Emits ``aiodatadist.FinalizeTimeout``.
        """
        return (
            DEFAULT_FINALIZE_TIMEOUT_MS
            if self._finalize_timeout is None
            else self._finalize_timeout
        )

    @finalize_timeout.setter
    def finalize_timeout(self, value: int) -> None:
        self._finalize_timeout = check_int(
            "finalize_timeout", value, min_value=0, max_value=INT32_MAX
        )

    @property
    def serve_threads(self) -> int:
        """Threads that serve peers' tcp requests, ``[1, 64]``; default 4.

        They are separate from ``executor_threads``, so peers can never starve this
        instance's own transfers; each peer has at most one request running on them.
        Emits ``aiodatadist.ServeThreads``.
        """
        return DEFAULT_SERVE_THREADS if self._serve_threads is None else self._serve_threads

    @serve_threads.setter
    def serve_threads(self, value: int) -> None:
        self._serve_threads = check_int("serve_threads", value, min_value=1, max_value=_THREADS_MAX)

    @property
    def serve_timeout(self) -> int:
        """The longest a peer's request may take here, in ms, ``[1, 2**31-1]``; default 30000.

        A request's deadline is the smaller of the one the peer asks for and this,
        counted from its arrival: a peer that stops reading holds a serving thread
        for at most this long.  Emits ``aiodatadist.ServeTimeout``.
        """
        return DEFAULT_SERVE_TIMEOUT_MS if self._serve_timeout is None else self._serve_timeout

    @serve_timeout.setter
    def serve_timeout(self, value: int) -> None:
        self._serve_timeout = check_int("serve_timeout", value, min_value=1, max_value=INT32_MAX)


LlmConfig = LLMConfig


@dataclass(frozen=True)
class Options:
    """Validated engine settings read from an options dict by :func:`parse_options`.

    Attributes:
        sync_kv_timeout_ms: Per-operation transfer timeout (``llm.SyncKvCacheWaitTime``).
        listen_ip: Address to accept links on, or ``None`` (pure client).
        listen_port: Port to accept links on (0: any free port), or ``None``.
        enable_cache_manager: ``llm.EnableCacheManager``; defaults to true when
            ``llm.LocalCommRes`` is present.
        enable_remote_cache_accessible: ``llm.EnableRemoteCacheAccessible``;
            defaults to true when ``llm.LocalCommRes`` or
            ``llm.TransferBackend`` is present.
        device_id: ``ge.session_device_id`` (else the first id of
            ``ge.exec.deviceId``), or ``None``.
        data_path: ``aiodatadist.DataPath``.
        executor_threads: ``aiodatadist.ExecutorThreads``.
        shared_secret: ``aiodatadist.SharedSecret`` or, when that is absent or
            empty, ``$AIODATADIST_SECRET``, UTF-8 encoded; ``None`` if neither.
        tcp_streams: ``aiodatadist.TcpStreams``.
        mover_threads: ``aiodatadist.MoverThreads``.
        finalize_timeout_ms: ``aiodatadist.FinalizeTimeout``.
        serve_threads: ``aiodatadist.ServeThreads``.
        serve_timeout_ms: ``aiodatadist.ServeTimeout``.
        link_total_time_s: ``llm.LinkTotalTime`` (0: not set).
        link_retry_count: ``llm.LinkRetryCount``.
        raw: A copy of every option given, known or not.
    """

    sync_kv_timeout_ms: int = DEFAULT_SYNC_KV_TIMEOUT_MS
    listen_ip: str | None = None
    listen_port: int | None = None
    enable_cache_manager: bool = False
    enable_remote_cache_accessible: bool = False
    device_id: int | None = None
    data_path: DataPath = DEFAULT_DATA_PATH
    executor_threads: int = DEFAULT_EXECUTOR_THREADS
    shared_secret: bytes | None = field(default=None, repr=False)
    tcp_streams: int = DEFAULT_TCP_STREAMS
    mover_threads: int = DEFAULT_MOVER_THREADS
    finalize_timeout_ms: int = DEFAULT_FINALIZE_TIMEOUT_MS
    serve_threads: int = DEFAULT_SERVE_THREADS
    serve_timeout_ms: int = DEFAULT_SERVE_TIMEOUT_MS
    link_total_time_s: int = 0
    link_retry_count: int = 1
    raw: dict[str, str] = field(default_factory=dict, repr=False, hash=False)


def _opt_int(key: str, text: str, min_value: int, max_value: int) -> int:
    if not _is_decimal(text) or not min_value <= int(text) <= max_value:
        raise_param_error(
            f"option {key} must be a decimal integer in [{min_value}, {max_value}], got {text!r}"
        )
    return int(text)


def _opt_flag(key: str, text: str) -> bool:
    require(text in ("0", "1"), f"option {key} must be '1' or '0', got {text!r}")
    return text == "1"


def _opt_choice(key: str, text: str, choices: Sequence[str]) -> str:
    require(text in choices, f"option {key} must be one of {list(choices)}, got {text!r}")
    return text


def _opt_device_ids(key: str, text: str) -> list[int]:
    return [_opt_int(key, part, 0, INT32_MAX) for part in text.split(";")] if text else []


def _check_other_keys(opts: Mapping[str, str]) -> None:
    # Keys the engine does not act on, checked so a typo in a value fails at init.
    for key in (OPT_MEM_POOL_CONFIG, OPT_HOST_MEM_POOL_CONFIG):
        if opts.get(key):
            _check_pool_cfg(f"option {key}", opts[key])
    for key in (OPT_GLOBAL_RESOURCE_CONFIG, OPT_CLUSTER_INFO):
        if opts.get(key):
            _check_json(f"option {key}", opts[key])
    if OPT_RDMA_TRAFFIC_CLASS in opts:
        tc = _opt_int(OPT_RDMA_TRAFFIC_CLASS, opts[OPT_RDMA_TRAFFIC_CLASS], 0, _RDMA_TC_MAX)
        _check_rdma_traffic_class(f"option {OPT_RDMA_TRAFFIC_CLASS}", tc)
    if OPT_RDMA_SERVICE_LEVEL in opts:
        _opt_int(OPT_RDMA_SERVICE_LEVEL, opts[OPT_RDMA_SERVICE_LEVEL], 0, _RDMA_SL_MAX)
    if OPT_OUTPUT_MAX_SIZE in opts:
        _opt_int(OPT_OUTPUT_MAX_SIZE, opts[OPT_OUTPUT_MAX_SIZE], 0, 2**63 - 1)
    if OPT_FLOW_GRAPH_MEM_MAX_SIZE in opts:
        _opt_int(OPT_FLOW_GRAPH_MEM_MAX_SIZE, opts[OPT_FLOW_GRAPH_MEM_MAX_SIZE], 0, 2**63 - 1)
    if OPT_ENABLE_SWITCH_ROLE in opts:
        _opt_flag(OPT_ENABLE_SWITCH_ROLE, opts[OPT_ENABLE_SWITCH_ROLE])
    if OPT_TRANSFER_BACKEND in opts:
        _opt_choice(OPT_TRANSFER_BACKEND, opts[OPT_TRANSFER_BACKEND], TRANSFER_BACKENDS)
    if OPT_ROLE in opts:
        _opt_choice(OPT_ROLE, opts[OPT_ROLE], ROLE_OPTION_VALUES)
    if OPT_MEMORY_UTILIZATION in opts:
        text = opts[OPT_MEMORY_UTILIZATION]
        try:
            ok = 0.0 <= float(text) <= 1.0
        except ValueError:
            ok = False
        require(ok, f"option {OPT_MEMORY_UTILIZATION} must be a number in [0, 1], got {text!r}")


def _listen_address(opts: Mapping[str, str]) -> tuple[str | None, int | None]:
    for key in (OPT_LISTEN_IP_INFO, OPT_LISTEN_IP_INFO_CPP):
        if opts.get(key):
            return parse_listen_ip_info(opts[key], f"option {key}")
    ip, port = opts.get(OPT_LISTEN_IP), opts.get(OPT_LISTEN_PORT)
    if ip is None and port is None:
        return None, None
    require(
        ip is not None and port is not None,
        f"options {OPT_LISTEN_IP} and {OPT_LISTEN_PORT} must be given together, "
        f"got {OPT_LISTEN_IP}={ip!r}, {OPT_LISTEN_PORT}={port!r}",
    )
    assert ip is not None and port is not None
    try:
        host = str(ipaddress.ip_address(ip))
    except ValueError:
        raise LLMParamError(f"option {OPT_LISTEN_IP} must be an IP address, got {ip!r}") from None
    return host, _opt_int(OPT_LISTEN_PORT, port, 0, UINT16_MAX)


def parse_options(
    options: Mapping[str, str], *, environ: Mapping[str, str] | None = None
) -> Options:
    """Validate an options dict and read the settings the engine uses.

    Every key this module knows has its value checked; unknown keys are kept
    in :attr:`Options.raw` and otherwise ignored.

    Args:
        options: The dict given to ``LLMDataDist.init`` (``str`` to ``str``).
        environ: Where to read ``AIODATADIST_SECRET``; ``os.environ`` by default.

    Returns:
        The parsed :class:`Options`.

    Raises:
        TypeError: ``options`` is not a mapping of ``str`` to ``str``.
        LLMParamError: a known key has a bad value; the message names the key
            and the value.
    """
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping of str to str, got {type(options).__name__}")
    for k, v in options.items():
        check_type("options key", k, str)
        check_type(f"options[{k!r}]", v, str)
    opts = dict(options)
    _check_other_keys(opts)

    device_ids = _opt_device_ids(OPT_DEVICE_ID, opts.get(OPT_DEVICE_ID, ""))
    device_id = device_ids[0] if device_ids else None
    if OPT_SESSION_DEVICE_ID in opts:
        device_id = _opt_int(OPT_SESSION_DEVICE_ID, opts[OPT_SESSION_DEVICE_ID], 0, INT32_MAX)

    has_comm_res = OPT_LOCAL_COMM_RES in opts
    enable_cache_manager = has_comm_res
    if OPT_ENABLE_CACHE_MANAGER in opts:
        enable_cache_manager = _opt_flag(OPT_ENABLE_CACHE_MANAGER, opts[OPT_ENABLE_CACHE_MANAGER])
    remote_accessible = has_comm_res or OPT_TRANSFER_BACKEND in opts
    if OPT_ENABLE_REMOTE_CACHE_ACCESSIBLE in opts:
        remote_accessible = _opt_flag(
            OPT_ENABLE_REMOTE_CACHE_ACCESSIBLE, opts[OPT_ENABLE_REMOTE_CACHE_ACCESSIBLE]
        )

    def get_int(key: str, default: int, min_value: int, max_value: int) -> int:
        return _opt_int(key, opts[key], min_value, max_value) if key in opts else default

    secret_text = opts.get(OPT_SHARED_SECRET) or (os.environ if environ is None else environ).get(
        SECRET_ENV, ""
    )
    listen_ip, listen_port = _listen_address(opts)
    return Options(
        sync_kv_timeout_ms=get_int(OPT_SYNC_KV_TIMEOUT, DEFAULT_SYNC_KV_TIMEOUT_MS, 1, INT32_MAX),
        listen_ip=listen_ip,
        listen_port=listen_port,
        enable_cache_manager=enable_cache_manager,
        enable_remote_cache_accessible=remote_accessible,
        device_id=device_id,
        data_path=DataPath(
            _opt_choice(OPT_DATA_PATH, opts.get(OPT_DATA_PATH, DEFAULT_DATA_PATH), DATA_PATHS)
        ),
        executor_threads=get_int(OPT_EXECUTOR_THREADS, DEFAULT_EXECUTOR_THREADS, 1, _THREADS_MAX),
        shared_secret=secret_text.encode() if secret_text else None,
        tcp_streams=get_int(OPT_TCP_STREAMS, DEFAULT_TCP_STREAMS, 1, _TCP_STREAMS_MAX),
        mover_threads=get_int(OPT_MOVER_THREADS, DEFAULT_MOVER_THREADS, 1, _THREADS_MAX),
        finalize_timeout_ms=get_int(
            OPT_FINALIZE_TIMEOUT, DEFAULT_FINALIZE_TIMEOUT_MS, 0, INT32_MAX
        ),
        serve_threads=get_int(OPT_SERVE_THREADS, DEFAULT_SERVE_THREADS, 1, _THREADS_MAX),
        serve_timeout_ms=get_int(OPT_SERVE_TIMEOUT, DEFAULT_SERVE_TIMEOUT_MS, 1, INT32_MAX),
        link_total_time_s=get_int(OPT_LINK_TOTAL_TIME, 0, 0, UINT32_MAX),
        link_retry_count=get_int(OPT_LINK_RETRY_COUNT, 1, 1, _LINK_RETRY_MAX),
        raw=opts,
    )
