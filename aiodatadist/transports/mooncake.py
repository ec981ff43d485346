"""The Mooncake Transfer Engine (``mooncake-transfer-engine-non-cuda``) as an engine: host memory.

One ``TransferEngine`` per instance, ``initialize(host, "P2PHANDSHAKE", "tcp", "")``:
no metadata server, its TCP transport. :meth:`MooncakeAgent.info` is the engine's
segment name ``"host:rpc_port"``; a peer addresses its transfers to that name (the
engine opens the segment, a P2P handshake, on first use and caches it). The
non-CUDA wheel cannot move device memory (``moves_device_memory = False``).

What Mooncake 0.3.13 does here (measured on this host, two processes, TCP transport;
the throwaway scripts drove ``TransferEngine`` directly):

* **Completion.** ``batch_transfer_async_read/write`` submit a batch and return its id
  (0: not submitted). ``get_batch_transfer_status([ids])`` is no poll: it blocks,
  spinning without a pause, until the batches end, and frees a failed batch while
  other requests of it may still be in flight. ``transfer_check_status(id)`` is the one
  non-blocking probe, and it looks at the *first* request of a batch only. So every
  request here is a batch of one (a piece of at most :data:`PIECE_BYTES`), up to
  :data:`WINDOW` of them in flight per transfer; the oldest is polled from the
  executor thread (a short spin of :data:`SPIN_S` that yields the CPU, then sleeps
  doubling from 20 us to 1 ms), completed ones are replaced by the next pieces. A submit
  only queues (with the peer SIGSTOPped it returned in ~30 us, the request in flight),
  so a pull of at most :data:`BEGIN_MAX_BYTES` is submitted on the loop thread
  (``MooncakeConn.begin``) and the executor only waits for it. Tiny pulls: one submit
  and the spin; ``MooncakeConn.read`` of 4 KiB / 64 KiB took 0.9-1.3x the time of
  ``transfer_sync_read`` driven directly (itself a busy loop), medians 1.27 / 1.04 on
  this 2-core host under a load of 5 (quiet: 55 us both); the poller used ~0.6 of a
  core in a loop of tiny pulls. 1 GiB in 4096 x 256 KiB descriptors: 1.0-2.0 GiB/s
  with 32-64 requests in flight (scripts driving the engine directly: 2.0 GiB/s at
  64, 1.4 at 16), vs ~1.2 GiB/s for ``batch_transfer_sync_read`` in batches of 512;
  the poller's process used under half a core meanwhile.
* **Big batches.** The TCP transport queues at most 1024 requests per peer
  (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``) plus 1024 waiting admission: one batch of
  4096 descriptors fails at once (queue-full), and ``batch_transfer_sync_read``
  returns -1 while the rest of that batch is still running and writing into the
  destination; the peer's lanes stay busy with it for seconds (the next transfers
  time out in admission, 1 s each). Hence the window (per transfer) and
  :data:`PEER_QUEUE` (requests in flight per peer segment, over every connection of
  the agent), well below that limit.
* **No cancel.** Nothing in the Python API cancels a submitted request. On an abort
  (deadline, cancel) no further piece is submitted and the call raises at once; the
  requests in flight go to a reaper thread (``_Transfer._hand_off``) that polls them
  until Mooncake reports each ended, and until then the local bytes those requests may
  touch are *fenced* (``CacheEntry.fence``: no transfer or copy touches them, a free or
  re-registration of the cache refuses with ``LLM_LINK_BUSY``; the cache's other blocks,
  a decoder's KV pool, take transfers as usual) and the remote cache's lease is kept
  (``_leases.LeaseHold``: the owner's free waits), as for NIXL's requests on the wire.
  A failure (no abort) waits for the requests in flight before it raises. How long a
  request stays in flight is bounded by Mooncake's own timeouts: a peer that died
  (kill -9) fails every request in flight at once (128 in flight: the first failure
  3-8 ms after the kill, all of them within 1 s); a peer that is alive but stalled fails
  a request after ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (30 s) without progress or
  ``MC_TCP_STATUS_TIMEOUT_SEC`` (30 s) without a status frame, one request per lane (4
  lanes, ``MC_TCP_LANES_PER_PEER``) after another, so the worst case is about
  ``(WINDOW / 4 + 2) * timeout`` (measured with both timeouts set to 2 s: a 256 MiB
  pull of a SIGSTOPped peer, aborted after 0.1 s, had its requests failed after 20 s).
  The agent sets both to :data:`STALL_TIMEOUT_S` (5 s) unless the environment sets
  them, which bounds a fence at about 50 s (``abort_wait_s``: ``finalize`` waits that
  long for fenced caches).
  ``MC_TRANSFER_TIMEOUT`` only bounds the Python wrapper's *sync* calls, not used here.
* **Address checks.** The target checks every incoming request against its own
  registered buffers (``validateTcpAddress``): a read or write of an address outside
  them, or straddling a buffer's end, is refused by the target, nothing moves, and the
  request fails within a millisecond. Registrations may not overlap (rc -7) nor be
  empty (rc -1).
* **Late registration.** A buffer the target registers after the initiator connected
  is readable at once (the TCP transport asks the target, which checks its current
  buffers: no segment metadata is cached for it). :meth:`MooncakeAgent.info` never
  changes: nothing is re-sent on (de)registration.
* **Dead peer.** A request to a segment whose process died fails (connection refused,
  about 1 s with the engine's reconnect backoff); a new peer works at once.

Address: the segment names the host the instance was started with (its listen
address; IPv4 or a name: the handshake resolves no IPv6, so an IPv6 listen address
makes the engine unavailable); given none (empty, ``0.0.0.0``, ``::``), the source
address of the default route, else the first non-loopback IPv4 address of an
interface. A peer on another host can only reach (pull from, push into) an engine
whose segment names an address it routes to: an instance started with ``127.0.0.1``
is reachable from its own host only.

Trust: the engine's handshake and data ports listen on every interface, without
authentication; the only check is the target's own registered-buffer check above,
so Mooncake paths belong on trusted fabrics. Our leases still hold: a transfer runs
under the remote cache's lease, and memory is deregistered from the engine before it
is freed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _native
from .._caches import Region
from .._leases import keep_current
from ..config import DataPath
from ..errors import LLMStatusCode, failure
from .engine import Begun, EngineAgent, EngineConn, EngineUnavailable, on_device

if TYPE_CHECKING:
    from .._caches import CacheEntry

__all__ = ["PEER_QUEUE", "PIECE_BYTES", "SPIN_S", "WINDOW", "MooncakeAgent", "MooncakeConn"]

log = logging.getLogger("aiodatadist.transports.mooncake")

PIECE_BYTES = 4 * 1024 * 1024
"""Most bytes of one Mooncake request (longer segments are cut: an abort waits for less)."""
WINDOW = 32
STALL_TIMEOUT_VARS = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
STALL_TIMEOUT_S = "5"
"""Those two Mooncake timeouts when the environment does not set them (seconds)."""
"""Requests of one transfer in flight at once."""
PEER_QUEUE = 256
"""Requests in flight to one peer segment over all connections (Mooncake queues 1024)."""
SPIN_S = 500e-6
"""How long a transfer polls without sleeping first (a tiny one lands in ~50 us)."""
BEGIN_MAX_BYTES = 256 * 1024
"""Pulls up to this size are submitted on the loop thread (``MooncakeConn.begin``)."""

_WILDCARDS = ("", "0.0.0.0", "::", "[::]")
_SMALL_PLAN = 16  # segments up to which a plan is turned into requests without numpy


def _seconds(text: str) -> float:
    try:
        return max(0.0, float(text))
    except ValueError:
        return 30.0  # Mooncake's own default


def _advertised(host: str) -> str:
    """The address peers reach this engine at: ``host``; when ``host`` names no
    address (empty, or every interface), the source address of the default route,
    else the first non-loopback IPv4 address of an interface, else 127.0.0.1.

    Raises:
        EngineUnavailable: ``host`` is an IPv6 address (Mooncake's handshake is IPv4).
    """
    if host not in _WILDCARDS:
        if ":" in host:
            # Its handshake resolves IPv4 only ("use IPv4 address instead", checked).
            raise EngineUnavailable(
                f"Mooncake's P2P handshake needs an IPv4 address or host name, not {host!r}: "
                "listen on an IPv4 address (or on every interface) to run it"
            )
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP: picks a route, sends nothing
            return str(s.getsockname()[0])
    except OSError:
        pass  # no default route (an isolated network namespace, say)
    for _index, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address
        addr = socket.inet_ntoa(raw[20:24])
        if not addr.startswith("127."):
            return addr
    return "127.0.0.1"


def _pieces(
    op: str, segs: Any, local: CacheEntry, remote: CacheEntry
) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths) of every request (lists of ints);
    segments longer than :data:`PIECE_BYTES` are cut, empty ones dropped."""
    # READ: src = remote (columns 0, 1), dst = local (2, 3); WRITE the other way.
    r_cols, l_cols = ((0, 1), (2, 3)) if op == "READ" else ((2, 3), (0, 1))
    if len(segs) <= _SMALL_PLAN:  # plain Python: numpy's fixed cost dominates a tiny pull
        los: list[int] = []
        rs: list[int] = []
        ns: list[int] = []
        for row in segs.tolist():
            r0 = remote.addrs[row[r_cols[0]]] + row[r_cols[1]]
            l0 = local.addrs[row[l_cols[0]]] + row[l_cols[1]]
            for off in range(0, row[4], PIECE_BYTES):
                los.append(l0 + off)
                rs.append(r0 + off)
                ns.append(min(PIECE_BYTES, row[4] - off))
        return los, rs, ns
    r_addrs = np.asarray(remote.addrs, dtype=np.uint64)
    l_addrs = np.asarray(local.addrs, dtype=np.uint64)
    r = r_addrs[segs[:, r_cols[0]].astype(np.intp)] + segs[:, r_cols[1]]
    lo = l_addrs[segs[:, l_cols[0]].astype(np.intp)] + segs[:, l_cols[1]]
    n = segs[:, 4].astype(np.uint64)
    keep = n > 0  # Mooncake completes an empty request without a round trip: skip it
    r, lo, n = r[keep], lo[keep], n[keep]
    if int(n.max(initial=0)) > PIECE_BYTES:
        piece = np.uint64(PIECE_BYTES)
        count = (n + piece - np.uint64(1)) // piece
        idx = np.repeat(np.arange(len(n)), count.astype(np.intp))
        first = np.cumsum(count) - count
        off = (np.arange(len(idx)) - first[idx]).astype(np.uint64) * piece
        r, lo = r[idx] + off, lo[idx] + off
        n = np.minimum(n[idx] - off, piece)
    return lo.tolist(), r.tolist(), n.tolist()


class _PeerQueue:
    """Requests in flight to one peer segment (over every connection of the agent)."""

    def __init__(self) -> None:
        self.sem = threading.BoundedSemaphore(PEER_QUEUE)


class MooncakeAgent(EngineAgent):
    """This instance's Mooncake ``TransferEngine`` (P2P handshake, TCP transport)."""

    kind = DataPath.MOONCAKE
    moves_device_memory = False

    @classmethod
    def probe(cls) -> str | None:
        from .._engine_env import engine_problem  # reasons with the command that fixes them

        return engine_problem("mooncake")

    def __init__(self, name: str, host: str) -> None:
        try:
            from mooncake.engine import TransferEngine  # type: ignore[import-untyped,import-not-found,unused-ignore]
        except ImportError as e:
            from .._engine_env import engine_problem

            raise EngineUnavailable(
                engine_problem("mooncake") or f"mooncake.engine cannot be imported: {e}"
            ) from e
        self.name = name
        # Mooncake's defaults fail a stalled (alive, frozen) peer's request only after 30 s
        # without progress, one lane after another: an aborted transfer waits for that (it
        # cannot be cancelled), overrunning its deadline by minutes. 5 s unless the user
        # chose (see the module docstring, "No cancel"). Read when the engine starts.
        for var in STALL_TIMEOUT_VARS:
            os.environ.setdefault(var, STALL_TIMEOUT_S)
        stall = max(_seconds(os.environ[var]) for var in STALL_TIMEOUT_VARS)
        self.abort_wait_s = (WINDOW / 4 + 2) * stall + 5.0  # (see "No cancel" above)
        addr = _advertised(host)
        self.te: Any = TransferEngine()
        try:
            rc = self.te.initialize(addr, "P2PHANDSHAKE", "tcp", "")
        except Exception as e:  # pybind raises on odd arguments
            raise EngineUnavailable(f"Mooncake TransferEngine.initialize failed: {e}") from e
        if rc != 0:
            raise EngineUnavailable(
                f"Mooncake TransferEngine.initialize({addr!r}, 'P2PHANDSHAKE', 'tcp') "
                f"returned {rc} (see its log on stderr)"
            )
        self.segment = f"{addr}:{self.te.get_rpc_port()}"
        self._regs: dict[int, list[int]] = {}  # cache_id -> registered addresses
        self._peers: dict[str, _PeerQueue] = {}
        self._lock = threading.Lock()
        self._closed = False

    def info(self) -> dict[str, Any]:
        return {"segment": self.segment}

    def register(self, entry: CacheEntry) -> None:
        dev = on_device(entry)
        if dev is not None:
            raise failure(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"cache {entry.cache_id} is in device memory (device {dev}): the Mooncake "
                "engine here (non-CUDA wheel) moves host memory only; NIXL moves device memory",
            )
        n = entry.tensor_bytes
        addrs = [int(a) for a in entry.addrs]
        done: list[int] = []
        with self._lock:
            for a in addrs:
                rc = self.te.register_memory(a, n)
                if rc != 0:
                    for b in done:
                        self.te.unregister_memory(b)
                    raise failure(
                        LLMStatusCode.LLM_PARAM_INVALID,
                        f"Mooncake cannot register cache {entry.cache_id} (tensor at {a:#x}, "
                        f"{n} bytes): register_memory returned {rc}"
                        + (" (overlaps a registered region)" if rc == -7 else ""),
                    )
                done.append(a)
            self._regs[entry.cache_id] = done

    def deregister(self, entry: CacheEntry) -> None:
        with self._lock:
            addrs = self._regs.pop(entry.cache_id, None)
            for a in addrs or ():
                rc = self.te.unregister_memory(a)
                if rc != 0:
                    log.warning("Mooncake: unregister_memory(%#x) returned %d", a, rc)

    def peer_queue(self, segment: str) -> threading.BoundedSemaphore:
        """The limit of requests in flight to ``segment`` (shared by its connections)."""
        with self._lock:
            q = self._peers.get(segment)
            if q is None:
                q = self._peers[segment] = _PeerQueue()
            return q.sem

    def connect(self, peer_info: dict[str, Any]) -> MooncakeConn:
        return MooncakeConn(self, peer_info)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for addrs in self._regs.values():
                for a in addrs:
                    self.te.unregister_memory(a)
            self._regs.clear()
        # The engine's destructor closes its segments and stops its threads.
        self.te = None


class MooncakeConn(EngineConn):
    """The way to one peer's Mooncake segment (it holds no engine resource of its own)."""

    begins = True  # (a submit only queues: see ``begin``)

    def __init__(self, agent: MooncakeAgent, peer_info: dict[str, Any]) -> None:
        self.agent = agent
        self.segment = ""
        self.update(peer_info)

    def update(self, peer_info: dict[str, Any]) -> None:
        # A segment name is the peer engine's for its whole life (late registrations
        # are seen without news: see the module docstring).
        self.segment = str(peer_info["segment"])
        self._queue = self.agent.peer_queue(self.segment)

    def read(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, control: _native.Control
    ) -> None:
        self._run("READ", plan, local, remote, control)

    def write(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, control: _native.Control
    ) -> None:
        self._run("WRITE", plan, local, remote, control)

    def close(self) -> None:
        """Nothing to release: the engine keeps the peer's segment until it closes."""

    def _run(
        self,
        op: str,
        plan: _native.Plan,
        local: CacheEntry,
        remote: CacheEntry,
        control: _native.Control,
    ) -> None:
        _Transfer(self, op, plan, local, remote).run(control)

    def begin(
        self, op: str, plan: _native.Plan, local: CacheEntry, remote: CacheEntry
    ) -> Begun | None:
        """A small READ's requests submitted now, on the loop thread: a submit only queues
        them (it returned in ~30 us with the peer stopped), so the network round trip
        overlaps the executor's hand-off; the executor polls them (see ``EngineConn``)."""
        if op != "READ" or plan.total_bytes > BEGIN_MAX_BYTES:
            return None
        t = _Transfer(self, op, plan, local, remote)
        if len(t.ns) > WINDOW:
            return None
        t.fill(False, wait=False)
        if not t.flight:
            return None  # nothing submitted (the peer's queue is full): the whole job
        return _Begun(t)


class _Transfer:
    """The requests of one transfer, each a batch of one (a piece of at most
    :data:`PIECE_BYTES`), at most :data:`WINDOW` in flight, the oldest polled."""

    def __init__(
        self, conn: MooncakeConn, op: str, plan: _native.Plan, local: CacheEntry, remote: CacheEntry
    ) -> None:
        te = conn.agent.te
        if te is None:
            raise failure(LLMStatusCode.LLM_FAILED, "the Mooncake engine was closed")
        self.los, self.rs, self.ns = _pieces(op, plan.segments(), local, remote)
        self.submit = (
            te.batch_transfer_async_read if op == "READ" else te.batch_transfer_async_write
        )
        self.check = te.transfer_check_status
        self.seg, self.queue, self.op = conn.segment, conn._queue, op
        self.remote_id = remote.cache_id
        self.local = local
        self.flight: deque[int] = deque()
        self.nxt = 0
        self.error = ""
        self.handed_off = False  # an abort left requests in flight to a reaper

    def fill(self, stop: bool, wait: bool = True) -> bool:
        """Submits pieces while the window and the peer's queue allow; True if any."""
        flight, queue, ns = self.flight, self.queue, self.ns
        progressed = False
        while not stop and self.nxt < len(ns) and len(flight) < WINDOW:
            got = queue.acquire(timeout=1e-3) if wait and not flight else queue.acquire(False)
            if not got:
                break  # the peer's queue is full: poll what we have in flight
            i = self.nxt
            bid = self.submit(self.seg, [self.los[i]], [self.rs[i]], [ns[i]])
            if not bid:
                queue.release()
                self.error = (
                    f"Mooncake could not submit the {self.op} (segment {self.seg} unreachable?)"
                )
                break
            flight.append(bid)
            self.nxt += 1
            progressed = True
        return progressed

    def reap(self) -> bool:
        """Takes the completed requests off the head of the window; True if any."""
        flight, check = self.flight, self.check
        progressed = False
        while flight:
            s = check(flight[0])
            if s == 0:
                break
            flight.popleft()
            self.queue.release()
            progressed = True
            if s != 1 and not self.error:
                # -1 FAILED (peer gone, address refused by the peer, queue full);
                # -2 TIMEOUT (other transports; the batch stays allocated).
                self.error = (
                    f"a Mooncake {self.op} request failed (status {s}: the peer died, or "
                    "refused an address outside its registered memory)"
                )
        return progressed

    def run(self, control: _native.Control) -> None:
        """Submits and polls until every piece ended (a short spin that yields the CPU,
        then sleeps doubling from 20 us to 1 ms); raises as ``MooncakeConn.read``."""
        total = len(self.ns)
        spin_until = time.perf_counter() + SPIN_S
        delay = 20e-6
        try:
            while self.nxt < total or self.flight:
                stop = bool(self.error) or control.aborted
                progressed = self.fill(stop)
                progressed = self.reap() or progressed
                if stop and not self.flight:
                    break
                if control.aborted:
                    self._hand_off()  # (the call keeps its deadline; see "No cancel")
                    break
                if progressed:
                    delay = 20e-6
                    continue
                if time.perf_counter() < spin_until:
                    # Yield: on a small machine the engine's own threads need this core.
                    os.sched_yield()
                    continue
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
        finally:
            # Only reached with requests in flight when something raised in Python
            # (KeyboardInterrupt): Mooncake may still write them; wait for each.
            for bid in self.flight:
                with contextlib.suppress(Exception):
                    while self.check(bid) == 0:
                        time.sleep(1e-3)
                self.queue.release()
            self.flight.clear()
        if control.aborted and (self.error or self.nxt < total or self.handed_off):
            # The abort (deadline, cancel) is what the caller asked for: it wins over a
            # request that failed meanwhile (a stalled peer's, typically).
            raise _native.NativeError(_native.Status.ABORTED, "transfer aborted")
        if self.error:
            raise failure(
                LLMStatusCode.LLM_FAILED,
                f"{self.error}; remote cache {self.remote_id} at {self.seg}",
            )

    def _hand_off(self) -> None:
        """An abort with requests in flight: Mooncake cannot cancel them, and a stalled
        peer ends them only after its timeouts, so a thread of their own waits for them.
        Until they ended the local bytes they may touch are fenced (no transfer or copy
        touches them, no free of the cache) and the remote cache's lease is kept (the
        owner's free waits), as for NIXL's requests on the wire (``nixl.py``); the peer's
        queue slots are released as each ends."""
        flight, self.flight = list(self.flight), deque()
        self.handed_off = True
        local, queue, check, op = self.local, self.queue, self.check, self.op
        # What those requests may still touch of ours: their pieces, the window's last
        # len(flight) submitted (the rest of the cache takes transfers meanwhile).
        first = self.nxt - len(flight)
        starts = np.asarray(self.los[first : self.nxt], dtype=np.uint64)
        where = Region((starts, starts + np.asarray(self.ns[first : self.nxt], dtype=np.uint64)))
        let_go = keep_current()
        fence = local.fence(where)

        def wait() -> None:
            try:
                for bid in flight:
                    delay = 1e-4
                    try:
                        while check(bid) == 0:
                            time.sleep(delay)
                            delay = min(delay * 2, 1e-2)
                    except Exception:
                        pass  # the engine gave up on it: over
                    finally:
                        queue.release()
            finally:
                local.unfence(fence)
                if let_go is not None:
                    let_go()
                log.debug(
                    "Mooncake: aborted %s over; its blocks of cache %d take transfers again",
                    op,
                    local.cache_id,
                )

        threading.Thread(target=wait, name="aiodatadist-mooncake-reaper", daemon=True).start()


class _Begun(Begun):
    """A :class:`_Transfer` whose first requests were submitted on the loop thread."""

    def __init__(self, transfer: _Transfer) -> None:
        super().__init__()
        self._t = transfer

    def _wait(self, control: _native.Control) -> None:
        self._t.run(control)
