"""What a cross-process data path needs from its link's control connection.

The control plane (:mod:`aiodatadist._control`) owns the connection: the handshake,
table sync, ping and close. The paths of a cross-process link (``tcp`` above all:
its requests and replies travel on that connection) use it only through
:class:`ControlLink`, which ``_control.Peer`` satisfies. Defining it here, below
both, keeps the transports from importing the control plane (no cycle).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .. import _wire
    from .._caches import CacheTable
    from ..config import DataPath

__all__ = ["ControlLink", "PeerInfo"]


@dataclass
class PeerInfo:
    """Who the peer said it is in the handshake (``data_paths``: what it offers;
    ``engines``: the transfer engines it runs and how to reach them, by name, replaced
    by every table update that carries them)."""

    cluster_id: int
    host_id: str
    pid: int
    role: int
    data_paths: list[DataPath] = field(default_factory=list)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)


class ControlLink(Protocol):
    """One link's control connection, as the data paths see it.

    Attributes:
        info: the peer's identity and offered data paths.
        is_client: this side linked (it opens the tcp data streams).
        endpoint: the peer's listen address (the client's only).
        link_token: the secret the handshake gave this link (data streams and the fd
            channel prove it).
        same_host: the peer is on this host and verifiably the process it claims to be
            (only then may one-sided paths act on its pid).
        table: the peer's cache table, mirrored.
        closed: set once the connection closed (every request then fails).
    """

    info: PeerInfo
    is_client: bool
    endpoint: tuple[str, int] | None
    link_token: str
    same_host: bool
    table: CacheTable
    closed: asyncio.Event

    async def send(
        self, msg_type: _wire.MsgType, body: dict[str, Any], binary: bytes = b""
    ) -> None:
        """Sends one message (raises LLM_LINK_FAILED when the link is or gets closed)."""

    async def request(
        self, msg_type: _wire.MsgType, body: dict[str, Any], binary: bytes
    ) -> tuple[int, asyncio.Future[dict[str, Any]]]:
        """Sends a request under a new id; the future gets the peer's DONE body."""

    def forget_request(self, req: int) -> None:
        """Stops tracking ``req``: its DONE, if one still comes, is dropped."""

    def cancel_soon(self, req: int, epoch: int) -> None:
        """Tells the peer (in the background) that ``req`` and streams of ``epoch`` are dead."""

    async def close(self, reason: str = "closed") -> None:
        """Closes the connection (and with it the link)."""

    def table_changed(self) -> None:
        """Our table changed: the peer gets a TABLE soon."""

    async def refresh(self, deadline: float | None) -> None:
        """Returns once every table the peer sent before now has been applied.

        Raises:
            LLMTimeoutError: the deadline passed first.
        """

    async def unlink(self) -> None:
        """Says goodbye and closes the connection."""
