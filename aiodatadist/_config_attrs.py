"""The validated attributes of :class:`~aiodatadist.config.LLMConfig`: one descriptor, the checks.

Each attribute is an :class:`Option`: it validates an assignment with its check
(the error names the attribute), reads as its default while unset, and knows the
option key :meth:`~aiodatadist.config.LLMConfig.generate_options` emits and when.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar, overload

from ._cluster import ip_to_int
from ._options import (
    DATA_PATHS,
    TRANSFER_BACKENDS,
    DataPath,
    check_json,
    check_pool_cfg,
    is_decimal,
    parse_listen_ip_info,
)
from ._validate import INT32_MAX, check_int, check_str, check_type, require

_T = TypeVar("_T")
Emit = Literal["set", "truthy", "always", "never"]


class Option(Generic[_T]):
    """A validated attribute of :class:`LLMConfig` that emits one option key.

    Stored as ``_<name>`` on the instance (absent until set); reading an unset one gives
    ``default``. ``check(name, value)`` validates an assignment and returns what to store.
    ``emit`` says when :meth:`LLMConfig.generate_options` writes ``key``: once ``set``
    (even to a false value), when ``truthy``, ``always`` (the default included) or
    ``never`` (the attribute has its own rule there).
    """

    def __init__(
        self,
        key: str,
        check: Callable[[str, Any], Any],
        *,
        default: _T,
        emit: Emit = "set",
        doc: str,
    ) -> None:
        self.key = key
        self.check = check
        self.default = default
        self.emit = emit
        self.__doc__ = doc
        self.name = self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_{name}"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Option[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _T: ...
    def __get__(self, obj: object, owner: type | None = None) -> Option[_T] | _T:
        if obj is None:
            return self
        value = getattr(obj, self.slot, None)
        return self.default if value is None else value

    def __set__(self, obj: object, value: Any) -> None:
        setattr(obj, self.slot, self.check(self.name, value))

    def emitted(self, obj: object) -> str | None:
        """The option's text for ``obj``, or None when ``key`` is not to be written."""
        stored = getattr(obj, self.slot, None)
        value = self.__get__(obj) if self.emit == "always" else stored
        if self.emit == "never" or value is None or (self.emit == "truthy" and not value):
            return None
        if isinstance(value, bool):
            return "1" if value else "0"
        return str(value)


def int_in(min_value: int, max_value: int | None = None) -> Callable[[str, Any], int]:
    return functools.partial(check_int, min_value=min_value, max_value=max_value)


def check_device_id(name: str, value: Any) -> int | list[int] | tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        require(len(value) > 0, "device_id must not be an empty list")
        for i, dev in enumerate(value):
            check_int(f"device_id[{i}]", dev, min_value=0, max_value=INT32_MAX)
    else:
        check_type(name, value, (int, list, tuple))
        check_int(name, value, min_value=0, max_value=INT32_MAX)
    return value  # type: ignore[no-any-return]


def check_timeout_ms(name: str, value: Any) -> int:
    check_type(name, value, (int, str))
    if isinstance(value, str):
        require(is_decimal(value), f"{name} must be digits, got {value!r}")
        value = int(value)
    return check_int(name, value, min_value=1, max_value=INT32_MAX)


def check_listen_ip_info(name: str, value: Any) -> str:
    check_str(name, value)
    if value:
        parse_listen_ip_info(value)
    return value  # type: ignore[no-any-return]


def check_pool(name: str, value: Any) -> str:
    check_str(name, value)
    if value:
        check_pool_cfg(name, value)
    return value  # type: ignore[no-any-return]


def check_backend(name: str, value: Any) -> str:
    check_str(name, value)
    require(
        value in TRANSFER_BACKENDS,
        f"{name} must be one of {list(TRANSFER_BACKENDS)}, got {value!r}",
    )
    return value  # type: ignore[no-any-return]


def check_json_text(name: str, value: Any) -> str:
    check_str(name, value)
    if value:
        check_json(name, value)
    return value  # type: ignore[no-any-return]


def check_fraction(name: str, value: Any) -> float:
    check_type(name, value, (float, int))
    require(0.0 <= value <= 1.0, f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def check_cluster_info(name: str, value: Any) -> str:
    check_str(name, value)
    if not value:
        return ""
    info = check_json(name, value)
    require(isinstance(info, dict), f"{name} must be a JSON object, got {value!r}")
    entries = info.get("listen_ip_info", [])
    require(
        isinstance(entries, list) and all(isinstance(e, dict) for e in entries),
        f"{name}: listen_ip_info must be a list of objects, got {entries!r}",
    )
    for entry in entries:
        if "ip" in entry:
            entry["ip"] = ip_to_int(f"{name}: listen_ip_info[].ip", entry["ip"])
    return json.dumps(info)


def check_data_path(name: str, value: Any) -> DataPath:
    check_str(name, value)
    require(value in DATA_PATHS, f"{name} must be one of {list(DATA_PATHS)}, got {value!r}")
    return DataPath(value)


def check_secret(name: str, value: Any) -> str:
    return check_str(name, value, allow_empty=False)
