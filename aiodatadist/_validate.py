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

from typing import Literal, NoReturn, overload

from .errors import LLMException, LLMParamError, LLMStatusCode

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "INT64_MAX",
    "INT64_MIN",
    "INVALID_ID",
    "UINT16_MAX",
    "UINT32_MAX",
    "UINT64_MAX",
    "check_bool",
    "check_int",
    "check_int_list",
    "check_layer_range",
    "check_sint",
    "check_str",
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


def type_name(value: object) -> str:
    """Return the name of ``value``'s type, for messages."""
    return type(value).__name__


def raise_param_error(message: str) -> NoReturn:
    """Raise :class:`LLMParamError` (``LLM_PARAM_INVALID``, a ``ValueError``) with ``message``."""
    raise LLMParamError(message)


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
        raise LLMException(message, status_code=status_code)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    if not _is_int(value):
        raise TypeError(f"{name} must be int, got {type_name(value)}")
    assert isinstance(value, int)
    if (min_value is not None and value < min_value) or (
        max_value is not None and value > max_value
    ):
        raise_param_error(f"{name} must be {_range_text(min_value, max_value)}, got {value}")
    return int(value)


def check_uint(name: str, value: object, bits: int = 64) -> int:
    """Check that ``value`` is an unsigned integer of ``bits`` bits.

    Raises:
        TypeError: ``value`` is not an ``int`` (``bool`` included).
        LLMParamError: ``value`` is out of range, e.g.
            ``req_id must be a uint64 in [0, 18446744073709551615], got -1``.
    """
    if not _is_int(value):
        raise TypeError(f"{name} must be int, got {type_name(value)}")
    assert isinstance(value, int)
    max_value = (1 << bits) - 1
    if not 0 <= value <= max_value:
        raise_param_error(f"{name} must be a uint{bits} in [0, {max_value}], got {value}")
    return int(value)


def check_sint(name: str, value: object, bits: int = 64) -> int:
    """Check that ``value`` is a signed integer of ``bits`` bits.

    Raises:
        TypeError: ``value`` is not an ``int`` (``bool`` included).
        LLMParamError: ``value`` is out of range, e.g.
            ``cache_id must be an int64 in [-9223372036854775808, 9223372036854775807], got ...``.
    """
    if not _is_int(value):
        raise TypeError(f"{name} must be int, got {type_name(value)}")
    assert isinstance(value, int)
    min_value, max_value = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if not min_value <= value <= max_value:
        raise_param_error(f"{name} must be an int{bits} in [{min_value}, {max_value}], got {value}")
    return int(value)


def check_int_list(
    name: str,
    values: object,
    *,
    bits: int = 64,
    signed: bool = False,
    allow_empty: bool = True,
) -> list[int]:
    """Check a ``list``/``tuple``/``range`` of integers of ``bits`` bits.

    Args:
        name: Argument name for messages; elements are named ``name[i]``.
        values: The sequence to check.
        bits: Width of each element.
        signed: Whether elements are signed (``intN``) or unsigned (``uintN``).
        allow_empty: Whether an empty sequence is accepted.

    Returns:
        A new ``list`` of plain ``int``.

    Raises:
        TypeError: ``values`` is not a list, tuple or range, or an element is
            not an ``int`` (``bool`` included).
        LLMParamError: an element is out of range, or the sequence is empty
            and ``allow_empty`` is false.
    """
    if not isinstance(values, (list, tuple, range)):
        raise TypeError(f"{name} must be list or tuple of int, got {type_name(values)}")
    if not values:
        if not allow_empty:
            raise_param_error(f"{name} must not be empty")
        return []
    if isinstance(values, range):
        items = list(values)
    elif all(type(v) is int for v in values):
        items = list(values)
    else:
        items = []
        for i, v in enumerate(values):
            if not _is_int(v):
                raise TypeError(f"{name}[{i}] must be int, got {type_name(v)}")
            items.append(int(v))
    if signed:
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    else:
        lo, hi = 0, (1 << bits) - 1
    if min(items) < lo or max(items) > hi:
        check = check_sint if signed else check_uint
        for i, v in enumerate(items):
            check(f"{name}[{i}]", v, bits)
    return items


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
