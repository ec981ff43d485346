"""LLMConfig (the option builder) and parse_options (its reader)."""

from __future__ import annotations

import dataclasses

import pytest

from aiodatadist.config import (
    DATA_PATHS,
    SECRET_ENV,
    LLMConfig,
    Options,
    parse_listen_ip_info,
    parse_options,
)
from aiodatadist.errors import LLMException, LLMParamError, LLMStatusCode

MEM_UTIL = {"llm.MemoryUtilization": "0.95"}


# -- LLMConfig -------------------------------------------------------------------


def test_empty_config_emits_only_mem_utilization() -> None:
    assert LLMConfig().generate_options() == MEM_UTIL


def test_own_option_defaults() -> None:
    config = LLMConfig()
    assert config.data_path == "auto"
    assert config.executor_threads == 2
    assert config.shared_secret is None
    assert config.tcp_streams == 2
    assert config.mover_threads == 2
    assert config.finalize_timeout == 5000
    assert config.serve_threads == 4
    assert config.serve_timeout == 30000
    assert config.heartbeat_timeout == 30000


@pytest.mark.parametrize(
    ("attr", "value", "key"),
    [
        ("data_path", "tcp", "aiodatadist.DataPath"),
        ("executor_threads", 8, "aiodatadist.ExecutorThreads"),
        ("shared_secret", "s3cret", "aiodatadist.SharedSecret"),
        ("tcp_streams", 16, "aiodatadist.TcpStreams"),
        ("mover_threads", 1, "aiodatadist.MoverThreads"),
        ("finalize_timeout", 0, "aiodatadist.FinalizeTimeout"),
        ("serve_threads", 64, "aiodatadist.ServeThreads"),
        ("serve_timeout", 1, "aiodatadist.ServeTimeout"),
        ("heartbeat_timeout", 0, "aiodatadist.HeartbeatTimeout"),
        ("heartbeat_timeout", 100, "aiodatadist.HeartbeatTimeout"),
    ],
)
def test_own_options_emitted_when_set(attr: str, value: object, key: str) -> None:
    config = LLMConfig()
    setattr(config, attr, value)
    assert getattr(config, attr) == value
    assert config.generate_options() == {key: str(value), **MEM_UTIL}


def test_typical_v2_config() -> None:
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = "20000"
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.listen_ip_info = "127.0.0.1:26000"
    config.mem_utilization = 1
    options = config.generate_options()
    assert options == {
        "ge.exec.deviceId": "0",
        "ge.session_device_id": "0",
        "llm.SyncKvCacheWaitTime": "20000",
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.listenIpInfo": "127.0.0.1:26000",
        "llm.MemoryUtilization": "1.0",
    }
    assert config.sync_kv_timeout == 20000
    assert config.gen_options() is options
    assert config.options is options


def test_ge_options_merged_first_and_overridden() -> None:
    config = LLMConfig()
    config.ge_options = {"ge.exec.deviceId": "7", "ge.flowGraphMemMaxSize": "1024"}
    config.device_id = 1
    options = config.generate_options()
    assert options["ge.exec.deviceId"] == "1"
    assert options["ge.flowGraphMemMaxSize"] == "1024"


def test_local_comm_res_emitted_even_if_empty() -> None:
    config = LLMConfig()
    assert config.local_comm_res == ""
    assert "llm.LocalCommRes" not in config.generate_options()
    config.local_comm_res = ""
    assert config.generate_options()["llm.LocalCommRes"] == ""


def test_switch_role_false_not_emitted() -> None:
    config = LLMConfig()
    config.enable_switch_role = False
    assert "llm.EnableSwitchRole" not in config.generate_options()


def test_cluster_info_converts_ips() -> None:
    config = LLMConfig()
    config.cluster_info = '{"cluster_id": 1, "listen_ip_info": [{"ip": "1.2.3.4", "port": 5}]}'
    assert config.cluster_info == (
        '{"cluster_id": 1, "listen_ip_info": [{"ip": 67305985, "port": 5}]}'
    )
    assert config.generate_options()["llm.ClusterInfo"] == config.cluster_info
    config.cluster_info = ""
    assert config.cluster_info == ""


