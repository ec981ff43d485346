"""Existing transfer engines (NIXL, Mooncake) as the data path of a link.

An instance starts the engines ``aiodatadist.Engines`` names (and the one
``aiodatadist.DataPath`` forces) at ``init``: one :class:`EngineAgent` each,
created on the instance's executor. Every cache registered or allocated is
registered with every running engine; the agent's :meth:`EngineAgent.info`
(what a peer needs to reach it) travels in the handshake and in every table
update. A link offers an engine when both sides run it; its
:class:`EnginePath` connects lazily (on the executor) at the first transfer and
updates the connection when the peer's info changed.

Integrity: an engine transfer runs under the remote cache's lease. Same host
(the link's fd channel is up): the lease page, exactly as ``cma``. Other hosts:
a lease over the control plane (:mod:`aiodatadist._engine_lease`, one round trip
per transfer): the owner holds the cache until we say the job returned.

Aborts (deadline, cancel): :meth:`EngineConn.read`/``write`` return (raising) at
once; what the engine cannot recall (a NIXL request on the wire, every Mooncake request
in flight) goes to a reaper thread, and until it ended the blocks of the local cache it
may touch are fenced (``CacheEntry.fence``: transfers and copies that touch them, and
a free, refuse with ``LLM_LINK_BUSY``; the cache's other blocks take transfers) and
the remote cache's lease kept (``_leases.LeaseHold``, the thread's current one while
the job runs). NIXL: a transfer is cut into requests of
8 MiB and the abort is checked between them; see :mod:`aiodatadist.transports.nixl`.
Mooncake: see its module.

Small pulls (at most ``ONE_SIDED_INLINE_MAX_BYTES``) skip what they can of the executor
(:mod:`aiodatadist.transports.engine_lane`): on one host, once a connection's small read
completed inside the engine's post (NIXL over UCX's CMA), later ones are posted inline on
the loop thread, and :meth:`EnginePath.lane` offers the runner an :class:`EngineLane`
(never between hosts: a control-plane lease per transfer cannot be synchronous). An
engine whose submit only queues (Mooncake) submits a small pull on the loop thread
(:meth:`EngineConn.begin`) and the executor only waits for it: the hand-off overlaps
the network round trip.

Engine modules (``transports/nixl.py``, ``transports/mooncake.py``) are imported
only when that engine is probed or started: ``import aiodatadist`` imports no
engine package.
"""

from __future__ import annotations

import abc
import functools
import importlib
import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import _engine_lease, _native
from .._executor import ONE_SIDED_INLINE_MAX_BYTES
from .._leases import LeaseHold, LeaseStale, leased, page_lease
from ..config import DataPath
from ..errors import LLMException, LLMStatusCode, failure
from .base import Call, Lane, Path
from .engine_lane import LANE_REQUESTS, Begun, EngineLane, InlineRead, lease_end

if TYPE_CHECKING:
    from .._caches import CacheEntry, CacheTable
    from .._fdchannel import FdChannel
    from .._leases import LeasePage
    from .peer import ControlLink

__all__ = [
    "EngineAgent",
    "EngineConn",
    "EngineLane",
    "EnginePath",
    "InlineRead",
    "EngineUnavailable",
    "Begun",
    "LANE_REQUESTS",
    "engine_class",
    "engine_problem",
    "on_device",
    "poll_until_done",
    "start_engines",
]

# Where each engine's classes live (imported on first use only).
_MODULES: dict[DataPath, tuple[str, str]] = {
    DataPath.NIXL: ("aiodatadist.transports.nixl", "NixlAgent"),
    DataPath.MOONCAKE: ("aiodatadist.transports.mooncake", "MooncakeAgent"),
}


AGENT_PREFIX = "aiodd"
"""Engine agents are named ``aiodd-<pid>-<cluster id>-<random>``: a peer's agent must carry
the peer's own cluster id."""


def on_device(entry: CacheEntry) -> int | None:
    """The device id of a cache in device memory, None for host memory.

    ``CacheEntry.placement`` is upstream's label (``DEVICE`` by default, for host
    memory too): device memory is marked by a ``device_id`` on the entry instead.
    """
    dev = getattr(entry, "device_id", None)
    return None if dev is None else int(dev)


class EngineUnavailable(Exception):
    """An engine cannot run here; the message says why (and how to fix it)."""


