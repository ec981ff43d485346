"""Native movers vs plain-C baselines on a standard pull, measured in the same run.

    .venv/bin/python bench/bench_movers.py [--quick] [--repeats N] [--json PATH]

For the ``llama8b-fp16`` "64 random blocks, all layers" pull (1 GiB, 4096
segments of 256 KiB) this measures, case by case:

* memcpy: C memcpy gather (``bench/bin/baselines memcpy``) vs ``_native.copy_local``,
  2 threads and 1; a numpy fancy-index gather for reference;
* cma:    C ``process_vm_readv`` gather vs ``_native.cma_read``, the source held by a
  child process; 2 threads and 1;
* tcp:    C ``writev``/``readv`` over K loopback streams vs ``_native.sock_send`` /
  ``sock_recv`` between two processes; K = 1 and 2.

Each C baseline runs as a server (``baselines OP --serve``, set up once) whose
transfers alternate one by one with the native mover's (order rotated every
round), after one warm-up each, so all see the same state of a noisy machine.
memcpy and cma also run the same C gather inside this process, on the mover's
own buffers (``bin/libbaselines.so``), as a control.  The table gives the median
of ``--repeats`` timed transfers in GB/s (1e9 bytes/s); ``ratio`` = native
median / baseline median; ``paired`` = median of the per-round ratios (robust
to drift; the goal verdict uses it).  The baselines move exactly the same
segments (same seed, checked by hash); every buffer is touched before timing
and every destination checked after.

``bench/build.sh`` builds the baselines (this script runs it when they are missing).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import mmap
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from workloads import DEFAULT_SEED, Pull, make_pull

from aiodatadist.cli.stats import (
    DISAGREE,
    Summary,
    disagree_warning,
    disagreement,
    fmt_load,
    load_average,
    summarize,
)

HERE = Path(__file__).resolve().parent
BASELINES = HERE / "bin" / "baselines"
LIBBASELINES = HERE / "bin" / "libbaselines.so"
GOAL = 0.9


# --------------------------------------------------------------------------- memory


@dataclass
class Buffers:
    """One side of the pull: ``num_tensors`` tensors of ``pool`` blocks in one mapping."""

    pull: Pull
    pool: int
    huge: bool
    mm: mmap.mmap = field(init=False)
    arr: np.ndarray = field(init=False)  # uint8, flat

    def __post_init__(self) -> None:
        w = self.pull.workload
        n = w.num_tensors * w.tensor_bytes(self.pool)
        self.mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mm.madvise(mmap.MADV_HUGEPAGE if self.huge else mmap.MADV_NOHUGEPAGE)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)

    @property
    def tensor_bytes(self) -> int:
        return self.pull.workload.tensor_bytes(self.pool)

    def bases(self) -> list[int]:
        a = self.arr.ctypes.data
        return [a + t * self.tensor_bytes for t in range(self.pull.workload.num_tensors)]

    def words(self) -> np.ndarray:
        w = self.pull.workload
        return self.arr.view(np.uint64).reshape(w.num_tensors, self.pool, w.block_bytes // 8)

    def typed(self) -> np.ndarray:
        w = self.pull.workload
        typed: np.ndarray = self.arr.view(w.np_dtype())
        return typed.reshape(w.num_tensors, self.pool, w.block_elems)

    def fill_source(self) -> None:
        """Every word of block b of tensor t holds ((t << 32) | b) + 1, as in the C baselines."""
        w = self.pull.workload
        t = np.arange(w.num_tensors, dtype=np.uint64)[:, None]
        b = np.arange(self.pool, dtype=np.uint64)[None, :]
        self.words()[:] = (((t << np.uint64(32)) | b) + np.uint64(1))[:, :, None]

    def clear(self) -> None:
        self.arr[:] = 0


def check_destination(dst: Buffers) -> bool:
    p = dst.pull
    words = dst.words()
    t0, tn = p.tensor_start, p.tensor_start + p.tensor_count
    t = np.arange(t0, tn, dtype=np.uint64)[:, None]
    sb = np.asarray(p.src_blocks, dtype=np.uint64)[None, :]
    want = ((t << np.uint64(32)) | sb) + np.uint64(1)
    blocks = words[t0:tn][:, np.asarray(p.dst_blocks)]
    return bool(np.array_equal(blocks[:, :, 0], want) and np.array_equal(blocks[:, :, -1], want))


# --------------------------------------------------------------------------- results


@dataclass
class Row:
    group: str
    mover: str  # "plain-C memcpy gather", "native copy_local", ...
    par: int  # threads or streams
    par_name: str
    samples: list[float] = field(default_factory=list)  # GB/s, timed runs only
    verified: bool = True
    baseline: Row | None = None
    goal: bool = False  # the issue's >= 0.9x goal applies to this row
    note: str = ""
    extra_baselines: list[Row] = field(default_factory=list)  # also compared, shown below the row
    variant: str = ""  # baseline variant, e.g. "4 MiB/call"
    args: list[str] = field(default_factory=list)  # extra `baselines` command-line arguments
    inproc: Any = (
        None  # runs the baseline in this process (libbaselines.so) instead of `baselines --serve`
    )

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or not self.baseline.samples or not self.samples:
            return None
        return self.median / self.baseline.median

    @property
    def paired_ratio(self) -> float | None:
        return self.paired_vs(self.baseline)

    def ratio_vs(self, b: Row | None) -> float | None:
        if b is None or not b.samples or not self.samples:
            return None
        return self.median / b.median

    def paired_vs(self, b: Row | None) -> float | None:
        """Median of native_i / baseline_i over alternated transfers."""
        if b is None or not self.samples or len(b.samples) != len(self.samples):
            return None
        return statistics.median(n / c for n, c in zip(self.samples, b.samples, strict=True))

    @property
    def label(self) -> str:
        return f"{self.mover} ({self.variant})" if self.variant else self.mover

    def paired_spread_vs(self, b: Row | None) -> Summary | None:
        """The per-round ratios native / baseline."""
        if b is None or not self.samples or len(b.samples) != len(self.samples):
            return None
        return summarize(n / c for n, c in zip(self.samples, b.samples, strict=True))

    def warning(self) -> str | None:
        """A WARNING when this row's timed transfers disagree by more than 20%."""
        par = f"{self.par} {self.par_name[:-1] if self.par == 1 else self.par_name}"
        return disagree_warning(f"{self.group} {self.label}, {par}", self.samples, "GB/s")

    def as_json(self) -> dict[str, Any]:
        pr = self.paired_ratio
        spread = summarize(self.samples)
        paired = self.paired_spread_vs(self.baseline)
        d = disagreement(self.samples)
        return {
            "group": self.group,
            "mover": self.mover,
            "variant": self.variant or None,
            self.par_name: self.par,
            "median_gbps": round(self.median, 4),
            "min_gbps": round(min(self.samples), 4) if self.samples else None,
            "max_gbps": round(max(self.samples), 4) if self.samples else None,
            "samples_gbps": [round(s, 4) for s in self.samples],
            "spread_gbps": None if spread is None else spread.as_json(),
            "paired_ratio_spread": None if paired is None else paired.as_json(),
            "disagreement": None if d is None else round(d, 4),
            "warning": self.warning(),
            "verified": self.verified,
            "baseline": None if self.baseline is None else self.baseline.label,
            "ratio": None if self.ratio is None else round(self.ratio, 4),
            "paired_ratio": None if self.paired_ratio is None else round(self.paired_ratio, 4),
            "vs_other_baselines": {
                b.label: {"ratio": _r4(self.ratio_vs(b)), "paired_ratio": _r4(self.paired_vs(b))}
                for b in self.extra_baselines
            },
            "goal": GOAL if self.goal else None,
            "goal_met": None if not self.goal or pr is None else pr >= GOAL,
            "note": self.note,
        }


