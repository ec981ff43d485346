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

class NativeError(Exception):
    status: Status
    errno: int
    def __init__(self, status: Status, message: str, errno: int = 0) -> None: ...

class Control:
    """Abort token and progress counter shared by Python and a running mover."""

    def __init__(self) -> None: ...
    def abort(self) -> None: ...
    @property
    def aborted(self) -> bool: ...
    @property
    def bytes_done(self) -> int: ...
    @property
    def total(self) -> int: ...
    def reset(self) -> None: ...

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

def copy_local(
    plan: Plan,
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    control: Control,
    threads: int = 1,
) -> None: ...
def cma_read(
    pid: int,
    plan: Plan,
    remote_src_bases: Sequence[int],
    local_dst_bases: Sequence[int],
    control: Control,
    threads: int = 1,
) -> None: ...
def cma_write(
    pid: int,
    plan: Plan,
    local_src_bases: Sequence[int],
    remote_dst_bases: Sequence[int],
    control: Control,
    threads: int = 1,
) -> None: ...
def sock_send(
    fds: Sequence[int], plan: Plan, src_bases: Sequence[int], control: Control
) -> None: ...
def sock_recv(
    fds: Sequence[int], plan: Plan, dst_bases: Sequence[int], control: Control
) -> None: ...
def cma_probe(pid: int) -> tuple[bool, int]:
    """Whether ``process_vm_readv`` on ``pid`` is allowed here, and the errno when it is not."""

class ShmSegment:
    """A POSIX shared-memory segment mapped into this process."""

    @staticmethod
    def create(name: str, size: int) -> ShmSegment: ...
    @staticmethod
    def open(name: str, size: int, writable: bool = False) -> ShmSegment: ...
    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def addr(self) -> int: ...
    @property
    def owner(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None:
        """Unmap (and, for the creator, unlink). Idempotent."""
    def unlink(self) -> None: ...
    @property
    def writable(self) -> bool: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
