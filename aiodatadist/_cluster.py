"""Link targets: :class:`LLMClusterInfo` and upstream's integer IPv4 form.

Public through :mod:`aiodatadist.types`, which re-exports every name and gives
each its public ``__module__``.
"""

from __future__ import annotations

import ipaddress
import socket

from ._enums import LLMRole
from ._validate import check_type, check_uint, raise_param_error, require

__all__ = ["LLMClusterInfo", "ip_to_int", "ip_to_str"]


def ip_to_int(name: str, ip: str | int) -> int:
    """Convert an IPv4 address to upstream's integer form.

    Args:
        name: Argument name for messages.
        ip: Dotted IPv4 string, or an int already in upstream's form.

    Returns:
        ``int.from_bytes(socket.inet_aton(ip), "little")`` for a string; the
        int itself (checked to be a uint32) otherwise.

    Raises:
        TypeError: ``ip`` is neither ``str`` nor ``int``.
        LLMParamError: ``ip`` is not a dotted IPv4 address or not a uint32.
    """
    if isinstance(ip, str):
        try:
            packed = ipaddress.IPv4Address(ip).packed
        except ValueError:
            packed = b""
        if not packed:
            raise_param_error(f"{name} must be a dotted IPv4 address, got {ip!r}")
        return int.from_bytes(packed, "little")
    check_type(name, ip, (str, int))
    return check_uint(name, ip, 32)


def ip_to_str(ip: int) -> str:
    """Convert upstream's integer IPv4 form back to a dotted string."""
    return socket.inet_ntoa(check_uint("ip", ip, 32).to_bytes(4, "little"))


class LLMClusterInfo:
    """Where and what to link to, for ``link_clusters`` / ``unlink_clusters``.

    IPs are stored as upstream does: ``(ip_int, port)`` with
    ``ip_int = int.from_bytes(socket.inet_aton(ip), "little")``.  Only IPv4.
    """

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int | None = None
        self._local_ip_info_list: list[tuple[int, int]] = []
        self._remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """Cluster id of the peer (uint64); ``None`` until set."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = check_uint("remote_cluster_id", value, 64)

    @property
    def remote_role_type(self) -> LLMRole | int | None:
        """Role of the peer (stored only; not used in cache-manager mode)."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: LLMRole | int) -> None:
        check_type("remote_role_type", value, (LLMRole, int))
        self._remote_role_type = value

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        """``(ip_int, port)`` entries for this side."""
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        """``(ip_int, port)`` entries for the peer (its listen address)."""
        return self._remote_ip_info_list

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add a local host IP (the port is unused in practice; samples pass 0).

        Raises:
            TypeError: ``ip`` or ``port`` has the wrong type.
            LLMParamError: ``ip`` is not IPv4 or ``port`` is not a uint16.
        """
        entry = (ip_to_int("ip", ip), check_uint("port", port, 16))
        self._local_ip_info_list.append(entry)

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add the peer's host IP and the port of its ``listen_ip_info``.

        Raises:
            TypeError: ``ip`` or ``port`` has the wrong type.
            LLMParamError: ``ip`` is not IPv4 or ``port`` is not a uint16.
        """
        entry = (ip_to_int("ip", ip), check_uint("port", port, 16))
        self._remote_ip_info_list.append(entry)

    def local_ip_info_strs(self) -> list[tuple[str, int]]:
        """Return :attr:`local_ip_info_list` with dotted IP strings."""
        return [(ip_to_str(ip), port) for ip, port in self._local_ip_info_list]

    def remote_ip_info_strs(self) -> list[tuple[str, int]]:
        """Return :attr:`remote_ip_info_list` with dotted IP strings."""
        return [(ip_to_str(ip), port) for ip, port in self._remote_ip_info_list]

    def remote_address(self) -> tuple[str, int]:
        """Return the first remote ``(dotted_ip, port)``: where to connect.

        Raises:
            LLMParamError: no remote IP info was appended.
        """
        require(
            bool(self._remote_ip_info_list),
            f"remote_ip_info_list is empty for remote_cluster_id={self._remote_cluster_id}",
        )
        ip, port = self._remote_ip_info_list[0]
        return ip_to_str(ip), port

    def remote_ip_str(self) -> str:
        """Return the first remote IP as a dotted string.

        Raises:
            LLMParamError: no remote IP info was appended.
        """
        return self.remote_address()[0]

    def __repr__(self) -> str:
        return (
            f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
            f"remote_role_type={self._remote_role_type}, "
            f"local_ip_info={self.local_ip_info_strs()}, "
            f"remote_ip_info={self.remote_ip_info_strs()})"
        )
