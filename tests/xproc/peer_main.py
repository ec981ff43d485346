"""The cross-process tests' commands in the peer process: a plugin of the one harness.

:class:`xproc_harness.PeerProc` starts ``aiodatadist.testing``'s peer process
(:class:`aiodatadist.testing.PeerProcess`) with ``plugin=<this file>``. Once the
instance is initialized, :meth:`Commands.start` registers the caches of
:mod:`xproc_common` (a prompt fills them from ``seed``, a decoder leaves them zeroed)
and adds them to the ``ready`` line (``{"event": "ready", "port": ..., "caches":
{...}, ...}``); the peer process then answers one JSON command per stdin line with
one JSON line, until ``{"cmd": "quit"}``, the end of stdin, or a signal.

Plugin configuration: ``seed`` (None: a decoder's zeroed caches), ``big_mib``.

Commands (``cmd``; every reply has ``ok`` and, on failure, ``status``/``error``):

* ``register`` ``{name, model_id, seed, allocate, num_blocks}``: a new blocks cache (after
  the link); ``num_blocks`` (default 8) of 4 KiB per tensor.
* ``free`` ``{name, fill}``: deallocates (or unregisters) one of them; with ``fill``, then
  overwrites its (freed) memory with that byte, as a reuse of it would; replies
  ``seconds`` (how long the free took).
* ``cycle`` ``{name, model_id, allocate, seeds, fill, pause_ms}``: for each seed, frees
  ``name``, overwrites the freed memory with ``fill``, and registers a new cache under
  the same ``model_id`` filled from the seed (registered caches reuse the same memory);
  pauses ``pause_ms`` between rounds.
* ``truncate`` ``{name, size}``: tries to ``ftruncate`` the cache's segment (a hostile
  owner); replies ``errno`` (0 when it worked).
* ``link`` / ``unlink`` ``{cluster_id, host, port, timeout}``: ``link_clusters`` /
  ``unlink_clusters``; replies ``status`` and ``statuses``.
* ``links``: ``[{cluster_id, data_path}]``.
* ``pull_blocks`` ``{cluster_id, model_id, dst, src_blocks, dst_blocks, src_layers,
  dst_layers, tpl, timeout}``: replies ``path`` (the data path used).
* ``pull_cache`` ``{cluster_id, req_id, dst, batch_index, src_layers, dst_layers, tpl}``.
* ``push`` ``{dst_cluster, src, model_id | dst_addrs, src_blocks, dst_blocks,
  src_layers, dst_layers}``: ``transfer_cache_async`` to a linked peer; replies
  ``status`` and ``results``.
* ``digest`` ``{name}``: sha256 per tensor of one local cache.
* ``serve_stats`` ``{cluster_id?}``: the serving side's counters (served, failed,
  stale, cancelled_queued, cancelled_running), summed over links.
* ``comm_link`` ``{comm_name, members: [[cluster_id, rank], ...], rank_table}``: the
  two-sided ``link``; replies ``comm_id``. ``comm_status`` ``{comm_id}``: replies
  ``status`` (the ``RegisterMemStatus`` name). ``comm_unlink`` ``{comm_id}``.
* ``switch_role`` ``{role, listen}``: ``switch_role(LLMRole[role], {"llm.listenIpInfo":
  listen} if listen else None)``; replies ``address`` (``listen_address``).
* ``big`` ``{model_id, mib, allocate}``: a new blocks cache ``big`` (2 tensors of ``mib / 2``
  blocks of 1 MiB, filled with 0x5A), allocated in shared memory with ``allocate``.
* ``used`` ``{cluster_id}``: the data path that moved the last transfer of the link to
  ``cluster_id`` and the paths of its metrics' counts.
* ``quit``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from aiodatadist import (
    BlocksCacheKey,
    CacheKey,
    LayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMRole,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import PeerCommands, cluster_info
from tests.xproc import xproc_common as xc


class Always(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


class Commands(PeerCommands):
    def __init__(self, dd: LLMDataDist, config: dict[str, Any]) -> None:
        super().__init__(dd, config)
        self.cluster_id = dd.cluster_id
        self.caches: dict[str, xc.Local] = {}

    def describe(self, local: xc.Local) -> dict[str, Any]:
        return {"cache_id": local.cache.cache_id, "addrs": list(local.cache.tensor_addrs)}

    async def start(self) -> dict[str, Any]:
        seed = self.config.get("seed")
        big_mib = int(self.config.get("big_mib", 0))
        self.caches = xc.make_caches(self.dd, seed, self.cluster_id, big_mib)
        from aiodatadist._control import host_identity

        return {
            "host_id": host_identity(),
            "caches": {n: self.describe(c) for n, c in self.caches.items()},
        }

    # ---------------------------------------------------------------- commands

    async def cmd_register(self, c: dict[str, Any]) -> dict[str, Any]:
        spec = xc.Spec(
            c["name"],
            True,
            bool(c.get("allocate", False)),
            (int(c.get("num_blocks", xc.NUM_BLOCKS)), *xc.BLOCK_SHAPE),
            model_id=int(c["model_id"]),
        )
        local = xc.make_cache(self.dd, spec, c.get("seed"), self.cluster_id)
        self.caches[spec.name] = local
        return {"ok": True, **self.describe(local)}

    def _free(self, name: str, fill: int | None) -> xc.Local:
        local = self.caches[name]
        cm = self.dd.cache_manager
        if not local.spec.allocate:
            cm.unregister_cache(local.cache.cache_id)
        elif local.spec.blocks:
            cm.deallocate_blocks_cache(local.cache)
        else:
            cm.deallocate_cache(local.cache)
        del self.caches[name]
        if fill is not None:
            # The views keep the memory mapped: this is what reusing freed memory does.
            for v in local.views:
                v.fill(fill)
        return local

    async def cmd_free(self, c: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        self._free(c["name"], c.get("fill"))
        return {"ok": True, "seconds": time.monotonic() - t0}

    async def cmd_cycle(self, c: dict[str, Any]) -> dict[str, Any]:
        name, model_id = c["name"], int(c["model_id"])
        allocate = bool(c.get("allocate", False))
        busy = 0
        for seed in c["seeds"]:
            old = self.caches.get(name)
            if old is not None:
                try:
                    self._free(name, int(c["fill"]))
                except LLMException as e:
                    busy += 1  # LLM_LINK_BUSY: a peer still copies; stays registered
                    if "LINK_BUSY" not in str(e):
                        raise
                    await asyncio.sleep(int(c.get("pause_ms", 0)) / 1000)
                    continue
            shape = (xc.NUM_BLOCKS, *xc.BLOCK_SHAPE)
            spec = xc.Spec(name, True, allocate, shape, model_id=model_id)
            if old is not None and not allocate:
                # Reuses the freed memory for the new registration, as an engine would.
                cache = self.dd.cache_manager.register_blocks_cache(
                    spec.desc(), old.keep, BlocksCacheKey(self.cluster_id, model_id)
                )
                local = xc.Local(spec, cache, old.views, old.keep)
                ref = xc.pattern(int(seed), spec)
                for t, v in enumerate(local.views):
                    v[...] = ref[t]  # before the loop runs: before any peer hears of it
            else:
                local = xc.make_cache(self.dd, spec, int(seed), self.cluster_id)
            self.caches[name] = local
            await asyncio.sleep(int(c.get("pause_ms", 0)) / 1000)
        return {"ok": True, "busy": busy}

    async def cmd_truncate(self, c: dict[str, Any]) -> dict[str, Any]:
        entry = self.dd._rt.caches.entries[self.caches[c["name"]].cache.cache_id]
        assert entry.segment is not None
        try:
            os.ftruncate(entry.segment.fd, int(c.get("size", 0)))
        except OSError as e:
            return {"ok": True, "errno": e.errno}
        return {"ok": True, "errno": 0}

    async def cmd_link(self, c: dict[str, Any]) -> dict[str, Any]:
        info = cluster_info(int(c["cluster_id"]), c["host"], int(c["port"]))
        status, statuses = await self.dd.link_clusters([info], int(c.get("timeout", 3000)))
        return {"ok": True, "status": int(status), "statuses": [int(s) for s in statuses]}

    async def cmd_unlink(self, c: dict[str, Any]) -> dict[str, Any]:
        info = cluster_info(int(c["cluster_id"]))
        status, statuses = await self.dd.unlink_clusters([info], int(c.get("timeout", 3000)))
        return {"ok": True, "status": int(status), "statuses": [int(s) for s in statuses]}

    async def cmd_links(self, c: dict[str, Any]) -> dict[str, Any]:
        return {
            "ok": True,
            "links": [
                {"cluster_id": lk.remote_cluster_id, "data_path": lk.data_path}
                for lk in self.dd.links
            ],
        }

    def _path(self, cluster_id: int, remote: Any) -> str:
        link = self.dd._rt.links.find(cluster_id)
        if link is None or remote is None:
            return "?"
        return str(link.path.path_for(remote).kinds[0])

    async def cmd_pull_blocks(self, c: dict[str, Any]) -> dict[str, Any]:
        cid = int(c["cluster_id"])
        key = BlocksCacheKey(cid, int(c["model_id"]))
        await self.dd.cache_manager.pull_blocks(
            key,
            self.caches[c["dst"]].cache,
            c["src_blocks"],
            c["dst_blocks"],
            src_layer_range=xc.layer_range(c.get("src_layers")),
            dst_layer_range=xc.layer_range(c.get("dst_layers")),
            tensor_num_per_layer=int(c.get("tpl", 2)),
            timeout=c.get("timeout"),
        )
        link = self.dd._rt.links.find(cid)
        remote = None if link is None else link.path.remote_table.blocks(key.model_id)
        return {"ok": True, "path": self._path(cid, remote)}

    async def cmd_pull_cache(self, c: dict[str, Any]) -> dict[str, Any]:
        cid = int(c["cluster_id"])
        key = CacheKey(cid, req_id=int(c["req_id"]))
        await self.dd.cache_manager.pull_cache(
            key,
            self.caches[c["dst"]].cache,
            int(c.get("batch_index", 0)),
            src_layer_range=xc.layer_range(c.get("src_layers")),
            dst_layer_range=xc.layer_range(c.get("dst_layers")),
            tensor_num_per_layer=int(c.get("tpl", 2)),
            timeout=c.get("timeout"),
        )
        link = self.dd._rt.links.find(cid)
        hit = None if link is None else link.path.remote_table.row((key.req_id, 0))
        return {"ok": True, "path": self._path(cid, None if hit is None else hit[0])}

    async def cmd_push(self, c: dict[str, Any]) -> dict[str, Any]:
        dst_cluster = int(c["dst_cluster"])
        src_layers = xc.layer_range(c.get("src_layers")) or range(xc.NUM_TENSORS // 2)
        dst_layers = xc.layer_range(c.get("dst_layers")) or src_layers
        cfg: TransferConfig | TransferWithCacheKeyConfig
        if c.get("dst_addrs") is not None:
            cfg = TransferConfig(dst_cluster, c["dst_addrs"], src_layers)
        else:
            cfg = TransferWithCacheKeyConfig(
                BlocksCacheKey(dst_cluster, int(c["model_id"])), src_layers, dst_layers
            )
        task = await self.dd.cache_manager.transfer_cache_async(
            self.caches[c["src"]].cache, Always(), [cfg], c["src_blocks"], c["dst_blocks"]
        )
        status = await task.synchronize(int(c.get("timeout_ms", 10000)))
        results = await task.get_results(1000)
        return {
            "ok": True,
            "status": int(status),
            "results": [None if r is None else int(r) for r in results],
        }

    async def cmd_serve_stats(self, c: dict[str, Any]) -> dict[str, Any]:
        """The serving side's counters (``transports.tcp_serve.ServeStats``), summed over this
        instance's links, or for the link to ``cluster_id``."""
        total: dict[str, int] = {}
        for lk in self.dd.links:
            peer = getattr(lk.path, "peer", None)
            if peer is None or c.get("cluster_id") not in (None, lk.remote_cluster_id):
                continue
            for k, v in vars(peer.serving.stats).items():
                total[k] = total.get(k, 0) + int(v)
        return {"ok": True, "stats": total}

    async def cmd_digest(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "sha": xc.digests(self.caches[c["name"]].matrix())}

    async def cmd_comm_link(self, c: dict[str, Any]) -> dict[str, Any]:
        members = {int(cid): int(rank) for cid, rank in c["members"]}
        comm_id = await self.dd.link(c["comm_name"], members, c["rank_table"])
        return {"ok": True, "comm_id": comm_id}

    async def cmd_comm_status(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "status": self.dd.query_register_mem_status(int(c["comm_id"])).name}

    async def cmd_comm_unlink(self, c: dict[str, Any]) -> dict[str, Any]:
        await self.dd.unlink(int(c["comm_id"]))
        return {"ok": True}

    async def cmd_big(self, c: dict[str, Any]) -> dict[str, Any]:
        big = xc.big_spec(int(c["mib"]))
        spec = xc.Spec(
            "big",
            True,
            bool(c.get("allocate", False)),
            big.shape,
            num_tensors=big.num_tensors,
            model_id=int(c["model_id"]),
        )
        self.caches["big"] = xc.make_cache(self.dd, spec, 0, self.cluster_id)
        return {"ok": True, **self.describe(self.caches["big"])}

    async def cmd_used(self, c: dict[str, Any]) -> dict[str, Any]:
        link = self.dd._rt.links.find(int(c["cluster_id"]))
        if link is None:
            return {"ok": False, "error": f"no link to {c['cluster_id']}"}
        used = link.path.used or link.data_path
        paths = sorted({str(path) for _, path in link.metrics.counts})
        return {"ok": True, "used": str(used), "paths": paths}

    async def cmd_switch_role(self, c: dict[str, Any]) -> dict[str, Any]:
        listen = c.get("listen")
        opts = {"llm.listenIpInfo": listen} if listen else None
        await self.dd.switch_role(LLMRole[c["role"]], opts)
        return {"ok": True, "address": self.dd.listen_address}
