"""The engine's side of the options: keys, defaults, :class:`DataPath`, :func:`parse_options`.

:func:`parse_options` is what the engine calls in ``init``: it checks the value
of every key it knows and returns a frozen :class:`Options`.  The builder users
fill, :class:`~aiodatadist.config.LLMConfig`, emits these keys.  Everything here
is public through :mod:`aiodatadist.config`.
"""

from __future__ import annotations

import difflib
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
    check_int,
    check_str,
    check_type,
    raise_param_error,
    require,
)
from .errors import LLMParamError

__all__ = [
    "DATA_PATHS",
    "KNOWN_OPTION_KEYS",
    "SECRET_ENV",
    "DataPath",
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
OPT_DEVICE_ID_CPP = "llm.DeviceId"  # the C++ API's device key; accepted, not acted on
# Upstream v1 CacheDesc keys (model options); accepted, not acted on.
OPT_REF_INPUT_SHAPES = "llm.RefInputShapes"
OPT_REF_INPUT_DTYPES = "llm.RefInputDtypes"
OPT_REF_INPUT_SEQ_LEN_DIM_INDEX = "llm.RefInputSeqLenDimIndex"
OPT_KV_TENSOR_FORMAT = "llm.kvTensorFormat"

# This library's option keys.
OPT_DATA_PATH = "aiodatadist.DataPath"
OPT_EXECUTOR_THREADS = "aiodatadist.ExecutorThreads"
OPT_SHARED_SECRET = "aiodatadist.SharedSecret"
OPT_TCP_STREAMS = "aiodatadist.TcpStreams"
OPT_MOVER_THREADS = "aiodatadist.MoverThreads"
OPT_FINALIZE_TIMEOUT = "aiodatadist.FinalizeTimeout"
OPT_SERVE_THREADS = "aiodatadist.ServeThreads"
OPT_SERVE_TIMEOUT = "aiodatadist.ServeTimeout"
OPT_HEARTBEAT_TIMEOUT = "aiodatadist.HeartbeatTimeout"
OPT_ENGINES = "aiodatadist.Engines"

CHECKED_PREFIXES = ("llm.", "aiodatadist.")
"""Key prefixes whose keys must be known (a typo fails at init); other keys pass through."""

# Every OPT_* constant above: a key added there is known without a second list to update.
KNOWN_OPTION_KEYS = frozenset(
    value for name, value in dict(globals()).items() if name.startswith("OPT_")
)
"""Every ``llm.*`` / ``aiodatadist.*`` (and ``ge.*``) key :func:`parse_options` accepts.

Upstream keys the engine does not act on are in it too, so a real client's options parse.
"""

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
    NIXL = "nixl"
    """Any hosts, both sides run NIXL (``aiodatadist.Engines``): its UCX backend; moves
    device memory too."""
    MOONCAKE = "mooncake"
    """Any hosts, both sides run the Mooncake Transfer Engine (``aiodatadist.Engines``)."""

    @classmethod
    def remote(cls) -> tuple[DataPath, ...]:
        """The cross-process paths, fastest first (the order ``auto`` tries them in)."""
        return (cls.SHM, cls.CMA, cls.TCP)

    @classmethod
    def engines(cls) -> tuple[DataPath, ...]:
        """The paths of existing transfer engines (started at ``init`` when named)."""
        return (cls.NIXL, cls.MOONCAKE)


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
DEFAULT_HEARTBEAT_TIMEOUT_MS = 30000
HEARTBEAT_MIN_MS = 100
"""The smallest heartbeat timeout but 0 (off): a link pings its peer every third of it."""
DEFAULT_MEM_UTILIZATION = 0.95
TRANSFER_BACKENDS = ("hixl",)
ROLE_OPTION_VALUES = ("Prompt", "Decoder", "Mix")

THREADS_MAX = 64
TCP_STREAMS_MAX = 16
LINK_RETRY_MAX = 100
RDMA_TC_MAX = 255
RDMA_SL_MAX = 7
PAGE_SHIFT_RANGE = range(10, 31)


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
    if not sep or not is_decimal(port_text) or int(port_text) > UINT16_MAX:
        raise_param_error(error)
    try:
        if host.startswith("[") and host.endswith("]"):
            host = str(ipaddress.IPv6Address(host[1:-1]))
        else:
            host = str(ipaddress.IPv4Address(host))
    except ValueError:
        raise LLMParamError(error) from None
    return host, int(port_text)


def is_decimal(text: str) -> bool:
    # str.isdigit() alone accepts non-ASCII digits such as "²".
    return text.isascii() and text.isdigit()


def check_json(name: str, value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        raise LLMParamError(f"{name} must be a JSON string, got {value!r}") from None


def check_pool_cfg(name: str, value: str) -> None:
    # {"memory_size": int > 0 (bytes), "page_shift": int in [10, 31)}
    cfg = check_json(name, value)
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
            type(shift) is int and shift in PAGE_SHIFT_RANGE,
            f"{name}: page_shift must be an int in [10, 31), got {shift!r}",
        )


def check_rdma_traffic_class(name: str, value: object) -> int:
    tc = check_int(name, value, min_value=0, max_value=RDMA_TC_MAX)
    require(tc % 4 == 0, f"{name} must be a multiple of 4, got {tc}")
    return tc


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
        heartbeat_timeout_ms: ``aiodatadist.HeartbeatTimeout`` (0: off).
        engines: the transfer engines to start at ``init``: ``aiodatadist.Engines``, plus
            the engine ``aiodatadist.DataPath`` forces (in :meth:`DataPath.engines` order).
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
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS
    engines: tuple[DataPath, ...] = ()
    link_total_time_s: int = 0
    link_retry_count: int = 1
    raw: dict[str, str] = field(default_factory=dict, repr=False, hash=False)


def _opt_int(key: str, text: str, min_value: int, max_value: int) -> int:
    if not is_decimal(text) or not min_value <= int(text) <= max_value:
        raise_param_error(
            f"option {key} must be a decimal integer in [{min_value}, {max_value}], got {text!r}"
        )
    return int(text)


def opt_heartbeat_ms(key: str, value: int) -> int:
    """``value`` as a heartbeat timeout: 0 (off) or at least :data:`HEARTBEAT_MIN_MS`."""
    if value != 0 and not HEARTBEAT_MIN_MS <= value <= INT32_MAX:
        raise_param_error(
            f"{key} must be 0 (off) or in [{HEARTBEAT_MIN_MS}, {INT32_MAX}] ms, got {value}"
        )
    return value


def _opt_flag(key: str, text: str) -> bool:
    require(text in ("0", "1"), f"option {key} must be '1' or '0', got {text!r}")
    return text == "1"


def _opt_choice(key: str, text: str, choices: Sequence[str]) -> str:
    require(text in choices, f"option {key} must be one of {list(choices)}, got {text!r}")
    return text


def _opt_device_ids(key: str, text: str) -> list[int]:
    return [_opt_int(key, part, 0, INT32_MAX) for part in text.split(";")] if text else []


def parse_engines(name: str, value: str | Sequence[str]) -> tuple[DataPath, ...]:
    """Engine names (a comma list or a sequence) as :class:`DataPath` members, in
    :meth:`DataPath.engines` order, without duplicates."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    names = {p.strip() if isinstance(p, str) else p for p in parts} - {""}
    known = [e.value for e in DataPath.engines()]
    for n in names:
        require(
            isinstance(n, str) and n in known,
            f"{name}: unknown engine {n!r} (known: {', '.join(known)})",
        )
    return tuple(e for e in DataPath.engines() if e.value in names)


def _check_known_keys(opts: Mapping[str, str]) -> None:
    # Keys are case-sensitive (upstream has both llm.listenIpInfo and llm.ListenIpInfo); the
    # suggestion compares the names after the prefix, ignoring case, so the shared prefix does
    # not make every key look close and "aiodatadist.SyncKvCacheWaitTime" still finds llm.'s.
    names = {k.partition(".")[2].lower(): k for k in sorted(KNOWN_OPTION_KEYS)}
    for key in opts:
        if not key.startswith(CHECKED_PREFIXES) or key in KNOWN_OPTION_KEYS:
            continue
        close = difflib.get_close_matches(key.partition(".")[2].lower(), list(names), n=1)
        hint = f"; did you mean {names[close[0]]}?" if close else ""
        raise_param_error(f"unknown option key {key!r}{hint}")


def _check_other_keys(opts: Mapping[str, str]) -> None:
    # Keys the engine does not act on, checked so a typo in a value fails at init.
    for key in (OPT_MEM_POOL_CONFIG, OPT_HOST_MEM_POOL_CONFIG):
        if opts.get(key):
            check_pool_cfg(f"option {key}", opts[key])
    for key in (OPT_GLOBAL_RESOURCE_CONFIG, OPT_CLUSTER_INFO):
        if opts.get(key):
            check_json(f"option {key}", opts[key])
    if OPT_RDMA_TRAFFIC_CLASS in opts:
        tc = _opt_int(OPT_RDMA_TRAFFIC_CLASS, opts[OPT_RDMA_TRAFFIC_CLASS], 0, RDMA_TC_MAX)
        check_rdma_traffic_class(f"option {OPT_RDMA_TRAFFIC_CLASS}", tc)
    if OPT_RDMA_SERVICE_LEVEL in opts:
        _opt_int(OPT_RDMA_SERVICE_LEVEL, opts[OPT_RDMA_SERVICE_LEVEL], 0, RDMA_SL_MAX)
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

    Every key this module knows has its value checked.  An ``llm.*`` or
    ``aiodatadist.*`` key not in :data:`KNOWN_OPTION_KEYS` is refused (the
    message suggests the closest known key); other keys (``ge.*``, a vendor's)
    are kept in :attr:`Options.raw` and otherwise ignored.

    Args:
        options: The dict given to ``LLMDataDist.init`` (``str`` to ``str``).
        environ: Where to read ``AIODATADIST_SECRET``; ``os.environ`` by default.

    Returns:
        The parsed :class:`Options`.

    Raises:
        TypeError: ``options`` is not a mapping of ``str`` to ``str``.
        LLMParamError: a known key has a bad value (the message names the key
            and the value), or an ``llm.*`` / ``aiodatadist.*`` key is unknown.
    """
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping of str to str, got {type(options).__name__}")
    for k, v in options.items():
        check_type("options key", k, str)
        check_type(f"options[{k!r}]", v, str)
    opts = dict(options)
    _check_known_keys(opts)
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
    data_path = DataPath(
        _opt_choice(OPT_DATA_PATH, opts.get(OPT_DATA_PATH, DEFAULT_DATA_PATH), DATA_PATHS)
    )
    engines = set(parse_engines(f"option {OPT_ENGINES}", opts.get(OPT_ENGINES, "")))
    if data_path in DataPath.engines():
        engines.add(data_path)  # a forced engine path implies running that engine
    return Options(
        sync_kv_timeout_ms=get_int(OPT_SYNC_KV_TIMEOUT, DEFAULT_SYNC_KV_TIMEOUT_MS, 1, INT32_MAX),
        listen_ip=listen_ip,
        listen_port=listen_port,
        enable_cache_manager=enable_cache_manager,
        enable_remote_cache_accessible=remote_accessible,
        device_id=device_id,
        data_path=data_path,
        engines=tuple(e for e in DataPath.engines() if e in engines),
        executor_threads=get_int(OPT_EXECUTOR_THREADS, DEFAULT_EXECUTOR_THREADS, 1, THREADS_MAX),
        shared_secret=secret_text.encode() if secret_text else None,
        tcp_streams=get_int(OPT_TCP_STREAMS, DEFAULT_TCP_STREAMS, 1, TCP_STREAMS_MAX),
        mover_threads=get_int(OPT_MOVER_THREADS, DEFAULT_MOVER_THREADS, 1, THREADS_MAX),
        finalize_timeout_ms=get_int(
            OPT_FINALIZE_TIMEOUT, DEFAULT_FINALIZE_TIMEOUT_MS, 0, INT32_MAX
        ),
        serve_threads=get_int(OPT_SERVE_THREADS, DEFAULT_SERVE_THREADS, 1, THREADS_MAX),
        serve_timeout_ms=get_int(OPT_SERVE_TIMEOUT, DEFAULT_SERVE_TIMEOUT_MS, 1, INT32_MAX),
        heartbeat_timeout_ms=opt_heartbeat_ms(
            f"option {OPT_HEARTBEAT_TIMEOUT}",
            get_int(OPT_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT_MS, 0, INT32_MAX),
        ),
        link_total_time_s=get_int(OPT_LINK_TOTAL_TIME, 0, 0, UINT32_MAX),
        link_retry_count=get_int(OPT_LINK_RETRY_COUNT, 1, 1, LINK_RETRY_MAX),
        raw=opts,
    )
