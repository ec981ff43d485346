"""Type stubs for the private native core (``ext/`` -> ``aiodatadist._native``).

Every blocking function here releases the GIL, takes a :class:`Control` (abort
token + progress counter) and raises :class:`NativeError` carrying a
:class:`Status` on failure.  Nothing in here knows about asyncio.
"""

import enum
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__version__: str
IOV_MAX: int
CHUNK_BYTES: int
"""Movers check their abort token at least every ``CHUNK_BYTES`` (4 MiB)."""

class Status(enum.IntEnum):
    # ext/core.hpp's enum class Status is the source; tests/test_errors.py checks this copy.
    OK = 0
    FAILED = 1
    PARAM_INVALID = 2
    OUT_OF_RANGE = 3
    OVERLAP = 4
    ABORTED = 5
    TIMEOUT = 6
    PERMISSION_DENIED = 7
    NO_SUCH_PROCESS = 8
    PEER_CLOSED = 9
    IO_ERROR = 10
    NO_MEMORY = 11
    STALE = 12
    """A data stream carried another transfer's bytes: nothing was written."""

class NativeError(Exception):
    status: Status
    errno: int
    def __init__(self, status: Status, message: str, errno: int = 0) -> None: ...

class Control:
    """Abort token and progress counter shared by Python and a running mover."""

    def __init__(self) -> None: ...
    def abort(self) -> None: ...
    @property
    def aborted(self) -> bool:
        """Stop now: :meth:`abort` was called, or the :meth:`expire_in` deadline passed
        (reading it then aborts the job and sets :attr:`expired`, as a mover would)."""
    @property
    def bytes_done(self) -> int: ...
    @property
    def total(self) -> int: ...
    def reset(self) -> None: ...
    def expire_in(self, seconds: float) -> None:
        """The job's own deadline, ``seconds`` from now (CLOCK_MONOTONIC; <= 0: due now):
        its movers end it there (``ABORTED``, :attr:`expired` set) between chunks, even
        while nothing calls :meth:`abort`. Cleared by :meth:`reset`."""
    @property
    def expired(self) -> bool:
        """The job ended (or ends) at its :meth:`expire_in` deadline."""

