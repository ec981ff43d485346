"""``aiodatadist doctor``'s engines section: NIXL and Mooncake, and the fabric they would use.

Per engine: installed or not (version), why it cannot run here
(:func:`aiodatadist._engine_env.engine_problem`: the pip or apt command that fixes it),
and what it finds when it starts. That last part runs in a child process (bounded, then
killed), so an engine whose import or start crashes cannot take doctor with it:

* NIXL: an agent with no backend lists its plugins (``get_plugin_list``), then creates
  the UCX backend (what the ``nixl`` data path uses) and lists the memory kinds it takes
  (``DRAM_SEG``, ``VRAM_SEG``). UCX's transport modules bundled in the wheel (``cma``,
  ``ib``, ``cuda``...; tcp, shared memory and self are built into UCX) are listed from
  its module directory, with the ones this host's devices can use.
* Mooncake: a ``TransferEngine`` is initialized with the ``tcp`` protocol (P2P handshake
  on loopback, no metadata server: what aiodatadist uses), and with ``rdma`` too when the
  host has RDMA NICs.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from typing import Any

from .._engine_env import ENGINES, engine_problem, engine_spec, engine_version, fabric_report
from ..testing.peer import python_argv, python_env
from ..transports.nixl import UCX_MODULES_DEFAULT

__all__ = ["EngineReport", "engines_section", "print_engines", "probe_engine"]

ENGINE_PROBE_TIMEOUT = 60.0
"""Bound on each engine's child probe (imports of large libraries on a loaded machine)."""

_MARK = "AIODD-DOCTOR "  # the child's result line (engines log to stdout/stderr freely)

_NIXL_PROBE = """
import json, os, sys
import nixl_cu12
from nixl_cu12._api import nixl_agent, nixl_agent_config
out = {}
agent = nixl_agent(f"aiodd-doctor-{os.getpid()}", nixl_agent_config(backends=[]))
out["plugins"] = sorted(agent.get_plugin_list())
try:
    agent.create_backend("UCX")
    out["ucx"] = None
    out["ucx_mem_types"] = sorted(agent.get_backend_mem_types("UCX"))
except Exception as exc:
    out["ucx"] = f"{type(exc).__name__}: {exc}"
libs = os.path.join(os.path.dirname(os.path.dirname(nixl_cu12.__file__)), "nixl_cu12.libs", "ucx")
try:
    out["ucx_modules"] = sorted(
        n[len("libuct_"):].split(".so")[0] for n in os.listdir(libs) if n.startswith("libuct_")
        and ".so" in n
    )
except OSError:
    out["ucx_modules"] = []
print("AIODD-DOCTOR " + json.dumps(out), flush=True)
"""

_MOONCAKE_PROBE = """
import json, sys
from mooncake.engine import TransferEngine
out = {}
for protocol in sys.argv[1:]:
    engine = TransferEngine()
    try:
        rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
        out[protocol] = None if rc == 0 else f"initialize returned {rc}"
    except Exception as exc:
        out[protocol] = f"{type(exc).__name__}: {exc}"
print("AIODD-DOCTOR " + json.dumps(out), flush=True)
"""


