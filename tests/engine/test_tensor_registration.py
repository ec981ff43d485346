"""Registering caches from tensor objects, without a framework: the buffer protocol,
``__array_interface__``, ``__dlpack__``, torch-style ``data_ptr()``; device memory refused.

The wrappers below expose one protocol each over a numpy array (which the test keeps
alive or hands to the registration), so each protocol path is the only way in. Every
accepted registration is proven by pulling pattern bytes through it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMParamError,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import Pair, inproc_pair
from aiodatadist.testing.patterns import fill_pattern, pattern_mismatches

pytestmark = pytest.mark.asyncio

SHAPE = [8, 32, 4, 16]  # 8 blocks of 4 KiB (fp16)
N = 3


def _desc(shape: list[int] | None = None) -> CacheDesc:
    return CacheDesc(N, shape or SHAPE, DataType.DT_FLOAT16, Placement.HOST)


class ArrayInterfaceOnly:
    """Exposes only ``__array_interface__`` (no buffer protocol, no DLPack)."""

    def __init__(self, array: np.ndarray, *, hold: bool = True, **override: Any) -> None:
        self.__array_interface__ = {**array.__array_interface__, **override}
        self.array = array if hold else None


class CudaArrayInterfaceOnly:
    """A CUDA array as CuPy/Numba expose it; the pointer is never dereferenced."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": (nbytes // 2,),
            "typestr": "<f2",
            "strides": None,
            "version": 3,
        }


class DLPackOnly:
    """Exposes only ``__dlpack__`` / ``__dlpack_device__`` (delegating to numpy's)."""

    def __init__(self, array: np.ndarray, device: tuple[int, int] | None = None) -> None:
        self.array = array
        self.device = device

    def __dlpack__(self, **kwargs: Any) -> Any:
        if self.device is not None:
            raise AssertionError("a device tensor must not be exported")
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device or self.array.__dlpack_device__()


class PinnedDLPack(DLPackOnly):
    """Reports kDLCUDAHost (pinned host memory, which the CPU addresses directly)."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (3, 0)


class FakeDevice:
    def __init__(self, type: str, index: int | None = None) -> None:
        self.type = type
        self.index = index


class TorchLike:
    """``torch.Tensor``'s registration surface over a numpy array (no other protocol)."""

    def __init__(
        self, array: np.ndarray, device: FakeDevice | None = None, *, numel: int | None = None
    ) -> None:
        self.array = array
        self.device = device or FakeDevice("cpu")
        self._numel = array.size if numel is None else numel

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return int(self.array.itemsize)

    def is_contiguous(self) -> bool:
        return bool(self.array.flags.c_contiguous)


