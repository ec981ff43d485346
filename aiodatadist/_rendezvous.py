"""The same-host rendezvous of two-sided comms: where a member that accepts links
publishes its listener, per comm, and where the others look it up (the rule is
:mod:`aiodatadist._ranktable`'s docstring).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
from pathlib import Path

from ._ranktable import RankTable
from .errors import LLMStatusCode, failure

__all__ = [
    "DEFAULT_LINK_TOTAL_TIME_S",
    "comm_key",
    "default_link_total_time",
    "file_name",
    "lookup",
    "rundir",
    "trusted_rundir",
]

log = logging.getLogger("aiodatadist.links")

DEFAULT_LINK_TOTAL_TIME_S = 120
"""A comm's deadline without ``llm.LinkTotalTime`` or ``$HCCL_CONNECT_TIMEOUT`` (seconds)."""


def rundir() -> Path:
    """The same-host rendezvous directory (see :mod:`aiodatadist._ranktable`)."""
    if os.environ.get("AIODATADIST_RUNDIR"):
        return Path(os.environ["AIODATADIST_RUNDIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "aiodatadist"
    return Path(f"/tmp/aiodatadist-{os.getuid()}")


def trusted_rundir() -> Path:
    """The rendezvous directory, created 0700 if missing.

    Raises:
        LLMException: LLM_FAILED when it is not a directory of ours without
            group/other write (someone else could plant addresses in it).
    """
    path = rundir()
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, mode=0o700)
    try:
        st = os.lstat(path)
    except OSError as e:
        raise failure(LLMStatusCode.LLM_FAILED, f"rendezvous directory {path}: {e}") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        why = (
            f"refusing the rendezvous directory {path}: it must be a directory owned by "
            f"uid {os.getuid()} with no group/other write (mode {stat.filemode(st.st_mode)}, "
            f"owner {st.st_uid})"
        )
        log.error("%s", why)
        raise failure(LLMStatusCode.LLM_FAILED, why)
    return path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def default_link_total_time() -> int:
    """Seconds a comm may take without ``llm.LinkTotalTime``: ``$HCCL_CONNECT_TIMEOUT``
    when it is a positive integer (upstream's fallback), else 120."""
    text = os.environ.get("HCCL_CONNECT_TIMEOUT", "")
    if text.isdigit() and int(text) > 0:
        return int(text)
    return DEFAULT_LINK_TOTAL_TIME_S


def comm_key(name: str, members: dict[int, int], table: RankTable) -> str:
    """What names one comm on this host: its name, its ``cluster_rank_info`` and the rank
    table's entries of its ranks (server, device id, device IP), hashed.

    Every member computes the same key from ``link``'s identical arguments; two jobs
    that reuse cluster ids (1 and 2, say) but differ in any of those never find each
    other's listeners (upstream keeps them apart by device IP the same way).
    """
    ranks = sorted(members.items())
    entries = [
        (r, table.ranks[r].server_id, table.ranks[r].device_id, table.ranks[r].device_ip)
        for _, r in ranks
    ]
    text = json.dumps([name, ranks, entries], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def file_name(key: str, cluster_id: int) -> str:
    return f"comm-{key}-cluster-{cluster_id}.json"


def lookup(key: str, cluster_id: int) -> tuple[str, int] | None:
    """The address ``cluster_id`` published for the comm ``key``, or None (none,
    unreadable, stale, or written for another comm)."""
    path = trusted_rundir() / file_name(key, cluster_id)
    try:
        doc = json.loads(path.read_text())
        host, port, pid = str(doc["host"]), int(doc["port"]), int(doc["pid"])
        comm = str(doc["comm"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if comm != key or pid <= 0 or not pid_alive(pid) or not 0 < port < 65536:
        return None
    return host, port
