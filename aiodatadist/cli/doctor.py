"""``aiodatadist doctor``: which data paths work here and, for those that do not, why.

Then the transfer engines (NIXL, Mooncake: installed? usable? what they found, each
probed in a child process) and the fabric (RDMA NICs, GPUs, NPUs): ``doctor_engines``.

Every probe is real: shared memory is created here and read by a child process;
``process_vm_readv`` is tried by this process on a child (a descendant) and by one
child on a sibling (an unrelated process, as a decoder and a prompt started apart
are); TCP listens and connects on loopback. With the end-to-end check (default),
a prompt process is started and one block is pulled over each path and verified.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import glob
import importlib.metadata
import json
import os
import platform
import re
import resource
import socket
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from .._options import DataPath
from ..testing.peer import python_argv, python_env
from .doctor_engines import engines_section, print_engines

__all__ = ["clean_stale_segments", "run_doctor"]

CROSS_PROCESS = DataPath.remote()
_PROBE_TIMEOUT = 20.0


@dataclass
class PathReport:
    name: DataPath
    works: bool
    detail: str
    notes: list[str] = field(default_factory=list)
    pull: str | None = None  # end-to-end result, when run


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else _fmt_bytes(value)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def versions() -> dict[str, str]:
    """Versions of everything a transfer goes through."""
    import numpy as np

    from .. import __version__, _native

    return {
        "aiodatadist": __version__,
        "native": f"{_native.__version__} ({os.path.basename(_native.__file__ or '?')})",
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "numpy": np.__version__,
        "uvloop": _version("uvloop"),
        "kernel": f"{platform.system()} {platform.release()} {platform.machine()}",
    }


def limits() -> dict[str, str]:
    """The limits that bound transfers on this machine."""
    from .. import _native

    out: dict[str, str] = {}
    try:
        sys_iov = str(os.sysconf("SC_IOV_MAX"))
    except (ValueError, OSError):
        sys_iov = "?"
    out["IOV_MAX"] = f"{sys_iov} (native build: {_native.IOV_MAX} iovecs per system call)"
    try:
        st = os.statvfs("/dev/shm")
        out["/dev/shm"] = (
            f"{_fmt_bytes(st.f_blocks * st.f_frsize)} total, "
            f"{_fmt_bytes(st.f_bavail * st.f_frsize)} free"
        )
    except OSError as e:
        out["/dev/shm"] = f"unavailable ({e.strerror})"
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    out["RLIMIT_MEMLOCK"] = f"{_limit(soft)} soft, {_limit(hard)} hard"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    out["open files"] = (
        f"{soft} soft, {hard if hard != resource.RLIM_INFINITY else 'unlimited'} hard "
        f"(a link takes 1 + 2 x TcpStreams sockets)"
    )
    thp = {}
    for kind in ("enabled", "shmem_enabled"):
        text = _read(f"/sys/kernel/mm/transparent_hugepage/{kind}")
        m = re.search(r"\[(\w[\w-]*)\]", text or "")
        thp[kind] = m.group(1) if m else "?"
    out["transparent huge pages"] = (
        f"anonymous: {thp['enabled']}, shmem: {thp['shmem_enabled']}"
        + (
            " (caches from allocate_* live in shared memory (memfd) on 4 KiB pages: copies "
            "from them run slower than from registered numpy memory)"
            if thp["shmem_enabled"] in ("never", "deny") and thp["enabled"] != "never"
            else ""
        )
    )
    scope = _read("/proc/sys/kernel/yama/ptrace_scope")
    out["ptrace_scope"] = "absent (no Yama LSM)" if scope is None else scope
    out["cpus"] = str(os.cpu_count())
    mem = _read("/proc/meminfo") or ""
    m = re.search(r"MemAvailable:\s+(\d+) kB", mem)
    if m:
        out["memory available"] = _fmt_bytes(int(m.group(1)) * 1024)
    return out


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    # python_argv/python_env: the probe imports this installation, not a source tree that
    # happens to be the current directory.
    return subprocess.Popen(
        python_argv("-c", code, *args),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Closes its stdin and collects its output (bounded); kills it if it hangs."""
    try:
        out, err = proc.communicate(timeout=_PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return out, err


_SLEEPER = "import sys; print('up', flush=True); sys.stdin.read()"


def probe_inproc() -> PathReport:
    return PathReport(DataPath.INPROC, True, "both instances in one process: always available")


def probe_shm() -> PathReport:
    """Creates a (memfd) segment here, has a child map it read-only and read it back."""
    from .. import _native

    name = f"/aiodd-doctor-{os.getpid()}"
    notes = []
    stale = stale_segments()
    if stale:
        notes.append(
            f"{len(stale)} segment(s) of dead processes (older aiodatadist) left in /dev/shm "
            f"({_fmt_bytes(sum(s for _, s in stale))}), e.g. {stale[0][0]}: "
            "`aiodatadist doctor --clean` removes them"
        )
    try:
        seg = _native.ShmSegment.create(name, 4096)
    except _native.NativeError as e:
        return PathReport(DataPath.SHM, False, f"memfd_create/mmap failed: {e}", notes)
    try:
        memoryview(seg)[:8] = b"aiodatad"
        code = (
            "import os, sys; from aiodatadist import _native; "
            "fd = os.open(sys.argv[1], os.O_RDONLY); "
            "s = _native.ShmSegment.from_fd(fd, 4096, False); os.close(fd); "
            "print(bytes(memoryview(s)[:8]).decode()); s.close()"
        )
        # The library passes the fd over a Unix socket; the child reopens it through /proc.
        proc = _child(code, f"/proc/{os.getpid()}/fd/{seg.fd}")
        out, err = _finish(proc)
        if proc.returncode != 0 or out.strip() != "aiodatad":
            last = (err.strip().splitlines() or ["no output"])[-1]
            return PathReport(
                DataPath.SHM, False, f"another process cannot map the segment: {last}", notes
            )
    finally:
        seg.close()
    return PathReport(
        DataPath.SHM,
        True,
        "a memfd segment made here is mapped by another process (prompt caches from "
        "allocate_* live in such segments: nameless, nothing in /dev/shm)",
        notes,
    )


SHM_DIR = "/dev/shm"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def stale_segments(shm_dir: str = SHM_DIR) -> list[tuple[str, int]]:
    """``(path, size)`` of each ``aiodd-<pid>-*`` file in ``shm_dir`` whose process is gone.

    Named segments are what aiodatadist versions before memfd segments (and tools that
    copied their naming) left behind when killed; this version creates none. A segment
    whose pid is alive, or belongs to another user's process, is not stale.
    """
    out = []
    for path in sorted(glob.glob(os.path.join(shm_dir, "aiodd-*"))):
        m = re.match(r"aiodd-(\d+)-", os.path.basename(path))
        if m is None or _pid_alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):  # never follow a link out of /dev/shm
                out.append((path, st.st_size))
    return out


