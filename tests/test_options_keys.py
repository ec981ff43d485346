"""Option keys: an unknown ``llm.*`` / ``aiodatadist.*`` key is refused (with the closest
known key as a hint); every key a real client or ``LLMConfig`` emits is known."""

from __future__ import annotations

import pytest

from aiodatadist import LLMDataDist, LLMRole
from aiodatadist._config_attrs import Option
from aiodatadist.config import KNOWN_OPTION_KEYS, LLMConfig, parse_options
from aiodatadist.errors import LLMParamError, LLMStatusCode

# Every key upstream documents (v1 and v2 option keys, the C++ spellings, the v1 CacheDesc
# model-option keys): a real client may pass any of them, so each must parse.
UPSTREAM_KEYS = {
    "llm.BufPoolCfg",
    "llm.MemoryUtilization",
    "llm.ClusterInfo",
    "llm.OutputMaxSize",
    "llm.deployResPath",
    "llm.EnableSwitchRole",
    "llm.RdmaTrafficClass",
    "llm.RdmaServiceLevel",
    "llm.LinkTotalTime",
    "llm.LinkRetryCount",
    "llm.LocalCommRes",
    "llm.TransferBackend",
    "llm.GlobalResourceConfig",
    "llm.ListenIp",
    "llm.ListenPort",
    "llm.listenIpInfo",
    "llm.ListenIpInfo",
    "llm.DeviceId",
    "llm.Role",
    "llm.EnableCacheManager",
    "llm.EnableRemoteCacheAccessible",
    "llm.MemPoolConfig",
    "llm.HostMemPoolConfig",
    "llm.SyncKvCacheWaitTime",
    "llm.RefInputShapes",
    "llm.RefInputDtypes",
    "llm.RefInputSeqLenDimIndex",
    "llm.kvTensorFormat",
}

# A valid value for every LLMConfig attribute; a new attribute without one fails the test.
ALL_ATTRIBUTES = {
    "device_id": [1, 2],
    "sync_kv_timeout": 2500,
    "deploy_res_path": "/opt/deploy",
    "buf_pool_cfg": '{"buf_cfg": []}',
    "mem_pool_cfg": '{"memory_size": 1048576, "page_shift": 16}',
    "host_mem_pool_cfg": '{"memory_size": 1048576}',
    "enable_cache_manager": True,
    "enable_remote_cache_accessible": True,
    "listen_ip_info": "127.0.0.1:0",
    "link_total_time": 30,
    "link_retry_count": 3,
    "rdma_traffic_class": 132,
    "rdma_service_level": 4,
    "local_comm_res": "",
    "transfer_backend": "hixl",
    "global_resource_config": '{"a": 1}',
    "cluster_info": '{"cluster_id": 1, "listen_ip_info": [{"ip": "1.2.3.4", "port": 5}]}',
    "output_max_size": 4096,
    "enable_switch_role": True,
    "mem_utilization": 0.5,
    "data_path": "tcp",
    "engines": ["mooncake", "nixl"],
    "executor_threads": 3,
    "shared_secret": "s3cret",
    "tcp_streams": 4,
    "mover_threads": 4,
    "finalize_timeout": 100,
    "serve_threads": 2,
    "serve_timeout": 1000,
    "heartbeat_timeout": 5000,
}


def test_known_keys_cover_upstream_and_llmconfig() -> None:
    assert isinstance(KNOWN_OPTION_KEYS, frozenset)
    assert UPSTREAM_KEYS <= KNOWN_OPTION_KEYS
    emitted = {o.key for o in vars(LLMConfig).values() if isinstance(o, Option)}
    assert emitted <= KNOWN_OPTION_KEYS
    assert {"ge.exec.deviceId", "ge.session_device_id"} <= KNOWN_OPTION_KEYS


