"""The adversity suite's commands in the peer process: a plugin of the one harness.

:class:`_common.ActorProc` starts ``aiodatadist.testing``'s peer process (the command
line of :class:`aiodatadist.testing.PeerProcess`, with ``plugin=<this file>`` and
``control=True``) without an event loop, so that it can outlive one test's loop. The
peer process prints one JSON line ``{"event": "ready", "port": ..., "control": ...}``
on stdout and answers JSON-line commands on its *control* port (``127.0.0.1:control``,
one reply line per command line, any number of connections, so that tests on any event
loop can talk to it) until its stdin reaches EOF (its lifeline: when the test process
dies, so does this one) or it gets SIGTERM.

Every reply has ``ok``; a failure carries ``status`` (an ``LLMException``'s code) or
``error`` (``Type: message``). Commands (``cmd``):

* ``cache {name, model_id, allocate, num_tensors, num_blocks, block_shape}``: registers
  (numpy memory) or allocates (shared memory) a blocks cache under
  ``BlocksCacheKey(this, model_id)``.
* ``fill {name, seed, blocks}``: writes ``pattern_blocks(seed, t, blocks)`` into those
  blocks of every tensor (the pattern of one transfer).
* ``reregister {name, seed, poison}``: the cache is unregistered (or deallocated) and a
  new one of the same shape registered under the same key, on *new* memory filled
  with ``seed``; the old memory (registered caches: it stays mapped, as an allocator
  would reuse it) is overwritten with the ``poison`` seed's pattern.
* ``free {name}``: unregisters / deallocates; replies ``seconds``.
* ``truncate {name}``: tries to ``ftruncate`` the shared-memory segment of the
  allocated cache to 0 bytes (what a hostile or buggy peer could do); replies
  ``truncated`` and ``how`` (or ``error``/``errno``).
* ``link {cluster_id, host, port, timeout_ms}``: ``link_clusters``; replies ``status``.
* ``pull {cluster_id, model_id, dst, src_blocks, dst_blocks, seed, timeout}``: pulls and
  checks every pulled byte against ``seed``; replies ``mismatches``.
* ``pull_loop {cluster_id, model_id, dst, blocks, timeout}``: starts pulling
  ``blocks`` again and again in the background (a decoder to kill mid-pull); replies at
  once. ``loop_stats`` replies how many completed.
* ``pid`` (built in).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import glob
import inspect
import os
import time
from typing import Any

from aiodatadist import BlocksCacheKey, LLMDataDist, LLMException
from aiodatadist.testing import (
    PeerCommands,
    cluster_info,
    make_blocks_cache,
    pattern_blocks,
    pattern_mismatches,
)


def fill(tensors: list[Any], seed: int, blocks: list[int]) -> None:
    for t, tensor in enumerate(tensors):
        raw = tensor.view("uint8").reshape(tensor.shape[0], -1)
        raw[blocks] = pattern_blocks(seed, t, blocks, raw.shape[1])


class Commands(PeerCommands):
    def __init__(self, dd: LLMDataDist, config: dict[str, Any]) -> None:
        super().__init__(dd, config)
        self.caches: dict[str, Any] = {}  # name -> FilledCache
        self.specs: dict[str, dict[str, Any]] = {}
        self.old: list[Any] = []  # memory of re-registered caches, kept (and poisoned)
        self.loop_task: asyncio.Task[None] | None = None
        self.loop_done = 0
        self.loop_mismatches = 0
        self.loop_errors: list[str] = []

    async def close(self) -> None:
        if self.loop_task is not None:
            self.loop_task.cancel()
            with contextlib.suppress(BaseException):
                await self.loop_task

    def _make(self, c: dict[str, Any]) -> Any:
        return make_blocks_cache(
            self.dd,
            num_tensors=int(c["num_tensors"]),
            num_blocks=int(c["num_blocks"]),
            block_shape=tuple(c["block_shape"]),
            model_id=c.get("model_id"),
            allocate=bool(c.get("allocate", False)),
        )

    def _describe(self, name: str) -> dict[str, Any]:
        fc = self.caches[name]
        seg = getattr(fc.cache, "_buffers", None)
        return {
            "cache_id": fc.cache.cache_id,
            "addrs": list(fc.cache.tensor_addrs),
            "shm_name": getattr(seg, "name", None),
            "has_fd": getattr(seg, "fd", None) is not None,
        }

    async def _free_cache(self, fc: Any, allocate: bool) -> None:
        cm = self.dd.cache_manager
        if allocate:
            r = cm.deallocate_blocks_cache(fc.cache)
        else:
            r = cm.unregister_cache(fc.cache.cache_id)
        if inspect.isawaitable(r):  # revocation may become a coroutine
            await r

    # ---------------------------------------------------------------- commands

    async def cmd_cache(self, c: dict[str, Any]) -> dict[str, Any]:
        name = str(c["name"])
        self.caches[name] = self._make(c)
        self.specs[name] = dict(c)
        return {"ok": True, **self._describe(name)}

    async def cmd_fill(self, c: dict[str, Any]) -> dict[str, Any]:
        fill(self.caches[c["name"]].tensors, int(c["seed"]), [int(b) for b in c["blocks"]])
        return {"ok": True}

    async def cmd_reregister(self, c: dict[str, Any]) -> dict[str, Any]:
        name = str(c["name"])
        spec = self.specs[name]
        old = self.caches[name]
        t0 = time.monotonic()
        await self._free_cache(old, bool(spec.get("allocate")))
        freed_s = time.monotonic() - t0
        nb = int(spec["num_blocks"])
        if not spec.get("allocate"):
            # The old memory is reused by its owner at once: a peer that still reads it
            # gets the poison pattern, never the bytes it asked for, and a peer that
            # still writes into it changes the poison (``check_old``).
            fill(old.tensors, int(c["poison"]), list(range(nb)))
            self.old.append(old)
            del self.old[:-2]
        new = self._make(spec)
        fill(new.tensors, int(c["seed"]), list(range(nb)))
        self.caches[name] = new
        return {"ok": True, "freed_s": freed_s, **self._describe(name)}

    async def cmd_free(self, c: dict[str, Any]) -> dict[str, Any]:
        name = str(c["name"])
        fc = self.caches.pop(name)
        t0 = time.monotonic()
        try:
            await self._free_cache(fc, bool(self.specs[name].get("allocate")))
        except BaseException:
            self.caches[name] = fc
            raise
        return {"ok": True, "seconds": time.monotonic() - t0}

    async def cmd_truncate(self, c: dict[str, Any]) -> dict[str, Any]:
        fc = self.caches[c["name"]]
        seg = getattr(fc.cache, "_buffers", None)
        fd = getattr(seg, "fd", None)
        how = ""
        own_fd = -1
        if isinstance(fd, int) and fd >= 0:
            how = "segment fd"
        else:
            name = getattr(seg, "name", None)
            with contextlib.suppress(OSError, TypeError):
                own_fd = fd = os.open("/dev/shm" + str(name), os.O_RDWR)
                how = "/dev/shm" + str(name)
            if own_fd < 0:
                # A nameless (memfd) segment: find it among our own descriptors.
                for link in glob.glob("/proc/self/fd/*"):
                    with contextlib.suppress(OSError):
                        target = os.readlink(link)
                        if target.startswith("/memfd:") and "aiodd" in target:
                            own_fd = fd = os.open(link, os.O_RDWR)
                            how = target
                            break
            if own_fd < 0:
                # No descriptor kept: the mapping itself (root may open map_files).
                with open("/proc/self/maps") as f:  # noqa: ASYNC230 (procfs: no disk wait)
                    maps = f.read().splitlines()
                for line in maps:
                    if "aiodd" in line and "memfd:" in line:
                        with contextlib.suppress(OSError):
                            own_fd = fd = os.open(
                                "/proc/self/map_files/" + line.split()[0], os.O_RDWR
                            )
                            how = "map_files " + line.split()[-2]
                            break
        if not isinstance(fd, int) or fd < 0:
            return {"ok": True, "truncated": False, "how": "no fd reachable"}
        try:
            os.ftruncate(fd, 0)
        except OSError as e:
            return {
                "ok": True,
                "truncated": False,
                "how": how,
                "errno": errno.errorcode.get(e.errno or 0, str(e.errno)),
            }
        finally:
            if own_fd >= 0:
                os.close(own_fd)
        return {"ok": True, "truncated": True, "how": how}

    async def cmd_check_old(self, c: dict[str, Any]) -> dict[str, Any]:
        """Bytes of the last re-registered (freed, then reused) memory that are no longer
        the ``poison`` pattern written into it: a peer wrote into freed memory."""
        if not self.old:
            return {"ok": True, "changed": 0}
        old = self.old[-1]
        changed = 0
        for t, tensor in enumerate(old.tensors):
            raw = tensor.view("uint8").reshape(tensor.shape[0], -1)
            want = pattern_blocks(int(c["poison"]), t, list(range(raw.shape[0])), raw.shape[1])
            changed += int((raw != want).sum())
        return {"ok": True, "changed": changed}

    async def cmd_link(self, c: dict[str, Any]) -> dict[str, Any]:
        info = cluster_info(int(c["cluster_id"]), str(c["host"]), int(c["port"]))
        status, statuses = await self.dd.link_clusters([info], int(c.get("timeout_ms", 5000)))
        return {"ok": True, "status": int(status), "statuses": [int(s) for s in statuses]}

    async def cmd_pull(self, c: dict[str, Any]) -> dict[str, Any]:
        dst = self.caches[c["dst"]]
        src = [int(b) for b in c["src_blocks"]]
        dstb = [int(b) for b in c["dst_blocks"]]
        await self.dd.cache_manager.pull_blocks(
            BlocksCacheKey(int(c["cluster_id"]), int(c["model_id"])),
            dst.cache,
            src,
            dstb,
            timeout=c.get("timeout"),
        )
        bad = pattern_mismatches(dst.tensors, src, dstb, int(c["seed"]))
        return {"ok": True, "mismatches": len(bad), "first": str(bad[0]) if bad else ""}

    async def _pull_loop(self, c: dict[str, Any]) -> None:
        dst = self.caches[c["dst"]]
        blocks = [int(b) for b in c["blocks"]]
        key = BlocksCacheKey(int(c["cluster_id"]), int(c["model_id"]))
        seed = c.get("seed")
        while True:
            try:
                await self.dd.cache_manager.pull_blocks(
                    key, dst.cache, blocks, blocks, timeout=c.get("timeout")
                )
                self.loop_done += 1
                if seed is not None and self.loop_done % 8 == 1:
                    # Checked now and then only: the point is to keep the peer busy.
                    bad = pattern_mismatches(dst.tensors, blocks, blocks, int(seed))
                    self.loop_mismatches += sum(m.count for m in bad)
                    for t in dst.tensors:
                        t.view("uint8").fill(0)  # the next pull must bring every byte again
            except LLMException as e:
                self.loop_errors.append(str(e)[:200])
                await asyncio.sleep(0.01)

    async def cmd_pull_loop(self, c: dict[str, Any]) -> dict[str, Any]:
        self.loop_task = asyncio.get_running_loop().create_task(self._pull_loop(c))
        return {"ok": True}

    async def cmd_loop_stats(self, c: dict[str, Any]) -> dict[str, Any]:
        return {
            "ok": True,
            "done": self.loop_done,
            "mismatches": self.loop_mismatches,
            "errors": self.loop_errors[-5:],
        }
