"""NIXL (``nixl-cu12``) as an engine: its UCX backend, host (DRAM) and device (VRAM) memory.

One ``nixl_agent`` per instance (UCX backend, ``NIXL_THREAD_SYNC_STRICT``: the
executor's threads share it; its progress thread stays on: over UCX's tcp
transport a passive target only serves reads while something progresses it).
:meth:`NixlAgent.info` is the agent's metadata (hex); a peer adds it with
``add_remote_agent``. A transfer builds NIXL descriptor lists from
``plan.segments()`` with numpy and keeps the prepared request per (remote cache,
local cache, segments), so a repeated pull only posts it again and polls.

What NIXL 1.5.1 does here (checked on this host: UCX over CMA, two processes):

* ``add_remote_agent`` with newer metadata of an agent it already knows *updates*
  it (memory the peer registered since becomes readable); no
  ``remove_remote_agent`` is needed. Requests prepared before the update are
  released (they may refer to the old metadata) and rebuilt on next use.
* A READ/WRITE naming remote memory outside what the peer's metadata (as we have
  it) lists fails when the request is created (``nixlNotFoundError``,
  ``NIXL_ERR_NOT_FOUND``): nothing moves; straddling the end of a region too.
  The check is the initiator's, against metadata the peer sent: memory the peer
  deregistered after its last update is still read without error (UCX keeps the
  mapping). Hence leases: we read a peer's cache only under its lease.
* Nothing cancels a request on the wire: over UCX's tcp transport (two network
  namespaces, the peer stopped mid-transfer) a request's bytes still landed after
  ``release_xfer_handle`` returned, and after ``remove_remote_agent`` too. So an abort
  with a request in flight returns at once (the call keeps its deadline) and hands the
  request to a reaper thread that polls it (backoff up to 10 ms) until it ends, then
  releases it. Until then the local blocks the aborted call named are *fenced*
  (``CacheEntry.fence``): the cache stays held (free and re-registration refuse with
  ``LLM_LINK_BUSY``) and a transfer or copy touching those blocks refuses with
  ``LLM_LINK_BUSY`` (no later success can be overwritten by the aborted transfer's
  bytes); its other blocks take transfers. Only the blocks named are undefined. The
  remote cache's lease is kept until then too (``_leases.LeaseHold``: the reaper lets
  go of it), so its owner cannot free or re-bind memory the request may still read or
  write (a WRITE lands in the owner's).
* UCX over CMA moves a request *inside* ``postXferReq`` (256 MiB: ~100 ms in the post
  call, nothing to abort). A transfer is therefore cut into requests of
  :data:`~.nixl_descs.CHUNK_BYTES`; the abort (deadline, cancel) is checked between them, so it
  waits for at most one chunk and nothing is in flight when it raises.
* Small requests: the first post to a peer does not complete inside the call (UCX
  connects its endpoint), later ones over CMA do (256 KiB: ~7 us). A connection whose
  last small host-memory post completed inside the call (``completes_inline``) posts
  small reads inline on the loop thread and offers the fast lane
  (:class:`~aiodatadist.transports.engine_lane.EngineLane`); one that did not (never
  seen over CMA) is polled there for at most :data:`INLINE_WAIT_S`, then reaped as an
  aborted request (the call fails, its blocks fenced until it ends) and the
  connection's small reads go through the executor again. A small pull of whole blocks
  is a request by indices into lists prepared once per cache (``nixl_descs``); the
  first post of a new request still costs more than posting one again.
* A peer that dies mid-transfer: ``postXferReq``/``getXferStatus`` raise
  ``nixlRemoteDisconnectError`` (``NIXL_ERR_REMOTE_DISCONNECT``; UCX logs requests
  "not returned to mpool"), or the request ends in ``ERR``: the call fails at once
  with ``LLM_LINK_FAILED``/``LLM_FAILED``, well within its deadline.
* Trust: NIXL/UCX checks a READ/WRITE only against the metadata the peer sent (which
  regions it registered); it has no notion of our leases or keys. NIXL paths belong
  on trusted fabrics.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _native
from .._caches import Region
from .._executor import ONE_SIDED_INLINE_MAX_BYTES
from .._leases import keep_current
from ..config import DataPath
from ..errors import LLMException, LLMStatusCode, failure
from .engine import (
    EngineAgent,
    EngineConn,
    EngineUnavailable,
    InlineRead,
    on_device,
    poll_until_done,
)
from .nixl_descs import SMALL_PLAN, BlockLists, chunks, dev, host, mem

if TYPE_CHECKING:
    from .._caches import CacheEntry

__all__ = ["NixlAgent", "NixlConn"]

log = logging.getLogger("aiodatadist.transports.nixl")

_CACHED_REQUESTS = 64  # prepared transfers kept per connection
PROGRESS_DELAY_US = 100
"""Microseconds NIXL's progress thread sleeps between rounds (see ``_paced_agent``)."""
INLINE_MAX_BYTES = ONE_SIDED_INLINE_MAX_BYTES
"""The largest request whose completion inside the post is tracked (``completes_inline``)."""
INLINE_WAIT_S = 5e-3
"""How long an inline (fast lane) request that did not complete in its post is polled on
the loop thread before it is handled as aborted (never seen over CMA)."""
UCX_MODULES_DEFAULT = "^efa"
"""``UCX_MODULES`` when unset: every UCX module but EFA (see ``NixlAgent.__init__``)."""


