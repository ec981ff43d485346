"""Status codes and the exception hierarchy.

Every error this library raises on purpose is an :class:`LLMException`, the
root class of upstream ``llm_datadist``.  It carries an :class:`LLMStatusCode`
in ``status_code``.  Subclasses group the codes by what a caller does about
them, and also derive from the matching builtin so that code which knows
nothing about this library can still catch them::

    RuntimeError
    └── LLMException                       any failure; .status_code says which
        ├── LLMTimeoutError    (TimeoutError)    LLM_TIMEOUT, LLM_WAIT_PROCESS_TIMEOUT
        ├── LLMParamError      (ValueError)      LLM_PARAM_INVALID
        ├── LLMLinkError       (ConnectionError) LLM_NOT_YET_LINK, LLM_ALREADY_LINK,
        │                                        LLM_LINK_FAILED, LLM_UNLINK_FAILED,
        │                                        LLM_NOTIFY_PROMPT_UNLINK_FAILED,
        │                                        LLM_PROCESSING_LINK, LLM_EXIST_LINK,
        │                                        LLM_LINK_BUSY
        └── LLMCacheNotFoundError (LookupError)  LLM_KV_CACHE_NOT_EXIST

Constructing the root class with a status code picks the subclass, so
``LLMException("...", status_code=LLMStatusCode.LLM_TIMEOUT)`` is an
:class:`LLMTimeoutError` and therefore also a :class:`TimeoutError`.  Code that
upstream raises as a plain ``LLMException`` keeps working unchanged.

Not in the tree, as upstream: a wrong Python type raises :class:`TypeError`,
and a call on an instance that is not initialized raises :class:`RuntimeError`.

This module also holds the one table that turns the native core's
``Status`` values into :class:`LLMStatusCode` (:data:`NATIVE_STATUS_TABLE`,
:func:`from_native`).  It never imports the native module.

Every error the package raises on purpose is made by :func:`failure` (or
:func:`from_native` for a caught one). The name of the public call it belongs
to is attached once, where the call enters the package (:func:`api_scope`, used
by the facade's decorators); code below the facade never passes it around.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

__all__ = [
    "API_CONTEXT",
    "API_CONTEXT_NONE",
    "NATIVE_STATUS_NAMES",
    "NATIVE_STATUS_TABLE",
    "LLMCacheNotFoundError",
    "LLMException",
    "LLMLinkError",
    "LLMParamError",
    "LLMStatusCode",
    "LLMTimeoutError",
    "Status",
    "api_scope",
    "current_api",
    "failure",
    "format_error",
    "from_native",
    "raise_for_status",
    "to_status_code",
]


class LLMStatusCode(enum.IntEnum):
    """Upstream status codes; the values are the native ``ge::Status`` integers."""

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = 0x5010B001
    LLM_KV_CACHE_NOT_EXIST = 0x5010B002
    LLM_REPEAT_REQUEST = 0x5010B003
    LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004
    LLM_PARAM_INVALID = 0x5010B005
    LLM_ENGINE_FINALIZED = 0x5010B006
    LLM_NOT_YET_LINK = 0x5010B007
    LLM_ALREADY_LINK = 0x5010B008
    LLM_LINK_FAILED = 0x5010B009
    LLM_UNLINK_FAILED = 0x5010B00A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    LLM_PROCESSING_LINK = 0x5010B00D
    LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00E
    LLM_PREFIX_ALREADY_EXIST = 0x5010B00F
    LLM_PREFIX_NOT_EXIST = 0x5010B010
    LLM_SEQ_LENOVERLIMIT = 0x5010B011
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        # Upstream prints "LLMStatusCode.LLM_TIMEOUT"; IntEnum's str() became the
        # bare number in Python 3.11.
        return f"{type(self).__name__}.{self.name}"


def to_status_code(code: int) -> LLMStatusCode:
    """Return the :class:`LLMStatusCode` for an upstream integer status.

    Args:
        code: An :class:`LLMStatusCode` or a plain ``int``.

    Returns:
        The member with that value; :attr:`LLMStatusCode.LLM_FAILED` for an
        integer that is not a member value (upstream's ``code_2_status``).

    Raises:
        TypeError: ``code`` is not an ``int`` (``bool`` included).
    """
    if isinstance(code, LLMStatusCode):
        return code
    if not isinstance(code, int) or isinstance(code, bool):
        raise TypeError(f"status_code must be LLMStatusCode or int, got {type(code).__name__}")
    try:
        return LLMStatusCode(code)
    except ValueError:
        return LLMStatusCode.LLM_FAILED


_E = TypeVar("_E", bound="LLMException")
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: set on classes defined in Python


def _builtin_base(cls: type[BaseException]) -> type[BaseException]:
    # Exception subclasses that also derive from OSError (TimeoutError,
    # ConnectionError) must be created by OSError.__new__, and CPython refuses
    # RuntimeError.__new__ for them.  The builtin at the end of the __base__
    # chain is the one whose __new__ is safe to call.
    base: type[BaseException] = cls
    while base.__flags__ & _HEAPTYPE:
        base = base.__base__  # type: ignore[assignment]
    return base


class LLMException(RuntimeError):
    """Root of every error this library raises on purpose.

    Args:
        *args: The message (normally one string), as for any exception.
        status_code: An :class:`LLMStatusCode` or an int member value; an int
            that is not a member value becomes ``LLM_FAILED``.  ``None`` (the
            default) means the class's own code: ``LLM_SUCCESS`` for
            :class:`LLMException` itself (as upstream), the natural code for a
            subclass (e.g. ``LLM_TIMEOUT`` for :class:`LLMTimeoutError`).

    Constructing :class:`LLMException` directly with a status code returns the
    subclass for that code (see the module docstring); the result is still an
    :class:`LLMException`.
    """

    default_status: ClassVar[LLMStatusCode] = LLMStatusCode.LLM_SUCCESS

    def __new__(cls: type[_E], *args: object, status_code: int | None = None) -> _E:
        target: type[LLMException] = cls
        if cls is LLMException and status_code is not None:
            target = _CLASS_BY_STATUS.get(to_status_code(status_code), LLMException)
        # Message arguments go to __init__ only: OSError.__new__ would read two
        # arguments as (errno, strerror) and change str(e).
        return _builtin_base(target).__new__(target)  # type: ignore[return-value]

    def __init__(self, *args: object, status_code: int | None = None) -> None:
        super().__init__(*args)
        self._status_code = (
            type(self).default_status if status_code is None else to_status_code(status_code)
        )

    @property
    def status_code(self) -> LLMStatusCode:
        """The :class:`LLMStatusCode` of this error."""
        return self._status_code

    def __reduce__(self) -> tuple[Any, ...]:
        state = {k: v for k, v in self.__dict__.items() if k != "_status_code"}
        return (_rebuild, (type(self), self.args, int(self._status_code)), state or None)


def _rebuild(cls: type[LLMException], args: tuple[object, ...], status_code: int) -> LLMException:
    return cls(*args, status_code=status_code)


class LLMTimeoutError(LLMException, TimeoutError):
    """An operation did not finish in time (``LLM_TIMEOUT``, ``LLM_WAIT_PROCESS_TIMEOUT``).

    For a transfer this means the link is suspect: upstream's advice is to
    unlink (force) and link again before retrying.
    """

    default_status: ClassVar[LLMStatusCode] = LLMStatusCode.LLM_TIMEOUT


class LLMParamError(LLMException, ValueError):
    """An argument or option is invalid (``LLM_PARAM_INVALID``)."""

    default_status: ClassVar[LLMStatusCode] = LLMStatusCode.LLM_PARAM_INVALID


class LLMLinkError(LLMException, ConnectionError):
    """A link to a peer is missing, busy, or could not be made or removed."""

    default_status: ClassVar[LLMStatusCode] = LLMStatusCode.LLM_LINK_FAILED


class LLMCacheNotFoundError(LLMException, LookupError):
    """The remote cache key or cache id is not registered (``LLM_KV_CACHE_NOT_EXIST``)."""

    default_status: ClassVar[LLMStatusCode] = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


_S = LLMStatusCode
_CLASS_BY_STATUS: Mapping[LLMStatusCode, type[LLMException]] = MappingProxyType(
    {
        _S.LLM_TIMEOUT: LLMTimeoutError,
        _S.LLM_WAIT_PROCESS_TIMEOUT: LLMTimeoutError,
        _S.LLM_PARAM_INVALID: LLMParamError,
        _S.LLM_NOT_YET_LINK: LLMLinkError,
        _S.LLM_LINK_FAILED: LLMLinkError,
        _S.LLM_UNLINK_FAILED: LLMLinkError,
        _S.LLM_ALREADY_LINK: LLMLinkError,
        _S.LLM_LINK_BUSY: LLMLinkError,
        _S.LLM_PROCESSING_LINK: LLMLinkError,
        _S.LLM_NOTIFY_PROMPT_UNLINK_FAILED: LLMLinkError,
        _S.LLM_EXIST_LINK: LLMLinkError,
        _S.LLM_KV_CACHE_NOT_EXIST: LLMCacheNotFoundError,
    }
)


class Status:
    """Upstream's small status wrapper: ``Status(code).is_ok()``.

    Args:
        status: An :class:`LLMStatusCode` or an int (unknown ints become
            ``LLM_FAILED``).
    """

    def __init__(self, status: int) -> None:
        self._status_code = to_status_code(status)

    def is_ok(self) -> bool:
        """Return whether the status is ``LLM_SUCCESS``."""
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self) -> LLMStatusCode:
        """The wrapped :class:`LLMStatusCode`."""
        return self._status_code

    def __repr__(self) -> str:
        return f"Status({self._status_code})"


def format_error(api: str, status: int, info: str = "") -> str:
    """Build upstream's error message for a failed call.

    Args:
        api: Name of the API that failed, e.g. ``"pull_blocks"``.
        status: The status (int values are mapped as by :func:`to_status_code`).
        info: Extra detail; left out when empty.

    Returns:
        ``"[pull_blocks] failed, error code is LLMStatusCode.LLM_TIMEOUT, <info>."``
        (upstream's ``handle_llm_status`` text; an ``api`` already in brackets keeps them).
    """
    code = to_status_code(status)
    if not api.startswith("["):
        api = f"[{api}]"
    if info:
        return f"{api} failed, error code is {code}, {info}."
    return f"{api} failed, error code is {code}."


API_CONTEXT_NONE = "aiodatadist"
""":data:`API_CONTEXT`'s value outside any public call."""
API_CONTEXT: ContextVar[str] = ContextVar("aiodatadist_api", default=API_CONTEXT_NONE)
"""The public call running in this context; set by the facade (``_bridge.public``)."""


def current_api() -> str:
    """The public call running in this context (``"aiodatadist"`` outside any)."""
    return API_CONTEXT.get()


@contextlib.contextmanager
def api_scope(name: str) -> Iterator[None]:
    """Names the public call for every :func:`failure` made inside (tasks it starts too:
    they copy the context)."""
    token = API_CONTEXT.set(name)
    try:
        yield
    finally:
        API_CONTEXT.reset(token)


def failure(
    code: int,
    info: str = "",
    *,
    api: str | None = None,
    kind: type[LLMException] | None = None,
) -> LLMException:
    """The one constructor of the package's errors: upstream's message for ``code``.

    Args:
        code: the status (mapped as by :func:`to_status_code`).
        info: what went wrong, for the message.
        api: the public call's name; by default the one :func:`api_scope` set.
        kind: a more specific class than the one ``code`` selects (a private
            subclass a caller catches, e.g. a stale lease); by default that one.

    Returns:
        The :class:`LLMException` subclass for ``code`` (raise it).
    """
    status = to_status_code(code)
    message = format_error(api or API_CONTEXT.get(), status, info)
    return (kind or LLMException)(message, status_code=status)


def raise_for_status(status: int, api_name: str, info: str = "") -> None:
    """Raise the :class:`LLMException` for ``status`` unless it is success.

    Args:
        status: An :class:`LLMStatusCode` or upstream integer status.
        api_name: Name of the API, used in the message.
        info: Extra detail for the message.

    Raises:
        LLMException: The subclass matching ``status``, with the message from
            :func:`format_error`, when ``status`` is not ``LLM_SUCCESS``.
    """
    code = to_status_code(status)
    if code != LLMStatusCode.LLM_SUCCESS:
        raise failure(code, info, api=api_name)


# ext/core.hpp's ``enum class Status`` is the one source of the native values and names;
# tests/test_errors.py checks this table, the binding and the stub against it.
_NATIVE_STATUS: tuple[tuple[int, str, LLMStatusCode], ...] = (
    (0, "OK", _S.LLM_SUCCESS),
    (1, "FAILED", _S.LLM_FAILED),
    (2, "PARAM_INVALID", _S.LLM_PARAM_INVALID),
    (3, "OUT_OF_RANGE", _S.LLM_PARAM_INVALID),
    (4, "OVERLAP", _S.LLM_PARAM_INVALID),
    (5, "ABORTED", _S.LLM_TIMEOUT),  # a mover is aborted only on deadline or cancel
    (6, "TIMEOUT", _S.LLM_TIMEOUT),
    (7, "PERMISSION_DENIED", _S.LLM_LINK_FAILED),  # the peer's memory cannot be reached
    (8, "NO_SUCH_PROCESS", _S.LLM_LINK_FAILED),  # the peer is gone
    (9, "PEER_CLOSED", _S.LLM_LINK_FAILED),
    (10, "IO_ERROR", _S.LLM_FAILED),
    (11, "NO_MEMORY", _S.LLM_OUT_OF_MEMORY),
    (12, "STALE", _S.LLM_FAILED),  # a data stream carried another transfer's bytes
)

NATIVE_STATUS_TABLE: Mapping[int, LLMStatusCode] = MappingProxyType(
    {value: code for value, _, code in _NATIVE_STATUS}
)
"""The one mapping from ``aiodatadist._native.Status`` values to :class:`LLMStatusCode`."""

NATIVE_STATUS_NAMES: Mapping[int, str] = MappingProxyType(
    {value: name for value, name, _ in _NATIVE_STATUS}
)
"""The name of each ``aiodatadist._native.Status`` value (for messages and the drift test)."""


def _status_of(err: BaseException) -> LLMStatusCode:
    native = getattr(err, "status", None)
    if isinstance(native, int) and not isinstance(native, bool):
        return NATIVE_STATUS_TABLE.get(int(native), LLMStatusCode.LLM_FAILED)
    if isinstance(err, LLMException):
        return err.status_code
    if isinstance(err, TimeoutError):
        return LLMStatusCode.LLM_TIMEOUT
    if isinstance(err, MemoryError):
        return LLMStatusCode.LLM_OUT_OF_MEMORY
    if isinstance(err, ConnectionError):
        return LLMStatusCode.LLM_LINK_FAILED
    return LLMStatusCode.LLM_FAILED


def from_native(err: BaseException, api: str | None = None) -> LLMException:
    """Translate an error from the native core (or a transport) into an :class:`LLMException`.

    The status is read from ``err.status`` (duck-typed, so the native module is
    not imported) and mapped through :data:`NATIVE_STATUS_TABLE`; an unknown
    value maps to ``LLM_FAILED``.  Errors without a ``status`` attribute are
    classified by type: an :class:`LLMException` keeps its code,
    :class:`TimeoutError` gives ``LLM_TIMEOUT``, :class:`MemoryError`
    ``LLM_OUT_OF_MEMORY``, :class:`ConnectionError` ``LLM_LINK_FAILED``,
    anything else ``LLM_FAILED``.  A status that would map to ``LLM_SUCCESS``
    gives ``LLM_FAILED``: an error is never a success.

    The caller keeps the original as the cause::

        except NativeError as e:
            raise from_native(e) from e

    Args:
        err: The caught exception.
        api: Name of the public API that failed, used in the message (by default
            the one :func:`api_scope` set).

    Returns:
        The :class:`LLMException` subclass for the mapped status, with
        upstream's message format and the native message (plus ``errno`` when
        the error has a non-zero one) as its info.
    """
    code = _status_of(err)
    if code == LLMStatusCode.LLM_SUCCESS:
        code = LLMStatusCode.LLM_FAILED
    info = str(err) or type(err).__name__
    errno = getattr(err, "errno", None)
    # OSError's own str() already shows its errno.
    has_errno = isinstance(errno, int) and not isinstance(errno, bool) and errno != 0
    if has_errno and not isinstance(err, OSError):
        info = f"{info} (errno {errno})"
    return failure(code, info, api=api)