@dataclass
class EngineReport:
    """What doctor found out about one engine.

    Attributes:
        name: ``"nixl"`` or ``"mooncake"``.
        version: The installed distribution's version, or None.
        works: Whether it imports and starts here.
        detail: Why not (with the fix), or what it started with.
        transports: What it can move data over here.
        notes: Further facts (plugins, modules, memory kinds).
    """

    name: str
    version: str | None
    works: bool
    detail: str
    transports: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _run_probe(
    code: str, *args: str, env: dict[str, str] | None = None
) -> tuple[dict[str, Any] | None, str]:
    """Runs ``code`` in a child; its JSON result line, or None and why there is none.

    With a result, the text says whether the child then died of a signal (at exit): an
    engine that works but crashes the process that used it when it ends.
    """
    try:
        proc = subprocess.run(
            python_argv("-c", code, *args),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=ENGINE_PROBE_TIMEOUT,
            env=python_env(env),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"the probe did not finish within {ENGINE_PROBE_TIMEOUT:g} s"
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            died = f"signal {-proc.returncode}" if proc.returncode < 0 else ""
            return json.loads(line[len(_MARK) :]), died
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    last = lines[-1] if lines else "no output"
    if proc.returncode < 0:
        return None, f"the probe process died of signal {-proc.returncode}: {last}"
    return None, f"the probe process failed (exit {proc.returncode}): {last}"


def _ucx_usable(modules: list[str], fabric: dict[str, Any]) -> list[str]:
    """UCX transports this host can use: built-ins, cma, ib when NICs, cuda when GPUs."""
    usable = ["tcp", "shm", "self"]
    if "cma" in modules:
        usable.append("cma")
    if fabric["rdma"] and any(m.startswith("ib") for m in modules):
        usable.append("ib (rdma)")
    if fabric["gpus"]["devices"] and "cuda" in modules:
        usable.append("cuda")
    return usable


def _probe_nixl(report: EngineReport, fabric: dict[str, Any]) -> None:
    # As the library's NIXL engine does (transports/nixl.py): UCX_MODULES=^efa unless set.
    found, why = _run_probe(
        _NIXL_PROBE, env={"UCX_MODULES": os.environ.get("UCX_MODULES", UCX_MODULES_DEFAULT)}
    )
    if found is None:
        report.works, report.detail = False, f"imports, but {why}"
        return
    report.notes.append(f"plugins: {', '.join(found['plugins']) or 'none'}")
    if why:  # seen with NIXL 1.5.1 when the system libibverbs.so.1 is installed
        report.notes.append(
            f"the probe process died of {why} at exit, after its work: a process that "
            f"used NIXL may crash when it ends (UCX_MODULES={os.environ.get('UCX_MODULES')!r} "
            "is set here; the library's default ^efa avoided it where the system "
            "libibverbs1 is installed: docs/deployment.md)"
        )
    if found["ucx"] is not None:
        report.works = False
        report.detail = f"the UCX backend does not start: {found['ucx']}"
        return
    modules = found["ucx_modules"]
    report.works = True
    report.detail = f"the UCX backend starts (memory: {', '.join(found['ucx_mem_types']) or '?'})"
    report.transports = _ucx_usable(modules, fabric)
    report.notes.append(
        f"UCX modules in the wheel: {', '.join(modules) or 'none'} "
        "(tcp, shared memory and self are built in; UCX_TLS / UCX_NET_DEVICES choose)"
    )
    if not fabric["rdma"]:
        report.notes.append("no RDMA NIC here: across hosts UCX moves data over tcp")


def _probe_mooncake(report: EngineReport, fabric: dict[str, Any]) -> None:
    protocols = ["tcp", "rdma"] if fabric["rdma"] else ["tcp"]
    found, why = _run_probe(_MOONCAKE_PROBE, *protocols)
    if found is None:
        report.works, report.detail = False, f"imports, but {why}"
        return
    report.transports = [p for p in protocols if found.get(p) is None]
    failed = {p: found.get(p) for p in protocols if found.get(p) is not None}
    report.notes += [f"{p}: {reason}" for p, reason in failed.items()]
    report.works = "tcp" in report.transports
    report.detail = (
        f"TransferEngine starts ({', '.join(report.transports)})"
        if report.works
        else f"TransferEngine does not start over tcp: {failed.get('tcp')}"
    )
    report.notes.append("aiodatadist starts it with its tcp transport")
    if not fabric["rdma"]:
        report.notes.append("no RDMA NIC here: rdma not tried")


def probe_engine(name: str, fabric: dict[str, Any] | None = None) -> EngineReport:
    """Installed? usable? what it found? for engine ``name`` (blocking: a child process)."""
    fabric = fabric_report() if fabric is None else fabric
    report = EngineReport(name, engine_version(name), False, "")
    problem = engine_problem(name)
    if problem is not None:
        report.detail = problem
        return report
    if name == "nixl":
        _probe_nixl(report, fabric)
    else:
        _probe_mooncake(report, fabric)
    return report


def engines_section() -> tuple[dict[str, EngineReport], dict[str, Any]]:
    """Every engine's report and the fabric report (blocking: child processes)."""
    fabric = fabric_report()
    return {n: probe_engine(n, fabric) for n in ENGINES}, fabric


def _fabric_lines(fabric: dict[str, Any]) -> list[str]:
    lines = []
    if fabric["rdma"]:
        for dev in fabric["rdma"]:
            ports = ", ".join(
                f"port {p['port']} {p['state'] or '?'} {p['link_layer'] or '?'}"
                for p in dev["ports"]
            )
            nets = f" ({', '.join(dev['netdevs'])})" if dev["netdevs"] else ""
            lines.append(f"RDMA NIC {dev['name']}{nets}: {ports or 'no ports'}")
    else:
        lines.append("RDMA NICs: none (/sys/class/infiniband is empty or absent)")
    gpus = fabric["gpus"]
    if gpus["devices"]:
        models = f" ({', '.join(gpus['models'])})" if gpus["models"] else ""
        lines.append(f"NVIDIA GPUs: {', '.join(gpus['devices'])}{models}")
        lines.append(f"NVIDIA driver: {gpus['driver'] or '?'}; libcuda: {gpus['libcuda']}")
    else:
        lines.append("NVIDIA GPUs: none (/dev/nvidia<N> absent)")
    npus = fabric["npus"]["devices"]
    lines.append(f"Ascend NPUs: {', '.join(npus)}" if npus else "Ascend NPUs: none")
    lines.append(
        "libibverbs.so.1: "
        + ("loads" if fabric["libibverbs"] else "missing (apt-get install libibverbs1)")
    )
    return lines


def print_engines(reports: dict[str, EngineReport], fabric: dict[str, Any]) -> None:
    """Prints the engines and fabric sections of doctor's report."""
    print("\nengines (aiodatadist.Engines / DataPath nixl, mooncake)")
    for name, rep in reports.items():
        dist = engine_spec(name).distribution
        installed = f"{dist} {rep.version}" if rep.version else f"{dist} not installed"
        state = "works" if rep.works else "NOT AVAILABLE"
        print(f"  {name:<9} {state:<14} {installed}")
        print(f"  {'':<9} {'':<14} {rep.detail}")
        if rep.transports:
            print(f"  {'':<9} {'':<14} transports: {', '.join(rep.transports)}")
        for note in rep.notes:
            print(f"  {'':<9} {'':<14} note: {note}")
    print("\nfabric")
    for line in _fabric_lines(fabric):
        print(f"  {line}")
