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
from .._leases import leased
from ..errors import LLMException, LLMStatusCode, format_error
from .base import Call

if TYPE_CHECKING:
    from .._caches import CacheEntry
    from .._leases import FdChannel

__all__ = ["CmaPath"]


class CmaPath:
    """Copies to and from the peer process by pid."""

    name = "cma"

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.allowed, self.errno = _native.cma_probe(pid)
        self.fds: FdChannel | None = None

    async def _leased(
        self, call: Call, remote: CacheEntry, job: Callable[[_native.Control], None]
    ) -> Callable[[_native.Control], None]:
        if self.fds is None or self.fds.closed or remote.lease is None:
            raise LLMException(
                format_error(
                    call.api,
                    LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                    f"no lease for remote cache {remote.cache_id}: cma is not used without one",
                ),
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        page = await self.fds.peer_page(call.deadline, call.api)
        slot, gen = remote.lease
        return leased(page, slot, gen, call.api, remote.cache_id, job)

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        job = functools.partial(
            _read, self.pid, plan, remote.addrs, local.addrs, call.mover_threads
        )
        await call.run(await self._leased(call, remote, job))

    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        job = functools.partial(
            _write, self.pid, plan, local.addrs, remote.addrs, call.mover_threads
        )
        await call.run(await self._leased(call, remote, job))


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
