"""What memory a tensor object describes, read through the protocols it offers.

``register_cache`` / ``register_blocks_cache`` take, per tensor, an int address or
an object; :func:`tensor_memory` reads an object's address, size, layout and
placement without importing any framework.  Protocols, first that applies wins:

1. the buffer protocol (numpy arrays, ``bytearray``, ``memoryview``);
2. ``__array_interface__`` (numpy-like);
3. ``__cuda_array_interface__`` (CUDA device memory: recognized, never read);
4. ``__dlpack__`` / ``__dlpack_device__`` (host tensors viewed with ``numpy.from_dlpack``);
5. ``data_ptr()`` with ``numel()``, ``element_size()``, ``is_contiguous()``, ``device``
   (``torch.Tensor`` style).

Nothing here dereferences an address: the caller refuses device memory and checks
the rest before anything is registered.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._enums import Placement

__all__ = ["TensorMemory", "tensor_memory"]

# DLPack device types that are host memory a CPU can address (kDLCPU, kDLCUDAHost pinned,
# kDLROCMHost pinned); every other type is device memory.
_DLPACK_HOST = {1: "cpu", 3: "cuda_host", 11: "rocm_host"}
_DLPACK_DEVICE = {
    2: "cuda",
    4: "opencl",
    7: "vulkan",
    8: "metal",
    9: "vpi",
    10: "rocm",
    13: "cuda_managed",
    14: "oneapi",
}
# What exporting a tensor through DLPack may raise (torch: a tensor that requires grad).
_EXPORT_ERRORS = (BufferError, RuntimeError, TypeError, ValueError)


@dataclass(frozen=True)
class TensorMemory:
    """The memory one tensor object describes.

    Attributes:
        addr: first byte (a device address when ``placement`` is DEVICE: never read).
        nbytes: bytes the object spans.
        placement: HOST or DEVICE.
        device: where it lives, e.g. ``"cpu"``, ``"cuda:0"``.
        contiguous: C-contiguous.
        writable: False when the object says it is read-only; None when unknowable.
        keep: what must stay referenced while the memory is registered.
        source: the protocol it was read through (for messages).
    """

    addr: int
    nbytes: int
    placement: Placement
    device: str
    contiguous: bool
    writable: bool | None
    keep: Any
    source: str


def tensor_memory(obj: object, name: str, *, export_device: bool = False) -> TensorMemory:
    """The memory of ``obj`` (an argument called ``name``), read as the module doc says.

    ``export_device``: read a DLPack device tensor's address and layout (its capsule is
    exported, and kept); otherwise such a tensor is only recognized (``addr`` 0), for a
    caller that refuses device memory without touching the tensor.

    Raises:
        TypeError: ``obj`` offers none of the protocols, or offers one incompletely.
    """
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        pass
    else:
        return _from_view(view)
    interface = getattr(obj, "__array_interface__", None)
    if interface is not None:
        return _from_array_interface(obj, interface, name)
    cuda = getattr(obj, "__cuda_array_interface__", None)
    if cuda is not None:
        return _from_cuda_interface(obj, cuda, name)
    fallback = ""
    if callable(getattr(obj, "__dlpack__", None)) and callable(
        getattr(obj, "__dlpack_device__", None)
    ):
        try:
            return _from_dlpack(obj, name, export_device)
        except _EXPORT_ERRORS as e:
            if not callable(getattr(obj, "data_ptr", None)):
                raise TypeError(f"{name}: DLPack export failed: {e}") from e
            fallback = f" (DLPack export failed: {e})"
    if callable(getattr(obj, "data_ptr", None)):
        return _from_data_ptr(obj, name, fallback)
    raise TypeError(
        f"{name} must be an int address or a tensor (buffer protocol, __array_interface__, "
        f"__cuda_array_interface__, __dlpack__, or data_ptr()), got {type(obj).__name__}"
    )


def _from_view(view: memoryview) -> TensorMemory:
    contiguous = view.c_contiguous
    flat = view.cast("B") if contiguous and (view.format != "B" or view.ndim != 1) else view
    addr = 0
    if contiguous and not view.readonly and view.nbytes:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(flat))
    return TensorMemory(
        addr, view.nbytes, Placement.HOST, "cpu", contiguous, not view.readonly, flat, "buffer"
    )


def _c_contiguous(shape: Sequence[int], strides: Sequence[int] | None, itemsize: int) -> bool:
    if strides is None or 0 in shape:
        return True
    expected = itemsize
    for extent, stride in zip(reversed(shape), reversed(strides), strict=True):
        if extent != 1 and stride != expected:  # a stride of a 1-long axis never matters
            return False
        expected *= extent
    return True


def _interface_layout(interface: Any, name: str, protocol: str) -> tuple[int, bool, int, bool]:
    """``(ptr, readonly, nbytes, contiguous)`` of an array interface dict."""
    try:
        ptr, readonly = interface["data"]
        shape = tuple(int(n) for n in interface["shape"])
        typestr = str(interface["typestr"])
        itemsize = int(typestr[2:])
        strides = interface.get("strides")
        if strides is not None:
            strides = tuple(int(s) for s in strides)
        ptr = int(ptr)
    except (KeyError, TypeError, ValueError) as e:
        raise TypeError(
            f"{name}: {protocol} must give 'data': (ptr, readonly), 'shape', 'typestr' "
            f"and 'strides' (None or ints), got {interface!r}"
        ) from e
    nbytes = math.prod(shape) * itemsize
    return ptr, bool(readonly), nbytes, _c_contiguous(shape, strides, itemsize)


def _from_array_interface(obj: object, interface: Any, name: str) -> TensorMemory:
    ptr, readonly, nbytes, contiguous = _interface_layout(interface, name, "__array_interface__")
    return TensorMemory(
        ptr, nbytes, Placement.HOST, "cpu", contiguous, not readonly, obj, "__array_interface__"
    )


def _from_cuda_interface(obj: object, interface: Any, name: str) -> TensorMemory:
    ptr, readonly, nbytes, contiguous = _interface_layout(
        interface, name, "__cuda_array_interface__"
    )
    # torch: device.index; CuPy: device.id; the interface itself names no device.
    device = getattr(obj, "device", None)
    index = getattr(device, "index", getattr(device, "id", None))
    label = f"cuda:{index}" if isinstance(index, int) else "cuda"
    return TensorMemory(
        ptr,
        nbytes,
        Placement.DEVICE,
        label,
        contiguous,
        not readonly,
        obj,
        "__cuda_array_interface__",
    )


def _from_dlpack(obj: Any, name: str, export_device: bool) -> TensorMemory:
    try:
        dev_type, dev_id = (int(x) for x in obj.__dlpack_device__())
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: __dlpack_device__() must return (type, id)") from e
    if dev_type not in _DLPACK_HOST:
        label = f"{_DLPACK_DEVICE.get(dev_type, f'dlpack-device-{dev_type}')}:{dev_id}"
        if not export_device:  # recognized only: nothing of the tensor is touched
            return TensorMemory(0, 0, Placement.DEVICE, label, True, None, obj, "__dlpack__")
        return _device_dlpack(obj, name, label)
    import numpy as np

    # A zero-copy view; it holds the exporter's capsule (and so the memory) alive.
    view = np.from_dlpack(obj)
    contiguous = bool(view.flags.c_contiguous)
    memory = _from_view(view.reshape(-1).view(np.uint8).data) if contiguous else None
    label = _DLPACK_HOST[dev_type] if dev_type == 1 else f"{_DLPACK_HOST[dev_type]}:{dev_id}"
    return TensorMemory(
        memory.addr if memory is not None else int(view.ctypes.data),
        int(view.nbytes),
        Placement.HOST,
        label,
        contiguous,
        bool(view.flags.writeable),
        view,
        "__dlpack__",
    )


class _DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _DLTensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = (ctypes.py_object, ctypes.c_char_p)


def _device_dlpack(obj: Any, name: str, label: str) -> TensorMemory:
    """A device tensor's address and layout, read from its DLPack capsule's ``DLTensor``.

    The struct lives in host memory; the device memory it points to is never touched.
    The capsule is not consumed: it is kept (with ``obj``) for as long as the memory is
    registered, and its own destructor releases the exporter's reference when dropped.
    """
    try:
        capsule = obj.__dlpack__()
    except _EXPORT_ERRORS as e:
        raise TypeError(f"{name}: DLPack export failed: {e}") from e
    if not _capsule_is_valid(capsule, b"dltensor"):
        raise TypeError(f"{name}: __dlpack__() did not return a 'dltensor' capsule")
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    ndim = int(t.ndim)
    if ndim < 0 or ndim > 64 or (ndim and not t.shape):
        raise TypeError(f"{name}: DLPack tensor with a malformed shape (ndim {ndim})")
    shape = [int(t.shape[i]) for i in range(ndim)]
    strides = [int(t.strides[i]) for i in range(ndim)] if t.strides else None
    bits, lanes = int(t.dtype.bits), int(t.dtype.lanes)
    itemsize = bits * lanes // 8
    if itemsize <= 0 or bits * lanes % 8 or any(n < 0 for n in shape):
        raise TypeError(f"{name}: DLPack tensor with an unsupported dtype or shape")
    contiguous = True
    if strides is not None:  # DLPack strides count elements, not bytes
        contiguous = _c_contiguous(shape, [s * itemsize for s in strides], itemsize)
    addr = int(t.data or 0) + int(t.byte_offset)
    nbytes = math.prod(shape) * itemsize
    return TensorMemory(
        addr, nbytes, Placement.DEVICE, label, contiguous, None, (obj, capsule), "__dlpack__"
    )


def _device_label(device: Any) -> str:
    kind = getattr(device, "type", device)
    index = getattr(device, "index", None)
    return f"{kind}:{index}" if index is not None else str(kind)


def _from_data_ptr(obj: Any, name: str, note: str) -> TensorMemory:
    needed = ("numel", "element_size", "is_contiguous")
    missing = [m for m in needed if not callable(getattr(obj, m, None))]
    if not hasattr(obj, "device"):
        missing.append("device")
    if missing:
        raise TypeError(
            f"{name}: a data_ptr() tensor must also have numel(), element_size(), "
            f"is_contiguous() and .device to be registered; {type(obj).__name__} lacks "
            f"{', '.join(missing)}{note}"
        )
    device = obj.device
    kind = str(getattr(device, "type", device))
    return TensorMemory(
        int(obj.data_ptr()),
        int(obj.numel()) * int(obj.element_size()),
        Placement.HOST if kind == "cpu" else Placement.DEVICE,
        "cpu" if kind == "cpu" else _device_label(device),
        bool(obj.is_contiguous()),
        None,
        obj,
        "data_ptr()",
    )