def clean_stale_segments(shm_dir: str = SHM_DIR) -> tuple[list[tuple[str, int]], list[str]]:
    """Removes :func:`stale_segments`; returns ``(removed, failures)``.

    Only segments of dead processes: a pid that is alive (or reused by a live process
    meanwhile) keeps its segments. A failure (another user's file) is reported, not raised.
    """
    removed, failed = [], []
    for path, size in stale_segments(shm_dir):
        m = re.match(r"aiodd-(\d+)-", os.path.basename(path))
        if m is not None and _pid_alive(int(m.group(1))):
            continue  # the pid came back (reused) since the listing
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue  # removed meanwhile (another cleaner)
        except OSError as e:
            failed.append(f"{path}: {e.strerror}")
            continue
        removed.append((path, size))
    return removed, failed


def _errno_name(code: int) -> str:
    return f"{errno.errorcode.get(code, '?')} ({os.strerror(code)})" if code else "0"


def _cma_probes() -> tuple[tuple[bool, int], tuple[bool, int]]:
    """``cma_probe`` by this process on a child, and by a child on its sibling.

    Raises:
        RuntimeError: a probe process misbehaved.
    """
    from .. import _native

    target = _child(_SLEEPER)
    prober: subprocess.Popen[str] | None = None
    try:
        assert target.stdout is not None
        if target.stdout.readline().strip() != "up":
            raise RuntimeError("could not start a probe process")
        child = _native.cma_probe(target.pid)
        code = (
            "import sys; from aiodatadist import _native; "
            "ok, e = _native.cma_probe(int(sys.argv[1])); print(int(ok), e)"
        )
        prober = _child(code, str(target.pid))
        out, err = _finish(prober)
        try:
            ok, e = (int(x) for x in out.split())
        except ValueError:
            last = (err.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the sibling probe failed: {last}") from None
        return child, (bool(ok), e)
    finally:
        for p in (target, prober):
            if p is not None and p.poll() is None:
                _finish(p)


_SCOPES = {
    "0": "classic ptrace permissions",
    "1": "restricted: only descendants (or a declared tracer)",
    "2": "admin only (CAP_SYS_PTRACE)",
    "3": "no attach at all",
}


def cma_verdict(
    scope: str | None, child: tuple[bool, int], sibling: tuple[bool, int]
) -> PathReport:
    """What the two probes say about CMA here (``scope``: Yama's ptrace_scope or None)."""
    why = [] if scope is None else [f"yama ptrace_scope={scope} ({_SCOPES.get(scope, '?')})"]
    (ok_child, err_child), (ok_sib, err_sib) = child, sibling
    if ok_sib:
        return PathReport(DataPath.CMA, True, "process_vm_readv works between unrelated processes")
    if ok_child:
        return PathReport(
            DataPath.CMA,
            True,
            "process_vm_readv works only toward descendants: a decoder can read a prompt "
            f"it started, not an unrelated one (errno {_errno_name(err_sib)}); links to "
            "unrelated peers use shm or tcp",
            why,
        )
    err = err_child or err_sib
    detail = f"process_vm_readv refused: errno {_errno_name(err)}"
    if err == errno.EPERM:
        policy = f" ({why[0]})" if why else " (seccomp, a container profile or another LSM)"
        detail += f"; the kernel's ptrace policy forbids it{policy}; links use shm or tcp"
    elif err == errno.ENOSYS:
        detail += "; the kernel (or a seccomp filter) lacks process_vm_readv"
    return PathReport(DataPath.CMA, False, detail, why)


def probe_cma() -> PathReport:
    """``process_vm_readv`` on a child (descendant) and from a child on a sibling."""
    try:
        child, sibling = _cma_probes()
    except RuntimeError as e:
        return PathReport(DataPath.CMA, False, str(e))
    return cma_verdict(_read("/proc/sys/kernel/yama/ptrace_scope"), child, sibling)


def probe_tcp() -> PathReport:
    """Listens on loopback, connects, and moves a byte each way."""
    try:
        with socket.create_server(("127.0.0.1", 0)) as srv:
            srv.settimeout(_PROBE_TIMEOUT)
            port = srv.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=_PROBE_TIMEOUT) as c:
                conn, _ = srv.accept()
                with conn:
                    conn.settimeout(_PROBE_TIMEOUT)
                    c.sendall(b"p")
                    if conn.recv(1) != b"p":
                        return PathReport(DataPath.TCP, False, "loopback lost a byte")
                    conn.sendall(b"q")
                    if c.recv(1) != b"q":
                        return PathReport(DataPath.TCP, False, "loopback lost a byte")
    except OSError as e:
        return PathReport(DataPath.TCP, False, f"loopback listen/connect failed: {e}")
    return PathReport(DataPath.TCP, True, "loopback listen/connect works (127.0.0.1)")


