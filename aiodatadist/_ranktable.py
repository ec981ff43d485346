"""Upstream's two-sided ``link`` rank table: parse, validate, and map a rank to an address.

Pure: no I/O. :func:`parse_rank_table` reads the JSON text ``LLMDataDist.link`` gets;
every problem raises ``LLMParamError`` (``LLM_PARAM_INVALID``, a ``ValueError``) with a
message that names what is wrong. Fields this module does not know are ignored.

Accepted shape (versions ``"1.0"`` and ``"1.2"``)::

    {"version": "1.2", "server_count": "2", "status": "completed",
     "server_list": [{"server_id": "10.0.0.1",
                      "device": [{"device_id": "0", "device_ip": "192.168.1.1",
                                  "super_device_id": "0", "rank_id": "0",
                                  "listen_ip_info": "10.0.0.1:26000"}]}, ...],
     "super_pod_list": [{"super_pod_id": "0", "server_list": [{"server_id": "10.0.0.1"}]}]}

How a member (a ``cluster_id: rank_id`` pair of ``cluster_rank_info``) is reached
-------------------------------------------------------------------------------------
There is no HCCL here: a rank's entry names an Ascend device, not a socket. For each
pair of members the HIGHER rank links to the LOWER rank (the ordinary handshake of
``link_clusters``: shared secret, peer checks, cache tables); the lower rank waits for
that inbound link. The higher rank finds the lower rank's address, first rule that
applies:

1. ``"listen_ip_info": "ip:port"`` in the lower rank's device entry (an aiodatadist
   extension; upstream ignores unknown fields, so the same table still works there).
   The lower rank listens there (it starts a listener at that address if it has none;
   a listener it already has elsewhere fails the comm); port 0 is refused (the
   connecting side could not know the port).
2. Otherwise, an initialized instance with that cluster id in the same process, on the
   same event loop (and a data path that allows ``inproc``): an in-process link, made
   once both have called ``link`` with the same ``comm_name`` and ``cluster_rank_info``.
3. Otherwise, the same-host rendezvous directory: the lower rank starts a listener on
   ``127.0.0.1`` port 0 if it has none, and the higher rank reads the lower rank's
   ``comm-<key>-cluster-<id>.json`` (``{"host", "port", "pid", "comm"}``), retrying with
   a bounded backoff (20 ms doubling to 500 ms) until it appears, within the link
   deadline. ``<key>`` hashes the comm's name, its ``cluster_rank_info`` and the rank
   table's entries of its ranks (server id, device id, device IP): two jobs on one host
   that reuse cluster ids but not device entries (or names) never find each other.

The directory is ``$AIODATADIST_RUNDIR``, else ``$XDG_RUNTIME_DIR/aiodatadist``, else
``/tmp/aiodatadist-<uid>``; it is created mode 0700 and refused (the comm FAILS, with a
log) unless it is a directory owned by this user with no group/other write. Every member
that listens for a comm (rules 1 and 3) publishes one file per comm there (written atomically,
tmp + rename, mode 0600); a file whose pid is not alive is ignored (stale).
A file goes when its comm is unlinked or fails, or its instance finalizes or stops its listener
(``switch_role``); a listener a comm started stops then too, unless it was configured
(``llm.listenIpInfo``) or still serves other links.

Limits: a lower rank that already listens (``llm.listenIpInfo``, or a listener another
comm started) accepts the higher rank's link before it calls ``link`` itself; that call
then adopts the link. Until then the higher rank may already read OK.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._options import is_decimal, parse_listen_ip_info
from ._validate import UINT32_MAX, raise_param_error

__all__ = ["RANK_TABLE_VERSIONS", "RankEntry", "RankTable", "parse_rank_table"]

RANK_TABLE_VERSIONS = ("1.0", "1.2")
_MAX_RANK_TABLE_CHARS = 1 << 20


@dataclass(frozen=True)
class RankEntry:
    """One device entry of the table.

    Attributes:
        rank_id: the rank (uint32).
        server_id: the ``server_id`` of the server entry that holds it.
        device_id: the device id as written.
        device_ip: the device IP as written, or None.
        listen: ``(ip, port)`` of the ``listen_ip_info`` extension, or None.
    """

    rank_id: int
    server_id: str
    device_id: str
    device_ip: str | None
    listen: tuple[str, int] | None


@dataclass(frozen=True)
class RankTable:
    """A validated rank table: its version and entries by rank id."""

    version: str
    ranks: Mapping[int, RankEntry]

    def check_ranks(self, cluster_rank_info: Mapping[int, int]) -> None:
        """Every rank of ``cluster_rank_info`` must be in the table.

        Raises:
            LLMParamError: a rank is not in the table (naming its cluster id and rank).
        """
        for cluster_id, rank in cluster_rank_info.items():
            if rank not in self.ranks:
                raise_param_error(
                    f"rank_table has no rank {rank} (cluster {cluster_id} of cluster_rank_info)"
                )


def _text_id(where: str, value: object) -> str:
    """An id written as a string or an int (upstream writes strings)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise_param_error(f"rank_table: {where} must be a string, got {type(value).__name__}")
    text = str(value)
    if not text:
        raise_param_error(f"rank_table: {where} must not be empty")
    return text


