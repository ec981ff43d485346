"""Every upstream enum member, option key and default exists with its exact value.

The expected numbers are copied from the LLM-DataDist API reference
(``llm_datadist.md``, sections 3.1, 3.2, 4 and 6), not from the code under test.
"""

from __future__ import annotations

import enum

import pytest

from aiodatadist.config import LLMConfig, LlmConfig
from aiodatadist.errors import LLMStatusCode
from aiodatadist.types import (
    Cache,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMRole,
    Memtype,
    Placement,
    RegisterMemStatus,
)

# Reference §3.2, in table order.
STATUS_CODES = {
    "LLM_SUCCESS": 0,
    "LLM_FAILED": 4294967295,
    "LLM_WAIT_PROCESS_TIMEOUT": 0x5010B001,
    "LLM_KV_CACHE_NOT_EXIST": 0x5010B002,
    "LLM_REPEAT_REQUEST": 0x5010B003,
    "LLM_REQUEST_ALREADY_COMPLETED": 0x5010B004,
    "LLM_PARAM_INVALID": 0x5010B005,
    "LLM_ENGINE_FINALIZED": 0x5010B006,
    "LLM_NOT_YET_LINK": 0x5010B007,
    "LLM_ALREADY_LINK": 0x5010B008,
    "LLM_LINK_FAILED": 0x5010B009,
    "LLM_UNLINK_FAILED": 0x5010B00A,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 0x5010B00B,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": 0x5010B00C,
    "LLM_PROCESSING_LINK": 0x5010B00D,
    "LLM_DEVICE_OUT_OF_MEMORY": 0x5010B00E,
    "LLM_PREFIX_ALREADY_EXIST": 0x5010B00F,
    "LLM_PREFIX_NOT_EXIST": 0x5010B010,
    "LLM_SEQ_LENOVERLIMIT": 0x5010B011,
    "LLM_NO_FREE_BLOCK": 0x5010B012,
    "LLM_BLOCKS_OUT_OF_MEMORY": 0x5010B013,
    "LLM_EXIST_LINK": 0x5010B018,
    "LLM_FEATURE_NOT_ENABLED": 0x5010B019,
    "LLM_TIMEOUT": 0x5010B01A,
    "LLM_LINK_BUSY": 0x5010B01B,
    "LLM_OUT_OF_MEMORY": 0x5010B01C,
    "LLM_DEVICE_MEM_ERROR": 507053,
    "LLM_SUSPECT_REMOTE_ERROR": 507057,
    "LLM_UNKNOWN_ERROR": -1,
}

# Reference §3.1.
SIMPLE_ENUMS: list[tuple[type[enum.Enum], dict[str, int]]] = [
    (LLMRole, {"PROMPT": 1, "DECODER": 2, "MIX": 3}),
    (Placement, {"HOST": 0, "DEVICE": 1}),
    (RegisterMemStatus, {"OK": 0, "PREPARING": 1, "FAILED": 2}),
    (Memtype, {"MEM_TYPE_DEVICE": 0, "MEM_TYPE_HOST": 1}),
    (
        DataType,
        {
            "DT_FLOAT": 0,
            "DT_FLOAT16": 1,
            "DT_INT8": 2,
            "DT_INT32": 3,
            "DT_UINT8": 4,
            "DT_INT16": 6,
            "DT_UINT16": 7,
            "DT_UINT32": 8,
            "DT_INT64": 9,
            "DT_UINT64": 10,
            "DT_DOUBLE": 11,
            "DT_BOOL": 12,
            "DT_STRING": 13,
            "DT_BF16": 27,
        },
    ),
]


@pytest.mark.parametrize(("name", "value"), list(STATUS_CODES.items()))
def test_status_code_member(name: str, value: int) -> None:
    assert LLMStatusCode[name] == value
    assert LLMStatusCode(value).name == name


def test_status_code_has_no_extra_members() -> None:
    assert {m.name: m.value for m in LLMStatusCode} == STATUS_CODES


def test_ge_encoding_of_status_codes() -> None:
    # Reference §3.2: GE status = (1<<30)|(1<<28)|(0<<25)|(8<<17)|(11<<12)|n.
    base = (1 << 30) | (1 << 28) | (0 << 25) | (8 << 17) | (11 << 12)
    assert base == 0x5010B000
    assert LLMStatusCode.LLM_TIMEOUT == base | 0x1A


def test_status_code_is_int_enum_with_upstream_str() -> None:
    assert issubclass(LLMStatusCode, enum.IntEnum)
    assert str(LLMStatusCode.LLM_TIMEOUT) == "LLMStatusCode.LLM_TIMEOUT"