class EngineConn(abc.ABC):
    """This agent's connection to one peer's agent (one link). Every method blocks: it
    runs on the instance's executor, never on the event loop (but :meth:`prepare_inline`,
    :meth:`post_inline` and :meth:`begin`, which never wait on the network).

    Attributes:
        completes_inline: the last small host-memory request posted on this connection
            completed inside the post call (UCX over CMA): only then does its path run
            small reads inline on the loop or offer an :class:`EngineLane`.
        begins: :meth:`begin` may submit (the engine's submit only queues).
    """

    completes_inline: bool = False
    begins: bool = False

    def prepare_inline(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry
    ) -> InlineRead | None:
        """Makes (or finds) the engine request of a small READ of ``plan`` from ``remote``
        into ``local`` for :meth:`post_inline` (on the loop thread; nothing moves).

        Returns:
            None when the engine has no such fast read or refused the request (the
            whole path then says why).
        """
        return None

    def begin(
        self, op: str, plan: _native.Plan, local: CacheEntry, remote: CacheEntry
    ) -> Begun | None:
        """Submits a small transfer's requests now, on the loop thread, when the engine's
        submit never waits on the network (Mooncake: it queues them); the executor then
        only waits for them (:meth:`Begun.job`). The caller holds the remote cache's lease.

        Returns:
            None when the engine takes no such start (nothing was submitted).
        """
        return None

    def post_inline(self, req: InlineRead) -> bool:
        """Posts a request of :meth:`prepare_inline` on the calling (loop) thread, under
        the remote cache's lease (the caller holds it); it lands inside the post.

        Returns:
            True once every byte landed; False when nothing was posted (the request
            was released meanwhile: make it again).

        Raises:
            LLMException: posted, and it failed or did not complete within a few
                milliseconds (then handled as an aborted transfer: see the engine).
        """
        return False

    @abc.abstractmethod
    def update(self, peer_info: dict[str, Any]) -> None:
        """The peer's info changed (it registered or freed memory)."""

    @abc.abstractmethod
    def read(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, control: _native.Control
    ) -> None:
        """Moves every segment of ``plan`` from the peer's ``remote`` into ``local``.

        Returns only once every byte landed. Raises ``NativeError(ABORTED)`` once
        ``control`` was aborted and the engine can no longer touch local memory for this
        transfer, or what it may still touch is fenced and leased until it cannot (see
        the module docstring); ``LLMException`` for an engine failure.
        """

    @abc.abstractmethod
    def write(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, control: _native.Control
    ) -> None:
        """Moves every segment of ``plan`` from ``local`` into the peer's ``remote``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Forgets the peer (its transfers have returned)."""


class EngineAgent(abc.ABC):
    """One running engine of an instance.

    Attributes:
        kind: the data path it provides.
        moves_device_memory: it can move memory of ``Placement.DEVICE`` caches.
    """

    kind: DataPath
    moves_device_memory: bool = False
    copies_inline_on_host: bool = False
    """A same-host transfer of host memory completes inside the engine's post call (NIXL:
    UCX over CMA) when the kernel allows cross-process reads: tiny ones may run inline."""
    abort_wait_s: float = 0.0
    """How long requests of an aborted transfer may stay in flight, at most, because the
    engine cannot cancel them (Mooncake): ``finalize`` waits that much longer for running
    transfers and fenced caches rather than return while the engine may still write into
    memory."""

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> str | None:
        """None when the engine can run here, else why not (no side effects)."""

    @abc.abstractmethod
    def __init__(self, name: str, host: str) -> None:
        """Blocking setup. Raises :class:`EngineUnavailable`."""

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """What a peer needs to reach this agent now (JSON-able)."""

    @abc.abstractmethod
    def register(self, entry: CacheEntry) -> None:
        """Registers every tensor of ``entry`` (``addrs[i]`` .. + ``tensor_bytes``)."""

    @abc.abstractmethod
    def deregister(self, entry: CacheEntry) -> None:
        """Undoes :meth:`register` (nothing may touch the memory through it afterwards)."""

    @abc.abstractmethod
    def connect(self, peer_info: dict[str, Any]) -> EngineConn:
        """A connection to the peer agent ``peer_info`` describes (blocking)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops the agent (every registration and connection is gone by then)."""


def engine_class(kind: DataPath) -> type[EngineAgent]:
    """The agent class of ``kind`` (imports its module).

    Raises:
        EngineUnavailable: its module cannot be imported (the engine package is missing).
    """
    module, name = _MODULES[DataPath(kind)]
    try:
        cls: type[EngineAgent] = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise EngineUnavailable(f"{kind}: {e}") from e
    return cls


