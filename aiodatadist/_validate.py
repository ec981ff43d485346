"""Argument checks shared by the public classes and the engine.

Conventions (upstream's, tightened):

* a value of the wrong Python type raises :class:`TypeError` naming the
  argument and the type received; ``bool`` is never accepted where an ``int``
  is expected;
* a value of the right type that is out of range or otherwise invalid raises
  :class:`~aiodatadist.errors.LLMParamError`, which is both an
  ``LLMException(LLM_PARAM_INVALID)`` and a :class:`ValueError`, with a message
  that names the argument and shows the bad value.

Every checker returns the value it accepted, normalized (a ``list`` for
sequences), so callers can write ``self._ids = check_int_list("ids", ids)``.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Sequence
from typing import Any, Literal, NoReturn, overload

from .errors import (
    API_CONTEXT,
    API_CONTEXT_NONE,
    LLMException,
    LLMParamError,
    LLMStatusCode,
    format_error,
)

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "INT64_MAX",
    "INT64_MIN",
    "INVALID_ID",
    "MAX_IDS",
    "MAX_TIMEOUT_S",
    "UINT16_MAX",
    "UINT32_MAX",
    "UINT64_MAX",
    "check_bool",
    "check_int",
    "check_int_list",
    "check_layer_range",
    "check_sint",
    "check_str",
    "check_timeout",
    "check_type",
    "check_uint",
    "raise_param_error",
    "require",
    "type_name",
]

UINT16_MAX = 2**16 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INVALID_ID = UINT64_MAX
"""Upstream's "no id" marker for ``req_id`` / ``prefix_id`` (``2**64 - 1``)."""
MAX_IDS = 1 << 22
"""The most ids one list may hold when the caller knows no tighter bound (a cache's
``num_blocks`` usually is one): a longer one is refused before anything is allocated."""
MAX_TIMEOUT_S = INT32_MAX / 1000
"""The longest timeout in seconds (about 24.8 days): deadlines travel as int32 ms."""


def type_name(value: object) -> str:
    """Return the name of ``value``'s type, for messages."""
    return type(value).__name__


def _message(message: str, status_code: LLMStatusCode) -> str:
    # Inside a public call, upstream's shape ("[pull_blocks] failed, error code is
    # LLMStatusCode.LLM_PARAM_INVALID, <message>."): clients match on it. Outside one (a
    # CacheDesc, an LLMConfig attribute), the plain message, as upstream's raise_if_false.
    api = API_CONTEXT.get()
    return message if api == API_CONTEXT_NONE else format_error(api, status_code, message)


def raise_param_error(message: str) -> NoReturn:
    """Raise :class:`LLMParamError` (``LLM_PARAM_INVALID``, a ``ValueError``) with ``message``
    (in upstream's "[api] failed, error code is ..." shape inside a public call)."""
    raise LLMParamError(_message(message, LLMStatusCode.LLM_PARAM_INVALID))


def require(
    condition: bool,
    message: str,
    status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID,
) -> None:
    """Raise ``LLMException(message, status_code=status_code)`` unless ``condition`` holds.

    Upstream's ``raise_if_false``.  The exception is the subclass that
    ``status_code`` selects (:class:`LLMParamError` by default).

    Raises:
        LLMException: ``condition`` is false.
    """
    if not condition:
        raise LLMException(_message(message, status_code), status_code=status_code)


def _is_bool(value: object) -> bool:
    if isinstance(value, bool):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.bool_)


def _as_int(name: str, value: object) -> int:
    """``value`` as a plain ``int``: an ``int`` or anything with ``__index__`` (numpy
    integer scalars, 0-d integer arrays), never a ``bool`` (Python's or numpy's)."""
    if type(value) is int:
        return value
    if not _is_bool(value):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise TypeError(f"{name} must be int, got {type_name(value)}")


def check_type(name: str, value: object, types: type | tuple[type, ...]) -> None:
    """Check that ``value`` is an instance of ``types``.

    ``bool`` does not count as ``int`` unless ``bool`` itself is listed.

    Raises:
        TypeError: ``value`` is not an instance, e.g.
            ``TypeError: cache_desc must be CacheDesc, got dict``.
    """
    allowed = types if isinstance(types, tuple) else (types,)
    ok = isinstance(value, allowed)
    if ok and isinstance(value, bool) and bool not in allowed:
        ok = False
    if not ok:
        expected = " or ".join(t.__name__ for t in allowed)
        raise TypeError(f"{name} must be {expected}, got {type_name(value)}")