_AGENT_LOCK = threading.Lock()


def _paced_agent(nixl_agent: Any, name: str, cfg: Any) -> Any:
    """``nixl_agent(name, cfg)`` whose progress thread sleeps :data:`PROGRESS_DELAY_US`
    between rounds. nixl-cu12's Python wrapper hard-codes a delay of 0: its progress
    thread then spins, a whole core per idle agent (measured: 1.00 of a core idle; 0.02
    with 100 us). The wrapper builds its ``nixlAgentConfig`` and hands it to
    ``nixlBind.nixlAgent``: that one call is wrapped, for this construction only."""
    import nixl_cu12._api  # type: ignore[import-not-found,unused-ignore]

    bind: Any = getattr(nixl_cu12._api, "nixlBind")  # noqa: B009 (not in its stubs)
    with _AGENT_LOCK:
        real = bind.nixlAgent

        def paced(agent_name: str, config: Any) -> Any:
            if config.useProgThread:
                config.pthrDelay = PROGRESS_DELAY_US
            return real(agent_name, config)

        bind.nixlAgent = paced
        try:
            return nixl_agent(name, cfg)
        finally:
            bind.nixlAgent = real


def _reap(conn: NixlConn, h: Any, local: CacheEntry, op: str, where: Region) -> None:
    """Waits (on a thread of its own) for an aborted request still in flight to end, with
    the bytes of ``local`` it may touch (``where``) fenced and the remote cache's lease
    kept meanwhile (see the module docstring). The connection keeps the peer's agent
    until then (closing it early would hide the request's state)."""
    nx = conn.nx
    # The lease the transfer holds (this thread's: ``_leases.holding``) outlives the call
    # until the request ended: the owner's free waits for it, as for a running transfer.
    let_go = keep_current()
    fence = local.fence(where)
    with conn._lock:
        conn._reaping += 1

    def wait() -> None:
        delay = 1e-4
        try:
            while True:
                try:
                    state = nx.check_xfer_state(h)
                except Exception:
                    break  # the request failed (its peer is gone)
                if state != "PROC":
                    break
                time.sleep(delay)
                delay = min(delay * 2, 1e-2)
            try:
                nx.release_xfer_handle(h)
            except Exception:
                pass
        finally:
            local.unfence(fence)
            if let_go is not None:
                let_go()
            log.debug("NIXL: aborted %s over; cache %d takes transfers again", op, local.cache_id)
            with conn._lock:
                conn._reaping -= 1
                idle, last = not conn._reaping, not conn._reaping and conn._closing
            if idle:
                conn._blocks.release()  # the lists retired meanwhile
            if last:
                conn._forget()

    threading.Thread(target=wait, name="aiodatadist-nixl-reaper", daemon=True).start()