def engine_problem(kind: DataPath | str) -> str | None:
    """Why the engine ``kind`` cannot run here, or None when it can (no side effects)."""
    try:
        return engine_class(DataPath(kind)).probe()
    except EngineUnavailable as e:
        return str(e)


def start_engines(kinds: Sequence[DataPath], cluster_id: int, host: str) -> list[EngineAgent]:
    """Starts one agent per engine (blocking: call it on the executor).

    Raises:
        LLMException: LLM_FEATURE_NOT_ENABLED saying why an engine cannot run (then
            none of them runs).
    """
    agents: list[EngineAgent] = []
    try:
        for kind in kinds:
            why = engine_problem(kind)
            if why is not None:
                raise EngineUnavailable(why)
            name = f"{AGENT_PREFIX}-{os.getpid()}-{cluster_id}-{secrets.token_hex(4)}"
            agents.append(engine_class(kind)(name, host))
    except EngineUnavailable as e:
        for a in agents:
            a.close()
        raise failure(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED, f"engine {kind} cannot run: {e}"
        ) from None
    except BaseException:
        for a in agents:
            a.close()
        raise
    return agents


def poll_until_done(
    check: Callable[[], bool | None], control: _native.Control, abort: Callable[[], bool]
) -> None:
    """Polls an engine transfer from an executor thread with backoff.

    ``check()``: True once done, False while in progress (raises on failure).
    A few spins first (a tiny transfer lands in microseconds), then sleeps doubling
    from 20 us to 1 ms: never a loop that burns a core. On ``control.aborted``,
    ``abort()`` deals with the engine transfer: True once the call may return (then this
    raises ``NativeError(ABORTED)``): the engine can no longer touch local memory for it,
    or what it may still write is fenced (``CacheEntry.fence``, see ``nixl.py``); False
    when it can do neither (then this keeps waiting for the transfer to end, and raises).
    """
    spins = 0
    delay = 20e-6
    aborted = False
    while not check():
        if control.aborted and not aborted:
            if abort():
                raise _native.NativeError(_native.Status.ABORTED, "transfer aborted")
            aborted = True  # not cancellable: wait for the engine to finish with it
        if spins < 32:
            spins += 1
            continue
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
    if aborted:
        raise _native.NativeError(_native.Status.ABORTED, "transfer aborted")


