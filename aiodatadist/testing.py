"""Test helpers: linked prompt/decoder pairs with real caches and real bytes, and faults.

Everything here works with or without pytest (embedded programs, examples, the
``aiodatadist`` command line); the pytest fixtures in
:mod:`aiodatadist.pytest_plugin` are thin wrappers over it.

* :func:`inproc_pair`: a prompt and a decoder in this process, linked in-process::

      async with inproc_pair() as pair:
          src = pair.prompt_cache(num_tensors=4, num_blocks=8, block_shape=(16, 2, 64))
          dst = pair.decoder_cache(num_tensors=4, num_blocks=8, block_shape=(16, 2, 64))
          await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0], [1])

* :func:`remote_pair`: the prompt in a subprocess (``python -m aiodatadist._peer_proc``)
  holding a cache filled with a seeded pattern, the decoder in this process, linked over
  loopback with a chosen data path (``shm``, ``cma``, ``tcp`` or ``auto``), optionally
  through a :class:`FaultInjector`::

      async with remote_pair(PromptSpec(num_blocks=16), data_path="tcp", faults=True) as pair:
          dst = pair.decoder_cache()
          await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [3], [0])
          assert not pair.mismatches(dst, [3], [0])
          pair.faults.pause()          # the next pull times out ...
          pair.faults.resume()         # ... and then works again
          await pair.faults.drop()     # the link breaks: LLMException, not a hang
          pair.faults.kill_peer()      # SIGKILL the prompt process

* :func:`fill_pattern`, :func:`pattern_blocks`, :func:`pattern_mismatches`: the
  deterministic block contents both sides can compute from a seed, so a decoder can
  check every byte it pulled from a process it cannot see into.

* :func:`host_buffer`: host memory as a serving process registers it (anonymous,
  2 MiB-aligned, ``MADV_HUGEPAGE``, touched); ``make_blocks_cache(huge_pages=True)``
  registers a cache on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mmap
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ._peer_proc import python_argv, python_env
from .datadist import LLMDataDist
from .errors import LLMException, LLMStatusCode
from .types import BlocksCacheKey, CacheDesc, DataType, KvCache, LLMClusterInfo, LLMRole, Placement

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "FaultInjector",
    "FilledCache",
    "Mismatch",
    "Pair",
    "PeerProcess",
    "PromptSpec",
    "RemotePair",
    "cluster_info",
    "fill_pattern",
    "host_buffer",
    "inproc_pair",
    "make_blocks_cache",
    "pattern_blocks",
    "pattern_mismatches",
    "remote_pair",
]

log = logging.getLogger("aiodatadist.testing")

OPT_DATA_PATH = "aiodatadist.DataPath"

# --------------------------------------------------------------------------- in-process


@dataclass
class FilledCache:
    """A registered cache and numpy views of its tensors."""

    cache: KvCache
    tensors: list[Any]

    def block(self, tensor: int, block: int) -> Any:
        return self.tensors[tensor][block]


def cluster_info(
    remote_cluster_id: int, host: str | None = None, port: int | None = None
) -> LLMClusterInfo:
    """An ``LLMClusterInfo`` for ``remote_cluster_id`` (with its address when it is remote)."""
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    if host is not None and port is not None:
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(host, port)
    return info


HUGE_PAGE_BYTES = 2 << 20
"""The transparent huge page size :func:`host_buffer` aligns to (x86-64, arm64 4K)."""


def host_buffer(shape: int | Sequence[int], dtype: Any, *, huge_pages: bool = True) -> Any:
    """A zeroed numpy array on its own anonymous mapping, every page touched.

    What a serving process does with host memory it registers: the mapping is
    aligned to 2 MiB and ``madvise(MADV_HUGEPAGE)``'d, so with transparent huge
    pages in ``always`` or ``madvise`` mode (``/sys/kernel/mm/transparent_hugepage/
    enabled``) the kernel backs it with 2 MiB pages when it can. Copies, and above
    all ``process_vm_readv`` (the ``cma`` path), which pins the peer's pages one
    page at a time, are then much faster than on 4 KiB pages. Whether the kernel
    did is visible in ``/proc/PID/smaps`` (``AnonHugePages``); it is a hint.

    Args:
        shape: the array's shape.
        dtype: a numpy dtype.
        huge_pages: True: ``MADV_HUGEPAGE``; False: ``MADV_NOHUGEPAGE`` (4 KiB pages
            for certain, e.g. for a benchmark that compares both).

    The memory is unmapped when the array (and every view of it) is gone.
    """
    import numpy as np

    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    nbytes = dt.itemsize
    for d in dims:
        nbytes *= d
    if nbytes == 0:
        return np.zeros(dims, dtype=dt)
    # From 2 MiB on, over-map by one huge page and start the array on a 2 MiB
    # boundary, so that every whole 2 MiB of it can be one huge page (the untouched
    # slack costs no memory). A smaller array could only get one by wasting one.
    slack = HUGE_PAGE_BYTES if huge_pages and nbytes >= HUGE_PAGE_BYTES else 0
    mm = mmap.mmap(-1, nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(mm, dtype=np.uint8)
    offset = -raw.ctypes.data % HUGE_PAGE_BYTES if slack else 0
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # THP compiled out, or a kernel without it
            mm.madvise(advice)
    raw = raw[offset : offset + nbytes]
    raw.fill(0)  # touch: every page is resident before the first transfer
    return raw.view(dt).reshape(dims)


def make_blocks_cache(
    dd: LLMDataDist,
    *,
    num_tensors: int = 4,
    num_blocks: int = 8,
    block_shape: Sequence[int] = (16, 2, 64),
    data_type: DataType = DataType.DT_FLOAT16,
    model_id: int | None = None,
    seed: int | None = None,
    allocate: bool = False,
    pattern: bool = False,
    huge_pages: bool = False,
) -> FilledCache:
    """Registers (or allocates in shared memory) a blocks cache on ``dd``.

    ``seed`` fills it with reproducible random bytes (or, with ``pattern=True``, with
    :func:`fill_pattern`'s pattern, which a peer can check without seeing this cache);
    None leaves it zeroed.

    ``huge_pages=True`` puts the registered tensors, one after the other, on one
    :func:`host_buffer` (2 MiB-aligned, ``MADV_HUGEPAGE``), as a serving process
    would; it has no effect
    with ``allocate=True`` (POSIX shared memory gets huge pages only when
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` says so).
    """
    import numpy as np

    desc = CacheDesc(num_tensors, [num_blocks, *block_shape], data_type, Placement.HOST)
    key = None if model_id is None else BlocksCacheKey(dd.cluster_id, model_id)
    cm = dd.cache_manager
    if allocate:
        cache = cm.allocate_blocks_cache(desc, key)
        tensors = cache.tensors()
    else:
        dtype = data_type.to_numpy()
        if huge_pages:
            # One mapping for every tensor (as a serving process allocates its cache):
            # huge pages then cover tensors smaller than one, too.
            tensors = list(host_buffer((num_tensors, *desc.shape), dtype))
        else:
            # np.empty + fill touches every page now, so the first transfer does not
            # pay for page faults (a serving cache is resident too).
            tensors = [np.empty(desc.shape, dtype=dtype) for _ in range(num_tensors)]
            for t in tensors:
                t.view(np.uint8).fill(0)
        cache = cm.register_blocks_cache(desc, tensors, key)
    if seed is not None:
        if pattern:
            fill_pattern(tensors, seed)
        else:
            rng = np.random.default_rng(seed)
            for t in tensors:
                raw = t.view(np.uint8)
                raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    return FilledCache(cache, tensors)


@dataclass
class Pair:
    """A prompt and a decoder in this process, linked (decoder -> prompt)."""

    prompt: LLMDataDist
    decoder: LLMDataDist
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self, model_id: int = 0) -> BlocksCacheKey:
        """The key a decoder uses to pull the prompt's blocks cache ``model_id``."""
        return BlocksCacheKey(self.prompt.cluster_id, model_id)

    def prompt_cache(self, *, model_id: int = 0, seed: int = 1, **kw: Any) -> FilledCache:
        """A blocks cache of the prompt under ``model_id``, filled from ``seed``."""
        return make_blocks_cache(self.prompt, model_id=model_id, seed=seed, **kw)

    def decoder_cache(self, **kw: Any) -> FilledCache:
        """A zeroed blocks cache of the decoder (``make_blocks_cache`` keywords)."""
        return make_blocks_cache(self.decoder, **kw)


@asynccontextmanager
async def inproc_pair(
    *,
    prompt_id: int = 1,
    decoder_id: int = 2,
    options: dict[str, str] | None = None,
    prompt_role: LLMRole = LLMRole.PROMPT,
    decoder_role: LLMRole = LLMRole.DECODER,
    link: bool = True,
    data_path: str = "inproc",
) -> AsyncIterator[Pair]:
    """A linked prompt/decoder pair in this process; finalized on exit.

    Args:
        prompt_id, decoder_id: cluster ids.
        options: ``init`` options of both instances.
        prompt_role, decoder_role: their roles.
        link: link the decoder to the prompt.
        data_path: ``inproc`` (or ``auto``): an in-process link. ``shm``, ``cma`` or ``tcp``:
            the prompt listens on loopback and the decoder, forced to that path, links to
            its address: a real cross-process link, both ends in this process
            (``pair.extra["address"]`` holds the prompt's address).

    Raises:
        ValueError: unknown ``data_path``.
        RuntimeError: the link failed.
        LLMException: ``init`` refused the options or a cluster id is in use.

    Cancel: a cancel while setting up (or in the body) finalizes what was set up and
    propagates. Timeout: linking is bounded by ``link_clusters``' default 3 s.
    """
    if data_path not in ("auto", "inproc", "shm", "cma", "tcp"):
        raise ValueError(f"data_path must be auto, inproc, shm, cma or tcp, got {data_path!r}")
    remote = data_path in ("shm", "cma", "tcp")
    prompt_opts = dict(options or {})
    decoder_opts = dict(options or {})
    if remote:
        prompt_opts.setdefault("llm.listenIpInfo", "127.0.0.1:0")
        decoder_opts[OPT_DATA_PATH] = data_path
    prompt = LLMDataDist(prompt_role, prompt_id)
    decoder = LLMDataDist(decoder_role, decoder_id)
    await prompt.init(prompt_opts)
    try:
        await decoder.init(decoder_opts)
        try:
            extra: dict[str, Any] = {}
            if link:
                if remote:
                    address = prompt.listen_address
                    assert address is not None
                    extra["address"] = address
                    info = cluster_info(prompt_id, *address)
                else:
                    info = cluster_info(prompt_id)
                status, _ = await decoder.link_clusters([info])
                if status != 0:
                    raise RuntimeError(f"{data_path} link failed: {status!r}")
            yield Pair(prompt, decoder, extra)
        finally:
            await decoder.finalize()
    finally:
        await prompt.finalize()


# --------------------------------------------------------------------------- the pattern

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_WORD_STEP = 0xBF58476D1CE4E5B9


def _mix64(x: int) -> int:
    x = (x + _GOLDEN) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def pattern_blocks(
    seed: int, tensor: int, blocks: Sequence[int] | npt.NDArray[Any], block_bytes: int
) -> npt.NDArray[np.uint8]:
    """The pattern bytes of ``blocks`` of tensor ``tensor`` for ``seed``.

    Every (seed, tensor, block) gives a different sequence and every 8-byte word of a
    block differs from its neighbours, so a lost, misplaced, shifted or flipped byte
    shows. Cheap: a few vector operations per block.

    Returns:
        A ``(len(blocks), block_bytes)`` uint8 array.
    """
    import numpy as np

    ids = np.asarray(blocks, dtype=np.uint64).reshape(-1)
    nwords = -(-block_bytes // 8)
    key = np.uint64(_mix64((seed & _M64) ^ _mix64(tensor + 1)))
    bases = (ids * np.uint64(_GOLDEN)) ^ key
    words = bases[:, None] + np.arange(nwords, dtype=np.uint64)[None, :] * np.uint64(_WORD_STEP)
    words ^= words >> np.uint64(31)
    out: npt.NDArray[np.uint8] = words.view(np.uint8)[:, :block_bytes]
    return out


def _raw_blocks(tensor: Any) -> npt.NDArray[np.uint8]:
    raw: npt.NDArray[np.uint8] = tensor.view("uint8").reshape(tensor.shape[0], -1)
    return raw


_CHUNK_BYTES = 32 << 20


def fill_pattern(
    tensors: Sequence[Any],
    seed: int,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Fills every block of ``tensors`` (each ``[num_blocks, ...]``) with :func:`pattern_blocks`.

    ``progress(done, total)`` is called after each tensor.
    """
    import numpy as np

    for t, tensor in enumerate(tensors):
        raw = _raw_blocks(tensor)
        n, bb = raw.shape
        step = max(1, _CHUNK_BYTES // max(1, bb))
        for b0 in range(0, n, step):
            ids = np.arange(b0, min(n, b0 + step))
            raw[b0 : b0 + len(ids)] = pattern_blocks(seed, t, ids, bb)
        if progress is not None:
            progress(t + 1, len(tensors))


@dataclass(frozen=True)
class Mismatch:
    """A destination block whose bytes are not the pattern of the source block it should hold."""

    src_tensor: int
    dst_tensor: int
    src_block: int
    dst_block: int
    offset: int  # first differing byte within the block
    count: int  # differing bytes within the block

    def __str__(self) -> str:
        return (
            f"tensor {self.src_tensor} block {self.src_block} -> tensor {self.dst_tensor} "
            f"block {self.dst_block}: {self.count} byte(s) differ, first at offset {self.offset}"
        )


def pattern_mismatches(
    dst_tensors: Sequence[Any],
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    seed: int,
    tensors: Sequence[tuple[int, int]] | None = None,
    *,
    limit: int = 100,
) -> list[Mismatch]:
    """Checks pulled blocks against :func:`pattern_blocks`; returns at most ``limit`` mismatches.

    Args:
        dst_tensors: the destination cache's tensors (``[num_blocks, ...]`` each).
        src_blocks, dst_blocks: the pull's block lists (pairwise).
        seed: the seed the source was filled with.
        tensors: ``(src_tensor, dst_tensor)`` pairs to check; default: every tensor to itself.
    """
    import numpy as np

    pairs = [(t, t) for t in range(len(dst_tensors))] if tensors is None else list(tensors)
    src = list(src_blocks)
    dst = list(dst_blocks)
    out: list[Mismatch] = []
    for st, dt in pairs:
        raw = _raw_blocks(dst_tensors[dt])
        bb = raw.shape[1]
        step = max(1, _CHUNK_BYTES // max(1, bb))
        for i0 in range(0, len(src), step):
            s_ids, d_ids = src[i0 : i0 + step], dst[i0 : i0 + step]
            want = pattern_blocks(seed, st, s_ids, bb)
            got = raw[np.asarray(d_ids, dtype=np.intp)]
            if np.array_equal(got, want):
                continue
            for k in np.flatnonzero((got != want).any(axis=1)).tolist():
                diff = np.flatnonzero(got[k] != want[k])
                out.append(Mismatch(st, dt, s_ids[k], d_ids[k], int(diff[0]), int(diff.size)))
                if len(out) >= limit:
                    return out
    return out


# --------------------------------------------------------------------------- the peer process

_DTYPES = {
    "fp16": DataType.DT_FLOAT16,
    "bf16": DataType.DT_BF16,
    "fp32": DataType.DT_FLOAT,
    "int8": DataType.DT_INT8,
    "uint8": DataType.DT_UINT8,
}


@dataclass(frozen=True)
class PromptSpec:
    """The blocks cache a prompt subprocess serves (see :class:`PeerProcess`).

    Attributes:
        num_tensors: tensors of the cache (layers x tensors per layer).
        num_blocks: blocks per tensor.
        block_shape: shape of one block of one tensor, e.g. ``(128, 8, 128)``.
        dtype: ``fp16``, ``bf16``, ``fp32``, ``int8`` or ``uint8``.
        model_id: the cache's ``BlocksCacheKey`` model id.
        seed: the :func:`fill_pattern` seed.
        allocate: allocate in shared memory (``shm`` applies) instead of registering
            numpy memory (only ``cma`` / ``tcp`` apply).
        corrupt: ``(tensor, block, offset)`` of one byte to flip after filling, or None
            (to prove that a check of the pulled bytes really checks).
    """

    num_tensors: int = 8
    num_blocks: int = 16
    block_shape: tuple[int, ...] = (16, 2, 64)
    dtype: str = "fp16"
    model_id: int = 0
    seed: int = 1
    allocate: bool = True
    corrupt: tuple[int, int, int] | None = None

    @property
    def data_type(self) -> DataType:
        return _DTYPES[self.dtype]

    @property
    def block_bytes(self) -> int:
        n = self.data_type.itemsize
        for d in self.block_shape:
            n *= d
        return n

    @property
    def cache_bytes(self) -> int:
        return self.num_tensors * self.num_blocks * self.block_bytes

    def desc(self, num_blocks: int | None = None) -> CacheDesc:
        """The cache's ``CacheDesc`` (with another block count for a decoder cache)."""
        n = self.num_blocks if num_blocks is None else num_blocks
        return CacheDesc(self.num_tensors, [n, *self.block_shape], self.data_type, Placement.HOST)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PromptSpec:
        d = json.loads(text)
        d["block_shape"] = tuple(int(x) for x in d["block_shape"])
        if d.get("corrupt") is not None:
            t, b, o = (int(x) for x in d["corrupt"])
            d["corrupt"] = (t, b, o)
        spec = cls(**d)
        if spec.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {spec.dtype!r}")
        return spec


def _kill_quietly(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


class PeerProcess:
    """A prompt ``LLMDataDist`` in a subprocess, serving one pattern-filled blocks cache.

    ``async with PeerProcess(spec) as peer:`` starts it (``python -m aiodatadist._peer_proc``)
    and waits until it listens on loopback; the exit stops it (SIGKILL if it does not stop
    in time) and removes shared-memory segments a killed peer left behind.

    Args:
        spec: the cache it serves.
        cluster_id: its cluster id.
        options: extra ``init`` options of the prompt (``llm.listenIpInfo`` is set).
        env: extra environment variables (e.g. ``AIODATADIST_SECRET``).
        start_timeout: seconds to wait for it to listen.
        progress: called with ``(stage, done, total)`` while it fills its cache.
    """

    def __init__(
        self,
        spec: PromptSpec | None = None,
        *,
        cluster_id: int = 1,
        options: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 60.0,
        progress: Callable[[str, int, int], None] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.spec = spec or PromptSpec()
        self.cluster_id = cluster_id
        self.options = dict(options or {})
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.progress = progress
        self.host = host
        self.address: tuple[str, int] = ("", 0)
        self.pid = 0
        self.killed = False
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (negative: killed by that signal), else None."""
        return None if self._proc is None else self._proc.returncode

    def argv(self) -> list[str]:
        """The command line that starts it."""
        # The child imports this installation, whatever the current directory (-P, PYTHONPATH).
        cmd = python_argv(
            "-m",
            "aiodatadist._peer_proc",
            "--cluster-id",
            str(self.cluster_id),
            "--listen",
            f"{self.host}:0",
            "--spec",
            self.spec.to_json(),
        )
        for k, v in self.options.items():
            cmd += ["--option", f"{k}={v}"]
        return cmd

    async def start(self) -> tuple[str, int]:
        """Starts the process and waits until it listens; returns its ``(host, port)``.

        Raises:
            RuntimeError: it exited or reported an error before listening.
            TimeoutError: it did not listen within ``start_timeout``; it is killed and
                reaped first.

        Cancel: the process is killed and reaped, then the cancel propagates.
        """
        if self._proc is not None:
            raise RuntimeError("the peer process was already started")
        env = python_env({**self.env, "PYTHONUNBUFFERED": "1"})
        proc = await asyncio.create_subprocess_exec(
            *self.argv(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        self._proc = proc
        self.pid = proc.pid
        ok = False
        try:
            async with asyncio.timeout(self.start_timeout):
                ready = await self._read_until_ready()
            self.address = (str(ready["host"]), int(ready["port"]))
            ok = True
            return self.address
        finally:
            if not ok:
                await self._reap(kill=True)

    async def _read_until_ready(self) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        while True:
            line = await self._proc.stdout.readline()
            if not line:
                rc = await self._proc.wait()
                raise RuntimeError(f"the peer process exited ({rc}) before it was ready")
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not ours (a stray print)
            kind = event.get("event")
            if kind == "progress" and self.progress is not None:
                self.progress(str(event["stage"]), int(event["done"]), int(event["total"]))
            elif kind == "error":
                raise RuntimeError(f"the peer process failed: {event.get('error')}")
            elif kind == "ready":
                return dict(event)

    def kill(self) -> None:
        """SIGKILLs the process now (a crash: no unlink, no goodbye). Idempotent."""
        if self._proc is not None and self._proc.returncode is None:
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)

    async def wait_exit(self, timeout: float | None = None) -> int:
        """Waits for the process to exit; returns its exit status.

        Raises:
            TimeoutError: still running after ``timeout`` seconds (it keeps running).

        Cancel: stops waiting; the process keeps running.
        """
        assert self._proc is not None
        async with asyncio.timeout(timeout):
            return await self._proc.wait()

    async def stop(self, timeout: float = 10.0) -> int | None:
        """Asks the process to finalize and exit (closes its stdin). Idempotent.

        Returns:
            Its exit status (negative: killed by that signal).

        Never raises for the process's sake. Timeout: after ``timeout`` seconds it is
        SIGKILLed and reaped. Cancel: it is SIGKILLed, then the cancel propagates.
        """
        return await self._reap(kill=False, timeout=timeout)

    async def _reap(self, *, kill: bool, timeout: float = 10.0) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        try:
            if kill:
                self.kill()
            elif proc.stdin is not None and not proc.stdin.is_closing():
                with contextlib.suppress(OSError):
                    proc.stdin.write(b"quit\n")
                proc.stdin.close()
            try:
                async with asyncio.timeout(timeout):
                    await proc.wait()
            except TimeoutError:
                log.warning("peer process %d did not stop in %.1f s: killed", proc.pid, timeout)
                self.kill()
                await proc.wait()
            if proc.stdout is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(timeout):
                        await proc.stdout.read()  # to EOF: lets the transport close
        except BaseException:
            _kill_quietly(proc)
            raise
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            # Nothing to reap after a crash: segments are nameless memfds (none in /dev/shm).
        return proc.returncode

    async def __aenter__(self) -> PeerProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


# --------------------------------------------------------------------------- faults


class _Proxied:
    """One proxied connection: the accepted side and the upstream side."""

    def __init__(self, down: asyncio.StreamWriter, up: asyncio.StreamWriter) -> None:
        self.down = down
        self.up = up
        self.tasks: list[asyncio.Task[None]] = []

    def abort(self) -> None:
        for w in (self.down, self.up):
            w.transport.abort()
        current = asyncio.current_task()
        for t in self.tasks:
            if t is not current:
                t.cancel()


class FaultInjector:
    """A loopback TCP proxy between a decoder and a prompt that injects faults.

    Link the decoder to :attr:`address` instead of the prompt's own address: the link's
    control connection and its TCP data streams then pass through this proxy (real
    sockets, real bytes), and the test can

    * :meth:`pause` / :meth:`resume` / :meth:`delay`: stall every byte in both directions
      (a transfer in flight then hits its deadline: ``LLMTimeoutError``);
    * :meth:`drop`: abort every proxied connection (the link breaks: ``LLMException``);
    * :meth:`kill_peer`: SIGKILL the prompt process, when it was given one.

    Through the proxy the prompt's pid does not hold the decoder's connection, so the
    one-sided paths (``shm``, ``cma``) are refused on such a link and every transfer
    goes over ``tcp`` (the bytes the injector can stall). To test a one-sided path's
    error handling, link directly (``remote_pair(faults=False)``) and kill the peer
    with ``pair.prompt.kill()``.

    It lives on the event loop that calls :meth:`start`; use it as ``async with``.

    Args:
        target: the prompt's ``(host, port)``.
        peer: the prompt's :class:`PeerProcess`, for :meth:`kill_peer`.
        host: where the proxy listens.
    """

    def __init__(
        self,
        target: tuple[str, int],
        *,
        peer: PeerProcess | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.target = target
        self.peer = peer
        self.host = host
        self.refuse_new = False
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._conns: set[_Proxied] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._resume_at: asyncio.TimerHandle | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._closing = False

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the proxy listens on.

        Raises:
            RuntimeError: not started.
        """
        if self._server is None:
            raise RuntimeError("the fault injector is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    @property
    def paused(self) -> bool:
        return not self._flowing.is_set()

    @property
    def connections(self) -> int:
        """Proxied connections open now."""
        return len(self._conns)

    async def start(self) -> tuple[str, int]:
        """Starts listening; returns :attr:`address`. Idempotent.

        Raises:
            OSError: cannot listen.

        Cancel: propagates; nothing is left listening.
        """
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self.host, 0)
        return self.address

    def pause(self) -> None:
        """Stalls every proxied byte, both directions, until :meth:`resume`."""
        self._cancel_resume()
        self._flowing.clear()

    def resume(self) -> None:
        """Lets bytes flow again (what was held is delivered in order)."""
        self._cancel_resume()
        self._flowing.set()

    def delay(self, seconds: float) -> None:
        """Stalls every proxied byte for ``seconds`` from now (a loop timer resumes)."""
        self.pause()
        self._resume_at = asyncio.get_running_loop().call_later(seconds, self.resume)

    def _cancel_resume(self) -> None:
        if self._resume_at is not None:
            self._resume_at.cancel()
            self._resume_at = None

    async def drop(self, *, refuse_new: bool = False) -> int:
        """Aborts every proxied connection (both sides see a reset); returns how many.

        Args:
            refuse_new: also refuse connections from now on (a relink fails) until
                :attr:`refuse_new` is set back to False.

        Never raises; does not wait for the peers to notice. A pause stays in force
        (a relink through a paused proxy times out): :meth:`resume` first.
        """
        self.refuse_new = refuse_new
        conns = list(self._conns)
        self._conns.clear()
        for c in conns:
            c.abort()
        await asyncio.sleep(0)  # let the aborts' connection_lost callbacks run
        return len(conns)

    def kill_peer(self) -> None:
        """SIGKILLs the prompt process (its sockets close, the link breaks).

        Raises:
            RuntimeError: the injector was made without ``peer``.
        """
        if self.peer is None:
            raise RuntimeError("FaultInjector(peer=...) is needed to kill the peer")
        self.peer.kill()

    async def close(self) -> None:
        """Stops listening and aborts every proxied connection. Idempotent.

        Never raises; waits at most 5 s for its connection handlers to end. Cancel:
        propagates after the connections were aborted.
        """
        self._cancel_resume()
        self._flowing.set()
        if self._server is not None:
            self._server.close()
            self._server = None
        self._closing = True
        for c in list(self._conns):
            c.abort()
        self._conns.clear()
        for t in list(self._handlers):
            t.cancel()  # those still connecting upstream; the others end with their pumps
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5)

    async def __aenter__(self) -> FaultInjector:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._proxy(reader, writer)
        except asyncio.CancelledError:
            writer.transport.abort()
            if not self._closing:
                raise
            # our own cancel from close(): end quietly (asyncio logs a cancelled handler)
        finally:
            self._handlers.discard(task)

    async def _proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse_new:
            writer.transport.abort()
            return
        try:
            async with asyncio.timeout(10):
                up_reader, up_writer = await asyncio.open_connection(*self.target)
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        conn = _Proxied(writer, up_writer)
        self._conns.add(conn)
        self.accepted += 1
        loop = asyncio.get_running_loop()
        conn.tasks = [
            loop.create_task(self._pump(reader, up_writer, conn)),
            loop.create_task(self._pump(up_reader, writer, conn)),
        ]
        try:
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            self._conns.discard(conn)
            conn.abort()

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, conn: _Proxied
    ) -> None:
        try:
            while True:
                data = await src.read(1 << 20)
                await self._flowing.wait()
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()
        except (OSError, ConnectionError):
            conn.abort()


# --------------------------------------------------------------------------- remote pair


@dataclass
class RemotePair:
    """A decoder in this process linked to a prompt in a subprocess (see :func:`remote_pair`).

    Attributes:
        decoder: the decoder instance (in this process).
        prompt: the prompt's :class:`PeerProcess`.
        spec: the cache the prompt serves (its bytes are ``pattern_blocks(spec.seed, ...)``).
        faults: the :class:`FaultInjector` the link goes through, or None.
        data_path: the decoder's ``aiodatadist.DataPath``.
    """

    decoder: LLMDataDist
    prompt: PeerProcess
    spec: PromptSpec
    faults: FaultInjector | None = None
    data_path: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_id(self) -> int:
        return self.prompt.cluster_id

    def key(self) -> BlocksCacheKey:
        """The key naming the prompt's cache."""
        return BlocksCacheKey(self.prompt.cluster_id, self.spec.model_id)

    def decoder_cache(self, num_blocks: int | None = None) -> FilledCache:
        """A zeroed blocks cache of the decoder shaped like the prompt's (``num_blocks`` each)."""
        s = self.spec
        return make_blocks_cache(
            self.decoder,
            num_tensors=s.num_tensors,
            num_blocks=s.num_blocks if num_blocks is None else num_blocks,
            block_shape=s.block_shape,
            data_type=s.data_type,
        )

    def expected(self, tensor: int, block: int) -> npt.NDArray[np.uint8]:
        """The bytes of the prompt's ``block`` of ``tensor`` (as filled, before any corruption)."""
        out: npt.NDArray[np.uint8] = pattern_blocks(
            self.spec.seed, tensor, [block], self.spec.block_bytes
        )[0]
        return out

    def mismatches(
        self,
        dst: FilledCache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        tensors: Sequence[tuple[int, int]] | None = None,
    ) -> list[Mismatch]:
        """Checks blocks pulled into ``dst`` (see :func:`pattern_mismatches`)."""
        return pattern_mismatches(dst.tensors, src_blocks, dst_blocks, self.spec.seed, tensors)

    async def relink(self, timeout_ms: int = 5000) -> LLMStatusCode:
        """Links the decoder to the prompt again (after a fault broke the link).

        Drops what is left of the old link first (``force=True``), then links through the
        fault injector when there is one.

        Returns:
            ``link_clusters``' status: ``LLM_SUCCESS`` or why the link failed (it never
            raises for a failed link).

        Timeout: ``timeout_ms`` bounds each of the unlink and the link (a paused injector
        makes the link fail with ``LLM_LINK_FAILED`` after it). Cancel: propagates; the
        decoder may be left unlinked.
        """
        host, port = self.faults.address if self.faults is not None else self.prompt.address
        info = cluster_info(self.prompt.cluster_id, host, port)
        await self.decoder.unlink_clusters([info], timeout=timeout_ms, force=True)
        status, _ = await self.decoder.link_clusters([info], timeout=timeout_ms)
        return status


@asynccontextmanager
async def remote_pair(
    spec: PromptSpec | None = None,
    *,
    data_path: str = "auto",
    faults: bool = False,
    prompt_id: int = 1,
    decoder_id: int = 2,
    options: dict[str, str] | None = None,
    prompt_options: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    link_timeout_ms: int = 10_000,
    start_timeout: float = 60.0,
) -> AsyncIterator[RemotePair]:
    """A prompt in a subprocess and a decoder here, linked over loopback; torn down on exit.

    The prompt serves one blocks cache described by ``spec`` (filled with
    :func:`pattern_blocks`, seed ``spec.seed``) under ``BlocksCacheKey(prompt_id,
    spec.model_id)``.

    Args:
        spec: the prompt's cache; default :class:`PromptSpec()`.
        data_path: the decoder's ``aiodatadist.DataPath``: ``auto``, ``shm``, ``cma`` or ``tcp``.
        faults: link through a :class:`FaultInjector` (``pair.faults``) that can stall,
            drop and kill.
        prompt_id, decoder_id: cluster ids.
        options: extra decoder ``init`` options.
        prompt_options: extra prompt ``init`` options.
        env: extra environment of the prompt process.
        link_timeout_ms: the ``link_clusters`` timeout.
        start_timeout: seconds for the prompt process to fill its cache and listen.

    Raises:
        ValueError: ``data_path`` is not a cross-process path.
        RuntimeError: the prompt process exited or failed before it listened.
        TimeoutError: the prompt process did not listen within ``start_timeout``.
        LLMException: the link failed (its status code says why).

    Timeout: ``start_timeout`` bounds the start, ``link_timeout_ms`` the link; on exit the
    process gets 10 s to stop before it is SIGKILLed. Cancel: at any point, the decoder is
    finalized, the injector closed and the process reaped before the cancel propagates.
    """
    if data_path not in ("auto", "shm", "cma", "tcp"):
        raise ValueError(f"data_path must be auto, shm, cma or tcp, got {data_path!r}")
    spec = spec or PromptSpec()
    async with PeerProcess(
        spec, cluster_id=prompt_id, options=prompt_options, env=env, start_timeout=start_timeout
    ) as peer:
        injector: FaultInjector | None = None
        if faults:
            injector = FaultInjector(peer.address, peer=peer)
        try:
            host, port = await injector.start() if injector is not None else peer.address
            decoder = LLMDataDist(LLMRole.DECODER, decoder_id)
            await decoder.init({OPT_DATA_PATH: data_path, **(options or {})})
            try:
                status, _ = await decoder.link_clusters(
                    [cluster_info(prompt_id, host, port)], timeout=link_timeout_ms
                )
                if status != LLMStatusCode.LLM_SUCCESS:
                    raise LLMException(
                        f"link to the prompt process at {host}:{port} failed: {status.name}",
                        status_code=status,
                    )
                yield RemotePair(decoder, peer, spec, injector, data_path)
            finally:
                await decoder.finalize()
        finally:
            if injector is not None:
                await injector.close()
