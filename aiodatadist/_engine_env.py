"""Where the transfer engines (NIXL, Mooncake) and the fabrics they use stand on this host.

Pure discovery: nothing here imports an engine into this process. What is looked at:
the installed distributions (:mod:`importlib.metadata`), where the engine modules would
load from (:func:`importlib.util.find_spec` of the top-level package, which runs no code),
the system libraries an engine's compiled module links against (``ctypes.CDLL`` of a
system library such as ``libibverbs.so.1``), and, once per process and engine, a child
interpreter that imports the engine module: an engine whose import would fail (or
crash) says so there, never here. sysfs/procfs/devfs give the fabric report.

:func:`engine_problem` is what :meth:`EngineAgent.probe` and ``aiodatadist doctor`` build
on; its text is the reason users read, with the command that fixes it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINES",
    "EngineSpec",
    "engine_problem",
    "engine_spec",
    "engine_version",
    "fabric_report",
    "install_hint",
    "missing_system_libraries",
]


@dataclass(frozen=True)
class EngineSpec:
    """What one engine is made of: the distribution, the modules and the system libraries.

    Attributes:
        name: The engine's name in options (``aiodatadist.Engines``) and ``DataPath``.
        distribution: The PyPI distribution that provides it.
        package: The top-level import package (checked with ``find_spec``, never imported here).
        module: The module an engine agent imports (imported only in a child interpreter).
        system_libraries: ``(soname, Debian package)`` pairs its compiled module links against
            and does not bundle.
    """

    name: str
    distribution: str
    package: str
    module: str
    system_libraries: tuple[tuple[str, str], ...]


_SPECS: dict[str, EngineSpec] = {
    # The nixl-cu12 wheel bundles UCX and its own libibverbs: nothing from the system.
    "nixl": EngineSpec("nixl", "nixl-cu12", "nixl_cu12", "nixl_cu12", ()),
    # mooncake/engine.so links these from the system (the rest sits in the wheel's .libs).
    "mooncake": EngineSpec(
        "mooncake",
        "mooncake-transfer-engine-non-cuda",
        "mooncake",
        "mooncake.engine",
        (
            ("libibverbs.so.1", "libibverbs1"),
            ("libnuma.so.1", "libnuma1"),
            ("libcurl.so.4", "libcurl4"),
        ),
    ),
}

ENGINES: tuple[str, ...] = tuple(_SPECS)

# How long the child interpreter may take to import an engine (its libraries are large;
# a loaded CI machine can be slow, a hang is a problem worth reporting).
_IMPORT_CHECK_TIMEOUT_S = 60.0


def engine_spec(name: str) -> EngineSpec:
    """The :class:`EngineSpec` of engine ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`ENGINES`.
    """
    try:
        return _SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown engine {name!r}: expected one of {', '.join(ENGINES)}") from None


def install_hint(name: str) -> str:
    """The command that installs engine ``name`` (NIXL: the CPU route unless GPUs are present).

    ``nixl-cu12``'s metadata requires ``torch``: on a host without NVIDIA GPUs, installing it
    with its dependencies would pull a multi-GiB CUDA torch that nothing uses, so the hint is
    ``--no-deps`` there (numpy, its other dependency, is ours already).
    """
    spec = engine_spec(name)
    if name == "nixl" and not _nvidia_gpus():
        return "pip install --no-deps 'nixl-cu12>=1.5,<2'"
    return f"pip install 'aiodatadist[{spec.name}]'"


def engine_version(name: str) -> str | None:
    """The installed version of engine ``name``'s distribution, or None when not installed."""
    try:
        return importlib.metadata.version(engine_spec(name).distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_system_libraries(name: str) -> list[tuple[str, str]]:
    """The ``(soname, Debian package)`` pairs engine ``name`` needs that cannot be loaded here."""
    return [(so, pkg) for so, pkg in engine_spec(name).system_libraries if not _loadable(so)]


def engine_problem(name: str) -> str | None:
    """Why engine ``name`` (``"nixl"`` or ``"mooncake"``) cannot run on this host, or None.

    None means its module can be imported here (whether its agent then starts, e.g. finds
    a usable network device, is the agent's own report). The first check that fails gives
    the reason, with the command that fixes it: the package is not installed (pip), a
    system library is missing (apt), the import fails (its error).

    Raises:
        ValueError: ``name`` is not one of :data:`ENGINES`.
    """
    spec = engine_spec(name)
    if sys.modules.get(spec.module) is not None:  # imported already: it loads
        return None
    # A None entry in sys.modules blocks the import (how a process opts out of a module).
    if spec.module in sys.modules or _find_spec(spec.package) is None:
        return f"{spec.distribution} is not installed: {install_hint(name)}"
    missing = missing_system_libraries(name)
    if missing:
        libs = ", ".join(so for so, _ in missing)
        pkgs = " ".join(dict.fromkeys(pkg for _, pkg in missing))
        return (
            f"{spec.distribution} is installed but {libs} cannot be loaded "
            f"(Debian/Ubuntu: apt-get install {pkgs})"
        )
    return _import_problem(spec.module)


def _find_spec(package: str) -> Any:
    """``find_spec`` of a top-level package (runs none of its code), None on any failure."""
    try:
        return importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None


def _loadable(soname: str) -> bool:
    """Whether the dynamic loader finds and loads system library ``soname``."""
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


@functools.cache
def _import_problem(module: str) -> str | None:
    """Import ``module`` in a child interpreter (once per process): None, or why it failed.

    A child because a failing engine import can take the process with it (a missing symbol
    at load, an abort in a static initializer) and because a successful one loads hundreds
    of MiB of libraries that a process that never starts the engine should not carry.
    """
    code = f"import {module}"
    env = dict(os.environ)
    env.pop("PYTHONSTARTUP", None)
    try:
        proc = subprocess.run(
            # -P: the current directory (a checkout, say) does not shadow the engine.
            [sys.executable, "-P", "-c", code],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=_IMPORT_CHECK_TIMEOUT_S,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"importing {module} did not finish within {_IMPORT_CHECK_TIMEOUT_S:g} s"
    except OSError as exc:  # no interpreter to run: say so rather than guess
        return f"could not check that {module} imports: {exc}"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    if proc.returncode < 0:
        return f"importing {module} killed the interpreter (signal {-proc.returncode}) {last}"
    return f"importing {module} fails: {last or f'exit status {proc.returncode}'}"


# -- fabric ----------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _rdma_devices(sys_root: Path) -> list[dict[str, Any]]:
    """RDMA devices from ``<sys>/class/infiniband``: name, netdevs, ports (state, link layer)."""
    base = sys_root / "class" / "infiniband"
    devices: list[dict[str, Any]] = []
    try:
        names = sorted(p.name for p in base.iterdir())
    except OSError:
        return devices
    for name in names:
        dev = base / name
        ports = []
        try:
            port_dirs = sorted((dev / "ports").iterdir(), key=lambda p: (len(p.name), p.name))
        except OSError:
            port_dirs = []
        for port in port_dirs:
            # state reads like "4: ACTIVE", link_layer "InfiniBand" or "Ethernet" (RoCE).
            state = _read(port / "state") or ""
            ports.append(
                {
                    "port": port.name,
                    "state": state.split(":", 1)[-1].strip() or None,
                    "link_layer": _read(port / "link_layer"),
                    "rate": _read(port / "rate"),
                }
            )
        try:
            netdevs = sorted(p.name for p in (dev / "device" / "net").iterdir())
        except OSError:
            netdevs = []
        devices.append({"name": name, "netdevs": netdevs, "ports": ports})
    return devices


def _nvidia_gpus(dev_root: Path = Path("/dev")) -> list[str]:
    try:
        return sorted(
            p.name for p in dev_root.glob("nvidia[0-9]*") if p.name[len("nvidia") :].isdigit()
        )
    except OSError:
        return []


def _gpu_models(proc_root: Path) -> list[str]:
    models = []
    for info in sorted((proc_root / "driver" / "nvidia" / "gpus").glob("*/information")):
        for line in (_read(info) or "").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model":
                models.append(value.strip())
    return models


def fabric_report(
    *, sys_root: str = "/sys", dev_root: str = "/dev", proc_root: str = "/proc"
) -> dict[str, Any]:
    """What this host offers the engines: RDMA NICs, NVIDIA GPUs, Ascend NPUs, libibverbs.

    Args:
        sys_root: Where sysfs is mounted (another root reads a copy of one).
        dev_root: Where devfs is mounted.
        proc_root: Where procfs is mounted.

    Returns:
        A JSON-able dict: ``rdma`` (a list of ``{name, netdevs, ports: [{port, state,
        link_layer, rate}]}``), ``gpus`` (``{devices, models, driver, libcuda}``), ``npus``
        (``{devices}``: ``/dev/davinci<N>``) and ``libibverbs`` (whether the system's
        ``libibverbs.so.1`` loads: Mooncake needs it even for TCP).
    """
    dev = Path(dev_root)
    proc = Path(proc_root)
    driver = _read(proc / "driver" / "nvidia" / "version")
    try:
        npus = sorted(
            (p.name for p in dev.glob("davinci[0-9]*") if p.name[len("davinci") :].isdigit()),
            key=lambda n: int(n[len("davinci") :]),
        )
    except OSError:
        npus = []
    return {
        "rdma": _rdma_devices(Path(sys_root)),
        "gpus": {
            "devices": _nvidia_gpus(dev),
            "models": _gpu_models(proc),
            "driver": driver.splitlines()[0] if driver else None,
            "libcuda": ctypes.util.find_library("cuda"),
        },
        "npus": {"devices": npus},
        "libibverbs": _loadable("libibverbs.so.1"),
    }
