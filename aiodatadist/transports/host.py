"""Who the peer of a link is: host identity and the peer's pid, checked.

The one-sided paths (``shm``, ``cma``) act on the process and segments the peer
names. They are used only when both processes share a host identity (machine,
boot and namespaces) and the pid the peer gave verifiably holds the other end of
the link's control connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket

__all__ = ["host_identity", "peer_owns_connection", "verified_same_host"]

log = logging.getLogger("aiodatadist.control")


def _ns_inode(name: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{name}").st_ino)
    except OSError:
        return "?"


def host_identity() -> str:
    """Names the machine and namespaces this process lives in.

    Two processes with the same identity can use the one-sided same-host paths
    (shared memory, CMA). The network namespace is part of it, so processes in
    separate namespaces are treated as separate hosts (and use TCP).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    parts = [socket.gethostname(), boot] + [_ns_inode(n) for n in ("pid", "ipc", "mnt", "net")]
    return "/".join(parts)[:256]


def _proc_addr(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``/proc/net/tcp*`` address ``HEX_IP:HEX_PORT`` (the IP in 32-bit host-order words)."""
    hex_ip, hex_port = field.split(":")
    raw = bytes.fromhex(hex_ip)
    ip = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(ip), int(hex_port, 16)


def _socket_inode(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The inode of this namespace's TCP socket with that local and remote end."""
    want = (
        (ipaddress.ip_address(local[0]), local[1]),
        (ipaddress.ip_address(remote[0]), remote[1]),
    )
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            with contextlib.suppress(ValueError, IndexError):
                if (_proc_addr(parts[1]), _proc_addr(parts[2])) == want:
                    return int(parts[9])
    return None


def _holds_socket(pid: int, target: str) -> bool | None:
    """Whether process ``pid`` has an fd on ``target``; None when its fds cannot be read."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False  # no such process
    except OSError:
        return None  # another user's process, or no /proc
    for name in names:
        with contextlib.suppress(OSError):  # an fd closed while we look
            if os.readlink(f"/proc/{pid}/fd/{name}") == target:
                return True
    return False


def peer_owns_connection(pid: int, writer: asyncio.StreamWriter) -> bool | None:
    """Whether process ``pid`` holds the other end of this control connection.

    The one-sided paths (shm, cma) act on the process and segments the peer names: a
    peer claiming someone else's pid could make us read or write that process's memory.
    Checked once per link through /proc. Returns:

    * True: ``pid`` holds it;
    * False: the other end is open, held by some process, and ``pid`` is not one of
      them: the peer claims a pid that is not its own;
    * None: it cannot be told: the other end was already closed (a short-lived peer
      that linked and left before we looked: its socket has no owner any more), or
      /proc does not show it (not the same network namespace, another user's process).

    Only True lets the one-sided paths act on ``pid``.
    """
    sock = writer.get_extra_info("socket")
    try:
        ours, theirs = sock.getsockname()[:2], sock.getpeername()[:2]
    except (OSError, AttributeError):
        return None  # closed already, or not a socket
    inode = _socket_inode(local=theirs, remote=ours)
    if not inode:  # None: not in the table; 0: closed, no process owns it (TIME_WAIT, ...)
        return None
    held = _holds_socket(pid, f"socket:[{inode}]")
    if held is not False:
        return held
    # Not among pid's fds. A lie, unless the peer closed its end meanwhile (or exited):
    # then the socket left the table, or lost its inode, since we read it above.
    if _socket_inode(local=theirs, remote=ours) != inode:
        return None
    return False


def verified_same_host(
    cluster_id: int, host_id: str, pid: int, writer: asyncio.StreamWriter
) -> bool:
    """Whether the peer ``cluster_id`` (``host_id``, ``pid``) on this control connection is
    on this host and verifiably process ``pid``: only then may the one-sided paths act on it.
    """
    if host_id != host_identity():
        return False
    owns = peer_owns_connection(pid, writer)
    if owns is False:
        # Only a peer that is verifiably lying: an honest peer that already closed its
        # end (linked and left) or one /proc cannot show is not accused (tcp only).
        log.warning(
            "cluster %d claims pid %d on this host, which does not hold its connection: "
            "using tcp only",
            cluster_id,
            pid,
        )
    elif owns is None:
        log.debug(
            "cluster %d (pid %d): its end of the connection cannot be checked (closed, "
            "or not visible here): using tcp only",
            cluster_id,
            pid,
        )
    return owns is True
