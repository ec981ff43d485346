"""How long is the walk of one pull? Counts the aiodatadist modules and frames it crosses.

Runs one warm ``pull_blocks`` (1 block) over an in-process link and one over a tcp link
(both instances in this process), with a profiler that records every Python frame of the
``aiodatadist`` package (``aiodatadist.testing`` excluded: it is the harness). Frames of
the call's own task and of transfer threads are the *call*; frames of the links' own
tasks and serving threads (reading the control connection, serving the peer's request,
both ends in this process) are *link tasks*. Prints, for each: the modules touched, the
deepest stack of package frames, and the modules on that deepest stack (the walk).
DESIGN.md's rule: a change that makes this walk longer is the wrong change.

Run: ``.venv/bin/python scripts/pull_walk.py [--json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from typing import Any

from aiodatadist import BlocksCacheKey
from aiodatadist.testing import inproc_pair, make_blocks_cache

_PKG = "aiodatadist"


def _module(frame: Any) -> str | None:
    name = frame.f_globals.get("__name__", "")
    if not (name == _PKG or name.startswith(_PKG + ".")):
        return None
    if name.startswith(_PKG + ".testing"):
        return None
    return str(name)


class Walk:
    """Records the package's frames seen while active (every thread)."""

    def __init__(self) -> None:
        self.modules: dict[str, set[str]] = {}
        self.depth: dict[str, int] = {}
        self.chain: dict[str, list[str]] = {}
        self.active = False

    def _side(self) -> str:
        thread = threading.current_thread().name
        if "serve" in thread:
            return "link tasks"
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        if task is not None and "peer" in task.get_name():
            return "link tasks"
        return "call"

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if not self.active or event != "call":
            return
        mod = _module(frame)
        if mod is None:
            return
        side = self._side()
        self.modules.setdefault(side, set()).add(mod)
        chain, f = [], frame
        while f is not None:
            m = _module(f)
            if m is not None:
                chain.append(m)
            f = f.f_back
        if len(chain) > self.depth.get(side, 0):
            self.depth[side] = len(chain)
            self.chain[side] = list(dict.fromkeys(reversed(chain)))


async def _one(path: str, walk: Walk) -> None:
    async with inproc_pair(data_path=path) as pair:
        src = make_blocks_cache(pair.prompt, num_tensors=2, num_blocks=4, model_id=0, seed=1)
        dst = make_blocks_cache(pair.decoder, num_tensors=2, num_blocks=4)
        key = BlocksCacheKey(pair.prompt.cluster_id, 0)
        cm = pair.decoder.cache_manager
        await cm.pull_blocks(key, dst.cache, [1], [2])  # warm: mappings, streams
        walk.active = True
        await cm.pull_blocks(key, dst.cache, [3], [0])
        await asyncio.sleep(0.05)  # the serving side's DONE bookkeeping
        walk.active = False
        del src


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out: dict[str, Any] = {}
    for path in ("inproc", "tcp"):
        walk = Walk()
        sys.setprofile(walk.profile)
        threading.setprofile(walk.profile)
        try:
            asyncio.run(_one(path, walk))
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
        out[path] = {
            side: {
                "modules": sorted(mods),
                "count": len(mods),
                "max_depth": walk.depth[side],
                "walk": walk.chain[side],
            }
            for side, mods in sorted(walk.modules.items())
        }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        def short(mods: list[str]) -> str:
            return " ".join(m.removeprefix(_PKG + ".") for m in mods)

        for path, sides in out.items():
            for side, r in sides.items():
                print(f"{path} / {side}: {r['count']} modules touched: {short(r['modules'])}")
                print(f"    deepest stack {r['max_depth']} frames, {len(r['walk'])} modules: "
                      f"{' -> '.join(m.removeprefix(_PKG + '.') for m in r['walk'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