class EnginePath(Path):
    """The data path of one link over one engine (both sides run it).

    Args:
        agent: this instance's agent of the engine.
        peer: the link's control connection (``peer.info.engines`` has the peer's info).
    """

    def __init__(self, agent: EngineAgent, peer: ControlLink) -> None:
        self.agent = agent
        self.peer = peer
        self.kinds = (agent.kind,)
        self.fds: FdChannel | None = None  # the link's fd channel (same host), if up
        # Tiny same-host transfers may run inline on the loop (RemotePath sets it when
        # the kernel allows process_vm_readv to the peer and the engine copies with it).
        self.inline_ok = False
        self._conn: EngineConn | None = None
        self._seen: dict[str, Any] | None = None

    @property
    def remote_table(self) -> CacheTable:
        return self.peer.table

    def _peer_info(self) -> dict[str, Any]:
        info = self.peer.info.engines.get(self.agent.kind.value)
        cluster = self.peer.info.cluster_id
        if info is None:
            raise failure(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                f"cluster {cluster} does not run engine {self.agent.kind}",
            )
        name = info.get("name")
        parts = str(name).split("-") if name is not None else None
        if parts is not None and (parts[0] != AGENT_PREFIX or parts[2:3] != [str(cluster)]):
            # Agents are named aiodd-<pid>-<cluster id>-<random>: a peer that presents
            # another cluster's agent (replayed metadata) would have us read that
            # cluster's memory outside its leases.
            raise failure(
                LLMStatusCode.LLM_LINK_FAILED,
                f"cluster {cluster} presents engine agent {name!r}, not one of its own",
            )
        return info

    async def _ready(self, call: Call) -> EngineConn:
        info = self._peer_info()
        if self._conn is not None and info is self._seen:
            return self._conn

        def sync(_control: _native.Control) -> EngineConn:
            try:
                if self._conn is None:
                    self._conn = self.agent.connect(info)
                else:
                    self._conn.update(info)
            except LLMException:
                raise
            except Exception as e:  # the engine's own error type
                raise failure(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"engine {self.agent.kind}: cannot reach the agent of cluster "
                    f"{self.peer.info.cluster_id}: {e}",
                ) from e
            self._seen = info
            return self._conn

        conn: EngineConn = await call.run(sync)
        return conn

    async def _begin(
        self,
        call: Call,
        plan: _native.Plan,
        remote: CacheEntry,
        local: CacheEntry,
        lease: tuple[LeasePage, int, int] | None,
        held: LeaseHold | None = None,
    ) -> bool:
        """A small pull submitted on the loop thread and waited for on the executor
        (:meth:`EngineConn.begin`), under the lease page's lease when ``lease`` is given
        (else the caller holds ``held``, a control-plane lease); False: the engine did not
        take it (nothing submitted). Requests abandoned in flight keep the lease until
        they end (``Begun.abandon``)."""
        conn = self._conn
        if conn is None or not conn.begins or plan.total_bytes > ONE_SIDED_INLINE_MAX_BYTES:
            return False
        addr = 0
        if lease is not None:
            page, slot, gen = lease
            addr = page.addr(slot)
            if not _native.lease_enter(addr, gen):
                raise failure(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"the peer re-registered or freed cache {remote.cache_id} (its lease is "
                    "no longer current)",
                    kind=LeaseStale,
                )
        try:
            begun = conn.begin("READ", plan, local, remote)
        except BaseException:
            if lease is not None:
                _native.lease_exit(addr)
            raise
        if begun is None:
            if lease is not None:
                _native.lease_exit(addr)
            return False
        if lease is not None:
            try:
                hold = page_lease(lease[0], addr)
            except BaseException:
                _native.lease_exit(addr)
                raise
            begun.on_end = functools.partial(lease_end, hold, addr, lease[2], remote)
            begun.hold = hold
        else:
            begun.hold = held
        try:
            await call.run(begun.job)
        finally:
            # (nothing to do once the job ran)
            begun.abandon(local, plan, held.keep if held is not None else None)
        return True

    async def _run(
        self,
        call: Call,
        plan: _native.Plan,
        remote: CacheEntry,
        local: CacheEntry,
        job: Callable[..., None],
        begin: bool = False,
        writes: bool = False,
    ) -> None:
        if self.fds is not None and not self.fds.closed and remote.lease is not None:
            page = await self.fds.peer_page(call.deadline)
            slot, gen = remote.lease
            # Same host, host memory, the kernel lets us read the peer (``inline_ok``), and
            # the connection's small reads complete inside the post (UCX over CMA): a tiny
            # one runs inline, as cma (the first one ran on the executor and proved it).
            inline = self._inline(remote, local)
            if (
                begin
                and not inline
                and await self._begin(call, plan, remote, local, (page, slot, gen))
            ):
                return
            await call.run(
                leased(page, slot, gen, None, remote.cache_id, job, keepable=True, writes=writes),
                local_bytes=plan.total_bytes if inline else -1,
                inline_max=ONE_SIDED_INLINE_MAX_BYTES,
                fair=True,
            )
            return
        async with _engine_lease.remote_lease(
            self.peer, remote, call.deadline, writes=writes
        ) as held:
            # (A request handed to a reaper keeps it past the body: ``LeaseHold``.)
            if not begin or not await self._begin(call, plan, remote, local, None, held):
                await call.run(held.around(job))

    def _inline(self, remote: CacheEntry, local: CacheEntry) -> bool:
        conn = self._conn
        return (
            self.inline_ok
            and conn is not None
            and conn.completes_inline
            and on_device(remote) is None
            and on_device(local) is None
        )

    def lane(self, remote: CacheEntry, local: CacheEntry) -> Lane | None:
        """An :class:`EngineLane` from ``remote`` into ``local``, or None: only on one host
        (the link's fd channel and the peer's lease page are up), host memory, and a
        connection whose small reads were seen to complete inside the post."""
        fds, conn = self.fds, self._conn
        if fds is None or fds.closed or fds.page is None or fds.page.closed:
            return None
        if conn is None or remote.lease is None or not self._inline(remote, local):
            return None
        info = self.peer.info.engines.get(self.agent.kind.value)
        if info is None or info is not self._seen:
            return None  # the peer's agent changed: the whole path updates the connection
        try:
            return EngineLane(self, conn, info, fds.page, remote, local)
        except LLMException:
            return None  # a lease slot outside the peer's page: the whole path says so

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        conn = await self._ready(call)
        job = functools.partial(conn.read, plan, remote, local)
        await self._run(call, plan, remote, local, job, begin=True)

    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        conn = await self._ready(call)
        job = functools.partial(conn.write, plan, local, remote)
        await self._run(call, plan, remote, local, job, writes=True)

    def close_conn(self) -> None:
        """Forgets the peer's agent (blocking; no transfer runs on the link)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
