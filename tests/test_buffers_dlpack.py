"""DLPack device tensors: their address and layout read from the capsule's ``DLTensor``.

The tensor below claims CUDA memory at an address nothing maps: reading it would crash
the test process, so a pass also shows the memory itself is never touched.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from aiodatadist._buffers import _DLTensor, tensor_memory
from aiodatadist.types import Placement

_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)

FAKE_DEVICE_ADDR = 0xDEAD_0000_0000


class DeviceDLPack:
    """A CUDA tensor as DLPack exporters describe it (the struct in host memory)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        bits: int = 16,
        strides: tuple[int, ...] | None = None,
        offset: int = 0,
        device: tuple[int, int] = (2, 3),
    ) -> None:
        self.device = device
        self.exported = 0
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = (ctypes.c_int64 * len(strides))(*strides) if strides else None
        t = _DLTensor()
        t.data = FAKE_DEVICE_ADDR
        t.device.device_type, t.device.device_id = device
        t.ndim = len(shape)
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, bits, 1
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        if self._strides is not None:
            t.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = offset
        self._tensor = t  # a DLManagedTensor starts with its DLTensor

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.exported += 1
        return _new_capsule(ctypes.addressof(self._tensor), b"dltensor", None)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def test_device_tensor_is_only_recognized_unless_exporting_is_asked_for() -> None:
    obj = DeviceDLPack((4, 128, 8))
    mem = tensor_memory(obj, "addrs[0]")
    assert (mem.placement, mem.device, mem.addr) == (Placement.DEVICE, "cuda:3", 0)
    assert obj.exported == 0  # refused without touching the tensor


def test_device_tensor_address_and_size_come_from_the_dltensor() -> None:
    obj = DeviceDLPack((4, 128, 8), offset=256)
    mem = tensor_memory(obj, "addrs[0]", export_device=True)
    assert mem.placement is Placement.DEVICE
    assert mem.device == "cuda:3"
    assert mem.addr == FAKE_DEVICE_ADDR + 256
    assert mem.nbytes == 4 * 128 * 8 * 2
    assert mem.contiguous
    assert obj.exported == 1
    assert obj in mem.keep  # the exporter (and its capsule) stay referenced


@pytest.mark.parametrize(
    ("strides", "contiguous"),
    [((1024, 8, 1), True), ((2048, 8, 1), False), ((1, 4, 512), False)],
)
def test_device_tensor_strides_count_elements(strides: tuple[int, ...], contiguous: bool) -> None:
    obj = DeviceDLPack((4, 128, 8), strides=strides)
    assert tensor_memory(obj, "t", export_device=True).contiguous is contiguous


def test_a_malformed_device_tensor_is_a_type_error() -> None:
    obj = DeviceDLPack((4, 128, 8), bits=0)
    with pytest.raises(TypeError, match="unsupported dtype"):
        tensor_memory(obj, "t", export_device=True)
