"""``shm``: same host, the peer's cache lives in a shared-memory (memfd) segment.

The decoder maps the peer's segment once (per link) from the fd the peer sent over
the link's fd channel (never by name), and copies one-sidedly with the native local
mover under the cache's lease: no peer CPU involved. Only caches the peer allocated
with ``allocate_*`` live in shared memory. Segments are sealed against shrinking,
so nothing the peer does to its segment can fault a copy here (no SIGBUS).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

from .. import _native
from .._executor import ONE_SIDED_INLINE_MAX_BYTES
from .._leases import leased, stale_as_lease_stale
from ..config import DataPath
from ..errors import LLMStatusCode, failure, from_native
from .base import Call, CopyLane, LayerCut, Path

if TYPE_CHECKING:
    from .._caches import CacheEntry, CacheTable
    from .._fdchannel import FdChannel

__all__ = ["ShmPath"]


class ShmPath(Path):
    """The mappings of one link's peer segments, and copies through them.

    Args:
        pid: the peer's process id (its segments' names carry it).
        table: the peer's cache table, as the link mirrors it.
    """

    kinds = (DataPath.SHM,)

    def __init__(self, pid: int, table: CacheTable) -> None:
        self._table = table
        # Segments are labelled after the process that made them (``/aiodd-<pid>-...``):
        # a label that is not the peer's is refused (a confused or lying peer).
        self._prefix = f"/aiodd-{pid}-"
        self._maps: dict[tuple[str, bool], _native.ShmSegment] = {}
        # The link's fd channel (segments and the peer's lease page arrive on it).
        self.fds: FdChannel | None = None
        # Copies running on the executor with addresses inside the mappings, and whether
        # close() came meanwhile: unmapping under a running copy would crash the process.
        self._busy = 0
        self._close_pending = False

    @property
    def remote_table(self) -> CacheTable:
        return self._table

    @staticmethod
    def applies(remote: CacheEntry) -> bool:
        return remote.shm_name is not None and remote.shm_size > 0

    def _channel(self) -> FdChannel:
        if self.fds is None or self.fds.closed:
            raise failure(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                "the link has no fd channel: shared memory cannot be mapped",
            )
        return self.fds

    async def _segment(self, call: Call, remote: CacheEntry, writable: bool) -> _native.ShmSegment:
        name = remote.shm_name
        if name is None:
            raise failure(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                f"remote cache {remote.cache_id} is not in shared memory",
            )
        if not name.startswith(self._prefix):
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"remote cache {remote.cache_id} names segment {name!r}, which is not the peer's",
            )
        key = (name, writable)
        seg = self._maps.get(key)
        if seg is None or seg.closed:
            fd, size = await self._channel().segment_fd(name, call.deadline)
            if size < remote.shm_size:
                raise failure(
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"the peer's segment {name!r} holds {size} bytes, its table says "
                    f"{remote.shm_size}",
                )
            try:
                seg = _native.ShmSegment.from_fd(fd, remote.shm_size, writable, name)
            except _native.NativeError as e:
                raise from_native(e) from e
            self._maps[key] = seg
        if seg.size < remote.shm_size:
            # Another table entry naming this segment was mapped with a smaller size: the
            # offsets checked against this entry's shm_size would reach past our mapping
            # (a crash, or a copy into whatever else this process has mapped there).
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"remote cache {remote.cache_id} claims {remote.shm_size} bytes of segment "
                f"{name!r}, which the peer gave as {seg.size} bytes",
            )
        return seg

    async def _job(
        self,
        call: Call,
        remote: CacheEntry,
        writable: bool,
        plan: _native.Plan,
        local: CacheEntry,
    ) -> Any:
        fds = self._channel()
        page = await fds.peer_page(call.deadline)
        seg = await self._segment(call, remote, writable)
        addrs = [seg.addr + off for off in remote.shm_offsets]
        src, dst = (local.addrs, addrs) if writable else (addrs, local.addrs)
        assert remote.lease is not None  # RemotePath.path_for checks it
        slot, gen = remote.lease
        copy = functools.partial(_copy, seg, plan, src, dst, call.mover_threads)
        return leased(page, slot, gen, None, remote.cache_id, copy, writes=writable)

    def lane(self, remote: CacheEntry, local: CacheEntry) -> CopyLane | None:
        fds = self.fds
        if fds is None or fds.closed:
            return None
        page = fds.page
        name = remote.shm_name
        if page is None or remote.lease is None or name is None:
            return None
        key = (name, False)
        seg = self._maps.get(key)
        if seg is None or seg.closed or seg.size < remote.shm_size:
            return None  # (the pull that went the whole way mapped it, and checked it)
        slot, gen = remote.lease
        addrs = [seg.addr + off for off in remote.shm_offsets]
        copy = _native.LaneCopy(
            0,
            remote.geometry,
            local.geometry,
            addrs,
            local.addrs,
            page.addr(slot),
            gen,
            ONE_SIDED_INLINE_MAX_BYTES,
        )
        maps = self._maps

        def alive() -> bool:
            return (
                not fds.closed
                and fds.page is page
                and not page.closed
                and maps.get(key) is seg
                and not seg.closed
            )

        return CopyLane(DataPath.SHM, copy, alive, remote.cache_id, keep=(page, seg))

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        job = await self._job(call, remote, False, plan, local)
        await self._run(call, job, plan)

    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        job = await self._job(call, remote, True, plan, local)
        await self._run(call, job, plan)

    async def pull_layers(
        self,
        plan: _native.Plan,
        remote: CacheEntry,
        local: CacheEntry,
        call: Call,
        cut: LayerCut,
    ) -> None:
        if plan.total_bytes <= ONE_SIDED_INLINE_MAX_BYTES:  # see Path.pull_at_once
            await self.pull_at_once(plan, remote, local, call, cut)
            return
        # One native job over the whole plan (the mapping's copy under the lease), each
        # layer signalled on cut.fd once it landed and the lease was seen still current;
        # started on a mover thread as it is queued, and never inline (see InprocPath).
        page = await self._channel().peer_page(call.deadline)
        seg = await self._segment(call, remote, False)
        assert remote.lease is not None  # RemotePath.path_for checks it
        slot, gen = remote.lease
        start = functools.partial(
            _native.start_layered,
            0,
            plan,
            [seg.addr + off for off in remote.shm_offsets],
            local.addrs,
            cut.bounds(plan),
            threads=call.mover_threads,
            efd=cut.fd,
            lease_addr=page.addr(slot),
            lease_gen=gen,
        )
        stale = stale_as_lease_stale(call.api, remote.cache_id, (page, seg))
        await self._run(call, call.executor.prestart(start, stale), plan, inline=False)

    async def _run(self, call: Call, job: Any, plan: _native.Plan, inline: bool = True) -> None:
        self._busy += 1
        try:
            # Returns (even when cancelled) only once the native copy has. A layered job
            # never runs inline: the loop hands its layers over while it moves the rest.
            await call.run(
                job,
                local_bytes=plan.total_bytes if inline else -1,
                inline_max=ONE_SIDED_INLINE_MAX_BYTES,
                fair=True,
            )
        finally:
            self._busy -= 1
            if self._close_pending and not self._busy:
                self.unmap()

    @property
    def busy(self) -> bool:
        """Whether a copy through the mappings is running (they stay mapped meanwhile)."""
        return self._busy > 0

    def forget(self, live_names: set[str], busy: bool) -> None:
        """Unmaps segments the peer no longer lists (not while transfers run)."""
        if busy or self._busy:
            return
        for key in [k for k in self._maps if k[0] not in live_names]:
            with contextlib.suppress(Exception):
                self._maps.pop(key).close()

    async def close(self) -> None:
        self.unmap()

    def unmap(self) -> None:
        """Unmaps every segment; while copies run, once the last one has returned."""
        if self._busy:
            self._close_pending = True
            return
        self._close_pending = False
        for seg in self._maps.values():
            with contextlib.suppress(Exception):
                seg.close()
        self._maps.clear()


def _copy(
    seg: _native.ShmSegment,
    plan: _native.Plan,
    src: list[int],
    dst: list[int],
    threads: int,
    control: _native.Control,
) -> None:
    # ``seg`` rides along so the mapping outlives the job whatever happens to the path.
    del seg
    _native.copy_local(plan, src, dst, control, threads)
