"""The path of a cross-process link: picks ``shm``, ``cma``, ``tcp`` or an engine per transfer.

Automatic choice (fastest that applies): on the same host, ``shm`` when the
peer's cache lives in shared memory, else ``cma`` when the kernel allows it,
else ``tcp``; across hosts ``tcp``. A cache in device memory (either end) goes
over the first engine both sides run that moves device memory (NIXL); our own
paths never touch device memory. ``aiodatadist.DataPath`` forces one path (an
engine too: ``nixl``, ``mooncake``).

The one-sided paths (``shm``, ``cma``) need the link's fd channel (the peer's
segments and lease page come on it) and a lease on the remote cache: without
either, a cache goes over ``tcp`` (or, with the path forced,
``LLM_FEATURE_NOT_ENABLED``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .. import _native
from .._fdchannel import HELLO_TIMEOUT, FdChannel, connect_channel
from .._lease_book import LeaseBook
from ..config import DataPath
from ..errors import LLMException, LLMStatusCode, failure
from .base import Call, Lane, LayerCut, Path
from .cma import CmaPath
from .engine import EngineAgent, EnginePath, on_device
from .shm import ShmPath
from .tcp import TcpPath

if TYPE_CHECKING:
    from .._caches import CacheEntry, CacheTable
    from .tcp import TcpLink

__all__ = ["RemotePath"]

log = logging.getLogger("aiodatadist.transports.select")


class RemotePath(Path):
    """Data paths to one peer process, with its mirrored cache table."""

    def __init__(
        self, peer: TcpLink, forced: DataPath, engines: Sequence[EngineAgent] = ()
    ) -> None:
        self.peer = peer
        self.forced = forced
        offered = set(peer.info.data_paths)
        # Engines this side runs that the server offers (the peer's info says whether
        # it runs them too: checked per transfer, see _engine()).
        self.engines = {a.kind: EnginePath(a, peer) for a in engines if a.kind in offered}
        self.engines_run = {a.kind for a in engines}  # the ones this side runs
        same_host, pid, table = peer.same_host, peer.info.pid, peer.table
        self.shm = ShmPath(pid, table) if same_host and DataPath.SHM in offered else None
        cma = CmaPath(pid, table) if same_host and DataPath.CMA in offered else None
        self.cma = cma if cma is not None and cma.allowed else None
        self.cma_refused_errno = cma.errno if cma is not None and not cma.allowed else 0
        self.tcp = TcpPath(peer) if DataPath.TCP in offered else None
        if self.engines and same_host:
            readable = self.cma is not None or (cma is None and _native.cma_probe(pid)[0])
            for e in self.engines.values():
                e.inline_ok = readable and e.agent.copies_inline_on_host
        # The link's fd channel: attached at link time (client) or once the peer has
        # connected and proved the link token (server). ``fds_settled`` is set when it
        # is attached or will not be; transfers wait for it, bounded.
        self.fds: FdChannel | None = None
        self.fds_settled = asyncio.Event()
        self._settle_by = asyncio.get_running_loop().time() + HELLO_TIMEOUT
        if not peer.same_host or (self.shm is None and self.cma is None and not self.engines):
            self.fds_settled.set()
        peer.table.on_replace = self._forget_fds
        # Transfers in pull()/push() (their native jobs have returned when they leave),
        # and whether the peer closed meanwhile: its mappings go once none runs.
        self._running = 0
        self._unmap_pending = False
        # The peer table's version _unmap_freed last ran at in full: it has nothing to
        # let go of until the table changes (it cost ~10 us of every tiny pull).
        self._swept_version = -1

    def _forget_fds(self) -> None:
        # A table update: fds of segments the peer freed are closed now (their memory is
        # released once unmapped too); mappings wait for the next transfer (in the slot).
        if self.fds is not None:
            self.fds.forget({e.shm_name for e in self.peer.table if e.shm_name})

    def connect_fds(self, name: str | None, book: LeaseBook) -> None:
        """Client side: connects to the server's fd socket ``name`` (from WELCOME). When it
        cannot, the link still works: one-sided paths are not used (tcp)."""
        if name is None or self.fds_settled.is_set():
            self.fds_settled.set()
            return
        try:
            chan = connect_channel(
                name, self.peer.link_token, asyncio.get_running_loop(), self.peer.info.pid
            )
        except OSError as e:
            log.debug("no fd channel to cluster %d (%s): tcp only", self.peer.info.cluster_id, e)
            self.fds_settled.set()
            return
        self.attach_fds(chan, book)

    def attach_fds(self, chan: FdChannel, book: LeaseBook) -> None:
        if self.fds is not None or self.peer.closed.is_set():
            chan.close()
            return
        self.fds = chan
        for p in (self.shm, self.cma, *self.engines.values()):
            if p is not None:
                p.fds = chan
        chan.start(book)
        self.fds_settled.set()

    def peer_closed(self) -> None:
        """The control connection closed: the fd channel stops (our page is revoked); the
        peer's page stays mapped until :meth:`close` (a running copy may use it)."""
        self.fds_settled.set()
        if self.fds is not None:
            self.fds.close()
        # The link is gone from the registry (nobody will unlink it): the peer's segments
        # and lease page are unmapped here, or they (and a dead peer's memory with them)
        # would stay mapped for the life of this process.
        if self._running:
            self._unmap_pending = True
        else:
            self._unmap_all()

    def _unmap_all(self) -> None:
        self._unmap_pending = False
        self._close_engines()
        if self.shm is not None:
            self.shm.unmap()
        if self.fds is not None:
            self.fds.release_page()

    def _done(self) -> None:
        self._running -= 1
        if self._unmap_pending and not self._running:
            self._unmap_all()

    async def _settle(self, deadline: float | None) -> None:
        if self.fds_settled.is_set():
            return
        bound = self._settle_by if deadline is None else min(deadline, self._settle_by)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(bound):
                await self.fds_settled.wait()

    def _leased(self, remote: CacheEntry) -> bool:
        return self.fds is not None and not self.fds.closed and remote.lease is not None

    def _close_engines(self) -> None:
        # No transfer runs (the link's slot, or none left): connections can go.
        for p in self.engines.values():
            p.close_conn()

    def _engine(self, kind: DataPath) -> EnginePath | None:
        p = self.engines.get(kind)
        return p if p is not None and kind.value in self.peer.info.engines else None

    @property
    def kinds(self) -> tuple[DataPath, ...]:  # type: ignore[override]
        if self.forced in DataPath.remote() or self.forced in DataPath.engines():
            return (self.forced,)
        usable = {DataPath.SHM: self.shm, DataPath.CMA: self.cma, DataPath.TCP: self.tcp}
        found = tuple(k for k, p in usable.items() if p is not None)
        found += tuple(k for k in self.engines if self._engine(k) is not None)
        return found or (DataPath.TCP,)

    def table_changed(self) -> None:
        self.peer.table_changed()

    @property
    def remote_table(self) -> CacheTable:
        return self.peer.table

    def _engine_for(self, forced: DataPath, device: bool) -> Path:
        # A forced engine, or auto with device memory at either end.
        if forced in DataPath.engines():
            p = self._engine(forced)
            if p is not None:
                return p
            why = (
                "this instance does not run it (aiodatadist.Engines)"
                if forced not in self.engines_run
                else "the peer does not run it"
            )
            raise failure(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                f"data path '{forced}' to cluster {self.peer.info.cluster_id}: {why}",
            )
        for kind in DataPath.engines():
            p = self._engine(kind)
            if p is not None and p.agent.moves_device_memory:
                return p
        raise failure(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            f"a cache in device memory needs an engine that moves it (nixl) on both ends of "
            f"the link to cluster {self.peer.info.cluster_id}",
        )

    def path_for(self, remote: CacheEntry, local: CacheEntry | None = None) -> Path:
        """The path a transfer on ``remote`` (and ``local``) takes now (see the module's
        docstring).

        Raises:
            LLMException: LLM_FEATURE_NOT_ENABLED, no path applies (says why);
                LLM_PARAM_INVALID, device memory on a path of ours.
        """
        forced = self.forced
        device = on_device(remote) is not None or (
            local is not None and on_device(local) is not None
        )
        if forced in DataPath.engines() or (device and forced == DataPath.AUTO):
            return self._engine_for(forced, device)
        if device:
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"data path '{forced}' cannot move device memory (use auto or nixl)",
            )
        leased = self._leased(remote)
        shm = self.shm if self.shm is not None and ShmPath.applies(remote) and leased else None
        cma = self.cma if leased else None
        candidates: list[Path | None]
        if forced == DataPath.SHM:
            candidates = [shm]
        elif forced == DataPath.CMA:
            candidates = [cma]
        elif forced == DataPath.TCP:
            candidates = [self.tcp]
        else:
            candidates = [shm, cma, self.tcp]
        for c in candidates:
            if c is not None:
                return c
        why = f"no usable data path to cluster {self.peer.info.cluster_id}"
        one_sided = (DataPath.SHM, DataPath.CMA)
        if forced != DataPath.AUTO:
            why += f" (forced '{forced}'"
            if forced == DataPath.CMA and self.cma_refused_errno:
                why += f"; process_vm_readv refused: errno {self.cma_refused_errno}"
            if not self.peer.same_host and forced in one_sided:
                why += "; the peer is on another host"
            elif forced in one_sided and not leased:
                why += (
                    "; no lease for the remote cache: the link's fd channel is not up"
                    if remote.lease is not None
                    else "; the remote cache has no lease"
                )
            why += ")"
        offered = [str(p) for p in self.peer.info.data_paths]
        if offered and not set(offered) & {str(p) for p in DataPath.remote()}:
            # The peer forced an engine: only that engine, on both sides, can move bytes.
            why += (
                f"; the peer offers only {', '.join(offered)}: run that engine here too "
                "(aiodatadist.Engines) or force it (aiodatadist.DataPath)"
            )
        raise failure(LLMStatusCode.LLM_FEATURE_NOT_ENABLED, why)

    def _unmap_freed(self) -> None:
        # Segments of caches the peer freed stay mapped (and their memory alive) until
        # unmapped here. Transfers on a link are serialized by its FIFO slot, so no
        # transfer uses a mapping while this runs.
        version = self.peer.table.version
        if version == self._swept_version:
            return
        live = {e.shm_name for e in self.peer.table if e.shm_name}
        if self.shm is not None:
            if self.shm.busy:
                return  # it forgets nothing under a running copy: sweep again next time
            self.shm.forget(live, busy=False)
        if self.fds is not None:
            self.fds.forget(live)
        self._swept_version = version

    def lane(self, remote: CacheEntry, local: CacheEntry) -> Lane | None:
        # The lane of the path a transfer between these two caches takes now (settled:
        # a pull went the whole way just before).
        if not self.fds_settled.is_set():
            return None
        try:
            path = self.path_for(remote, local)
        except LLMException:
            return None
        return path.lane(remote, local)

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        self._running += 1
        try:
            await self._settle(call.deadline)
            self._unmap_freed()
            path = self.path_for(remote, local)
            self.used = path.kinds[0]  # serialized by the link's slot: read by the runner
            await path.pull(plan, remote, local, call)
        finally:
            self._done()

    async def pull_layers(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call, cut: LayerCut
    ) -> None:
        # As pull(): the path chosen for this transfer moves it, layer by layer.
        self._running += 1
        try:
            await self._settle(call.deadline)
            self._unmap_freed()
            path = self.path_for(remote, local)
            self.used = path.kinds[0]
            await path.pull_layers(plan, remote, local, call, cut)
        finally:
            self._done()

    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        self._running += 1
        try:
            await self._settle(call.deadline)
            self._unmap_freed()
            path = self.path_for(remote, local)
            self.used = path.kinds[0]  # serialized by the link's slot: read by the runner
            await path.push(plan, local, remote, call)
        finally:
            self._done()

    async def refresh(self, deadline: float | None) -> bool:
        await self.peer.refresh(deadline)
        return True

    async def close(self) -> None:
        self._close_engines()
        if self.shm is not None:
            self.shm.unmap()
        self.fds_settled.set()
        if self.fds is not None:
            self.fds.release_page()  # (in the link's slot: no copy runs under it)
        await self.peer.unlink()