def _rank_id(where: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        rank = value
    elif isinstance(value, str) and is_decimal(value):
        rank = int(value)
    else:
        raise_param_error(f"rank_table: {where}.rank_id must be a decimal string, got {value!r}")
    if not 0 <= rank <= UINT32_MAX:
        raise_param_error(f"rank_table: {where}.rank_id must be a uint32, got {rank}")
    return rank


def _object(where: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise_param_error(f"rank_table: {where} must be an object, got {type(value).__name__}")
    return value


def _list(where: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise_param_error(f"rank_table: {where} must be a list, got {type(value).__name__}")
    return value


def _device(where: str, server_id: str, dev: object) -> RankEntry:
    d = _object(where, dev)
    for key in ("rank_id", "device_id"):
        if key not in d:
            raise_param_error(f"rank_table: {where} has no {key}")
    listen = None
    if "listen_ip_info" in d:
        text = d["listen_ip_info"]
        if not isinstance(text, str):
            raise_param_error(f"rank_table: {where}.listen_ip_info must be a string 'ip:port'")
        listen = parse_listen_ip_info(text, f"rank_table: {where}.listen_ip_info")
        if listen[1] == 0:
            raise_param_error(f"rank_table: {where}.listen_ip_info needs a port, not 0")
    ip = d.get("device_ip")
    return RankEntry(
        rank_id=_rank_id(where, d["rank_id"]),
        server_id=server_id,
        device_id=_text_id(f"{where}.device_id", d["device_id"]),
        device_ip=None if ip is None else str(ip),
        listen=listen,
    )


def _check_super_pods(value: object, server_ids: set[str]) -> None:
    for i, pod in enumerate(_list("super_pod_list", value)):
        where = f"super_pod_list[{i}]"
        p = _object(where, pod)
        if "super_pod_id" not in p:
            raise_param_error(f"rank_table: {where} has no super_pod_id")
        _text_id(f"{where}.super_pod_id", p["super_pod_id"])
        if "server_list" not in p:
            raise_param_error(f"rank_table: {where} has no server_list")
        for j, server in enumerate(_list(f"{where}.server_list", p["server_list"])):
            s = _object(f"{where}.server_list[{j}]", server)
            if "server_id" not in s:
                raise_param_error(f"rank_table: {where}.server_list[{j}] has no server_id")
            sid = _text_id(f"{where}.server_list[{j}].server_id", s["server_id"])
            if sid not in server_ids:
                raise_param_error(
                    f"rank_table: {where} names server {sid!r}, which is not in server_list"
                )


def parse_rank_table(text: str) -> RankTable:
    """Parses and validates an upstream rank table.

    Raises:
        TypeError: ``text`` is not a ``str``.
        LLMParamError: not JSON, not an object, or any rule of the module docstring broken.
    """
    if not isinstance(text, str):
        raise TypeError(f"rank_table must be str, got {type(text).__name__}")
    if len(text) > _MAX_RANK_TABLE_CHARS:
        raise_param_error(f"rank_table is longer than {_MAX_RANK_TABLE_CHARS} characters")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise_param_error(f"rank_table is not JSON: {e}")
    table = _object("the document", doc)
    version = table.get("version")
    if version not in RANK_TABLE_VERSIONS:
        raise_param_error(
            f"rank_table: version must be one of {list(RANK_TABLE_VERSIONS)}, got {version!r}"
        )
    if "server_list" not in table:
        raise_param_error("rank_table has no server_list")
    servers = _list("server_list", table["server_list"])
    if "server_count" in table:
        count = table["server_count"]
        ok = (isinstance(count, str) and is_decimal(count)) or (
            isinstance(count, int) and not isinstance(count, bool)
        )
        if not ok or int(count) != len(servers):
            raise_param_error(
                f"rank_table: server_count {count!r} does not match the {len(servers)} "
                "entries of server_list"
            )
    ranks: dict[int, RankEntry] = {}
    server_ids: set[str] = set()
    for i, server in enumerate(servers):
        s = _object(f"server_list[{i}]", server)
        if "server_id" not in s:
            raise_param_error(f"rank_table: server_list[{i}] has no server_id")
        sid = _text_id(f"server_list[{i}].server_id", s["server_id"])
        server_ids.add(sid)
        if "device" not in s:
            raise_param_error(f"rank_table: server_list[{i}] has no device list")
        for j, dev in enumerate(_list(f"server_list[{i}].device", s["device"])):
            entry = _device(f"server_list[{i}].device[{j}]", sid, dev)
            if entry.rank_id in ranks:
                raise_param_error(f"rank_table: rank_id {entry.rank_id} appears twice")
            ranks[entry.rank_id] = entry
    if "super_pod_list" in table:
        _check_super_pods(table["super_pod_list"], server_ids)
    return RankTable(str(version), ranks)