def _r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def gbps(nbytes: int, secs: float) -> float:
    return nbytes / secs / 1e9


# --------------------------------------------------------------------------- C baselines


def ensure_baselines() -> None:
    src = HERE / "c" / "baselines.c"
    for out in (BASELINES, LIBBASELINES):
        if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
            subprocess.run([str(HERE / "build.sh")], check=True, stdout=subprocess.DEVNULL)


class InProcess:
    """The baselines' gathers on this process's buffers (the plan's segments as addresses)."""

    def __init__(self, plan: Any, src_bases: list[int], dst_bases: list[int]) -> None:
        seg = plan.segments()
        sb = np.asarray(src_bases, dtype=np.uint64)
        db = np.asarray(dst_bases, dtype=np.uint64)
        self.src = sb[seg[:, 0].astype(np.intp)] + seg[:, 1]
        self.dst = db[seg[:, 2].astype(np.intp)] + seg[:, 3]
        self.len = np.ascontiguousarray(seg[:, 4])
        self.lib = ctypes.CDLL(str(LIBBASELINES))
        p, n = ctypes.c_void_p, ctypes.c_size_t
        self.lib.bl_memcpy.argtypes = [p, p, p, n, ctypes.c_int]
        self.lib.bl_cma_read.argtypes = [ctypes.c_int, p, p, p, n, ctypes.c_int, ctypes.c_uint64]

    def _ptrs(self) -> tuple[int, int, int, int]:
        return self.src.ctypes.data, self.dst.ctypes.data, self.len.ctypes.data, len(self.len)

    def memcpy(self, threads: int) -> None:
        if err := self.lib.bl_memcpy(*self._ptrs(), threads):
            raise OSError(err, os.strerror(err))

    def cma_read(self, pid: int, threads: int) -> None:
        if err := self.lib.bl_cma_read(pid, *self._ptrs(), threads, 0):
            raise OSError(err, os.strerror(err))