async def _end_to_end(reports: dict[DataPath, PathReport]) -> None:
    """Starts a prompt process and pulls (and checks) one block over each cross-process path."""
    from ..datadist import LLMDataDist
    from ..errors import LLMException
    from ..testing import PeerProcess, PromptSpec, cluster_info, make_blocks_cache
    from ..testing import pattern_mismatches as check
    from ..types import BlocksCacheKey, LLMRole

    spec = PromptSpec(num_tensors=4, num_blocks=8, block_shape=(16, 2, 64), seed=11)
    try:
        async with PeerProcess(spec, cluster_id=1, start_timeout=_PROBE_TIMEOUT) as peer:
            for i, name in enumerate(CROSS_PROCESS):
                dd = LLMDataDist(LLMRole.DECODER, 100 + i)
                await dd.init({"aiodatadist.DataPath": name})
                try:
                    dst = make_blocks_cache(
                        dd, num_tensors=4, num_blocks=8, block_shape=spec.block_shape
                    )
                    status, _ = await dd.link_clusters(
                        [cluster_info(1, *peer.address)], timeout=10_000
                    )
                    if status != 0:
                        reports[name].pull = f"link failed: {status.name}"
                        continue
                    await dd.cache_manager.pull_blocks(
                        BlocksCacheKey(1, 0), dst.cache, [5, 2], [0, 7], timeout=10
                    )
                    bad = check(dst.tensors, [5, 2], [0, 7], spec.seed)
                    reports[name].pull = "pulled and verified" if not bad else f"MISMATCH: {bad[0]}"
                except LLMException as e:
                    reports[name].pull = f"{type(e).__name__}: {e}"
                finally:
                    await dd.finalize()
    except (OSError, RuntimeError, TimeoutError) as e:
        for name in CROSS_PROCESS:
            reports[name].pull = f"no prompt process: {e}"


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


