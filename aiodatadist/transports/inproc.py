"""``inproc``: both instances live in this process; native memcpy of the plan's segments."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from .. import _native
from .._caches import require_host_memory
from .._executor import INLINE_MAX_BYTES
from ..config import DataPath
from .base import Call, CopyLane, LayerCut, Path, local_copy

if TYPE_CHECKING:
    from .._caches import CacheEntry, CacheTable

__all__ = ["InprocPath"]


class InprocPath(Path):
    """Reads and writes the peer's caches directly; the peer's table is always current."""

    kinds = (DataPath.INPROC,)
    used = DataPath.INPROC

    def __init__(self, peer_table: CacheTable) -> None:
        self._table = peer_table

    @property
    def remote_table(self) -> CacheTable:
        return self._table

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        require_host_memory("inproc", remote, local)  # (device memory: engines only)
        await call.run(
            functools.partial(local_copy, plan, remote.addrs, local.addrs, call.mover_threads),
            local_bytes=plan.total_bytes,
        )

    def lane(self, remote: CacheEntry, local: CacheEntry) -> CopyLane | None:
        if remote.device_id is not None or local.device_id is not None:
            return None
        # In one process the inline bound of local copies applies (INLINE_MAX_BYTES).
        copy = _native.LaneCopy(
            0, remote.geometry, local.geometry, remote.addrs, local.addrs, 0, 0, INLINE_MAX_BYTES
        )
        # The peer's cache is this process's: held while a copy runs (a free waits).
        return CopyLane(
            DataPath.INPROC,
            copy,
            lambda: not remote.freed,
            remote.cache_id,
            holds=(remote,),
            max_bytes=INLINE_MAX_BYTES,
        )

    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        require_host_memory("inproc", local, remote)
        await call.run(
            functools.partial(local_copy, plan, local.addrs, remote.addrs, call.mover_threads),
            local_bytes=plan.total_bytes,
        )

    async def pull_layers(
        self,
        plan: _native.Plan,
        remote: CacheEntry,
        local: CacheEntry,
        call: Call,
        cut: LayerCut,
    ) -> None:
        require_host_memory("inproc", remote, local)
        if plan.total_bytes <= INLINE_MAX_BYTES:  # copied inline: see Path.pull_at_once
            await self.pull_at_once(plan, remote, local, call, cut)
            return
        # One native job over the whole plan: threads and copy kernel chosen on the whole,
        # each layer signalled on cut.fd from the mover threads (never inline: the loop
        # must stay free to hand layers over while the rest moves). Started on a mover
        # thread as it is queued (no worker handoff before the first layer's bytes).
        start = functools.partial(
            _native.start_layered,
            0,
            plan,
            remote.addrs,
            local.addrs,
            cut.bounds(plan),
            threads=call.mover_threads,
            efd=cut.fd,
            lease_addr=0,
            lease_gen=0,
        )
        await call.run(call.executor.prestart(start))
