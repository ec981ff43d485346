"""``cma``: same host, user-registered memory; one-sided ``process_vm_readv/writev``.

Needs the kernel's permission to access the peer's memory (same user, and a
ptrace policy that allows it: ``/proc/sys/kernel/yama/ptrace_scope``). The
link probes it once; when refused, the link falls back to TCP.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from .. import _native
from .base import Call

if TYPE_CHECKING:
    from .._caches import CacheEntry

__all__ = ["CmaPath"]


class CmaPath:
    """Copies to and from the peer process by pid."""

    name = "cma"

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.allowed, self.errno = _native.cma_probe(pid)

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        await call.run(
            functools.partial(_read, self.pid, plan, remote.addrs, local.addrs, call.mover_threads)
        )

    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        await call.run(
            functools.partial(_write, self.pid, plan, local.addrs, remote.addrs, call.mover_threads)
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