class _Inline(InlineRead):
    """A prepared small READ of a connection (``NixlConn.prepare_inline``): ``handles``
    is the connection's own list, emptied (None) when it releases the request."""

    __slots__ = ("conn", "handles", "key", "local", "remote")

    def __init__(
        self,
        conn: NixlConn,
        key: tuple[Any, ...],
        handles: list[Any],
        nbytes: int,
        remote: CacheEntry,
        local: CacheEntry,
    ) -> None:
        super().__init__(nbytes)
        self.conn, self.key, self.handles = conn, key, handles
        self.remote, self.local = remote, local

    @property
    def live(self) -> bool:
        return self.handles[0] is not None


class NixlAgent(EngineAgent):
    """This instance's NIXL agent (UCX backend)."""

    kind = DataPath.NIXL
    moves_device_memory = True
    copies_inline_on_host = True  # UCX picks CMA on one host when ptrace allows it

    @classmethod
    def probe(cls) -> str | None:
        from .._engine_env import engine_problem  # reasons with the command that fixes them

        return engine_problem("nixl")

    def __init__(self, name: str, host: str) -> None:
        # UCX's AWS EFA module links the system libibverbs, whose libnl-route clashes with
        # the copy bundled in the nixl-cu12 wheel: the process then dies of SIGSEGV at exit
        # (in rtnl_tc_unregister, from _dl_fini), after everything else went well. Leaving
        # that one module out avoids it (cma, tcp, ib, ib_mlx5 still load); a user who set
        # UCX_MODULES (an EFA host) keeps their choice. UCX reads it when the agent starts.
        os.environ.setdefault("UCX_MODULES", UCX_MODULES_DEFAULT)
        try:
            from nixl_cu12._api import (  # type: ignore[import-not-found,unused-ignore]
                nixl_agent,
                nixl_agent_config,
                nixl_thread_sync_t,
            )
            from nixl_cu12._bindings import nixlXferDList  # type: ignore[import-not-found,unused-ignore]
        except ImportError as e:
            raise EngineUnavailable(
                f"nixl-cu12 cannot be imported ({e}): pip install --no-deps 'nixl-cu12>=1.5,<2'"
            ) from e
        cfg = nixl_agent_config(
            backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        try:
            self.nx = _paced_agent(nixl_agent, name, cfg)
        except Exception as e:
            raise EngineUnavailable(f"NIXL agent setup failed: {e}") from e
        if "UCX" not in self.nx.backends:
            raise EngineUnavailable("NIXL has no UCX backend plugin here")
        self.name = name
        self.host = host
        self.dlist = nixlXferDList
        self.mems = self.nx.nixl_mems
        self._regs: dict[int, Any] = {}
        self._conns: set[NixlConn] = set()
        # The remote agents this agent knows, by name, and the one connection each belongs
        # to: a link may neither claim another link's agent nor remove it when it closes.
        self.owners: dict[str, NixlConn] = {}
        self._lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        with self._lock:
            return {"name": self.name, "md": self.nx.get_agent_metadata().hex()}

    def register(self, entry: CacheEntry) -> None:
        n = entry.tensor_bytes
        device = dev(entry)
        regions = [(int(a), n, device, "") for a in entry.addrs]
        try:
            with self._lock:
                descs = self.nx.get_reg_descs(regions, mem(entry))
                self.nx.register_memory(descs)
                self._regs[entry.cache_id] = descs
        except Exception as e:
            where = "host memory" if on_device(entry) is None else f"device {device}"
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"NIXL cannot register cache {entry.cache_id} ({where}): {e}",
            ) from e

    def deregister(self, entry: CacheEntry) -> None:
        for conn in list(self._conns):
            conn.forget_local(entry.cache_id)
        with self._lock:
            descs = self._regs.pop(entry.cache_id, None)
            if descs is not None:
                self.nx.deregister_memory(descs)

    def connect(self, peer_info: dict[str, Any]) -> NixlConn:
        conn = NixlConn(self, peer_info)
        self._conns.add(conn)
        return conn

    def close(self) -> None:
        conns = list(self._conns)
        for conn in conns:
            conn.close()
        with self._lock:
            for descs in self._regs.values():
                self.nx.deregister_memory(descs)
            self._regs.clear()
            if not any(c._reaping for c in conns):
                # Stopped now (its progress thread, its UCX context), not by whichever
                # garbage collection finds the cycles a link's objects leave: that can be
                # one in a child uvloop forked (Python runs there before the exec), which
                # has none of the agent's threads (the likely cause of a crash seen beside
                # CPU burners). The wrapper's binding object is the agent; a call still
                # inside it keeps it alive until it returns, later ones fail (an
                # LLMException of the transfer). With a request still being reaped, the
                # last reaper needs it: it then goes with the wrapper.
                self.nx.agent = None


