"""``shm``: same host, the peer's cache lives in a shared-memory segment.

The decoder maps the peer's segment once (per link) and copies one-sidedly
with the native local mover: no peer CPU involved. Only caches the peer
allocated with ``allocate_*`` live in shared memory.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

from .. import _native
from ..errors import LLMException, LLMStatusCode, format_error, from_native
from .base import Call, local_copy

if TYPE_CHECKING:
    from .._caches import CacheEntry

__all__ = ["ShmPath"]


class ShmPath:
    """The mappings of one link's peer segments, and copies through them."""

    name = "shm"

    def __init__(self, pid: int) -> None:
        # Segments are named after the process that made them (``/aiodd-<pid>-...``): the
        # peer may only have us map its own, never another process's.
        self._prefix = f"/aiodd-{pid}-"
        self._maps: dict[tuple[str, bool], _native.ShmSegment] = {}
        # Copies running on the executor with addresses inside the mappings, and whether
        # close() came meanwhile: unmapping under a running copy would crash the process.
        self._busy = 0
        self._close_pending = False

    @staticmethod
    def applies(remote: CacheEntry) -> bool:
        return remote.shm_name is not None and remote.shm_size > 0

    def _addrs(self, api: str, remote: CacheEntry, writable: bool) -> list[int]:
        if remote.shm_name is None:
            raise LLMException(
                format_error(
                    api,
                    LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                    f"remote cache {remote.cache_id} is not in shared memory",
                ),
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        if not remote.shm_name.startswith(self._prefix):
            raise LLMException(
                format_error(
                    api,
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"remote cache {remote.cache_id} names segment {remote.shm_name!r}, "
                    "which is not the peer's",
                ),
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        key = (remote.shm_name, writable)
        seg = self._maps.get(key)
        if seg is None or seg.closed:
            try:
                seg = _native.ShmSegment.open(remote.shm_name, remote.shm_size, writable)
            except _native.NativeError as e:
                raise from_native(e, api) from e
            self._maps[key] = seg
        return [seg.addr + off for off in remote.shm_offsets]

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        src = self._addrs(call.api, remote, writable=False)
        await self._run(
            call, functools.partial(local_copy, plan, src, local.addrs, call.mover_threads), plan
        )

    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        dst = self._addrs(call.api, remote, writable=True)
        await self._run(
            call, functools.partial(local_copy, plan, local.addrs, dst, call.mover_threads), plan
        )

    async def _run(self, call: Call, job: Any, plan: _native.Plan) -> None:
        self._busy += 1
        try:
            # Returns (even when cancelled) only once the native copy has.
            await call.run(job, local_bytes=plan.total_bytes)
        finally:
            self._busy -= 1
            if self._close_pending and not self._busy:
                self.close()

    def forget(self, live_names: set[str], busy: bool) -> None:
        """Unmaps segments the peer no longer lists (not while transfers run)."""
        if busy or self._busy:
            return
        for key in [k for k in self._maps if k[0] not in live_names]:
            with contextlib.suppress(Exception):
                self._maps.pop(key).close()

    def close(self) -> None:
        """Unmaps every segment; while copies run, once the last one has returned."""
        if self._busy:
            self._close_pending = True
            return
        self._close_pending = False
        for seg in self._maps.values():
            with contextlib.suppress(Exception):
                seg.close()
        self._maps.clear()
