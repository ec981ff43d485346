"""The plain-C baselines of ``bench/c/baselines.c``: built on demand, run as servers.

``baselines OP --serve`` sets up once (buffers of the same kind of memory as the
engine's, the same blocks: same seed, checked by :func:`blocks_hash`) and times one
transfer per ``run`` line on its standard input, so its samples alternate with the
engine's. :func:`c_baselines` is the baseline factory that
``aiodatadist.cli.measure.run_workload`` takes:

* inproc: ``memcpy`` between huge-page-advised buffers;
* shm: ``memcpy --src-shm``, from a POSIX shared-memory source (which gets huge pages
  only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows it) into a
  huge-page-advised destination;
* cma: ``process_vm_readv`` between huge-page-advised buffers;
* tcp: ``writev``/``readv`` over loopback, huge-page-advised buffers.

Not installed (the package never imports ``bench/``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from memory_accounting import _process_tree, huge_bytes_of_processes

from aiodatadist.cli.measure import BaselineCase
from aiodatadist.cli.workloads import Workload, blocks_hash, random_blocks

__all__ = [
    "BaselineSpec",
    "CServer",
    "baseline_spec",
    "c_baselines",
    "find_c_baselines",
    "find_c_program",
]

HERE = Path(__file__).resolve().parent
_C_OP = {"inproc": "memcpy", "shm": "memcpy", "cma": "cma", "tcp": "tcp"}
_C_NAME = {"memcpy": "C memcpy", "cma": "C process_vm_readv", "tcp": "C writev/readv"}


def _baselines_source() -> Path | None:
    src = HERE / "c" / "baselines.c"
    return src if src.is_file() else None


def _program_source(name: str) -> Path | None:
    if name == "baselines":
        return _baselines_source()  # (a test points this one elsewhere)
    src = HERE / "c" / f"{name}.c"
    return src if src.is_file() else None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aiodatadist"


def find_c_baselines() -> tuple[Path | None, str]:
    """The C baselines executable (built on demand), or None and why not."""
    return find_c_program("baselines")


def find_c_program(name: str) -> tuple[Path | None, str]:
    """The executable of ``bench/c/NAME.c`` (``bench/bin/NAME`` when that is not older than
    the source, else built on demand and cached by the source's hash), or None and why not.
    """
    src = _program_source(name)
    if src is None:
        return None, f"bench/c/{name}.c is not here"
    prebuilt = src.parent.parent / "bin" / name
    if prebuilt.is_file() and prebuilt.stat().st_mtime >= src.stat().st_mtime:
        return prebuilt, f"{prebuilt}"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    exe = _cache_dir() / f"{name}-{digest}"
    if exe.is_file():
        return exe, f"{exe}"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, f"no C compiler (cc) to build bench/c/{name}.c"
    exe.parent.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_name(f"{exe.name}.{os.getpid()}.tmp")
    cmd = [cc, "-std=c11", "-O2", "-pthread", "-o", str(tmp), str(src)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"building bench/c/{name}.c failed: {e}"
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"building bench/c/{name}.c failed: {last}"
    os.replace(tmp, exe)
    return exe, f"{exe} (built now)"


@dataclass(frozen=True)
class BaselineSpec:
    """Which C baseline a path is compared with, on which memory."""

    op: str  # memcpy | cma | tcp
    args: tuple[str, ...] = ()  # extra `baselines` arguments
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or _C_NAME[self.op]


def baseline_spec(path: str, tcp_batch_bytes: int = 0) -> BaselineSpec:
    """The C baseline of ``path``, on the memory the engine uses on that path."""
    if path == "shm":
        # The engine copies out of the prompt's POSIX shm segment: so does this one.
        return BaselineSpec("memcpy", ("--src-shm",), "C memcpy (shm source)")
    if path == "tcp" and tcp_batch_bytes:
        mib = f"{tcp_batch_bytes / 2**20:g} MiB"
        return BaselineSpec(
            "tcp", ("--batch-bytes", str(tcp_batch_bytes)), f"C writev/readv ({mib}/call)"
        )
    return BaselineSpec(_C_OP[path])


class CServer:
    """``baselines OP --serve``: set up once; :meth:`sample` times ``inner`` transfers.

    ``extra`` are more ``baselines`` arguments (``--src-shm``, ``--no-huge``, ...).

    Raises (constructor):
        RuntimeError: it did not start.
    """

    def __init__(
        self,
        exe: Path,
        op: str,
        w: Workload,
        pool: int,
        blocks: int,
        seed: int,
        par: int,
        extra: tuple[str, ...] | list[str] = (),
        name: str | None = None,
    ) -> None:
        self.name = name or _C_NAME[op]
        self.nbytes = blocks * w.num_tensors * w.block_bytes
        self.buffer_bytes = 2 * pool * w.num_tensors * w.block_bytes  # source + destination
        self.expect_hash = blocks_hash(*random_blocks(pool, pool, blocks, seed))
        cmd = [
            str(exe), op, "--serve",
            "--tensors", str(w.num_tensors),
            "--pool", str(pool),
            "--blocks", str(blocks),
            "--block-bytes", str(w.block_bytes),
            "--seed", str(seed),
            "--streams" if op == "tcp" else "--threads", str(par),
            *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            err = self._kill()
            raise RuntimeError(f"the {op} baseline did not start: {err or 'no output'}")

    def sample(self, inner: int) -> float:
        """GB/s over ``inner`` transfers, as the baseline timed them."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("run\n" * inner)
        self.proc.stdin.flush()
        secs = 0.0
        for _ in range(inner):
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.name} baseline died: {self._kill()}")
            secs += float(line)
        return self.nbytes * inner / secs / 1e9

    def huge_share(self) -> float | None:
        """Share of its source and destination the kernel backs with huge pages now."""
        got = huge_bytes_of_processes(_process_tree(self.proc.pid))
        return None if got is None else min(1.0, got / self.buffer_bytes)

    def close(self) -> None:
        """Stops it and checks it moved the engine's segments and verified them.

        Raises:
            RuntimeError: it failed its check or moved other segments.
        """
        try:
            out, _ = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self._kill()
            raise RuntimeError(f"the {self.name} baseline did not stop") from None
        res = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        if res.get("blocks_hash") != self.expect_hash or not res.get("verified"):
            raise RuntimeError(f"the {self.name} baseline moved other segments or failed: {res}")

    def _kill(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        _, err = self.proc.communicate()
        return (err.strip().splitlines() or [""])[-1]


def c_baselines(
    exe: Path, tcp_batch_bytes: int = 0, par: int = 2
) -> Callable[[BaselineCase], CServer]:
    """The baseline factory of ``run_workload``: each path's C baseline (:func:`baseline_spec`)
    on the case's workload, pool, blocks and seed, ``par`` threads / streams."""

    def make(case: BaselineCase) -> CServer:
        spec = baseline_spec(case.path, tcp_batch_bytes)
        return CServer(
            exe, spec.op, case.workload, case.pool, case.blocks, case.seed, par, spec.args,
            spec.label,
        )  # fmt: skip

    return make