class NixlConn(EngineConn):
    """A connection to one peer's NIXL agent (transfers on it are serialized by the link)."""

    def __init__(self, agent: NixlAgent, peer_info: dict[str, Any]) -> None:
        self.agent = agent
        self.nx = agent.nx
        self._md = ""
        self._name = str(peer_info["name"])
        self.remote_name: str | None = None
        self._reqs: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._reaping = 0  # aborted requests still on the wire (see _reap)
        self._closing = False
        self._blocks = BlockLists(self.nx)
        self.update(peer_info)

    def update(self, peer_info: dict[str, Any]) -> None:
        md = str(peer_info["md"])
        if md == self._md and self.remote_name is not None:
            return
        self._drop(lambda _key: True)
        self._retire_lists(None)
        name = str(peer_info["name"])
        with self.agent._lock:
            owner = self.agent.owners.get(name)
            if owner is not None and owner is not self:
                # Another link's agent (a peer replaying someone else's metadata): adding it
                # would let this link read that peer's memory outside its leases, and
                # removing it when this link ends would break the other link.
                raise failure(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"NIXL agent {name!r} is the agent of another link: refused",
                )
            # Newer metadata of a known agent replaces the old (checked: see the docstring).
            added: Any = self.nx.add_remote_agent(bytes.fromhex(md))  # bytes, in 1.5.1
            got = added.decode() if isinstance(added, bytes) else str(added)
            if got != name:
                if got not in self.agent.owners:
                    self._forget_agent(got)
                raise failure(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"NIXL metadata names agent {got!r}, the peer said {name!r}: refused",
                )
            self.agent.owners[name] = self
        self.remote_name = self._name = name
        self._md = md

    def _forget_agent(self, name: str) -> None:
        # (agent lock held)
        try:
            self.nx.remove_remote_agent(name)
        except Exception:
            pass
        if self.agent.owners.get(name) is self:
            del self.agent.owners[name]

    def _drop(self, which: Any) -> None:
        with self._lock:
            keys = [k for k in self._reqs if which(k)]
            dropped = [self._reqs.pop(k) for k in keys]
        for handles in dropped:
            self._release(handles)

    def _release(self, handles: list[Any]) -> None:
        for i, h in enumerate(handles):
            if h is not None:
                handles[i] = None  # (a lane keeping the list sees it released)
                try:
                    self.nx.release_xfer_handle(h)
                except Exception:
                    pass  # best effort: NIXL frees it with the agent

    def forget_local(self, cache_id: int) -> None:
        """Releases prepared requests on local cache ``cache_id`` (it is deregistered)."""
        self._drop(lambda key: key[2] == cache_id)
        self._retire_lists(cache_id)

    def _retire_lists(self, local_cache: int | None) -> None:
        # (their requests are dropped) Released now, or by the last reaper.
        with self._lock:
            self._blocks.retire(local_cache)
            if self._reaping:
                return
        self._blocks.release()

    def _requests(
        self, op: str, plan: _native.Plan, local: CacheEntry, remote: CacheEntry
    ) -> tuple[tuple[Any, ...], list[Any]]:
        segs = plan.segments()
        key = (op, remote.cache_id, local.cache_id, remote.lease, segs.tobytes())
        handles = self._reqs.get(key)
        if handles is not None:
            self._reqs.move_to_end(key)
            return key, handles
        h = None
        if len(segs) <= SMALL_PLAN and plan.total_bytes <= INLINE_MAX_BYTES:
            assert self.remote_name is not None
            h = self._blocks.request(op, segs.tolist(), local, remote, self.remote_name)
        handles = (
            [h]
            if h is not None
            else [
                self._make(op, ld, rd, local, remote) for ld, rd in chunks(op, segs, local, remote)
            ]
        )
        with self._lock:
            self._reqs[key] = handles
            while len(self._reqs) > _CACHED_REQUESTS:
                self._release(self._reqs.popitem(last=False)[1])
        return key, handles

    def _make(self, op: str, ld: Any, rd: Any, local: CacheEntry, remote: CacheEntry) -> Any:
        mems = self.agent.mems
        assert self.remote_name is not None  # (connected by _requests)
        try:
            return self.nx.initialize_xfer(
                op,
                self.agent.dlist(mems[mem(local)], ld),
                self.agent.dlist(mems[mem(remote)], rd),
                self.remote_name,
            )
        except Exception as e:
            raise failure(
                LLMStatusCode.LLM_FAILED,
                f"NIXL refused the {op} of remote cache {remote.cache_id}: {e} (the memory "
                "is not registered with the peer's agent as we know it)",
            ) from e

    def _run(
        self,
        op: str,
        plan: _native.Plan,
        local: CacheEntry,
        remote: CacheEntry,
        control: _native.Control,
    ) -> None:
        key, handles = self._requests(op, plan, local, remote)
        for i, h in enumerate(handles):
            # Between chunks nothing is in flight: an abort there is exact.
            if i and control.aborted:
                raise _native.NativeError(_native.Status.ABORTED, "transfer aborted")
            at_once = self._one(key, i, h, op, remote, local, control)
            if len(handles) == 1 and plan.total_bytes <= INLINE_MAX_BYTES and host(local, remote):
                # Small requests run inline while the last one completed inside its post
                # (the first post to a peer does not: UCX connects its endpoint then).
                self.completes_inline = at_once

    def _one(
        self,
        key: tuple[Any, ...],
        i: int,
        h: Any,
        op: str,
        remote: CacheEntry,
        local: CacheEntry,
        control: _native.Control,
    ) -> bool:
        """Posts request ``i`` of ``key`` and waits for it; True when it completed inside
        the post."""
        nx = self.nx
        try:
            state = nx.transfer(h)
        except Exception as e:
            raise self._failed(key, op, remote, e) from e
        if state == "DONE":
            return True
        failed = state == "ERR"

        def check() -> bool:
            nonlocal failed
            if failed:
                return True
            try:
                s = nx.check_xfer_state(h)
            except Exception as e:
                raise self._failed(key, op, remote, e) from e
            failed = s == "ERR"
            return bool(s != "PROC")

        def abort() -> bool:
            # Neither releasing the request nor removing the peer's agent stops a READ
            # already on the wire over UCX's tcp transport: its bytes kept landing after
            # both (seen between two network namespaces, the peer stopped mid-transfer).
            # So the call returns at its deadline, and the request goes to a reaper that
            # waits for it to end; until then the blocks the call named are fenced: the
            # cache stays held (no free, no re-registration) and those blocks take no
            # transfer (the others do).
            self._to_reaper(key, i, h, local, op)
            return True

        poll_until_done(check, control, abort)
        if failed:
            raise self._failed(key, op, remote, None)
        return False

    def _to_reaper(self, key: tuple[Any, ...], i: int, h: Any, local: CacheEntry, op: str) -> None:
        with self._lock:
            handles = self._reqs.get(key)
        if handles is not None:
            handles[i] = None  # the reaper owns it now
        self._drop(lambda k: k == key)
        # Fenced: the blocks the call named on our side (a READ's dst, a WRITE's src).
        rows = np.frombuffer(key[4], dtype=np.uint64).reshape(-1, 5)
        _reap(
            self, h, local, op, Region.of_rows(local.addrs, rows, "dst" if op == "READ" else "src")
        )

    def _failed(
        self, key: tuple[Any, ...], op: str, remote: CacheEntry, error: Exception | None
    ) -> Exception:
        self._drop(lambda k: k == key)  # a failed request is not posted again
        why = type(error).__name__ if error is not None else "ERR"
        # NIXL_ERR_REMOTE_DISCONNECT: the peer's agent is gone (its process died).
        code = (
            LLMStatusCode.LLM_LINK_FAILED
            if error is not None and "Disconnect" in why
            else LLMStatusCode.LLM_FAILED
        )
        return failure(
            code, f"NIXL {op} of remote cache {remote.cache_id} failed: {why} ({error or ''})"
        )

    def prepare_inline(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry
    ) -> _Inline | None:
        """The prepared READ of a small ``plan`` (see ``EngineConn``): looked up, or made
        (None when NIXL refuses it: nothing moved)."""
        if self.remote_name is None or self._closing or plan.total_bytes > INLINE_MAX_BYTES:
            return None
        try:
            key, handles = self._requests("READ", plan, local, remote)
        except LLMException:
            return None  # refused when made (the whole path says why)
        if len(handles) != 1 or handles[0] is None:
            return None
        return _Inline(self, key, handles, plan.total_bytes, remote, local)

    def post_inline(self, req: InlineRead) -> bool:
        """Posts ``req`` once (loop thread). Over UCX's CMA it completes inside the post;
        when it does not (never seen once the connection has ``completes_inline``), it
        is polled for at most :data:`INLINE_WAIT_S`, then handled as an aborted request
        (reaped, its local blocks fenced until it ends) and the call fails; the
        connection's small reads then go through the executor again."""
        h = req.handles[0]  # type: ignore[attr-defined]  # (an _Inline of this connection)
        if h is None or self._closing:
            return False
        try:
            state = self.nx.transfer(h)
            if state == "DONE":
                return True
            end = time.perf_counter() + INLINE_WAIT_S
            while state == "PROC" and time.perf_counter() < end:
                self.completes_inline = False
                os.sched_yield()
                state = self.nx.check_xfer_state(h)
        except Exception as e:
            raise self._failed(req.key, "READ", req.remote, e) from e  # type: ignore[attr-defined]
        assert isinstance(req, _Inline)
        key, remote = req.key, req.remote
        if state == "DONE":
            return True
        if state == "ERR":
            raise self._failed(key, "READ", remote, None)
        self._to_reaper(key, 0, h, req.local, "READ")
        raise failure(
            LLMStatusCode.LLM_FAILED,
            f"NIXL READ of remote cache {remote.cache_id} on the fast lane did not complete "
            f"within {INLINE_WAIT_S * 1e3:g} ms: the blocks named are undefined and take "
            f"no transfer into cache {req.local.cache_id} until the request ends",
        )

    def read(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, control: _native.Control
    ) -> None:
        self._run("READ", plan, local, remote, control)

    def write(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, control: _native.Control
    ) -> None:
        self._run("WRITE", plan, local, remote, control)

    def close(self) -> None:
        self._drop(lambda _key: True)
        self._retire_lists(None)
        self.agent._conns.discard(self)
        with self._lock:
            self._closing = True
            if self._reaping:
                return  # the last reaper forgets the agent once its request is over
        self._forget()

    def _forget(self) -> None:
        with self.agent._lock:
            if self.remote_name is not None and self.agent.owners.get(self.remote_name) is self:
                self._forget_agent(self.remote_name)
        self.remote_name = None