async def run_doctor(args: argparse.Namespace) -> int:
    """Prints the report; returns 0 when a cross-process path works, else 1.

    With ``--clean`` it first removes the ``/dev/shm/aiodd-<pid>-*`` segments of dead
    processes (:func:`clean_stale_segments`) and lists what it removed.

    Never raises for a path that does not work (that is the report). Timeout: every
    probe process is bounded by 20 s (then killed). Cancel (Ctrl-C): the end-to-end
    prompt process is stopped before it propagates; a blocking probe in a worker
    thread finishes on its own bound.
    """
    loop = asyncio.get_running_loop()
    cleaned: tuple[list[tuple[str, int]], list[str]] | None = None
    if getattr(args, "clean", False):
        cleaned = clean_stale_segments()  # first: the shm probe then reports what is left
    vers = versions()
    lims = limits()
    reports = {DataPath.INPROC: probe_inproc()}
    # The engines' child probes (seconds: large imports) run meanwhile, on their own thread.
    engines_job = loop.run_in_executor(None, engines_section)
    for probe in (probe_shm, probe_cma, probe_tcp):
        # Blocking probes (child processes) run off the loop, bounded by _PROBE_TIMEOUT each.
        rep = await loop.run_in_executor(None, probe)
        reports[rep.name] = rep
    if args.pull:
        await _end_to_end(reports)
    engines, fabric = await engines_job
    works = [
        n
        for n in CROSS_PROCESS
        if reports[n].works and reports[n].pull in (None, "pulled and verified")
    ]

    print("aiodatadist doctor")
    print("\nversions")
    for k, v in vers.items():
        print(f"  {k:<22} {v}")
    print("\nlimits")
    for k, v in lims.items():
        print(f"  {k:<22} {v}")
    print("\ndata paths")
    for name, rep in reports.items():
        state = "works" if rep.works else "NOT AVAILABLE"
        print(f"  {name:<7} {state:<14} {rep.detail}")
        for note in rep.notes:
            print(f"  {'':<7} {'':<14} note: {note}")
        if rep.pull is not None:
            print(f"  {'':<7} {'':<14} end-to-end pull from a prompt process: {rep.pull}")
    print_engines(engines, fabric)
    if cleaned is not None:
        removed, failed = cleaned
        print("\nclean")
        if removed:
            print(
                f"  removed {len(removed)} segment(s) of dead processes from {SHM_DIR} "
                f"({_fmt_bytes(sum(n for _, n in removed))}):"
            )
            for path, _ in removed:
                print(f"    {path}")
        else:
            print(f"  no segments of dead processes in {SHM_DIR}: nothing removed")
        for failure in failed:
            print(f"  could not remove {failure}")
    print()
    if works:
        print(f"cross-process data paths that work here: {', '.join(works)}")
    else:
        print("no cross-process data path works here")
    if args.json:
        doc: dict[str, Any] = {
            "versions": vers,
            "limits": lims,
            "paths": {n: asdict(r) for n, r in reports.items()},
            "cross_process_paths": works,
            "engines": {n: asdict(r) for n, r in engines.items()},
            "fabric": fabric,
        }
        if cleaned is not None:
            doc["clean"] = {"removed": [p for p, _ in cleaned[0]], "failed": cleaned[1]}
        text = json.dumps(doc, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            _write(args.json, text)
    return 0 if works else 1