def test_listen_ip_info_ipv6_and_port_zero() -> None:
    config = LLMConfig()
    config.listen_ip_info = "[::1]:0"
    assert config.generate_options()["llm.listenIpInfo"] == "[::1]:0"
    config.listen_ip_info = ""
    assert config.listen_ip_info == ""


@pytest.mark.parametrize(
    ("attr", "value", "exc", "match"),
    [
        ("device_id", -1, LLMParamError, r"device_id must be in \[0, 2147483647\], got -1"),
        ("device_id", 2**31, LLMParamError, "device_id .*got 2147483648"),
        ("device_id", [0, -2], LLMParamError, r"device_id\[1\] must be in .*got -2"),
        ("device_id", [], LLMParamError, "device_id must not be an empty list"),
        ("device_id", "0", TypeError, "device_id must be int or list or tuple, got str"),
        ("device_id", True, TypeError, "device_id must be int or list or tuple, got bool"),
        (
            "sync_kv_timeout",
            0,
            LLMParamError,
            r"sync_kv_timeout must be in \[1, 2147483647\], got 0",
        ),
        ("sync_kv_timeout", 2**31, LLMParamError, "sync_kv_timeout .*got 2147483648"),
        ("sync_kv_timeout", "1e3", LLMParamError, "sync_kv_timeout must be digits, got '1e3'"),
        ("sync_kv_timeout", "-5", LLMParamError, "sync_kv_timeout must be digits, got '-5'"),
        ("sync_kv_timeout", 1.5, TypeError, "sync_kv_timeout must be int or str, got float"),
        (
            "listen_ip_info",
            "localhost:80",
            LLMParamError,
            "listen_ip_info must be .*got 'localhost:80'",
        ),
        ("listen_ip_info", 5, TypeError, "listen_ip_info must be str, got int"),
        ("enable_cache_manager", 1, TypeError, "enable_cache_manager must be bool, got int"),
        (
            "enable_remote_cache_accessible",
            "1",
            TypeError,
            "enable_remote_cache_accessible must be bool, got str",
        ),
        ("mem_pool_cfg", "{bad", LLMParamError, "mem_pool_cfg must be a JSON string, got '{bad'"),
        ("mem_pool_cfg", "[1]", LLMParamError, r"mem_pool_cfg must be a JSON object, got '\[1\]'"),
        (
            "mem_pool_cfg",
            '{"memory_size": 0}',
            LLMParamError,
            "mem_pool_cfg: memory_size must be an int > 0, got 0",
        ),
        (
            "host_mem_pool_cfg",
            '{"memory_size": 1, "page_shift": 31}',
            LLMParamError,
            r"host_mem_pool_cfg: page_shift must be an int in \[10, 31\), got 31",
        ),
        ("buf_pool_cfg", 1, TypeError, "buf_pool_cfg must be str, got int"),
        (
            "link_total_time",
            -1,
            LLMParamError,
            r"link_total_time must be in \[0, 4294967295\], got -1",
        ),
        ("link_retry_count", 0, LLMParamError, r"link_retry_count must be in \[1, 100\], got 0"),
        ("link_retry_count", 101, LLMParamError, "link_retry_count .*got 101"),
        (
            "rdma_traffic_class",
            256,
            LLMParamError,
            r"rdma_traffic_class must be in \[0, 255\], got 256",
        ),
        (
            "rdma_traffic_class",
            130,
            LLMParamError,
            "rdma_traffic_class must be a multiple of 4, got 130",
        ),
        ("rdma_service_level", 8, LLMParamError, r"rdma_service_level must be in \[0, 7\], got 8"),
        ("local_comm_res", None, TypeError, "local_comm_res must be str, got NoneType"),
        (
            "transfer_backend",
            "hccl",
            LLMParamError,
            r"transfer_backend must be one of \['hixl'\], got 'hccl'",
        ),
        (
            "global_resource_config",
            "nope",
            LLMParamError,
            "global_resource_config must be a JSON string, got 'nope'",
        ),
        ("enable_switch_role", None, TypeError, "enable_switch_role must be bool, got NoneType"),
        ("mem_utilization", 1.5, LLMParamError, r"mem_utilization must be in \[0, 1\], got 1.5"),
        ("mem_utilization", "0.5", TypeError, "mem_utilization must be float or int, got str"),
        ("cluster_info", "{", LLMParamError, "cluster_info must be a JSON string, got '{'"),
        (
            "cluster_info",
            '{"listen_ip_info": [{"ip": "1.2"}]}',
            LLMParamError,
            "cluster_info: listen_ip_info.*got '1.2'",
        ),
        ("output_max_size", -1, LLMParamError, "output_max_size must be >= 0, got -1"),
        ("deploy_res_path", 1, TypeError, "deploy_res_path must be str, got int"),
        ("ge_options", {"a": 1}, TypeError, r"ge_options\['a'\] must be str, got int"),
        ("ge_options", [("a", "b")], TypeError, "ge_options must be dict, got list"),
        (
            "data_path",
            "rdma",
            LLMParamError,
            r"data_path must be one of \['auto', 'inproc', 'shm', 'cma', 'tcp', 'nixl', "
            r"'mooncake'\], got 'rdma'",
        ),
        ("executor_threads", 0, LLMParamError, r"executor_threads must be in \[1, 64\], got 0"),
        ("executor_threads", 65, LLMParamError, "executor_threads .*got 65"),
        ("shared_secret", "", LLMParamError, "shared_secret must not be empty"),
        ("shared_secret", b"x", TypeError, "shared_secret must be str, got bytes"),
        ("tcp_streams", 17, LLMParamError, r"tcp_streams must be in \[1, 16\], got 17"),
        ("mover_threads", 0, LLMParamError, r"mover_threads must be in \[1, 64\], got 0"),
        (
            "finalize_timeout",
            -1,
            LLMParamError,
            r"finalize_timeout must be in \[0, 2147483647\], got -1",
        ),
        ("serve_threads", 0, LLMParamError, r"serve_threads must be in \[1, 64\], got 0"),
        ("serve_timeout", 0, LLMParamError, r"serve_timeout must be in \[1, 2147483647\], got 0"),
        ("serve_timeout", 1.5, TypeError, "serve_timeout"),
        (
            "heartbeat_timeout",
            99,
            LLMParamError,
            r"heartbeat_timeout must be 0 \(off\) or in \[100, 2147483647\] ms, got 99",
        ),
        ("heartbeat_timeout", -1, LLMParamError, "heartbeat_timeout"),
        ("heartbeat_timeout", 1.5, TypeError, "heartbeat_timeout"),
    ],
)
def test_config_validation(attr: str, value: object, exc: type[Exception], match: str) -> None:
    config = LLMConfig()
    before = getattr(config, attr)
    with pytest.raises(exc, match=match) as info:
        setattr(config, attr, value)
    if isinstance(info.value, LLMException):
        assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert getattr(config, attr) == before


