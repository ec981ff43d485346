"""Data types: validation, properties, equality, helpers."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aiodatadist import _validate as v
from aiodatadist.errors import LLMException, LLMParamError, LLMStatusCode
from aiodatadist.types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMRole,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
    ip_to_int,
    ip_to_str,
)

U64 = 2**64 - 1
FP16 = DataType.DT_FLOAT16


def desc(num_tensors: int = 4, shape: tuple[int, ...] = (8, 16), **kw: object) -> CacheDesc:
    return CacheDesc(num_tensors, list(shape), FP16, **kw)  # type: ignore[arg-type]


# -- import hygiene ---------------------------------------------------------------


def test_modules_import_without_numpy_or_native() -> None:
    # Load the modules under a bare package so the result does not depend on
    # what aiodatadist/__init__.py imports.
    pkg_dir = Path(__file__).resolve().parent.parent / "aiodatadist"
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('aiodatadist')\n"
        f"pkg.__path__ = [{str(pkg_dir)!r}]\n"
        "sys.modules['aiodatadist'] = pkg\n"
        "import aiodatadist.errors, aiodatadist.types, aiodatadist.config\n"
        "bad = [m for m in ('numpy', 'aiodatadist._native') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- _validate -------------------------------------------------------------------


def test_check_uint() -> None:
    assert v.check_uint("x", U64) == U64
    with pytest.raises(
        LLMParamError, match=r"req_id must be a uint64 in \[0, 18446744073709551615\], got -1"
    ):
        v.check_uint("req_id", -1)
    with pytest.raises(ValueError, match=r"port must be a uint16 in \[0, 65535\], got 65536"):
        v.check_uint("port", 65536, 16)
    with pytest.raises(TypeError, match=r"req_id must be int, got bool"):
        v.check_uint("req_id", True)
    with pytest.raises(TypeError, match=r"req_id must be int, got float"):
        v.check_uint("req_id", 1.0)


def test_check_sint() -> None:
    assert v.check_sint("x", -(2**63)) == -(2**63)
    with pytest.raises(
        LLMParamError, match=r"cache_id must be an int64 in .*, got 9223372036854775808"
    ):
        v.check_sint("cache_id", 2**63)
    with pytest.raises(LLMParamError, match=r"t must be an int32 .*got -2147483649"):
        v.check_sint("t", -(2**31) - 1, 32)


def test_check_int() -> None:
    assert v.check_int("n", 5, min_value=1, max_value=5) == 5
    with pytest.raises(LLMParamError, match=r"n must be in \[1, 5\], got 6"):
        v.check_int("n", 6, min_value=1, max_value=5)
    with pytest.raises(LLMParamError, match=r"n must be >= 1, got 0"):
        v.check_int("n", 0, min_value=1)
    with pytest.raises(LLMParamError, match=r"n must be <= 3, got 4"):
        v.check_int("n", 4, max_value=3)
    with pytest.raises(TypeError, match=r"n must be int, got str"):
        v.check_int("n", "1")


def test_check_int_list() -> None:
    assert v.check_int_list("ids", (1, 2)) == [1, 2]
    assert v.check_int_list("ids", range(3)) == [0, 1, 2]
    assert v.check_int_list("ids", [-1, 5], signed=True) == [-1, 5]
    assert v.check_int_list("ids", []) == []
    with pytest.raises(LLMParamError, match=r"ids must not be empty"):
        v.check_int_list("ids", [], allow_empty=False)
    with pytest.raises(LLMParamError, match=r"ids\[2\] must be a uint64 .*got -3"):
        v.check_int_list("ids", [1, 2, -3])
    with pytest.raises(LLMParamError, match=r"ids\[0\] must be a uint32 .*got 4294967296"):
        v.check_int_list("ids", [2**32], bits=32)
    with pytest.raises(TypeError, match=r"ids\[1\] must be int, got bool"):
        v.check_int_list("ids", [1, False])
    with pytest.raises(TypeError, match=r"ids must be list or tuple of int, got set"):
        v.check_int_list("ids", {1})


def test_check_layer_range() -> None:
    assert v.check_layer_range("r", range(0, 4)) == range(0, 4)
    assert v.check_layer_range("r", None, allow_none=True) is None
    with pytest.raises(ValueError, match=r"src_layer_range must have step 1, got range\(0, 4, 2\)"):
        v.check_layer_range("src_layer_range", range(0, 4, 2))
    with pytest.raises(LLMParamError, match=r"r must satisfy 0 <= start < stop, got range\(2, 2\)"):
        v.check_layer_range("r", range(2, 2))
    with pytest.raises(LLMParamError, match=r"got range\(-1, 2\)"):
        v.check_layer_range("r", range(-1, 2))
    with pytest.raises(TypeError, match=r"r must be range, got NoneType"):
        v.check_layer_range("r", None)
    with pytest.raises(TypeError, match=r"r must be range or None, got list"):
        v.check_layer_range("r", [0, 1], allow_none=True)


def test_check_type_bool_str_and_require() -> None:
    v.check_type("x", True, (bool,))
    with pytest.raises(TypeError, match=r"x must be int or str, got bool"):
        v.check_type("x", True, (int, str))
    with pytest.raises(TypeError, match=r"flag must be bool, got int"):
        v.check_bool("flag", 1)
    with pytest.raises(TypeError, match=r"s must be str, got bytes"):
        v.check_str("s", b"x")
    with pytest.raises(LLMParamError, match=r"s must not be empty"):
        v.check_str("s", "", allow_empty=False)
    v.require(True, "never")
    with pytest.raises(LLMParamError, match=r"bad thing") as info:
        v.require(False, "bad thing")
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException, match=r"off") as info2:
        v.require(False, "off", LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
    assert info2.value.status_code is LLMStatusCode.LLM_FEATURE_NOT_ENABLED


# -- enums -----------------------------------------------------------------------


def test_register_mem_status_unknown_is_failed() -> None:
    assert RegisterMemStatus(1) is RegisterMemStatus.PREPARING
    assert RegisterMemStatus(99) is RegisterMemStatus.FAILED
    with pytest.raises(ValueError):
        RegisterMemStatus("OK")


ITEMSIZES = {
    DataType.DT_FLOAT: 4,
    DataType.DT_FLOAT16: 2,
    DataType.DT_INT8: 1,
    DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1,
    DataType.DT_INT16: 2,
    DataType.DT_UINT16: 2,
    DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8,
    DataType.DT_UINT64: 8,
    DataType.DT_DOUBLE: 8,
    DataType.DT_BOOL: 1,
    DataType.DT_BF16: 2,
}


@pytest.mark.parametrize(("dt", "size"), list(ITEMSIZES.items()), ids=str)
def test_data_type_itemsize_and_numpy(dt: DataType, size: int) -> None:
    assert dt.itemsize == size
    assert dt.to_numpy().itemsize == size
    if dt is not DataType.DT_BF16:
        assert DataType.from_numpy(dt.to_numpy()) is dt


def test_data_type_numpy_specifics() -> None:
    assert DataType.DT_BF16.to_numpy() == np.dtype("uint16")
    assert DataType.from_numpy(np.uint16) is DataType.DT_UINT16
    assert DataType.from_numpy("float32") is DataType.DT_FLOAT
    assert DataType.from_numpy(np.bool_) is DataType.DT_BOOL


def test_data_type_string_has_no_size() -> None:
    with pytest.raises(LLMParamError, match=r"DT_STRING has no fixed item size"):
        _ = DataType.DT_STRING.itemsize
    with pytest.raises(LLMParamError, match=r"DT_STRING has no numpy equivalent"):
        DataType.DT_STRING.to_numpy()


def test_data_type_from_numpy_errors() -> None:
    with pytest.raises(LLMParamError, match=r"complex64"):
        DataType.from_numpy(np.complex64)
    with pytest.raises(LLMParamError, match=r"has no DataType"):
        DataType.from_numpy(np.dtype(">f4"))
    with pytest.raises(TypeError, match=r"dtype must be a numpy dtype, got 'nope'"):
        DataType.from_numpy("nope")


# -- CacheDesc --------------------------------------------------------------------


def test_cache_desc_properties() -> None:
    d = CacheDesc(4, [8, 16, 64], DataType.DT_BF16, Placement.HOST, 0, 1, "ND")
    assert d.num_tensors == 4
    assert d.shape == (8, 16, 64)
    assert d.data_type is DataType.DT_BF16
    assert d.placement is Placement.HOST
    assert d.batch_dim_index == d.batch_dim == 0
    assert d.batch_size == 8
    assert d.seq_len_dim_index == 1
    assert d.kv_tensor_format == "ND"
    assert d.size == 8 * 16 * 64 * 2
    assert d.block_bytes == 16 * 64 * 2
    assert "shape=(8, 16, 64)" in repr(d)
    assert "data_type=DataType.DT_BF16" in repr(d)


def test_cache_desc_shape_is_a_copy() -> None:
    shape = [8, 16]
    d = CacheDesc(2, shape, FP16)
    shape[0] = 1
    assert d.shape == (8, 16)
    assert CacheDesc(2, (8, 16), FP16).shape == (8, 16)


def test_cache_desc_update_dim() -> None:
    d = desc(shape=(8, 16), batch_dim_index=1)
    d.update_dim(1, 4)
    assert d.shape == (8, 4)
    assert d.batch_size == 4
    assert d.size == 8 * 4 * 2
    with pytest.raises(LLMParamError, match=r"dim_index must be in \[0, 1\], got 2"):
        d.update_dim(2, 1)
    with pytest.raises(LLMParamError, match=r"dim_value must be >= 1.*got 0"):
        d.update_dim(0, 0)
    with pytest.raises(TypeError, match=r"dim_value must be int, got bool"):
        d.update_dim(0, True)


def test_cache_desc_equality() -> None:
    assert desc() == desc()
    assert desc() != desc(shape=(8, 17))
    assert desc() != desc(placement=Placement.HOST)
    assert desc() != "CacheDesc"
    with pytest.raises(TypeError):
        hash(desc())


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"num_tensors": 0}, LLMParamError, r"num_tensors must be in \[1, 4294967295\], got 0"),
        ({"num_tensors": 2**32}, LLMParamError, "num_tensors .*got 4294967296"),
        ({"num_tensors": True}, TypeError, "num_tensors must be int, got bool"),
        ({"shape": []}, LLMParamError, r"shape must have 1 to 32 dims, got 0: \[\]"),
        ({"shape": [1] * 33}, LLMParamError, "shape must have 1 to 32 dims, got 33"),
        ({"shape": [4, 0]}, LLMParamError, r"shape\[1\] must be >= 1 .*got 0: shape=\[4, 0\]"),
        ({"shape": [-1, 4]}, LLMParamError, r"shape\[0\] must be >= 1 .*got -1"),
        ({"shape": [4, 2.0]}, TypeError, r"shape\[1\] must be int, got float"),
        ({"shape": "44"}, TypeError, "shape must be list or tuple, got str"),
        ({"data_type": 1}, TypeError, "data_type must be DataType, got int"),
        ({"placement": 1}, TypeError, "placement must be Placement, got int"),
        ({"batch_dim_index": 2}, LLMParamError, r"batch_dim_index must be in \[0, 1\], got 2"),
        ({"batch_dim_index": -1}, LLMParamError, "batch_dim_index .*got -1"),
        (
            {"seq_len_dim_index": 2},
            LLMParamError,
            r"seq_len_dim_index must be -1 or in \[0, 1\], got 2",
        ),
        ({"seq_len_dim_index": -2}, LLMParamError, "seq_len_dim_index .*got -2"),
        ({"kv_tensor_format": 3}, TypeError, "kv_tensor_format must be str, got int"),
    ],
)
def test_cache_desc_validation(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    args: dict[str, object] = {"num_tensors": 2, "shape": [4, 8], "data_type": FP16}
    args.update(kwargs)
    with pytest.raises(exc, match=match) as info:
        CacheDesc(**args)  # type: ignore[arg-type]
    if isinstance(info.value, LLMException):
        assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


# -- Cache -----------------------------------------------------------------------


def test_cache_properties() -> None:
    d = desc(num_tensors=2)
    cache = Cache(5, d, [0x1000, 0x2000], is_blocks_cache=True)
    assert isinstance(cache, KvCache)
    assert cache.cache_id == 5
    assert cache.cache_desc is d
    assert cache.tensor_addrs == [0x1000, 0x2000]
    assert cache.per_device_tensor_addrs == [[0x1000, 0x2000]]
    assert cache.is_blocks_cache is True
    assert cache._owner is None and cache._buffers is None and cache._views_factory is None
    cache.tensor_addrs.append(1)  # a copy: the handle is not changed
    assert cache.tensor_addrs == [0x1000, 0x2000]
    assert "cache_id=5" in repr(cache)


def test_cache_tensors() -> None:
    cache = Cache(1, desc(num_tensors=1), [0x1000])
    with pytest.raises(LLMException, match=r"tensors.. is not available for cache 1") as info:
        cache.tensors()
    assert info.value.status_code is LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    views = [np.zeros(4)]
    cache._views_factory = lambda: views
    assert cache.tensors() is views


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((2**63, [1, 2]), LLMParamError, "cache_id must be an int64 .*got 9223372036854775808"),
        (
            (1, [1]),
            LLMParamError,
            r"tensor_addrs must have cache_desc.num_tensors \(2\) entries, got 1",
        ),
        ((1, [1, -2]), LLMParamError, r"tensor_addrs\[1\] must be a uint64 .*got -2"),
        ((1, "ab"), TypeError, "tensor_addrs must be list or tuple of int, got str"),
    ],
)
def test_cache_validation(args: tuple[object, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        Cache(args[0], desc(num_tensors=2), args[1])  # type: ignore[arg-type]


def test_cache_validation_types() -> None:
    with pytest.raises(TypeError, match=r"cache_desc must be CacheDesc, got dict"):
        Cache(1, {}, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"is_blocks_cache must be bool, got int"):
        Cache(1, desc(num_tensors=1), [1], 1)  # type: ignore[arg-type]


def test_create_cpu_cache() -> None:
    host = desc(num_tensors=2, placement=Placement.HOST)
    cache = Cache.create_cpu_cache(host, [10, 20])
    assert cache.cache_id == -1
    assert cache.is_blocks_cache is True
    assert cache.tensor_addrs == [10, 20]
    assert KvCache.create_cpu_cache(host, [[10, 20]]).tensor_addrs == [10, 20]
    with pytest.raises(
        LLMParamError, match=r"cache_desc.placement must be Placement.HOST, got Placement.DEVICE"
    ):
        Cache.create_cpu_cache(desc(num_tensors=2), [10, 20])
    with pytest.raises(
        LLMParamError, match=r"addrs must have cache_desc.num_tensors \(2\) entries, got 3"
    ):
        Cache.create_cpu_cache(host, [1, 2, 3])
    with pytest.raises(TypeError, match=r"addrs must be list or tuple, got int"):
        Cache.create_cpu_cache(host, 5)  # type: ignore[arg-type]


# -- keys ------------------------------------------------------------------------


def test_cache_key_forms() -> None:
    a = CacheKey(1, 2, 3, 4)
    assert (a.cluster_id, a.prompt_cluster_id, a.req_id, a.model_id, a.prefix_id) == (1, 1, 2, 3, 4)
    assert CacheKey(prompt_cluster_id=1, req_id=2, model_id=3, prefix_id=4) == a
    assert CacheKey(cluster_id=1, req_id=2, model_id=3, prefix_id=4) == a
    assert CacheKey(1, req_id=2).prefix_id == U64
    assert CacheKey(1, 2) != CacheKey(1, 3)
    assert len({CacheKey(1, 2), CacheKey(cluster_id=1, req_id=2)}) == 1
    assert repr(CacheKey(1, 2, 3, 4)) == "CacheKey(cluster_id=1, req_id=2, model_id=3, prefix_id=4)"


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: CacheKey(-1, 2), LLMParamError, "prompt_cluster_id must be a uint64 .*got -1"),
        (
            lambda: CacheKey(cluster_id=2**64, req_id=2),
            ValueError,
            "cluster_id must be a uint64 .*got 18446744073709551616",
        ),
        (lambda: CacheKey(1, -2), LLMParamError, "req_id must be a uint64 .*got -2"),
        (lambda: CacheKey(1, 2, -3), LLMParamError, "model_id must be a uint64 .*got -3"),
        (
            lambda: CacheKey(1, 2, 3, 2**64),
            LLMParamError,
            "prefix_id must be a uint64 .*got 18446744073709551616",
        ),
        (lambda: CacheKey(True, 2), TypeError, "prompt_cluster_id must be int, got bool"),
        (lambda: CacheKey(1, "2"), TypeError, "req_id must be int, got str"),  # type: ignore[arg-type]
        (lambda: CacheKey(1), TypeError, "missing required argument 'req_id'"),
        (lambda: CacheKey(req_id=1), TypeError, "missing required argument 'cluster_id'"),
        (
            lambda: CacheKey(1, 2, cluster_id=1),
            TypeError,
            "got both prompt_cluster_id and cluster_id",
        ),
    ],
)
def test_cache_key_validation(call: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()  # type: ignore[operator]


def test_cache_key_by_id_and_index() -> None:
    k = CacheKeyByIdAndIndex(7, -1, 3)
    assert (k.cluster_id, k.prompt_cluster_id, k.cache_id, k.batch_index) == (7, 7, -1, 3)
    assert CacheKeyByIdAndIndex(7, 5).batch_index == 0
    assert k == CacheKeyByIdAndIndex(cluster_id=7, cache_id=-1, batch_index=3)
    assert hash(k) == hash(CacheKeyByIdAndIndex(7, -1, 3))
    assert k != CacheKeyByIdAndIndex(7, -1, 4)
    assert repr(k) == "CacheKeyByIdAndIndex(cluster_id=7, cache_id=-1, batch_index=3)"
    with pytest.raises(LLMParamError, match=r"cluster_id must be a uint64 .*got -7"):
        CacheKeyByIdAndIndex(-7, 1)
    with pytest.raises(LLMParamError, match=r"cache_id must be an int64 .*got 9223372036854775808"):
        CacheKeyByIdAndIndex(7, 2**63)
    with pytest.raises(LLMParamError, match=r"batch_index must be a uint32 .*got 4294967296"):
        CacheKeyByIdAndIndex(7, 1, 2**32)
    with pytest.raises(TypeError, match=r"batch_index must be int, got bool"):
        CacheKeyByIdAndIndex(7, 1, False)


def test_blocks_cache_key() -> None:
    k = BlocksCacheKey(3, 1)
    assert (k.cluster_id, k.prompt_cluster_id, k.model_id) == (3, 3, 1)
    assert BlocksCacheKey(cluster_id=3, model_id=1) == k
    assert BlocksCacheKey(prompt_cluster_id=3, model_id=1) == k
    assert BlocksCacheKey(3).model_id == 0
    assert {k: 1}[BlocksCacheKey(cluster_id=3, model_id=1)] == 1
    assert k != BlocksCacheKey(3, 2)
    assert k != CacheKeyByIdAndIndex(3, 1)
    assert repr(k) == "BlocksCacheKey(cluster_id=3, model_id=1)"
    with pytest.raises(LLMParamError, match=r"model_id must be a uint64 .*got -1"):
        BlocksCacheKey(3, -1)
    with pytest.raises(LLMParamError, match=r"cluster_id must be a uint64 .*got -3"):
        BlocksCacheKey(cluster_id=-3)
    with pytest.raises(TypeError, match=r"missing required argument 'cluster_id'"):
        BlocksCacheKey()
    with pytest.raises(TypeError, match=r"got both"):
        BlocksCacheKey(1, cluster_id=1)
    with pytest.raises(TypeError, match=r"model_id must be int, got float"):
        BlocksCacheKey(1, 1.0)  # type: ignore[arg-type]


def test_keys_are_immutable() -> None:
    k = CacheKey(1, 2)
    with pytest.raises(AttributeError):
        k.req_id = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        k.other = 3  # type: ignore[attr-defined]


# -- LLMClusterInfo --------------------------------------------------------------


def test_cluster_info() -> None:
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None
    info.remote_cluster_id = 2**64 - 1
    info.remote_role_type = LLMRole.PROMPT
    info.append_local_ip_info("192.168.1.2", 0)
    info.append_remote_ip_info("10.0.0.1", 26000)
    info.append_remote_ip_info(ip_to_int("ip", "10.0.0.2"), 1)
    expected = int.from_bytes(socket.inet_aton("10.0.0.1"), "little")
    assert info.remote_ip_info_list[0] == (expected, 26000)
    assert info.local_ip_info_list == [
        (int.from_bytes(socket.inet_aton("192.168.1.2"), "little"), 0)
    ]
    assert info.remote_ip_info_strs() == [("10.0.0.1", 26000), ("10.0.0.2", 1)]
    assert info.local_ip_info_strs() == [("192.168.1.2", 0)]
    assert info.remote_address() == ("10.0.0.1", 26000)
    assert info.remote_ip_str() == "10.0.0.1"
    assert info.remote_role_type is LLMRole.PROMPT
    assert "10.0.0.1" in repr(info)


def test_cluster_info_validation() -> None:
    info = LLMClusterInfo()
    with pytest.raises(
        LLMParamError, match=r"remote_ip_info_list is empty for remote_cluster_id=None"
    ):
        info.remote_address()
    with pytest.raises(LLMParamError, match=r"remote_cluster_id must be a uint64 .*got -1"):
        info.remote_cluster_id = -1
    with pytest.raises(TypeError, match=r"remote_role_type must be LLMRole or int, got str"):
        info.remote_role_type = "PROMPT"  # type: ignore[assignment]
    with pytest.raises(LLMParamError, match=r"ip must be a dotted IPv4 address, got '10.0.0'"):
        info.append_remote_ip_info("10.0.0", 1)
    with pytest.raises(LLMParamError, match=r"ip must be a dotted IPv4 address, got '::1'"):
        info.append_local_ip_info("::1", 1)
    with pytest.raises(LLMParamError, match=r"ip must be a uint32 .*got 4294967296"):
        info.append_remote_ip_info(2**32, 1)
    with pytest.raises(TypeError, match=r"ip must be str or int, got bytes"):
        info.append_remote_ip_info(b"10.0.0.1", 1)  # type: ignore[arg-type]
    with pytest.raises(LLMParamError, match=r"port must be a uint16 .*got 65536"):
        info.append_remote_ip_info("10.0.0.1", 65536)
    with pytest.raises(TypeError, match=r"port must be int, got str"):
        info.append_local_ip_info("10.0.0.1", "1")  # type: ignore[arg-type]
    assert info.remote_ip_info_list == [] and info.local_ip_info_list == []


def test_ip_round_trip() -> None:
    assert ip_to_str(ip_to_int("ip", "1.2.3.4")) == "1.2.3.4"
    assert ip_to_int("ip", "1.2.3.4") == 0x04030201


# -- LayerSynchronizer -----------------------------------------------------------


def test_layer_synchronizer_is_abstract() -> None:
    with pytest.raises(TypeError):
        LayerSynchronizer()  # type: ignore[abstract]

    class Sync(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return layer_index < 2

    class AsyncSync(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    assert Sync().synchronize_layer(1, None) is True
    coro = AsyncSync().synchronize_layer(0, None)
    coro.close()


# -- TransferConfig / TransferWithCacheKeyConfig ---------------------------------


def test_transfer_config() -> None:
    cfg = TransferConfig(9, [1, 2, 3, 4], range(1, 3), 1)
    assert cfg.dst_cluster_id == 9
    assert cfg.dst_addrs == [1, 2, 3, 4]
    assert cfg.src_layer_range == range(1, 3)
    assert cfg.src_batch_index == 1
    assert cfg.dst_layer_range is None
    default = TransferConfig(9, (5, 6))
    assert default.src_layer_range is None and default.src_batch_index == 0
    cfg.dst_cluster_id = 10
    cfg.dst_addrs = [7, 8]
    cfg.src_layer_range = range(0, 1)
    cfg.src_batch_index = 0
    assert (cfg.dst_cluster_id, cfg.dst_addrs, cfg.src_layer_range) == (10, [7, 8], range(0, 1))
    assert "dst_cluster_id=10" in repr(cfg)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (
            lambda: TransferConfig(-1, [1, 2]),
            LLMParamError,
            "dst_cluster_id must be a uint64 .*got -1",
        ),
        (
            lambda: TransferConfig(1, [1, -2]),
            LLMParamError,
            r"dst_addrs\[1\] must be a uint64 .*got -2",
        ),
        (
            lambda: TransferConfig(1, 5),  # type: ignore[arg-type]
            TypeError,
            "dst_addrs must be list or tuple of int, got int",
        ),
        (
            lambda: TransferConfig(1, [1, 2], range(0, 2, 2)),
            LLMParamError,
            r"src_layer_range must have step 1, got range\(0, 2, 2\)",
        ),
        (
            lambda: TransferConfig(1, [1, 2], range(3, 1)),
            LLMParamError,
            r"src_layer_range must satisfy 0 <= start < stop, got range\(3, 1\)",
        ),
        (
            lambda: TransferConfig(1, [1, 2], [0, 1]),  # type: ignore[arg-type]
            TypeError,
            "src_layer_range must be range or None, got list",
        ),
        (
            lambda: TransferConfig(1, [1, 2, 3], range(0, 2)),
            LLMParamError,
            r"dst_addrs must have 4 entries .*range\(0, 2\).*got 3",
        ),
        (
            lambda: TransferConfig(1, [1, 2], None, -1),
            LLMParamError,
            "src_batch_index must be a uint32 .*got -1",
        ),
    ],
)
def test_transfer_config_validation(call: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()  # type: ignore[operator]


def test_transfer_config_setters_validate() -> None:
    cfg = TransferConfig(1, [1, 2])
    with pytest.raises(LLMParamError, match=r"dst_cluster_id must be a uint64"):
        cfg.dst_cluster_id = -1
    with pytest.raises(LLMParamError, match=r"src_layer_range must have step 1"):
        cfg.src_layer_range = range(0, 4, 2)
    with pytest.raises(LLMParamError, match=r"src_batch_index must be a uint32"):
        cfg.src_batch_index = 2**32
    with pytest.raises(TypeError, match=r"dst_addrs\[0\] must be int, got str"):
        cfg.dst_addrs = ["1"]  # type: ignore[list-item]


def test_transfer_with_cache_key_config() -> None:
    key = BlocksCacheKey(5, 1)
    cfg = TransferWithCacheKeyConfig(key, range(0, 2), range(2, 4))
    assert cfg.cache_key is key
    assert cfg.dst_cluster_id == 5
    assert (cfg.src_layer_range, cfg.dst_layer_range, cfg.src_batch_index) == (
        range(0, 2),
        range(2, 4),
        0,
    )
    by_id = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(6, 3, 1), range(1, 2), range(0, 1), 4)
    assert by_id.src_batch_index == 4
    assert by_id.dst_cluster_id == 6
    by_id.cache_key = CacheKeyByIdAndIndex(8, 3)
    assert by_id.dst_cluster_id == 8
    by_id.src_layer_range = range(0, 1)
    by_id.dst_layer_range = range(3, 4)
    assert "TransferWithCacheKeyConfig(cache_key=CacheKeyByIdAndIndex" in repr(by_id)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (
            lambda: TransferWithCacheKeyConfig(BlocksCacheKey(1), range(0, 2), range(0, 3)),
            LLMParamError,
            r"src_layer_range and dst_layer_range must have the same length, "
            r"got range\(0, 2\) and range\(0, 3\)",
        ),
        (
            lambda: TransferWithCacheKeyConfig(BlocksCacheKey(1), range(0, 2), range(0, 2), 1),
            LLMParamError,
            "src_batch_index must be 0 when cache_key is a BlocksCacheKey, got 1",
        ),
        (
            lambda: TransferWithCacheKeyConfig(CacheKey(1, 2), range(0, 2), range(0, 2)),  # type: ignore[arg-type]
            TypeError,
            "cache_key must be BlocksCacheKey or CacheKeyByIdAndIndex, got CacheKey",
        ),
        (
            lambda: TransferWithCacheKeyConfig(BlocksCacheKey(1), None, range(0, 2)),  # type: ignore[arg-type]
            TypeError,
            "src_layer_range must be range, got NoneType",
        ),
        (
            lambda: TransferWithCacheKeyConfig(BlocksCacheKey(1), range(0, 2), range(1, 5, 2)),
            LLMParamError,
            r"dst_layer_range must have step 1, got range\(1, 5, 2\)",
        ),
        (
            lambda: TransferWithCacheKeyConfig(
                CacheKeyByIdAndIndex(1, 1), range(0, 1), range(0, 1), -1
            ),
            LLMParamError,
            "src_batch_index must be a uint32 .*got -1",
        ),
    ],
)
def test_transfer_with_cache_key_config_validation(
    call: object, exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        call()  # type: ignore[operator]


def test_transfer_with_cache_key_config_setters_validate() -> None:
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 1), range(0, 1), range(0, 1), 2)
    with pytest.raises(
        LLMParamError, match=r"src_batch_index must be 0 when cache_key is a BlocksCacheKey"
    ):
        cfg.cache_key = BlocksCacheKey(1)
    assert isinstance(cfg.cache_key, CacheKeyByIdAndIndex)
    cfg.src_batch_index = 0
    cfg.cache_key = BlocksCacheKey(1)
    with pytest.raises(
        LLMParamError, match=r"src_batch_index must be 0 when cache_key is a BlocksCacheKey, got 3"
    ):
        cfg.src_batch_index = 3
    with pytest.raises(TypeError, match=r"dst_layer_range must be range, got NoneType"):
        cfg.dst_layer_range = None  # type: ignore[assignment]


# -- MemInfo ---------------------------------------------------------------------


def test_mem_info() -> None:
    info = MemInfo(Memtype.MEM_TYPE_HOST, 0x1000, 4096)
    assert (info.mem_type, info.addr, info.size) == (Memtype.MEM_TYPE_HOST, 0x1000, 4096)
    assert "MemInfo(mem_type=Memtype.MEM_TYPE_HOST, addr=4096, size=4096)" == repr(info)
    with pytest.raises(TypeError, match=r"mem_type must be Memtype, got int"):
        MemInfo(0, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(LLMParamError, match=r"addr must be a uint64 .*got -1"):
        MemInfo(Memtype.MEM_TYPE_DEVICE, -1, 1)
    with pytest.raises(LLMParamError, match=r"size must be a uint64 .*got -1"):
        MemInfo(Memtype.MEM_TYPE_DEVICE, 1, -1)