def check_bool(name: str, value: object) -> bool:
    """Check that ``value`` is a ``bool``.

    Raises:
        TypeError: ``value`` is not a ``bool`` (``0``/``1`` included).
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be bool, got {type_name(value)}")
    return value


def check_str(name: str, value: object, *, allow_empty: bool = True) -> str:
    """Check that ``value`` is a ``str`` (non-empty unless ``allow_empty``).

    Raises:
        TypeError: ``value`` is not a ``str``.
        LLMParamError: ``value`` is empty and ``allow_empty`` is false.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, got {type_name(value)}")
    if not allow_empty and not value:
        raise_param_error(f"{name} must not be empty")
    return value


def _range_text(min_value: int | None, max_value: int | None) -> str:
    if min_value is not None and max_value is not None:
        return f"in [{min_value}, {max_value}]"
    if min_value is not None:
        return f">= {min_value}"
    return f"<= {max_value}"


def check_int(
    name: str,
    value: object,
    *,
    min_value: int | None = None,
    max_value: int | None = None,
) -> int:
    """Check that ``value`` is an ``int`` within ``[min_value, max_value]``.

    Either bound may be ``None`` (unbounded).

    Raises:
        TypeError: ``value`` is not an ``int`` (``bool`` included).
        LLMParamError: ``value`` is out of range, e.g.
            ``link_retry_count must be in [1, 100], got 0``.
    """
    value = _as_int(name, value)
    if (min_value is not None and value < min_value) or (
        max_value is not None and value > max_value
    ):
        raise_param_error(f"{name} must be {_range_text(min_value, max_value)}, got {value}")
    return value


def check_uint(name: str, value: object, bits: int = 64) -> int:
    """Check that ``value`` is an unsigned integer of ``bits`` bits.

    Raises:
        TypeError: ``value`` is not an ``int`` (``bool`` included).
        LLMParamError: ``value`` is out of range, e.g.
            ``req_id must be a uint64 in [0, 18446744073709551615], got -1``.
    """
    value = _as_int(name, value)
    max_value = (1 << bits) - 1
    if not 0 <= value <= max_value:
        raise_param_error(f"{name} must be a uint{bits} in [0, {max_value}], got {value}")
    return value


def check_sint(name: str, value: object, bits: int = 64) -> int:
    """Check that ``value`` is a signed integer of ``bits`` bits.

    Raises:
        TypeError: ``value`` is not an ``int`` (``bool`` included).
        LLMParamError: ``value`` is out of range, e.g.
            ``cache_id must be an int64 in [-9223372036854775808, 9223372036854775807], got ...``.
    """
    value = _as_int(name, value)
    min_value, max_value = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if not min_value <= value <= max_value:
        raise_param_error(f"{name} must be an int{bits} in [{min_value}, {max_value}], got {value}")
    return value