# -- parse_listen_ip_info --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:26000", ("127.0.0.1", 26000)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("[::1]:65535", ("::1", 65535)),
        ("[fe80::0001]:1", ("fe80::1", 1)),
    ],
)
def test_parse_listen_ip_info(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen_ip_info(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "127.0.0.1",
        "127.0.0.1:65536",
        "127.0.0.1:-1",
        "127.0.0.1:",
        "::1:80",
        "[::1]80",
        "1.2.3:80",
        "host:80",
        "[1.2.3.4]:80",
        "127.0.0.1: 80",
        "127.0.0.1:٣",
    ],
)
def test_parse_listen_ip_info_rejects(text: str) -> None:
    with pytest.raises(
        LLMParamError, match=r"listen_ip_info must be 'ipv4:port' or '\[ipv6\]:port'"
    ):
        parse_listen_ip_info(text)


# -- parse_options ---------------------------------------------------------------


def test_parse_options_defaults() -> None:
    opts = parse_options({}, environ={})
    assert opts == Options()
    assert opts.sync_kv_timeout_ms == 1000
    assert opts.listen_ip is None and opts.listen_port is None
    assert opts.enable_cache_manager is False
    assert opts.enable_remote_cache_accessible is False
    assert opts.device_id is None
    assert opts.data_path == "auto"
    assert (opts.executor_threads, opts.tcp_streams, opts.mover_threads) == (2, 2, 2)
    assert opts.finalize_timeout_ms == 5000
    assert (opts.serve_threads, opts.serve_timeout_ms) == (4, 30000)
    assert opts.heartbeat_timeout_ms == 30000
    assert opts.shared_secret is None
    assert opts.link_total_time_s == 0
    assert opts.link_retry_count == 1
    assert opts.raw == {}


