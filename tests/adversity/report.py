"""Totals of an adversity run: ``python tests/adversity/report.py REPORT.jsonl [--pytest-rc N]``.

Reads the JSON lines the scenarios appended (``AIODATADIST_ADVERSITY_REPORT``), prints
pulls, bytes, corrupt bytes, errors by status, faults (and those that did not end in
an exception within their deadline) and the ledger of every module (fds, threads,
mappings, /dev/shm before and after). Exits 1 on any corruption, late fault, leak or a
failed pytest run (``--pytest-rc``), else 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Any

TOLERANCE = {
    "fds": 4,
    "threads": 1,
    "os_threads": 2,
    "mappings": 256,
    "shm_mappings": 0,
    "dev_shm": 0,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("report")
    p.add_argument("--pytest-rc", type=int, default=0)
    args = p.parse_args(argv)
    figures: list[dict[str, Any]] = []
    ledgers: list[dict[str, Any]] = []
    try:
        with open(args.report) as f:
            for line in f:
                rec = json.loads(line)
                (figures if rec["kind"] == "figures" else ledgers).append(rec)
    except FileNotFoundError:
        pass
    pulls = sum(r["pulls"] for r in figures)
    nbytes = sum(r["bytes"] for r in figures)
    corrupt = sum(r["corrupt"] for r in figures)
    faults = sum(r["faults"] for r in figures)
    late = [(r["name"], x) for r in figures for x in r["late_faults"]]
    errors: collections.Counter[str] = collections.Counter()
    per: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0, 0])
    for r in figures:
        errors.update(r["errors"])
        row = per[r["name"]]
        row[0] += 1
        row[1] += r["pulls"]
        row[2] += r["bytes"]
        row[3] += r["corrupt"]
        row[4] += len(r["late_faults"])
    print("=" * 78)
    print("aiodatadist adversity: figures")
    print("=" * 78)
    print(f"{'scenario':32} {'runs':>5} {'pulls':>9} {'MiB':>10} {'corrupt':>9} {'late':>5}")
    for name in sorted(per):
        runs, pl, by, co, la = per[name]
        print(f"{name:32} {runs:5d} {pl:9d} {by / 2**20:10.1f} {co:9d} {la:5d}")
    print("-" * 78)
    print(f"pulls verified : {pulls}")
    print(f"bytes verified : {nbytes} ({nbytes / 2**30:.2f} GiB)")
    print(f"corrupt        : {corrupt}")
    print(f"faults injected: {faults}; not ended in an exception within the deadline: {len(late)}")
    print("outcomes by status / exception:")
    for k, v in sorted(errors.items(), key=lambda kv: -kv[1]):
        print(f"    {k:44} {v:8d}")
    for name, what in late[:20]:
        print(f"LATE  {name}: {what}")
    for r in figures:
        for what in r["corrupt_pulls"][:3]:
            print(f"CORRUPT  {r['name']}: {what}")
    print("ledger (before -> after):")
    leaks = []
    for lg in ledgers:
        b, a = lg["before"], lg["after"]
        cols = "  ".join(f"{k} {b[k]}->{a.get(k)}" for k in b)
        print(f"    {lg['name']:32} {cols}")
        for k in b:
            if a.get(k, 0) - b[k] > TOLERANCE.get(k, 0):
                leaks.append(f"{lg['name']}: {k} {b[k]} -> {a.get(k)}")
    for x in leaks:
        print(f"LEAK  {x}")
    ok = corrupt == 0 and not late and not leaks and args.pytest_rc == 0 and bool(figures)
    print("-" * 78)
    print(f"pytest exit status: {args.pytest_rc}")
    print("RESULT: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
