"""``cma``: same host, user-registered memory; one-sided ``process_vm_readv/writev``.

Needs the kernel's permission to access the peer's memory (same user, and a
ptrace policy that allows it: ``/proc/sys/kernel/yama/ptrace_scope``). The
link probes it once; when refused, the link falls back to TCP. Every copy runs
under the remote cache's lease (the peer's lease page arrives on the link's fd
channel), so a peer's memory is read or written only while it is registered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import _native
from .._executor import ONE_SIDED_INLINE_MAX_BYTES
from .._leases import leased, stale_as_lease_stale
from ..config import DataPath
from ..errors import LLMStatusCode, failure
from .base import Call, CopyLane, LayerCut, Path

if TYPE_CHECKING:
    from .._caches import CacheEntry, CacheTable
    from .._fdchannel import FdChannel
    from .._leases import LeasePage

__all__ = ["CmaPath"]


class CmaPath(Path):
    """Copies to and from the peer process by pid.

    Args:
        pid: the peer's process id (probed once: ``allowed``, or refused with ``errno``).
        table: the peer's cache table, as the link mirrors it.
    """

    kinds = (DataPath.CMA,)

    def __init__(self, pid: int, table: CacheTable) -> None:
        self.pid = pid
        self._table = table
        self.allowed, self.errno = _native.cma_probe(pid)
        self.fds: FdChannel | None = None

    @property
    def remote_table(self) -> CacheTable:
        return self._table

    async def _lease(self, call: Call, remote: CacheEntry) -> tuple[LeasePage, int, int]:
        """The peer's lease page, and the remote cache's slot and generation."""
        if self.fds is None or self.fds.closed or remote.lease is None:
            raise failure(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                f"no lease for remote cache {remote.cache_id}: cma is not used without one",
            )
        page = await self.fds.peer_page(call.deadline)
        slot, gen = remote.lease
        return page, slot, gen

    async def _leased(
        self,
        call: Call,
        remote: CacheEntry,
        job: Callable[[_native.Control], None],
        writes: bool = False,
    ) -> Callable[[_native.Control], None]:
        page, slot, gen = await self._lease(call, remote)
        return leased(page, slot, gen, None, remote.cache_id, job, writes=writes)

    def lane(self, remote: CacheEntry, local: CacheEntry) -> CopyLane | None:
        fds = self.fds
        if fds is None or fds.closed:
            return None
        page = fds.page
        if page is None or remote.lease is None:
            return None
        slot, gen = remote.lease
        copy = _native.LaneCopy(
            self.pid,
            remote.geometry,
            local.geometry,
            remote.addrs,
            local.addrs,
            page.addr(slot),
            gen,
            ONE_SIDED_INLINE_MAX_BYTES,
        )

        def alive() -> bool:
            return not fds.closed and fds.page is page and not page.closed

        return CopyLane(DataPath.CMA, copy, alive, remote.cache_id, keep=(page,))

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        job = functools.partial(
            _read, self.pid, plan, remote.addrs, local.addrs, call.mover_threads
        )
        # process_vm_readv never waits on the peer: a tiny one runs inline (see the limit).
        await call.run(
            await self._leased(call, remote, job),
            local_bytes=plan.total_bytes,
            inline_max=ONE_SIDED_INLINE_MAX_BYTES,
            fair=True,
        )

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
        # One process_vm_readv job over the whole plan, each layer signalled on cut.fd once
        # it landed and the lease was seen still current; never inline (see InprocPath).
        # The job enters the lease before a byte moves and leaves it at the end (as
        # ``leased``), on a mover thread started as it is queued.
        page, slot, gen = await self._lease(call, remote)
        start = functools.partial(
            _native.start_layered,
            self.pid,
            plan,
            remote.addrs,
            local.addrs,
            cut.bounds(plan),
            threads=call.mover_threads,
            efd=cut.fd,
            lease_addr=page.addr(slot),
            lease_gen=gen,
        )
        stale = stale_as_lease_stale(call.api, remote.cache_id, (page,))
        await call.run(call.executor.prestart(start, stale))

    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        job = functools.partial(
            _write, self.pid, plan, local.addrs, remote.addrs, call.mover_threads
        )
        await call.run(
            await self._leased(call, remote, job, writes=True),
            local_bytes=plan.total_bytes,
            inline_max=ONE_SIDED_INLINE_MAX_BYTES,
            fair=True,
        )


def _read(
    pid: int,
    plan: _native.Plan,
    src: list[int],
    dst: list[int],
    threads: int,
    control: _native.Control,
) -> None:
    _native.cma_read(pid, plan, src, dst, control, threads)


def _write(
    pid: int,
    plan: _native.Plan,
    src: list[int],
    dst: list[int],
    threads: int,
    control: _native.Control,
) -> None:
    _native.cma_write(pid, plan, src, dst, control, threads)