class Baseline:
    """``baselines OP --serve``: set up once, then one timed transfer per :meth:`run`."""

    def __init__(
        self, args: argparse.Namespace, pull: Pull, op: str, par: int, extra: list[str]
    ) -> None:
        self.pull = pull
        w = pull.workload
        cmd = [
            str(BASELINES),
            op,
            "--serve",
            "--tensors",
            str(pull.tensor_count),
            "--pool",
            str(pull.src_pool),
            "--blocks",
            str(len(pull.src_blocks)),
            "--block-bytes",
            str(w.block_bytes),
            "--seed",
            str(pull.seed),
            "--streams" if op == "tcp" else "--threads",
            str(par),
        ]
        cmd += extra
        if not args.huge:
            cmd.append("--no-huge")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"baseline failed to start: {' '.join(cmd)}")

    def run(self) -> float:
        """One transfer; returns GB/s as the baseline timed it."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("baseline died")
        return gbps(self.pull.total_bytes, float(line))

    def close(self) -> dict[str, Any]:
        """Stops it; returns its summary (checks it moved the same segments)."""
        out, _ = self.proc.communicate(timeout=60)
        res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        if res["blocks_hash"] != self.pull.hash() or res["bytes"] != self.pull.total_bytes:
            raise SystemExit(f"baseline moved different segments: {res} vs {self.pull.hash()}")
        return res


# --------------------------------------------------------------------------- child processes


def serve_command(args: argparse.Namespace, role: str, extra: list[str]) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--_serve",
        role,
        "--workload",
        args.workload,
        "--blocks",
        str(args.blocks),
        "--seed",
        str(args.seed),
    ]
    if not args.huge:
        cmd.append("--no-huge")
    return cmd + extra


def serve(args: argparse.Namespace) -> None:
    """Child side: hold the source; for tcp, sock_send it on every 'go' line."""
    from aiodatadist import _native as nat

    pull = make_pull(
        args.workload, "64-random-blocks-all-layers", num_blocks=args.blocks, seed=args.seed
    )
    src = Buffers(pull, pull.src_pool, args.huge)
    src.fill_source()
    out = sys.stdout
    if args._serve == "cma":
        out.write(f"ready {os.getpid()} {src.arr.ctypes.data}\n")
        out.flush()
        sys.stdin.read()  # until the parent closes our stdin
        return
    plan = build_plan(nat, pull)
    fds = []
    for i in range(args.streams):
        s = socket.create_connection(("127.0.0.1", args.port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(bytes([i]))
        fds.append(s)
    out.write("ready\n")
    out.flush()
    bases = src.bases()
    for line in sys.stdin:
        if line.strip() != "go":
            break
        try:
            nat.sock_send([s.fileno() for s in fds], plan, bases, nat.Control(), tag=1)
            out.write("ok\n")
        except Exception as e:  # report, keep serving
            out.write(f"err {e!r}\n")
        out.flush()


def build_plan(nat: Any, pull: Pull) -> Any:
    w = pull.workload
    g_src = nat.Geometry(w.num_tensors, pull.src_pool, w.block_bytes)
    g_dst = nat.Geometry(w.num_tensors, pull.dst_pool, w.block_bytes)
    return nat.Plan.blocks(
        g_src,
        g_dst,
        pull.src_blocks,
        pull.dst_blocks,
        pull.tensor_start,
        pull.tensor_start,
        pull.tensor_count,
    )


# --------------------------------------------------------------------------- groups


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(fn: Any, nbytes: int) -> float:
    t0 = time.perf_counter()
    fn()
    return gbps(nbytes, time.perf_counter() - t0)


def compare(
    args: argparse.Namespace, pull: Pull, op: str, native: Row, fn: Any, dst: Buffers
) -> None:
    """Alternates ``native`` (running ``fn``) with its baselines transfer by transfer,
    rotating the order every round; 1 warm-up each, then ``--repeats`` timed rounds."""
    bases = [r for r in (native.baseline, *native.extra_baselines) if r is not None]
    log(f"  {native.label} vs {', '.join(b.label for b in bases)}, {native.par} {native.par_name}")
    servers: dict[int, Baseline] = {}
    try:
        movers: list[tuple[Row, Any]] = []
        for b in bases:
            if b.inproc is None:
                srv = servers[id(b)] = Baseline(args, pull, op, b.par, b.args)
                movers.append((b, srv.run))
            else:
                movers.append((b, lambda f=b.inproc: timed(f, pull.total_bytes)))
        dst.clear()
        if isinstance(fn, TcpPull):
            movers.append((native, lambda: fn.timed(pull.total_bytes)))
        else:
            movers.append((native, lambda: timed(fn, pull.total_bytes)))
        for _, run in movers:  # warm-ups
            run()
        for i in range(args.repeats):
            k = i % len(movers)
            for row, run in movers[k:] + movers[:k]:
                row.samples.append(run())
    finally:
        results = {k: srv.close() for k, srv in servers.items()}
    ok = check_destination(dst)  # whatever wrote last: in-process baselines share dst
    for b in bases:
        b.verified &= bool(results[id(b)]["verified"]) if id(b) in results else ok
    native.verified &= ok


def group_memcpy(
    args: argparse.Namespace, nat: Any, pull: Pull, plan: Any, src: Buffers, dst: Buffers
) -> list[Row]:
    rows = []
    s_bases, d_bases = src.bases(), dst.bases()
    inproc = InProcess(plan, s_bases, d_bases)
    c1 = None
    for t in (2, 1):
        c = Row("memcpy", "plain-C memcpy gather", t, "threads")
        ci = Row(
            "memcpy",
            "plain-C memcpy gather",
            t,
            "threads",
            variant="in-process",
            inproc=lambda t=t: inproc.memcpy(t),
        )
        n = Row(
            "memcpy",
            "native copy_local",
            t,
            "threads",
            baseline=c,
            goal=t == 2,
            extra_baselines=[ci],
        )
        compare(
            args,
            pull,
            "memcpy",
            n,
            lambda t=t: nat.copy_local(plan, s_bases, d_bases, nat.Control(), t),
            dst,
        )
        rows += [c, ci, n]
        c1 = c
    if not args.no_numpy:
        log("  numpy gather")
        row = Row(
            "memcpy",
            "numpy gather",
            1,
            "threads",
            baseline=c1,
            note="dst[:, di] = src[:, si]: materializes a temporary (2x traffic)",
        )
        sv, dv = src.typed(), dst.typed()
        si, di = (
            np.asarray(pull.src_blocks, dtype=np.intp),
            np.asarray(pull.dst_blocks, dtype=np.intp),
        )
        t0, tn = pull.tensor_start, pull.tensor_start + pull.tensor_count

        def np_gather() -> None:
            dv[t0:tn, di] = sv[t0:tn, si]

        dst.clear()
        timed(np_gather, pull.total_bytes)
        row.samples = [timed(np_gather, pull.total_bytes) for _ in range(max(3, args.repeats // 2))]
        row.verified = check_destination(dst)
        rows.append(row)
    return rows


def group_cma(args: argparse.Namespace, nat: Any, pull: Pull, plan: Any, dst: Buffers) -> list[Row]:
    rows = []
    child = subprocess.Popen(
        serve_command(args, "cma", []), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        line = child.stdout.readline().split()
        if not line or line[0] != "ready":
            raise SystemExit(f"cma child failed to start: {line}")
        pid, addr = int(line[1]), int(line[2])
        ok, err = nat.cma_probe(pid)
        tb = pull.workload.tensor_bytes(pull.src_pool)
        r_bases = [addr + t * tb for t in range(pull.workload.num_tensors)]
        d_bases = dst.bases()
        inproc = InProcess(plan, r_bases, d_bases)
        for t in (2, 1):
            c = Row("cma", "plain-C process_vm_readv gather", t, "threads")
            ci = Row(
                "cma",
                "plain-C process_vm_readv gather",
                t,
                "threads",
                variant="in-process",
                inproc=lambda t=t: inproc.cma_read(pid, t),
            )
            n = Row(
                "cma",
                "native cma_read",
                t,
                "threads",
                baseline=c,
                goal=t == 2,
                extra_baselines=[ci],
            )
            rows += [c, ci, n]
            if not ok:
                c.note = n.note = f"process_vm_readv not permitted here (errno {err})"
                log("  " + c.note)
                continue
            compare(
                args,
                pull,
                "cma",
                n,
                lambda t=t: nat.cma_read(pid, plan, r_bases, d_bases, nat.Control(), t),
                dst,
            )
    finally:
        if child.stdin:
            child.stdin.close()
        child.wait(timeout=30)
    return rows


class TcpPull:
    """One native pull over loopback: tell the sender child to go, receive everything."""

    def __init__(self, nat: Any, child: Any, fds: list[int], plan: Any, bases: list[int]) -> None:
        self.nat, self.child, self.fds, self.plan, self.bases = nat, child, fds, plan, bases

    def timed(self, nbytes: int) -> float:
        """GB/s from the "go" to the last byte received (as the C baseline times it)."""
        t0 = time.perf_counter()
        self.child.stdin.write("go\n")
        self.child.stdin.flush()
        self.nat.sock_recv(self.fds, self.plan, self.bases, self.nat.Control(), tag=1)
        dt = time.perf_counter() - t0
        reply = self.child.stdout.readline().strip()
        if reply != "ok":
            raise RuntimeError(f"sender: {reply}")
        return gbps(nbytes, dt)


def group_tcp(args: argparse.Namespace, nat: Any, pull: Pull, plan: Any, dst: Buffers) -> list[Row]:
    rows = []
    d_bases = dst.bases()
    for k in (1, 2):
        # The plain baseline writev's / readv's IOV_MAX iovecs (256 MiB here) per call;
        # the second caps calls at 4 MiB like the native mover (faster on loopback).
        c = Row("tcp", "plain-C writev/readv", k, "streams", variant="IOV_MAX/call")
        c4 = Row(
            "tcp",
            "plain-C writev/readv",
            k,
            "streams",
            variant="4 MiB/call",
            args=["--batch-bytes", str(4 << 20)],
        )
        n = Row(
            "tcp",
            "native sock_send/recv",
            k,
            "streams",
            baseline=c,
            goal=True,
            extra_baselines=[c4],
        )
        rows += [c, c4, n]
        lsock = socket.create_server(("127.0.0.1", 0), backlog=16)
        port = lsock.getsockname()[1]
        child = subprocess.Popen(
            serve_command(args, "tcp", ["--port", str(port), "--streams", str(k)]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        conns: list[socket.socket] = [None] * k  # type: ignore[list-item]
        try:
            assert child.stdin is not None and child.stdout is not None
            for _ in range(k):
                conn, _addr = lsock.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns[conn.recv(1)[0]] = conn
            if child.stdout.readline().strip() != "ready":
                raise SystemExit("tcp child failed to start")
            fds = [conn.fileno() for conn in conns]
            compare(args, pull, "tcp", n, TcpPull(nat, child, fds, plan, d_bases), dst)
        finally:
            if child.stdin:
                child.stdin.close()
            child.wait(timeout=30)
            for conn in conns:
                if conn is not None:
                    conn.close()
            lsock.close()
    return rows


# --------------------------------------------------------------------------- output


def _paired_cell(p: float | None, s: Summary | None) -> str:
    if p is None or s is None:
        return ""
    return f"{p:.3f} ({s.band[1]:.3f}-{s.band[2]:.3f})"


def table(rows: list[Row]) -> str:
    """The rows; ``spread`` is p10-p90 of the timed transfers from 10 up, else min-max."""
    hdr = (
        f"{'group':<7} {'mover':<44} {'par':>9} {'median GB/s':>11} {'spread':>13} "
        f"{'ratio':>7} {'paired (spread)':>21}  goal"
    )
    lines = [hdr, "-" * (len(hdr) + 12)]
    for r in rows:
        par = f"{r.par} {r.par_name[:-1] if r.par == 1 else r.par_name}"
        s = summarize(r.samples)
        span = f"{s.band[1]:.2f}..{s.band[2]:.2f}" if s else "-"
        med = f"{r.median:.2f}" if r.samples else "-"
        ratio = "" if r.ratio is None else f"{r.ratio:.3f}"
        paired = _paired_cell(r.paired_ratio, r.paired_spread_vs(r.baseline))
        goal = ""
        verdict = r.paired_ratio if r.paired_ratio is not None else r.ratio
        if r.goal and verdict is not None:
            goal = f">= {GOAL}x {'met' if verdict >= GOAL else 'MISSED'}"
        flag = "" if r.verified else "  DATA MISMATCH"
        note = f"  ({r.note})" if r.note and not r.samples else ""
        lines.append(
            f"{r.group:<7} {r.label:<44} {par:>9} {med:>11} {span:>13} {ratio:>7} {paired:>21}  "
            f"{goal}{flag}{note}"
        )
        for b in r.extra_baselines:
            xr, xp = r.ratio_vs(b), _paired_cell(r.paired_vs(b), r.paired_spread_vs(b))
            lines.append(
                f"{'':<7} {'  vs ' + b.label:<44} {'':>9} {'':>11} {'':>13} "
                f"{'' if xr is None else f'{xr:.3f}':>7} {xp:>21}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 16 blocks (256 MiB), 5 repeats"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed transfers per mover per case (default 15, 5 with --quick; a warm-up precedes)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--workload", default="llama8b-fp16")
    ap.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="random blocks per tensor (default 64; 16 with --quick)",
    )
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument(
        "--only", action="append", choices=["memcpy", "cma", "tcp"], help="run only these groups"
    )
    ap.add_argument("--no-numpy", action="store_true", help="skip the numpy reference gather")
    ap.add_argument(
        "--no-huge", dest="huge", action="store_false", help="madvise(MADV_NOHUGEPAGE) the buffers"
    )
    ap.add_argument("--_serve", choices=["cma", "tcp"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--streams", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.blocks is None:
        args.blocks = 16 if args.quick else 64
    if args._serve:
        serve(args)
        return
    if args.repeats is None:
        args.repeats = 5 if args.quick else 15
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    from aiodatadist import _native as nat

    ensure_baselines()
    load_start = load_average()
    log(fmt_load("start", load_start))
    pull = make_pull(
        args.workload, "64-random-blocks-all-layers", num_blocks=args.blocks, seed=args.seed
    )
    t = time.perf_counter()
    plan = build_plan(nat, pull)
    plan_ms = (time.perf_counter() - t) * 1e3
    assert plan.total_bytes == pull.total_bytes and plan.num_segments == pull.num_segments
    groups = args.only or ["memcpy", "cma", "tcp"]
    log(
        f"{args.workload}: {len(pull.src_blocks)} random blocks x {pull.tensor_count} tensors = "
        f"{pull.total_bytes / 2**20:.0f} MiB in {plan.num_segments} segments "
        f"(blocks hash {pull.hash()}); Plan.blocks took {plan_ms:.2f} ms"
    )
    dst = Buffers(pull, pull.dst_pool, args.huge)
    dst.clear()  # touch
    rows: list[Row] = []
    t_start = time.perf_counter()
    if "memcpy" in groups:
        log("memcpy group")
        src = Buffers(pull, pull.src_pool, args.huge)
        src.fill_source()
        rows += group_memcpy(args, nat, pull, plan, src, dst)
        del src
    if "cma" in groups:
        log("cma group")
        rows += group_cma(args, nat, pull, plan, dst)
    if "tcp" in groups:
        log("tcp group")
        rows += group_tcp(args, nat, pull, plan, dst)
    elapsed = time.perf_counter() - t_start
    load_end = load_average()

    meta = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "native": nat.__version__,
            "iov_max": nat.IOV_MAX,
        },
        "workload": args.workload,
        "pull": "64-random-blocks-all-layers",
        "blocks": len(pull.src_blocks),
        "tensors": pull.tensor_count,
        "bytes": pull.total_bytes,
        "segments": plan.num_segments,
        "blocks_hash": pull.hash(),
        "seed": args.seed,
        "repeats": args.repeats,
        "hugepages": args.huge,
        "plan_build_ms": round(plan_ms, 3),
        "elapsed_s": round(elapsed, 1),
        "loadavg_start": load_start,
        "loadavg_end": load_end,
        "band": "p10-p90" if args.repeats >= 10 else "min-max",
        "disagree_threshold": DISAGREE,
        "unit": "GB/s = 1e9 bytes/s; median of --repeats timed transfers, movers alternated",
        "note": "2-core noisy VM" if os.cpu_count() == 2 else "",
    }
    print(
        f"\n{args.workload}, {len(pull.src_blocks)} random blocks x {pull.tensor_count} tensors "
        f"= {pull.total_bytes / 2**20:.0f} MiB, {plan.num_segments} segments; "
        f"{args.repeats} alternated timed transfers per mover per case; {elapsed:.0f} s\n"
    )
    print(table(rows))
    band = "p10-p90" if args.repeats >= 10 else "min-max"
    print(
        f"\nspread = {band} of the {args.repeats} timed transfers; ratio = native median / "
        f"baseline median, paired = median of the per-round ratios; a WARNING when a row's "
        f"transfers disagree: (max-min)/median > {100 * DISAGREE:.0f}%"
    )
    print(fmt_load("start", load_start))
    print(fmt_load("end", load_end))
    warnings = [w for r in rows if (w := r.warning())]
    for w in warnings:
        print(w)
    meta["warnings"] = warnings
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"meta": meta, "results": [r.as_json() for r in rows]}, indent=2) + "\n"
        )
        print(f"\nwrote {args.json}")
    if not all(r.verified for r in rows):
        raise SystemExit("a destination check failed")


if __name__ == "__main__":
    main()
