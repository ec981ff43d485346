"""Memory accounting of the benchmarks: which kind of memory, and how much of it huge pages.

The transparent-huge-page settings (``/sys/kernel/mm/transparent_hugepage``) name the
kinds of memory the paths use; ``/proc/PID/smaps`` says how much of a buffer the kernel
really backed with huge pages. :func:`observe` is the hook that
``aiodatadist.cli.measure.run_workload`` calls after each measurement: it adds the
``memory``, ``huge_pages_engine`` and ``huge_pages_baseline`` keys to the point.

Not installed (the package never imports ``bench/``).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

from aiodatadist.cli.bench import host_meta as _package_meta
from aiodatadist.cli.measure import Engine, Point

__all__ = [
    "baseline_huge_share",
    "engine_huge_share",
    "host_meta",
    "huge_bytes_of_processes",
    "huge_share_of_ranges",
    "memory_kinds",
    "memory_note",
    "observe",
    "thp_mode",
]


def thp_mode(name: str = "enabled") -> str | None:
    """The selected mode of ``/sys/kernel/mm/transparent_hugepage/<name>`` (``enabled``
    or ``shmem_enabled``), or None where there is none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage", name).read_text()
    except OSError:
        return None
    m = re.search(r"\[([^\]]+)\]", text)
    return m.group(1) if m else text.strip() or None


def memory_kinds() -> dict[str, str]:
    """Labels of the two kinds of memory the paths use, as this kernel backs them.

    ``anon``: anonymous memory advised with ``MADV_HUGEPAGE`` (registered caches,
    destinations, the C buffers); ``shm``: POSIX shared memory (allocated caches),
    which nobody advises, so only ``shmem_enabled`` = always/within_size/force
    gives it huge pages.
    """
    anon = "THP" if thp_mode("enabled") in ("always", "madvise") else "4K"
    shm = "shm-THP" if thp_mode("shmem_enabled") in ("always", "within_size", "force") else "shm-4K"
    return {"anon": anon, "shm": shm}


def _smaps_huge(text: str) -> int:
    """Bytes in huge pages in an smaps(-rollup) text."""
    total = 0
    for key in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
        for m in re.finditer(rf"^{key}\s+(\d+) kB", text, re.M):
            total += int(m.group(1)) * 1024
    return total


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its children (one level: the C baselines fork one peer)."""
    pids = [pid]
    with contextlib.suppress(OSError, ValueError):
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            pids += [int(x) for x in text.split()]
    return pids


def huge_bytes_of_processes(pids: list[int]) -> int | None:
    """Bytes the kernel backs with huge pages in these processes (``smaps_rollup``)."""
    try:
        return sum(_smaps_huge(Path(f"/proc/{p}/smaps_rollup").read_text()) for p in pids)
    except OSError:
        return None


def huge_share_of_ranges(ranges: list[tuple[int, int]]) -> float | None:
    """Share of the resident memory in huge pages, over this process's mappings that
    overlap these ``(address, length)`` ranges (whole mappings: smaps says no more)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    huge = rss = 0
    for vma in re.split(r"^(?=[0-9a-f]+-[0-9a-f]+ )", text, flags=re.M):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", vma)
        if not m:
            continue
        lo, hi = int(m.group(1), 16), int(m.group(2), 16)
        if any(a < hi and a + n > lo for a, n in ranges):
            huge += _smaps_huge(vma)
            r = re.search(r"^Rss:\s+(\d+) kB", vma, re.M)
            rss += int(r.group(1)) * 1024 if r else 0
    return min(1.0, huge / rss) if rss else None


def memory_note() -> str:
    """What the memory column means on this machine (printed under the table)."""
    kinds = memory_kinds()
    enabled, shmem = thp_mode("enabled"), thp_mode("shmem_enabled")
    text = (
        f"memory = source->destination, the same for the engine and its baseline: "
        f"{kinds['anon']} = anonymous, 2 MiB-aligned, madvise(MADV_HUGEPAGE) "
        f"(transparent_hugepage/enabled = {enabled}); {kinds['shm']} = POSIX shared memory "
        f"(shmem_enabled = {shmem})"
    )
    if kinds["shm"] == "shm-4K":
        text += (
            ":\n  POSIX shm cannot get huge pages here, so the shm path copies from 4 KiB "
            "pages, and so does its baseline (C memcpy from a POSIX shm source)"
        )
    return (
        text + ";\nhuge e/b = share of the engine's / the baseline's source and destination "
        "that the kernel backed with huge pages (/proc/PID/smaps)"
    )


def engine_huge_share(engine: Engine, dst: list[Any]) -> float | None:
    """Share of the prompt's cache and the destination in huge pages now."""
    dst_ranges = [(int(t.ctypes.data), int(t.nbytes)) for t in dst]
    dst_bytes = sum(n for _, n in dst_ranges)
    d = huge_share_of_ranges(dst_ranges)
    if engine.src_pid is not None:  # the prompt's cache is most of its process
        got = huge_bytes_of_processes([engine.src_pid])
        s = None if got is None else min(1.0, got / max(1, engine.src_bytes))
    else:
        s = huge_share_of_ranges(engine.src_ranges)
    if d is None or s is None:
        return None
    return (s * engine.src_bytes + d * dst_bytes) / (engine.src_bytes + dst_bytes)


def baseline_huge_share(baseline: Any) -> float | None:
    """Share of a baseline's source and destination in huge pages now: a C server's
    processes (its ``huge_share()``), or the native mover's buffers (its ``ranges``)."""
    if hasattr(baseline, "huge_share"):
        share: float | None = baseline.huge_share()
        return share
    ranges = getattr(baseline, "ranges", None)
    return huge_share_of_ranges(ranges) if ranges else None


def observe(point: Point, engine: Engine, baseline: Any, dst: list[Any]) -> None:
    """The ``observe`` hook of ``run_workload``: the memory kinds and huge-page shares.

    ``memory`` is ``SRC->DST``, the same for the engine and its baseline: the shm path
    reads POSIX shared memory, every other source and every destination is anonymous
    memory advised with ``MADV_HUGEPAGE``.
    """
    kinds = memory_kinds()
    src = kinds["shm"] if engine.path == "shm" else kinds["anon"]
    point.extra["memory"] = f"{src}->{kinds['anon']}"
    huge_e = engine_huge_share(engine, dst)
    huge_b = None if baseline is None else baseline_huge_share(baseline)
    point.extra["huge_pages_engine"] = None if huge_e is None else round(huge_e, 4)
    point.extra["huge_pages_baseline"] = None if huge_b is None else round(huge_b, 4)


def host_meta() -> dict[str, Any]:
    """Versions, the machine and its memory settings, for a JSON report."""
    return {
        **_package_meta(),
        "thp_enabled": thp_mode("enabled"),
        "thp_shmem_enabled": thp_mode("shmem_enabled"),
        "thp_defrag": thp_mode("defrag"),
        "memory_kinds": memory_kinds(),
    }