@pytest.mark.parametrize(
    ("enum_cls", "members"), SIMPLE_ENUMS, ids=lambda x: getattr(x, "__name__", "")
)
def test_simple_enum_members(enum_cls: type[enum.Enum], members: dict[str, int]) -> None:
    assert {m.name: m.value for m in enum_cls} == members


@pytest.mark.parametrize(
    ("enum_cls", "base"),
    [
        (LLMRole, enum.IntEnum),
        (Placement, enum.IntEnum),
        (RegisterMemStatus, enum.Enum),
        (Memtype, enum.Enum),
        (DataType, enum.Enum),
    ],
)
def test_enum_kinds(enum_cls: type[enum.Enum], base: type[enum.Enum]) -> None:
    assert issubclass(enum_cls, base)


def test_role_str_is_upstream() -> None:
    assert str(LLMRole.PROMPT) == "LLMRole.PROMPT"


def test_aliases() -> None:
    assert LlmConfig is LLMConfig
    assert Cache is KvCache


def test_cache_key_default_prefix_id() -> None:
    key = CacheKey(1, 2)
    assert key.prefix_id == 2**64 - 1
    assert key.model_id == 0


def test_cache_desc_defaults() -> None:
    desc = CacheDesc(2, [4, 8], DataType.DT_FLOAT16)
    assert desc.placement == Placement.DEVICE
    assert desc.batch_dim_index == 0
    assert desc.seq_len_dim_index == -1
    assert desc.kv_tensor_format is None


# Reference §4: attribute -> (value to set, expected emitted options).
OPTION_KEYS = [
    ("device_id", 3, {"ge.exec.deviceId": "3", "ge.session_device_id": "3"}),
    ("device_id", [1, 2], {"ge.exec.deviceId": "1;2", "ge.session_device_id": "1"}),
    ("sync_kv_timeout", 2000, {"llm.SyncKvCacheWaitTime": "2000"}),
    ("listen_ip_info", "10.1.2.3:26000", {"llm.listenIpInfo": "10.1.2.3:26000"}),
    ("enable_cache_manager", True, {"llm.EnableCacheManager": "1"}),
    ("enable_cache_manager", False, {"llm.EnableCacheManager": "0"}),
    ("enable_remote_cache_accessible", True, {"llm.EnableRemoteCacheAccessible": "1"}),
    ("mem_pool_cfg", '{"memory_size": 1024}', {"llm.MemPoolConfig": '{"memory_size": 1024}'}),
    (
        "host_mem_pool_cfg",
        '{"memory_size": 1024}',
        {"llm.HostMemPoolConfig": '{"memory_size": 1024}'},
    ),
    ("buf_pool_cfg", "[]", {"llm.BufPoolCfg": "[]"}),
    ("link_total_time", 30, {"llm.LinkTotalTime": "30"}),
    ("link_retry_count", 3, {"llm.LinkRetryCount": "3"}),
    ("rdma_traffic_class", 132, {"llm.RdmaTrafficClass": "132"}),
    ("rdma_service_level", 4, {"llm.RdmaServiceLevel": "4"}),
    ("local_comm_res", "", {"llm.LocalCommRes": ""}),
    ("transfer_backend", "hixl", {"llm.TransferBackend": "hixl"}),
    ("global_resource_config", "{}", {"llm.GlobalResourceConfig": "{}"}),
    ("enable_switch_role", True, {"llm.EnableSwitchRole": "1"}),
    ("output_max_size", 10, {"llm.OutputMaxSize": "10"}),
    ("deploy_res_path", "/x", {"llm.deployResPath": "/x"}),
]


@pytest.mark.parametrize(("attr", "value", "expected"), OPTION_KEYS)
def test_upstream_option_keys(attr: str, value: object, expected: dict[str, str]) -> None:
    config = LLMConfig()
    setattr(config, attr, value)
    # llm.MemoryUtilization = 0.95 is always emitted (reference §4).
    assert config.generate_options() == {**expected, "llm.MemoryUtilization": "0.95"}


def test_upstream_getter_defaults() -> None:
    config = LLMConfig()
    assert config.sync_kv_timeout == 1000
    assert config.link_total_time == 0
    assert config.link_retry_count == 1
    assert config.listen_ip_info == ""
    assert config.local_comm_res == ""
    assert config.enable_cache_manager is False
    assert config.enable_remote_cache_accessible is False
    assert config.enable_switch_role is False
    assert config.mem_utilization == 0.95