def test_every_upstream_key_parses() -> None:
    # Values the engine checks get a valid one; the rest are accepted and ignored.
    values = {
        "llm.BufPoolCfg": "{}",
        "llm.MemoryUtilization": "0.9",
        "llm.ClusterInfo": '{"cluster_id": 1}',
        "llm.OutputMaxSize": "1024",
        "llm.EnableSwitchRole": "1",
        "llm.RdmaTrafficClass": "4",
        "llm.RdmaServiceLevel": "1",
        "llm.LinkTotalTime": "5",
        "llm.LinkRetryCount": "2",
        "llm.TransferBackend": "hixl",
        "llm.GlobalResourceConfig": "{}",
        "llm.ListenIp": "127.0.0.1",
        "llm.ListenPort": "26000",
        "llm.listenIpInfo": "127.0.0.1:26000",
        "llm.ListenIpInfo": "127.0.0.1:26000",
        "llm.DeviceId": "0",
        "llm.Role": "Decoder",
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemPoolConfig": '{"memory_size": 4096}',
        "llm.HostMemPoolConfig": '{"memory_size": 4096}',
        "llm.SyncKvCacheWaitTime": "300",
        "llm.RefInputShapes": "1,2;3,4",
        "llm.RefInputDtypes": "1;1",
        "llm.RefInputSeqLenDimIndex": "0",
        "llm.kvTensorFormat": "ND",
    }
    opts = {k: values.get(k, "") for k in UPSTREAM_KEYS}
    parsed = parse_options(opts, environ={})
    assert parsed.sync_kv_timeout_ms == 300
    assert parsed.raw == opts


def test_llmconfig_with_every_attribute_set_parses() -> None:
    attributes = {n for n, o in vars(LLMConfig).items() if isinstance(o, Option)}
    assert attributes == set(ALL_ATTRIBUTES), "give the new LLMConfig attribute a value here"
    config = LLMConfig()
    for name, value in ALL_ATTRIBUTES.items():
        setattr(config, name, value)
    config.ge_options = {"ge.graphRunMode": "1"}
    raw = config.generate_options()
    assert len(raw) >= len(ALL_ATTRIBUTES)
    opts = parse_options(raw, environ={})
    assert opts.sync_kv_timeout_ms == 2500 and opts.serve_timeout_ms == 1000
    assert opts.heartbeat_timeout_ms == 5000
    assert opts.data_path == "tcp" and opts.shared_secret == b"s3cret"
    assert opts.engines == ("nixl", "mooncake")
    assert opts.raw["ge.graphRunMode"] == "1"


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("llm.SyncKvCacheWaitTme", "llm.SyncKvCacheWaitTime"),
        ("llm.synckvcachewaittime", "llm.SyncKvCacheWaitTime"),  # case matters for the key
        ("llm.EnableCacheManger", "llm.EnableCacheManager"),
        ("aiodatadist.DataPth", "aiodatadist.DataPath"),
        ("aiodatadist.tcpstreams", "aiodatadist.TcpStreams"),
        ("llm.DataPath", "aiodatadist.DataPath"),  # the right name under the wrong prefix
        ("aiodatadist.SyncKvCacheWaitTime", "llm.SyncKvCacheWaitTime"),
    ],
)
def test_unknown_key_names_the_closest_known_one(key: str, hint: str) -> None:
    with pytest.raises(LLMParamError) as info:
        parse_options({key: "1"}, environ={})
    assert isinstance(info.value, ValueError)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert f"unknown option key {key!r}; did you mean {hint}?" in str(info.value)


@pytest.mark.parametrize("key", ["llm.Qwxyz", "aiodatadist.Future", "aiodatadist.", "llm."])
def test_unknown_key_with_nothing_close_has_no_hint(key: str) -> None:
    with pytest.raises(LLMParamError, match="unknown option key") as info:
        parse_options({key: "1"}, environ={})
    assert "did you mean" not in str(info.value)


def test_listen_ip_info_spellings_are_exact() -> None:
    # Upstream has two spellings; a third is a typo.
    for key in ("llm.listenIpInfo", "llm.ListenIpInfo"):
        assert parse_options({key: "127.0.0.1:7"}, environ={}).listen_port == 7
    with pytest.raises(LLMParamError, match=r"did you mean llm\.(l|L)istenIpInfo\?"):
        parse_options({"llm.ListenIPInfo": "127.0.0.1:7"}, environ={})


@pytest.mark.parametrize("key", ["ge.graphRunMode", "ge.exec.precision_mode", "vendor.x", "LLM.X"])
def test_other_keys_pass_through(key: str) -> None:
    assert parse_options({key: "v"}, environ={}).raw == {key: "v"}


@pytest.mark.asyncio
async def test_init_refuses_an_unknown_key_and_stays_uninitialized() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 4711)
    with pytest.raises(LLMParamError, match=r"did you mean llm\.SyncKvCacheWaitTime\?"):
        await dd.init({"llm.SyncKvCacheWaitTme": "5"})
    assert not dd.is_initialized
    await dd.init({"llm.SyncKvCacheWaitTime": "5"})
    try:
        assert dd.options.sync_kv_timeout_ms == 5
    finally:
        await dd.finalize()