def test_parse_options_round_trip_from_config() -> None:
    config = LLMConfig()
    config.device_id = [3, 4]
    config.sync_kv_timeout = 33064
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.listen_ip_info = "10.0.0.5:26000"
    config.link_total_time = 30
    config.link_retry_count = 5
    config.data_path = "shm"
    config.executor_threads = 4
    config.shared_secret = "abc"
    config.tcp_streams = 4
    config.mover_threads = 8
    config.finalize_timeout = 100
    config.serve_threads = 3
    config.serve_timeout = 2500
    config.heartbeat_timeout = 0
    config.ge_options = {"unknown.key": "whatever"}
    raw = config.generate_options()
    opts = parse_options(raw, environ={SECRET_ENV: "from-env"})
    assert opts.sync_kv_timeout_ms == 33064
    assert (opts.listen_ip, opts.listen_port) == ("10.0.0.5", 26000)
    assert opts.enable_cache_manager and opts.enable_remote_cache_accessible
    assert opts.device_id == 3
    assert opts.data_path == "shm"
    assert (opts.executor_threads, opts.tcp_streams, opts.mover_threads) == (4, 4, 8)
    assert opts.finalize_timeout_ms == 100
    assert (opts.serve_threads, opts.serve_timeout_ms) == (3, 2500)
    assert opts.heartbeat_timeout_ms == 0
    assert opts.link_total_time_s == 30 and opts.link_retry_count == 5
    assert opts.shared_secret == b"abc"
    assert opts.raw == raw
    assert opts.raw is not raw
    assert opts.raw["unknown.key"] == "whatever"