def check_int_list(
    name: str,
    values: object,
    *,
    bits: int = 64,
    signed: bool = False,
    allow_empty: bool = True,
    max_len: int = MAX_IDS,
    min_value: int | None = None,
    max_value: int | None = None,
) -> list[int]:
    """Check a sequence of integers of ``bits`` bits (ids, block ids, addresses).

    Accepted: a ``list``, ``tuple`` or ``range``, a 1-D integer numpy array, or another
    sequence (not ``str``/bytes); each element an ``int`` or anything with ``__index__``
    (numpy integer scalars), never a ``bool`` (Python's or numpy's). The length is
    checked against ``max_len`` before anything is iterated or allocated, so a hostile
    ``range(10**12)`` costs nothing.

    Args:
        name: Argument name for messages; elements are named ``name[i]``.
        values: The sequence to check.
        bits: Width of each element.
        signed: Whether elements are signed (``intN``) or unsigned (``uintN``).
        allow_empty: Whether an empty sequence is accepted.
        max_len: The most elements accepted.
        min_value, max_value: Tighter bounds on each element than ``bits`` gives
            (e.g. ``max_value=num_blocks - 1`` for block ids of a known cache).

    Returns:
        A new ``list`` of plain ``int``.

    Raises:
        TypeError: ``values`` is not such a sequence (a set, a str, a float or bool
            array, a 2-D array), or an element is not an integer (``bool`` included).
        LLMParamError: it is longer than ``max_len``, an element is out of range, or the
            sequence is empty and ``allow_empty`` is false.
    """
    if signed:
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    else:
        lo, hi = 0, (1 << bits) - 1
    if min_value is not None:
        lo = max(lo, min_value)
    if max_value is not None:
        hi = min(hi, max_value)
    np = sys.modules.get("numpy")
    is_array = np is not None and isinstance(values, np.ndarray)
    if is_array:
        assert np is not None
        arr: Any = values
        if arr.ndim != 1:
            raise TypeError(f"{name} must be a 1-D array of int, got a {arr.ndim}-D array")
        if arr.dtype.kind not in "iuO":
            raise TypeError(f"{name} must hold integers, got an array of {arr.dtype}")
    elif not isinstance(values, (list, tuple, range)) and (
        not isinstance(values, Sequence) or isinstance(values, (str, bytes, bytearray))
    ):
        raise TypeError(
            f"{name} must be list or tuple of int, got {type_name(values)} "
            "(a range or a 1-D integer numpy array also do)"
        )
    try:
        n = len(values)  # type: ignore[arg-type]
    except OverflowError:  # a range longer than sys.maxsize
        n = sys.maxsize
    if n > max_len:
        raise_param_error(f"{name} holds {n} ids, more than the {max_len} allowed")
    if n == 0:
        if not allow_empty:
            raise_param_error(f"{name} must not be empty")
        return []
    items: list[int]
    if is_array and arr.dtype.kind in "iu":
        if int(arr.min()) < lo or int(arr.max()) > hi:
            items = arr.tolist()
        else:
            return list(arr.tolist())
    elif isinstance(values, range):
        items = list(values)  # n <= max_len: bounded
    elif isinstance(values, (list, tuple)) and all(type(v) is int for v in values):
        items = list(values)
    else:
        items = []
        seq: Sequence[object] = values  # type: ignore[assignment]
        for i, v in enumerate(seq):
            if i >= n:  # a sequence that grows while it is read
                raise_param_error(f"{name} changed length while it was read")
            items.append(_as_int(f"{name}[{i}]", v))
    if min(items) < lo or max(items) > hi:
        for i, v in enumerate(items):
            if not lo <= v <= hi:
                if min_value is None and max_value is None:
                    kind = f"an int{bits}" if signed else f"a uint{bits}"
                    raise_param_error(f"{name}[{i}] must be {kind} in [{lo}, {hi}], got {v}")
                raise_param_error(f"{name}[{i}] must be in [{lo}, {hi}], got {v}")
    return items


def check_timeout(name: str, value: object, *, allow_none: bool = True) -> float | None:
    """Check a timeout in seconds: a finite real number in ``(0, MAX_TIMEOUT_S]``.

    Raises:
        TypeError: not a real number (``bool`` included), or None when not allowed.
        LLMParamError: NaN, infinite, <= 0 or longer than ``MAX_TIMEOUT_S``.
    """
    if value is None and allow_none:
        return None
    np = sys.modules.get("numpy")
    real = isinstance(value, (int, float)) or (
        np is not None and isinstance(value, (np.integer, np.floating))
    )
    if not real or _is_bool(value):
        expected = "a number of seconds or None" if allow_none else "a number of seconds"
        raise TypeError(f"{name} must be {expected}, got {type_name(value)}")
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if not math.isfinite(seconds):
        raise_param_error(f"{name} must be a finite number of seconds, got {value}")
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise_param_error(f"{name} must be > 0 and <= {MAX_TIMEOUT_S} seconds, got {value}")
    return seconds


@overload
def check_layer_range(name: str, value: object, *, allow_none: Literal[False] = ...) -> range: ...
@overload
def check_layer_range(name: str, value: object, *, allow_none: bool) -> range | None: ...
def check_layer_range(name: str, value: object, *, allow_none: bool = False) -> range | None:
    """Check a layer range: a ``range`` with step 1 and ``0 <= start < stop``.

    Raises:
        TypeError: ``value`` is not a ``range`` (or ``None`` when
            ``allow_none``).
        LLMParamError: the step is not 1 or the bounds are wrong, e.g.
            ``src_layer_range must have step 1, got range(0, 4, 2)``.
    """
    if value is None and allow_none:
        return None
    if not isinstance(value, range):
        expected = "range or None" if allow_none else "range"
        raise TypeError(f"{name} must be {expected}, got {type_name(value)}")
    if value.step != 1:
        raise_param_error(f"{name} must have step 1, got {value!r}")
    if not 0 <= value.start < value.stop:
        raise_param_error(f"{name} must satisfy 0 <= start < stop, got {value!r}")
    return value
