"""The channel of a cross-process link: picks ``shm``, ``cma`` or ``tcp`` per transfer.

Automatic choice (fastest that applies): on the same host, ``shm`` when the
peer's cache lives in shared memory, else ``cma`` when the kernel allows it,
else ``tcp``; across hosts ``tcp``. ``aiodatadist.DataPath`` forces one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _native
from ..errors import LLMException, LLMStatusCode, format_error
from .base import Call, Channel
from .cma import CmaPath
from .shm import ShmPath
from .tcp import TcpPath

if TYPE_CHECKING:
    from .._caches import CacheEntry, CacheTable
    from .._control import Peer

__all__ = ["RemoteChannel"]


class RemoteChannel(Channel):
    """Data paths to one peer process, with its mirrored cache table."""

    def __init__(self, peer: Peer, forced: str) -> None:
        self.peer = peer
        self.forced = forced
        peer_paths = set(peer.info.data_paths)
        self.shm = ShmPath(peer.info.pid) if peer.same_host and "shm" in peer_paths else None
        cma = CmaPath(peer.info.pid) if peer.same_host and "cma" in peer_paths else None
        self.cma = cma if cma is not None and cma.allowed else None
        self.cma_refused_errno = cma.errno if cma is not None and not cma.allowed else 0
        self.tcp = TcpPath(peer) if "tcp" in peer_paths else None

    @property
    def name(self) -> str:  # type: ignore[override]
        if self.forced in ("shm", "cma", "tcp"):
            return self.forced
        if self.shm is not None or self.cma is not None:
            return "shm" if self.cma is None else ("shm+cma" if self.shm is not None else "cma")
        return "tcp"

    @property
    def remote_table(self) -> CacheTable:
        return self.peer.table

    def path_for(self, api: str, remote: CacheEntry) -> ShmPath | CmaPath | TcpPath:
        forced = self.forced
        candidates: list[ShmPath | CmaPath | TcpPath | None]
        if forced == "shm":
            candidates = [self.shm if self.shm is not None and ShmPath.applies(remote) else None]
        elif forced == "cma":
            candidates = [self.cma]
        elif forced == "tcp":
            candidates = [self.tcp]
        else:
            shm = self.shm if self.shm is not None and ShmPath.applies(remote) else None
            candidates = [shm, self.cma, self.tcp]
        for c in candidates:
            if c is not None:
                return c
        why = f"no usable data path to cluster {self.peer.info.cluster_id}"
        if forced != "auto":
            why += f" (forced '{forced}'"
            if forced == "cma" and self.cma_refused_errno:
                why += f"; process_vm_readv refused: errno {self.cma_refused_errno}"
            if not self.peer.same_host and forced in ("shm", "cma"):
                why += "; the peer is on another host"
            why += ")"
        raise LLMException(
            format_error(api, LLMStatusCode.LLM_FEATURE_NOT_ENABLED, why),
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )

    def _unmap_freed(self) -> None:
        # Segments of caches the peer freed stay mapped (and their memory alive) until
        # unmapped here. Transfers on a link are serialized by its FIFO slot, so no
        # transfer uses a mapping while this runs.
        if self.shm is not None:
            self.shm.forget({e.shm_name for e in self.peer.table if e.shm_name}, busy=False)

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        self._unmap_freed()
        await self.path_for(call.api, remote).pull(plan, remote, local, call)

    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        self._unmap_freed()
        await self.path_for(call.api, remote).push(plan, local, remote, call)

    async def refresh(self, deadline: float | None) -> bool:
        await self.peer.refresh(deadline)
        return True

    async def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        await self.peer.unlink()