class DataPtrOnly:
    """``data_ptr()`` and nothing to size it with: refused."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)


class ExportFails(DLPackOnly):
    """DLPack export that raises (torch: a tensor that requires grad)."""

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise RuntimeError("Can't export tensors that require gradient")


WRAP: dict[str, Callable[[np.ndarray], Any]] = {
    "ndarray": lambda a: a,
    "array_interface": ArrayInterfaceOnly,
    "dlpack": DLPackOnly,
    "dlpack_pinned": PinnedDLPack,
    "data_ptr": TorchLike,
}


def _wrap(kind: str, arrays: list[np.ndarray]) -> list[Any]:
    if kind == "mixed":  # one cache, a different protocol per tensor
        kinds = ["array_interface", "dlpack", "data_ptr"]
        return [WRAP[k](a) for k, a in zip(kinds, arrays, strict=True)]
    return [WRAP[kind](a) for a in arrays]


def _arrays(shape: list[int] | None = None) -> list[np.ndarray]:
    return [np.zeros(shape or SHAPE, np.float16) for _ in range(N)]


def _only_protocol(obj: Any, kind: str) -> None:
    """The wrapper offers no protocol that comes earlier than ``kind``."""
    if kind in ("ndarray", "mixed"):
        return
    with pytest.raises(TypeError):
        memoryview(obj)
    if kind != "array_interface":
        assert not hasattr(obj, "__array_interface__")
    if kind == "data_ptr":
        assert not hasattr(obj, "__dlpack__")


# ------------------------------------------------------------------ pulls


@pytest.mark.parametrize(
    ("kind", "seed"),
    [
        ("ndarray", 1101),
        ("array_interface", 1102),
        ("dlpack", 1103),
        ("dlpack_pinned", 1106),
        ("data_ptr", 1104),
        ("mixed", 1105),
    ],
)
async def test_pull_between_caches_registered_from_tensors(
    pair: Pair, kind: str, seed: int
) -> None:
    src_arrays, dst_arrays = _arrays(), _arrays()
    fill_pattern(src_arrays, seed)
    src_objs, dst_objs = _wrap(kind, src_arrays), _wrap(kind, dst_arrays)
    for obj in (*src_objs, *dst_objs):
        _only_protocol(obj, kind)
    src = pair.prompt.cache_manager.register_blocks_cache(_desc(), src_objs, BlocksCacheKey(1, 0))
    dst = pair.decoder.cache_manager.register_blocks_cache(_desc(), dst_objs)
    # The cache is the tensors' own memory, not a copy.
    assert src.tensor_addrs == [int(a.ctypes.data) for a in src_arrays]
    assert dst.tensor_addrs == [int(a.ctypes.data) for a in dst_arrays]

    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst, [6, 1, 3], [0, 5, 7])

    assert pattern_mismatches(dst_arrays, [6, 1, 3], [0, 5, 7], seed) == []
    for d in dst_arrays:  # blocks not pulled stay zero
        assert not d[[1, 2, 3, 4, 6]].view(np.uint8).any()
    views = dst.tensors()
    assert [v.ctypes.data for v in views] == [a.ctypes.data for a in dst_arrays]
    assert pattern_mismatches(views, [6, 1, 3], [0, 5, 7], seed) == []


@pytest.mark.parametrize("data_path", ["cma", "tcp"])
async def test_tensor_caches_over_cross_process_paths(data_path: str) -> None:
    seed = 1110 if data_path == "cma" else 1111
    async with inproc_pair(data_path=data_path) as pair:
        src_arrays, dst_arrays = _arrays(), _arrays()
        fill_pattern(src_arrays, seed)
        pair.prompt.cache_manager.register_blocks_cache(
            _desc(), [TorchLike(a) for a in src_arrays], BlocksCacheKey(1, 0)
        )
        dst = pair.decoder.cache_manager.register_blocks_cache(
            _desc(), [DLPackOnly(a) for a in dst_arrays]
        )
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst, [2, 7], [4, 0])
        assert pattern_mismatches(dst_arrays, [2, 7], [4, 0], seed) == []


async def test_register_cache_rows_from_tensors(pair: Pair) -> None:
    seed = 1120
    desc = CacheDesc(2, [4, 2048], DataType.DT_FLOAT16, Placement.HOST)
    src_arrays = [np.zeros([4, 2048], np.float16) for _ in range(2)]
    fill_pattern(src_arrays, seed)
    pair.prompt.cache_manager.register_cache(
        desc, [ArrayInterfaceOnly(a) for a in src_arrays], [CacheKey(1, 40), CacheKey(1, 41)]
    )
    dst_arrays = [np.zeros([4, 2048], np.float16) for _ in range(2)]
    dst = pair.decoder.cache_manager.register_cache(desc, [TorchLike(a) for a in dst_arrays])
    await pair.decoder.cache_manager.pull_cache(CacheKey(1, 41), dst, batch_index=2)
    assert pattern_mismatches(dst_arrays, [1], [2], seed) == []
    assert not dst_arrays[0][[0, 1, 3]].any()


@pytest.mark.parametrize("kind", ["array_interface", "dlpack", "data_ptr"])
async def test_registration_keeps_the_tensor_alive(pair: Pair, kind: str) -> None:
    seed = {"array_interface": 1131, "dlpack": 1132, "data_ptr": 1133}[kind]
    src_arrays = _arrays()
    fill_pattern(src_arrays, seed)
    # The registration holds the only reference to these wrappers (and their arrays).
    pair.prompt.cache_manager.register_blocks_cache(
        _desc(), _wrap(kind, [a.copy() for a in src_arrays]), BlocksCacheKey(1, 0)
    )
    dst = pair.decoder.cache_manager.register_blocks_cache(_desc(), _wrap(kind, _arrays()))
    gc.collect()
    # Memory freed too early would be reused (and overwritten) by these allocations.
    junk = [np.full(SHAPE, 7, np.float16) for _ in range(2 * N)]
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst, [4, 0], [4, 0])
    assert pattern_mismatches(dst.tensors(), [4, 0], [4, 0], seed) == []
    del junk


# ---------------------------------------------------------------- refusals


def _bad(case: str, good: np.ndarray) -> tuple[Any, type[BaseException], str]:
    """(bad tensor object, expected exception, message fragment)."""
    n = int(np.prod(SHAPE))
    strided = np.zeros([16, *SHAPE[1:]], np.float16)[::2]
    readonly = np.zeros(SHAPE, np.float16)
    readonly.setflags(write=False)
    small = np.zeros(n - 1, np.float16)
    table: dict[str, tuple[Any, type[BaseException], str]] = {
        "ai-non-contiguous": (ArrayInterfaceOnly(strided), LLMParamError, "not C-contiguous"),
        "ai-read-only": (ArrayInterfaceOnly(readonly), LLMParamError, "read-only"),
        "ai-too-small": (ArrayInterfaceOnly(small), LLMParamError, f"holds {(n - 1) * 2} bytes"),
        "ai-null": (ArrayInterfaceOnly(good, data=(0, False)), LLMParamError, "null address"),
        "ai-malformed": (ArrayInterfaceOnly(good, data=None), TypeError, "__array_interface__"),
        "dlpack-non-contiguous": (DLPackOnly(strided), LLMParamError, "not C-contiguous"),
        "dlpack-read-only": (DLPackOnly(readonly), LLMParamError, "read-only"),
        "dlpack-too-small": (DLPackOnly(small), LLMParamError, "cache_desc needs"),
        "dlpack-cuda": (
            DLPackOnly(good, device=(2, 0)),
            LLMParamError,
            "device memory (cuda:0) needs a fabric data path that moves it (NIXL",
        ),
        "dlpack-rocm": (DLPackOnly(good, device=(10, 1)), LLMParamError, "device memory (rocm:1)"),
        "dlpack-export-fails": (ExportFails(good), TypeError, "DLPack export failed"),
        "cuda-array-interface": (
            CudaArrayInterfaceOnly(0xDEAD0000, n * 2),
            LLMParamError,
            "device memory (cuda) needs a fabric data path",
        ),
        "torch-non-contiguous": (TorchLike(strided), LLMParamError, "not C-contiguous"),
        "torch-too-small": (TorchLike(good, numel=n - 1), LLMParamError, "cache_desc needs"),
        "torch-cuda": (
            TorchLike(good, FakeDevice("cuda", 0)),
            LLMParamError,
            "device memory (cuda:0) needs a fabric data path",
        ),
        "data-ptr-only": (DataPtrOnly(good), TypeError, "numel, element_size, is_contiguous"),
        "mixed-int": (good.ctypes.data, TypeError, "got a mix"),
        "not-a-tensor": (object(), TypeError, "must be an int address or a tensor"),
    }
    return table[case]


BAD_CASES = [
    "ai-non-contiguous",
    "ai-read-only",
    "ai-too-small",
    "ai-null",
    "ai-malformed",
    "dlpack-non-contiguous",
    "dlpack-read-only",
    "dlpack-too-small",
    "dlpack-cuda",
    "dlpack-rocm",
    "dlpack-export-fails",
    "cuda-array-interface",
    "torch-non-contiguous",
    "torch-too-small",
    "torch-cuda",
    "data-ptr-only",
    "mixed-int",
    "not-a-tensor",
]


@pytest.mark.parametrize("case", BAD_CASES)
async def test_bad_tensors_are_refused_before_anything_changes(pair: Pair, case: str) -> None:
    cm = pair.decoder.cache_manager
    good = _arrays()
    bad, exc, fragment = _bad(case, np.zeros(SHAPE, np.float16))
    wrapped = [ArrayInterfaceOnly(good[0]), TorchLike(good[1]), bad]
    for register in (cm.register_blocks_cache, cm.register_cache):
        with pytest.raises(exc) as info:
            register(_desc(), wrapped)
        assert fragment in str(info.value)
        assert "addrs[2]" in str(info.value)
        if isinstance(info.value, LLMParamError):
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    # Nothing was registered: the same good memory registers now (an overlap would refuse).
    cache = cm.register_blocks_cache(_desc(), [ArrayInterfaceOnly(a) for a in good])
    assert isinstance(cache, KvCache)
    assert cache.tensor_addrs == [int(a.ctypes.data) for a in good]


async def test_torch_cpu_tensors(pair: Pair) -> None:
    torch = pytest.importorskip("torch")
    seed = 1140
    src = [torch.zeros(SHAPE, dtype=torch.float16) for _ in range(N)]
    fill_pattern([t.numpy() for t in src], seed)
    # A tensor that requires grad cannot be exported through DLPack: data_ptr() is used.
    dst = [torch.zeros(SHAPE, dtype=torch.float16).requires_grad_() for _ in range(N)]
    pair.prompt.cache_manager.register_blocks_cache(_desc(), src, BlocksCacheKey(1, 0))
    cache = pair.decoder.cache_manager.register_blocks_cache(_desc(), dst)
    assert cache.tensor_addrs == [t.data_ptr() for t in dst]
    await pair.decoder.cache_manager.pull_blocks(pair.key(), cache, [5, 2], [1, 6])
    assert pattern_mismatches([t.detach().numpy() for t in dst], [5, 2], [1, 6], seed) == []