def test_options_is_frozen_and_hides_secret() -> None:
    opts = parse_options({"aiodatadist.SharedSecret": "topsecret"}, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.data_path = "tcp"  # type: ignore[misc]
    assert "topsecret" not in repr(opts)
    hash(opts)


def test_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_options({}, environ={SECRET_ENV: "envsecret"}).shared_secret == b"envsecret"
    assert (
        parse_options({"aiodatadist.SharedSecret": ""}, environ={SECRET_ENV: "e"}).shared_secret
        == b"e"
    )
    assert parse_options({}, environ={SECRET_ENV: ""}).shared_secret is None
    monkeypatch.setenv(SECRET_ENV, "osenv")
    assert parse_options({}).shared_secret == b"osenv"
    monkeypatch.delenv(SECRET_ENV)
    assert parse_options({}).shared_secret is None


def test_local_comm_res_implies_cache_manager_and_remote_access() -> None:
    opts = parse_options({"llm.LocalCommRes": ""}, environ={})
    assert opts.enable_cache_manager and opts.enable_remote_cache_accessible
    opts = parse_options(
        {"llm.LocalCommRes": "", "llm.EnableRemoteCacheAccessible": "0"}, environ={}
    )
    assert opts.enable_cache_manager and not opts.enable_remote_cache_accessible
    opts = parse_options({"llm.TransferBackend": "hixl"}, environ={})
    assert opts.enable_remote_cache_accessible and not opts.enable_cache_manager


def test_listen_address_forms() -> None:
    assert parse_options({"llm.ListenIpInfo": "[::]:0"}, environ={}).listen_ip == "::"
    opts = parse_options({"llm.ListenIp": "10.0.0.1", "llm.ListenPort": "80"}, environ={})
    assert (opts.listen_ip, opts.listen_port) == ("10.0.0.1", 80)
    opts = parse_options({"llm.listenIpInfo": ""}, environ={})
    assert opts.listen_ip is None


def test_session_device_id_wins() -> None:
    opts = parse_options({"ge.exec.deviceId": "1;2", "ge.session_device_id": "2"}, environ={})
    assert opts.device_id == 2


def test_all_data_paths_accepted() -> None:
    for path in DATA_PATHS:
        assert parse_options({"aiodatadist.DataPath": path}, environ={}).data_path == path


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        (
            "llm.SyncKvCacheWaitTime",
            "0",
            r"option llm.SyncKvCacheWaitTime must be a decimal integer in "
            r"\[1, 2147483647\], got '0'",
        ),
        ("llm.SyncKvCacheWaitTime", "abc", "option llm.SyncKvCacheWaitTime .*got 'abc'"),
        ("llm.SyncKvCacheWaitTime", " 100", "option llm.SyncKvCacheWaitTime .*got ' 100'"),
        (
            "llm.SyncKvCacheWaitTime",
            "2147483648",
            "option llm.SyncKvCacheWaitTime .*got '2147483648'",
        ),
        (
            "llm.listenIpInfo",
            "1.2.3.4",
            r"option llm.listenIpInfo must be 'ipv4:port' .*got '1.2.3.4'",
        ),
        (
            "llm.EnableCacheManager",
            "true",
            "option llm.EnableCacheManager must be '1' or '0', got 'true'",
        ),
        (
            "llm.EnableRemoteCacheAccessible",
            "2",
            "option llm.EnableRemoteCacheAccessible must be '1' or '0', got '2'",
        ),
        (
            "llm.LinkTotalTime",
            "-1",
            r"option llm.LinkTotalTime must be a decimal integer in \[0, 4294967295\], got '-1'",
        ),
        ("llm.LinkRetryCount", "0", r"option llm.LinkRetryCount .*\[1, 100\], got '0'"),
        ("llm.RdmaTrafficClass", "3", "option llm.RdmaTrafficClass must be a multiple of 4, got 3"),
        ("llm.RdmaServiceLevel", "8", r"option llm.RdmaServiceLevel .*\[0, 7\], got '8'"),
        ("llm.MemPoolConfig", "{", "option llm.MemPoolConfig must be a JSON string, got '{'"),
        (
            "llm.HostMemPoolConfig",
            '{"memory_size": -1}',
            "option llm.HostMemPoolConfig: memory_size must be an int > 0, got -1",
        ),
        (
            "llm.GlobalResourceConfig",
            "x",
            "option llm.GlobalResourceConfig must be a JSON string, got 'x'",
        ),
        (
            "llm.TransferBackend",
            "",
            r"option llm.TransferBackend must be one of \['hixl'\], got ''",
        ),
        (
            "llm.Role",
            "prompt",
            r"option llm.Role must be one of \['Prompt', 'Decoder', 'Mix'\], got 'prompt'",
        ),
        (
            "llm.MemoryUtilization",
            "2",
            r"option llm.MemoryUtilization must be a number in \[0, 1\], got '2'",
        ),
        ("llm.MemoryUtilization", "x", "option llm.MemoryUtilization .*got 'x'"),
        (
            "llm.EnableSwitchRole",
            "yes",
            "option llm.EnableSwitchRole must be '1' or '0', got 'yes'",
        ),
        ("llm.OutputMaxSize", "-3", "option llm.OutputMaxSize .*got '-3'"),
        ("ge.flowGraphMemMaxSize", "1,2", "option ge.flowGraphMemMaxSize .*got '1,2'"),
        ("ge.exec.deviceId", "0;x", "option ge.exec.deviceId .*got 'x'"),
        ("ge.session_device_id", "-1", "option ge.session_device_id .*got '-1'"),
        (
            "llm.ListenIp",
            "1.2.3.4",
            "options llm.ListenIp and llm.ListenPort must be given together",
        ),
        (
            "aiodatadist.DataPath",
            "nvlink",
            r"option aiodatadist.DataPath must be one of "
            r"\['auto', 'inproc', 'shm', 'cma', 'tcp', 'nixl', 'mooncake'\], got 'nvlink'",
        ),
        (
            "aiodatadist.ExecutorThreads",
            "0",
            r"option aiodatadist.ExecutorThreads .*\[1, 64\], got '0'",
        ),
        ("aiodatadist.TcpStreams", "17", r"option aiodatadist.TcpStreams .*\[1, 16\], got '17'"),
        (
            "aiodatadist.MoverThreads",
            "65",
            r"option aiodatadist.MoverThreads .*\[1, 64\], got '65'",
        ),
        ("aiodatadist.FinalizeTimeout", "-1", "option aiodatadist.FinalizeTimeout .*got '-1'"),
        ("aiodatadist.ServeThreads", "65", r"option aiodatadist.ServeThreads .*\[1, 64\]"),
        ("aiodatadist.ServeTimeout", "0", r"option aiodatadist.ServeTimeout .*got '0'"),
        ("aiodatadist.ServeTimeout", "2147483648", "option aiodatadist.ServeTimeout"),
        ("aiodatadist.HeartbeatTimeout", "99", r"HeartbeatTimeout must be 0 \(off\) or in \[100,"),
        ("aiodatadist.HeartbeatTimeout", "-1", "option aiodatadist.HeartbeatTimeout"),
        ("aiodatadist.HeartbeatTimeout", "2147483648", "option aiodatadist.HeartbeatTimeout"),
    ],
)
def test_parse_options_rejects(key: str, value: str, match: str) -> None:
    with pytest.raises(LLMParamError, match=match) as info:
        parse_options({key: value}, environ={})
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


