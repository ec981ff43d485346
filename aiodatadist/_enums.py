"""Upstream's enums: roles, placements, memory kinds and element types.

Public through :mod:`aiodatadist.types`, which re-exports every name and gives
each class its public ``__module__``.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from ._validate import raise_param_error

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["DataType", "LLMRole", "Memtype", "Placement", "RegisterMemStatus"]


class LLMRole(enum.IntEnum):
    """Role of an ``LLMDataDist``: ``PROMPT`` (prefill), ``DECODER`` or ``MIX`` (both).

    Unlike upstream's cache-manager mode, the role restricts two calls: ``pull_blocks``
    and ``pull_cache`` need ``DECODER`` or ``MIX``, ``transfer_cache_async`` needs
    ``PROMPT`` or ``MIX`` (otherwise ``LLMException(LLM_FAILED)``).
    """

    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class Placement(enum.IntEnum):
    """Where a cache lives."""

    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class RegisterMemStatus(enum.Enum):
    """State of the memory exchange after a two-sided ``link``.

    Looking up an unknown integer gives ``FAILED``, as upstream maps unknown
    native values.
    """

    OK = 0
    PREPARING = 1
    FAILED = 2

    @classmethod
    def _missing_(cls, value: object) -> RegisterMemStatus | None:
        if isinstance(value, int) and not isinstance(value, bool):
            return cls.FAILED
        return None


class Memtype(enum.Enum):
    """Memory kind of a :class:`MemInfo`."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


# Per-member facts kept outside the Enum body so they do not become members.
_ITEMSIZE: dict[str, int] = {
    "DT_FLOAT": 4,
    "DT_FLOAT16": 2,
    "DT_INT8": 1,
    "DT_INT32": 4,
    "DT_UINT8": 1,
    "DT_INT16": 2,
    "DT_UINT16": 2,
    "DT_UINT32": 4,
    "DT_INT64": 8,
    "DT_UINT64": 8,
    "DT_DOUBLE": 8,
    "DT_BOOL": 1,
    "DT_BF16": 2,
}
_NUMPY_NAME: dict[str, str] = {
    "DT_FLOAT": "float32",
    "DT_FLOAT16": "float16",
    "DT_INT8": "int8",
    "DT_INT32": "int32",
    "DT_UINT8": "uint8",
    "DT_INT16": "int16",
    "DT_UINT16": "uint16",
    "DT_UINT32": "uint32",
    "DT_INT64": "int64",
    "DT_UINT64": "uint64",
    "DT_DOUBLE": "float64",
    "DT_BOOL": "bool",
    "DT_BF16": "uint16",  # numpy has no bfloat16: a 2-byte stand-in with the same size
}
_FROM_NUMPY_NAME: dict[str, str] = {
    np_name: dt for dt, np_name in _NUMPY_NAME.items() if dt != "DT_BF16"
} | {"bfloat16": "DT_BF16"}


class DataType(enum.Enum):
    """Element type of a cache tensor; values are GE ``ge::DataType`` ids."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27

    @property
    def itemsize(self) -> int:
        """Bytes per element.

        Raises:
            LLMParamError: for ``DT_STRING``, which has no fixed size.
        """
        size = _ITEMSIZE.get(self.name)
        if size is None:
            raise_param_error(f"{self} has no fixed item size")
        return size

    def to_numpy(self) -> np.dtype[Any]:
        """Return the numpy dtype for this type.

        ``DT_BF16`` maps to ``uint16``: numpy has no bfloat16, and the byte
        layout is what matters for moving data.  Reinterpret the array (for
        example with ``ml_dtypes.bfloat16``) to compute with it.

        Raises:
            LLMParamError: for ``DT_STRING``.
        """
        import numpy as np

        name = _NUMPY_NAME.get(self.name)
        if name is None:
            raise_param_error(f"{self} has no numpy equivalent")
        return np.dtype(name)

    @classmethod
    def from_numpy(cls, dtype: npt.DTypeLike) -> DataType:
        """Return the :class:`DataType` for a numpy dtype (or anything ``np.dtype()`` accepts).

        ``uint16`` gives ``DT_UINT16``; a registered ``bfloat16`` dtype (such
        as ``ml_dtypes.bfloat16``) gives ``DT_BF16``.

        Raises:
            TypeError: ``dtype`` is not understood by numpy.
            LLMParamError: the dtype has no :class:`DataType` (e.g. ``complex64``)
                or is not in native byte order.
        """
        import numpy as np

        try:
            dt = np.dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"dtype must be a numpy dtype, got {dtype!r}") from exc
        name = _FROM_NUMPY_NAME.get(dt.name)
        if name is None or not dt.isnative:
            raise_param_error(f"dtype {dt!r} has no DataType equivalent")
        return cls[name]