class Geometry:
    """One side of a transfer: ``num_tensors`` tensors of ``tensor_bytes`` each,
    cut into ``num_blocks`` blocks of ``block_bytes`` bytes."""

    def __init__(self, num_tensors: int, num_blocks: int, block_bytes: int) -> None: ...
    @property
    def num_tensors(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def tensor_bytes(self) -> int: ...

class Plan:
    """An immutable, validated list of segments.

    Each segment is (src tensor, src offset, dst tensor, dst offset, bytes).
    """

    @staticmethod
    def blocks(
        src: Geometry,
        dst: Geometry,
        src_blocks: Sequence[int] | npt.NDArray[np.integer],
        dst_blocks: Sequence[int] | npt.NDArray[np.integer],
        src_tensor_start: int,
        dst_tensor_start: int,
        tensor_count: int,
    ) -> Plan: ...
    @staticmethod
    def from_segments(src: Geometry, dst: Geometry, segments: npt.NDArray[np.uint64]) -> Plan: ...
    @property
    def src(self) -> Geometry: ...
    @property
    def dst(self) -> Geometry: ...
    @property
    def num_segments(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    def segments(self) -> npt.NDArray[np.uint64]:
        """A copy of the segments as an ``(n, 5)`` uint64 array."""
    def layer_bounds(self, first_tensor: int, tensors: int, count: int) -> list[int]:
        """Each layer's end (a segment index; the last = the segment count) when layer
        ``k`` writes destination tensors ``first_tensor + k * tensors`` (``tensors`` of
        them); ``NativeError`` (PARAM_INVALID) when the segments are not cut that way
        (out of that range, out of layer order, or a layer without a segment)."""

def copy_local(
    plan: Plan,
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    control: Control,
    threads: int = 1,
) -> None: ...
def set_copy_mode(mode: str) -> None:
    """copy_local's kernel, process-wide: ``auto`` (non-temporal stores from
    ``STREAM_THRESHOLD`` bytes on), ``memcpy`` or ``stream`` (every piece)."""

def copy_mode() -> str: ...

STREAM_SUPPORTED: bool
STREAM_THRESHOLD: int

def cma_read(
    pid: int,
    plan: Plan,
    remote_src_bases: Sequence[int],
    local_dst_bases: Sequence[int],
    control: Control,
    threads: int = 1,
) -> None: ...
def copy_local_layered(
    plan: Plan,
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    bounds: Sequence[int],
    control: Control,
    threads: int,
    efd: int,
    lease_addr: int = 0,
    lease_gen: int = 0,
) -> None:
    """``copy_local`` as one job cut into layers: layer ``k`` is the plan's segments
    ``bounds[k-1] .. bounds[k]`` (ascending, none empty, the last = the segment count).
    Layers land in order; once each has landed in full (and, with ``lease_addr``, the
    lease slot there still holds ``lease_gen``: else ``Status.FAILED``), 1 is added to the
    eventfd ``efd``. Threads and the copy kernel are chosen on the whole plan."""

def cma_read_layered(
    pid: int,
    plan: Plan,
    remote_src_bases: Sequence[int],
    local_dst_bases: Sequence[int],
    bounds: Sequence[int],
    control: Control,
    threads: int,
    efd: int,
    lease_addr: int = 0,
    lease_gen: int = 0,
) -> None:
    """``cma_read`` as one job cut into layers, signalled as :func:`copy_local_layered`."""

class StartedJob:
    """A native job running on a mover pool thread (:func:`start_layered`)."""

    def wait(self) -> None:
        """Returns once the job has returned (running it here if no pool thread took it
        yet); raises its error (the first wait only). GIL released."""
    @property
    def done(self) -> bool: ...

def start_layered(
    pid: int,
    plan: Plan,
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    bounds: Sequence[int],
    control: Control,
    threads: int,
    efd: int,
    lease_addr: int,
    lease_gen: int,
    nice: int,
) -> StartedJob:
    """:func:`copy_local_layered` (``pid`` 0) or :func:`cma_read_layered`, started now on a
    mover pool thread running at ``nice``; the GIL is held throughout (it only queues).
    With ``lease_addr``, the job enters that lease slot first (``Status.STALE`` when
    ``lease_gen`` is not current: nothing moved) and leaves it at the end. The handle
    keeps ``plan`` and ``control`` alive; dropping it waits for the job."""

def cma_write(
    pid: int,
    plan: Plan,
    local_src_bases: Sequence[int],
    remote_dst_bases: Sequence[int],
    control: Control,
    threads: int = 1,
) -> None: ...

SOCK_HEADER_BYTES: int
"""Bytes of the header that starts every data stream of a socket transfer."""

def sock_send(
    fds: Sequence[int], plan: Plan, src_bases: Sequence[int], control: Control, *, tag: int
) -> None:
    """Sends the plan's source bytes, an equal share per fd, each share after a header
    naming transfer ``tag`` and the share's byte count."""

def sock_recv(
    fds: Sequence[int], plan: Plan, dst_bases: Sequence[int], control: Control, *, tag: int
) -> None:
    """Receives the plan's bytes into the destination; each stream's header must name
    transfer ``tag`` and the share's byte count, or it fails with ``Status.STALE``
    before writing a byte of that stream."""

class SockStep:
    """One stream of a small socket transfer, moved in non-blocking steps by an event
    loop: the stream format and header check of ``sock_send`` / ``sock_recv``."""

    def __init__(
        self, fd: int, plan: Plan, bases: Sequence[int], send: bool, *, tag: int
    ) -> None: ...
    def step(self) -> bool:
        """Moves what the socket takes (or holds) now, never waiting; True once done."""
    @property
    def finished(self) -> bool: ...
    @property
    def sending(self) -> bool: ...
    @property
    def fd(self) -> int: ...
    @property
    def bytes_done(self) -> int: ...
    @property
    def total(self) -> int: ...
    def step_for(self, timeout_us: int) -> bool:
        """``step()``, then waits for readiness (GIL released) and steps again, for at most
        ``timeout_us`` in all; True once done."""
    def run(self, control: Control) -> None:
        """``step()`` until done, waiting (GIL released) for readiness or ``control``'s
        abort between steps (a worker thread's run of the whole exchange); raises
        ``NativeError(ABORTED)`` once aborted (the stream is then out of step)."""
    @property
    def refused(self) -> bool:
        """The stream carried the sender's refusal of this transfer (nothing was written)."""
    @property
    def refusal(self) -> bytes:
        """The refusal's body (once ``finished``)."""

SOCK_REFUSAL_MAGIC: bytes
"""What a refusal starts with instead of the stream header: magic, tag, body length."""
SOCK_MAX_REFUSAL_BYTES: int

def plan_segment_bytes(plan: Plan) -> bytes:
    """The plan's segments as the wire's rows (5 little-endian uint64 each)."""

def plan_striped(plan: Plan, bounds: Sequence[int], streams: int) -> tuple[Plan, list[int]] | None:
    """A layered pull on ``streams`` streams: ``plan`` reordered so that each stream's share
    carries its part of every layer (cut by ``bounds``) in order, and where each layer's
    part ends in a share; None when a layer's bytes do not divide by ``streams``."""

def plan_from_segment_bytes(src: Geometry, dst: Geometry, data: bytes, offset: int = 0) -> Plan:
    """A plan from wire rows (``data[offset:]``), checked like ``Plan.from_segments``."""

def sock_recv_layered(
    fds: Sequence[int],
    plan: Plan,
    dst_bases: Sequence[int],
    control: Control,
    *,
    tag: int,
    ends: Sequence[int],
    efd: int,
) -> None:
    """``sock_recv``, adding 1 to the eventfd ``efd`` as each layer has landed: each
    stream's share of the plan carries its part of every layer in order, ``ends[k]``
    being where layer ``k``'s part ends in a share."""

def sock_header(tag: int, nbytes: int) -> bytes:
    """The header a stream of transfer ``tag`` carrying ``nbytes`` payload bytes starts with."""

def cma_probe(pid: int) -> tuple[bool, int]:
    """Whether ``process_vm_readv`` on ``pid`` is allowed here, and the errno when it is not."""

LEASE_SLOT_BYTES: int
"""Bytes per lease slot: ``{atomic u64 gen; atomic u32 readers; u32 pad}``."""
LEASE_REVOKED: int
"""The bit of a slot's generation that marks it revoked (``1 << 63``)."""

class LaneCopy:
    """One small pull of blocks on the calling thread (a fast lane, ``aiodatadist._lanes``):
    ``process_vm_readv`` from ``pid``, or a memcpy when ``pid`` is 0, under the lease
    slot at ``lease_addr`` (0: none); geometries and address lists fixed here."""

    def __init__(
        self,
        pid: int,
        src: Geometry,
        dst: Geometry,
        src_bases: Sequence[int],
        dst_bases: Sequence[int],
        lease_addr: int,
        lease_gen: int,
        max_bytes: int,
    ) -> None: ...
    def pull(
        self,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_tensor_start: int,
        dst_tensor_start: int,
        tensor_count: int,
    ) -> int:
        """GIL released. The bytes moved, or -1: declined (an invalid plan, or over
        ``max_bytes``; nothing moved), -2: the lease was stale (nothing moved), -3: the
        lease was revoked while the bytes moved (they are not valid). Raises NativeError."""

class ServeBook:
    """What the native tcp serving threads may read (``ext/serve.hpp``): per cache, its
    geometry, addresses, lease slot (in the book's own lease words) and generation."""

    def __init__(self, slots: int) -> None: ...
    @property
    def slots(self) -> int: ...
    def slot_addr(self, slot: int) -> int:
        """The address of lease slot ``slot`` (for ``lease_publish`` / ``lease_revoke``)."""
    def put(
        self,
        cache_id: int,
        slot: int,
        gen: int,
        geometry: Geometry,
        bases: Sequence[int],
        device: bool,
    ) -> None: ...
    def remove(self, cache_id: int) -> None: ...
    def __contains__(self, cache_id: int) -> bool: ...
    def __len__(self) -> int: ...

class StreamServer:
    """A thread serving one link's request stream (``ext/serve.hpp``): each request
    checked against ``book``, answered with its bytes under the cache's lease, or a
    refusal carrying ``codes[native status]`` (``not_exist``: no such cache, or stale)."""

    def __init__(
        self,
        book: ServeBook,
        cap_s: float,
        max_bytes: int,
        codes: Sequence[int],
        not_exist: int,
    ) -> None: ...
    def serve(self, fd: int) -> None:
        """Serves the stream on ``fd`` (owned and closed by the server) from now on; the
        one served until now is shut down."""
    def retire(self) -> None: ...
    def stop(self) -> None:
        """Ends (and joins) the thread; idempotent."""
    @property
    def served(self) -> int: ...
    @property
    def failed(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def busy(self) -> bool: ...

def lease_enter(addr: int, gen: int) -> bool:
    """Counts one reader on the slot at ``addr``; False (and no reader left) when the
    slot's generation is not ``gen``."""

def lease_exit(addr: int) -> None:
    """Ends one reader; the last reader of a revoked slot wakes the revoker (shared futex)."""

def lease_publish(addr: int, gen: int) -> None: ...
def lease_gen(addr: int) -> int: ...
def lease_readers(addr: int) -> int: ...
def lease_set_fences(addr: int, n: int) -> None:
    """The owner's count of fences on the slot's cache (one-sided writers stay out)."""

def lease_fences(addr: int) -> int: ...
def lease_revoke(addr: int, timeout_s: float) -> bool:
    """Marks the slot revoked and waits (GIL released, futex) until it has no reader, at
    most ``timeout_s``; on timeout restores the generation it found and returns False."""

class ShmSegment:
    """A nameless, size-sealed memfd segment mapped into this process.

    ``create`` makes one (nothing appears in ``/dev/shm``; its size is sealed, so no
    process that maps it can ever fault past its end); ``from_fd`` maps one received
    from a peer (an fd passed over a Unix socket) and refuses a file that is not
    sealed against shrinking. ``name`` is a label (shown in ``/proc/<pid>/maps``).
    """

    @staticmethod
    def create(name: str, size: int) -> ShmSegment: ...
    @staticmethod
    def from_fd(fd: int, size: int, writable: bool = False, name: str = "?") -> ShmSegment:
        """Maps ``size`` bytes of a received segment; the fd is dup'ed (the caller keeps
        and closes its own), the dup is closed by :meth:`close`.

        Raises:
            NativeError: PERMISSION_DENIED (not a sealed memfd), OUT_OF_RANGE (shorter
                than ``size``), PARAM_INVALID (a bad fd or size).
        """
    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def addr(self) -> int: ...
    @property
    def fd(self) -> int:
        """The segment's fd (-1 once closed): what a peer is sent to map it."""
    @property
    def owner(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def populated(self) -> bool:
        """Whether every page is in this mapping's page tables (a peer's mapping from
        :meth:`from_fd` is filled on a thread of its own; :meth:`create`'s at once)."""
    def close(self) -> None:
        """Unmaps and closes the fd. Idempotent."""
    @property
    def writable(self) -> bool: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