def test_parse_options_bad_listen_pair() -> None:
    with pytest.raises(LLMParamError, match=r"option llm.ListenIp must be an IP address, got 'x'"):
        parse_options({"llm.ListenIp": "x", "llm.ListenPort": "1"}, environ={})
    with pytest.raises(LLMParamError, match=r"option llm.ListenPort .*got '99999'"):
        parse_options({"llm.ListenIp": "::1", "llm.ListenPort": "99999"}, environ={})


def test_parse_options_types() -> None:
    with pytest.raises(TypeError, match=r"options must be a mapping of str to str, got list"):
        parse_options([("a", "b")])  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"options\['llm.SyncKvCacheWaitTime'\] must be str, got int"
    ):
        parse_options({"llm.SyncKvCacheWaitTime": 5})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"options key must be str, got int"):
        parse_options({1: "x"})  # type: ignore[dict-item]


def test_unknown_keys_outside_llm_and_aiodatadist_are_kept() -> None:
    # ge.* and a vendor's keys pass through; unknown llm.*/aiodatadist.* keys are refused
    # (tests/test_options_keys.py).
    opts = parse_options({"vendor.Thing": "?", "ge.graphRunMode": "1"}, environ={})
    assert opts.raw == {"vendor.Thing": "?", "ge.graphRunMode": "1"}


def test_known_option_keys_are_exported_with_every_opt_constant() -> None:
    import aiodatadist.config as config

    consts = {getattr(config, n) for n in config.__all__ if n.startswith("OPT_")}
    assert consts and consts <= config.KNOWN_OPTION_KEYS
    assert all(k.startswith(("llm.", "aiodatadist.", "ge.")) for k in config.KNOWN_OPTION_KEYS)
    with pytest.raises(LLMParamError, match=r"did you mean aiodatadist\.ExecutorThreads\?"):
        parse_options({"aiodatadist.ExecutorThread": "2"}, environ={})
