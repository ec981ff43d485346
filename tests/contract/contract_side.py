"""The one decoder/prompt pair of the contract suite, whatever the data path.

:class:`Side` is what the ``side`` fixture (``conftest.py``) yields: a decoder
``LLMDataDist`` in the test process, linked to a prompt that serves the caches of
:mod:`tests.xproc.xproc_common` (filled from a seed of the test's own), with the data
path forced on both ends:

* ``inproc``: the prompt is a second instance in this process, driven by the same
  commands as the peer process (``peer_main.Commands`` called directly,
  :class:`InprocPrompt`);
* ``shm``, ``cma``, ``tcp``, ``nixl``, ``mooncake``: the prompt is ``peer_main.py`` in
  another process (:class:`~tests.xproc.xproc_harness.PeerProc`).

Every transfer a test makes through :meth:`Side.pull` (and the pushes of the tests) is
checked byte for byte: the destination is first filled with a byte unique to that
transfer, the source holds seeded random bytes (different in every block of every
tensor), so blocks left alone, blocks misrouted and bytes of an earlier transfer all
show. :meth:`Side.check_path` proves the bytes moved on the forced path (the link's
``path.used`` and the paths of its metrics' counts).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    DataPath,
    LLMDataDist,
    LLMException,
    LLMRole,
)
from aiodatadist.links import Link
from aiodatadist.testing import cluster_info
from tests._engines import REQUIRE_ENGINES_ENV, engines_required, require_engine
from tests.xproc import xproc_common as xc
from tests.xproc.peer_main import Commands
from tests.xproc.xproc_harness import Harness, PeerProc, assert_same, decoder_options

PATHS = ("inproc", "shm", "cma", "tcp", "nixl", "mooncake")
ENGINES = ("nixl", "mooncake")
PROMPT, DECODER = 81, 82
BIG_MIB = 256  # 2 x 128 MiB: a whole pull is still under way when a deadline, cancel or kill lands
BOUND_S = 3.0  # generous: a deadline or cancel was honoured (a loaded 2-core machine), not speed


def engine_gate(name: str) -> None:
    """Skips (or fails, under ``AIODATADIST_REQUIRE_ENGINES=1``) when engine ``name`` cannot
    run here: ``DataPath`` lacks it, or the suite's one gate (``tests._engines``) says why."""
    if name not in {p.value for p in DataPath}:
        why = f"aiodatadist.DataPath has no {name!r} member"
        if engines_required():
            pytest.fail(f"{REQUIRE_ENGINES_ENV}=1 but {why}")
        pytest.skip(why)
    require_engine(name)


class InprocPrompt:
    """A prompt instance in this process answering ``peer_main``'s commands, as
    :class:`~tests.xproc.xproc_harness.PeerProc` does for a peer process."""

    pid: int | None = None

    def __init__(self, commands: Commands) -> None:
        self.commands = commands
        self.name = f"prompt:{commands.cluster_id} (in process)"

    async def call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        handler = getattr(self.commands, f"cmd_{cmd}")
        try:
            reply: dict[str, Any] = await handler({"cmd": cmd, **kw})
        except LLMException as e:  # answered as the peer process answers it
            return {"ok": False, "status": int(e.status_code), "error": str(e)}
        return reply

    async def ok(self, cmd: str, **kw: Any) -> dict[str, Any]:
        r = await self.call(cmd, **kw)
        assert r.get("ok"), f"{self.name} {cmd}: {r}"
        return r

    def cache_id(self, name: str) -> int:
        return int(self.commands.caches[name].cache.cache_id)


Prompt = PeerProc | InprocPrompt


class Side:
    """A decoder here linked to a prompt on one forced data path (see the module doc).

    Attributes:
        path: the data path, forced on both ends.
        dd: the decoder instance (this process).
        local: the decoder's caches (``xproc_common.make_caches``, zeroed).
        prompt: the prompt (a peer process, or :class:`InprocPrompt`).
        seed: the seed base of the prompt's caches (the test's own).
        harness: ends every process and instance of the test.
    """

    def __init__(self, harness: Harness, path: str, seed: int) -> None:
        self.harness = harness
        self.path = path
        self.seed = seed
        self.prompt_seed = seed
        self.dd: LLMDataDist
        self.local: dict[str, xc.Local] = {}
        self.prompt: Prompt
        self._fills = itertools.count(1)
        self._rngs = itertools.count(1)

    # ---------------------------------------------------------------- set up

    @classmethod
    async def start(cls, harness: Harness, path: str, seed: int) -> Side:
        side = cls(harness, path, seed)
        opts = decoder_options(path, **{"aiodatadist.MoverThreads": "1"})
        side.dd, side.local = await harness.local(DECODER, opts)
        side.prompt = await side.start_prompt(seed)
        await side.link_prompt()
        return side

    async def start_prompt(self, seed: int) -> Prompt:
        """A prompt (cluster ``PROMPT``) whose caches are filled from ``seed``."""
        self.prompt_seed = seed
        if self.path != "inproc":
            return await self.harness.peer(cluster_id=PROMPT, data_path=self.path, seed=seed)
        dd = LLMDataDist(LLMRole.PROMPT, PROMPT)
        await dd.init({"llm.SyncKvCacheWaitTime": "5000"})
        self.harness.dds.append(dd)
        commands = Commands(dd, {"seed": seed, "big_mib": 0})
        await commands.start()
        return InprocPrompt(commands)

    async def link_prompt(self) -> None:
        """Links the decoder to the current prompt and checks the link is on the path."""
        if isinstance(self.prompt, PeerProc):
            info = cluster_info(PROMPT, self.prompt.host, self.prompt.port)
        else:
            info = cluster_info(PROMPT)
        status, statuses = await self.dd.link_clusters([info], 10_000)
        where = self.prompt.stderr_tail() if isinstance(self.prompt, PeerProc) else ""
        assert status == 0 and list(statuses) == [0], (status, statuses, where)
        lk = self.link()
        if self.path == "cma" and getattr(lk.path, "cma", None) is None:
            pytest.skip(
                "the kernel refuses process_vm_readv here (errno "
                f"{getattr(lk.path, 'cma_refused_errno', '?')}): cma cannot be forced"
            )
        assert str(lk.data_path) == self.path, lk.data_paths
        assert [str(p) for p in lk.data_paths] == [self.path], lk.data_paths

    def link(self) -> Link:
        lk = self.dd._rt.links.find(PROMPT)
        assert lk is not None, f"no link to {PROMPT}"
        return lk

    # ---------------------------------------------------------------- names

    def src(self, kind: str = "blocks") -> str:
        """The prompt cache a test pulls from: forced shm reaches only shared memory."""
        if kind == "blocks":
            return "alloc" if self.path == "shm" else "reg"
        return "rows_alloc" if self.path == "shm" else "rows_reg"

    def sources(self, kind: str = "blocks") -> list[str]:
        """Every prompt cache the path reaches (registered and allocated, or only shm's)."""
        names = ["alloc", "reg"] if kind == "blocks" else ["rows_alloc", "rows_reg"]
        return names[:1] if self.path == "shm" else names

    def ref(self, name: str) -> np.ndarray:
        """What the current prompt's cache ``name`` holds since it started."""
        return xc.reference(self.prompt_seed, name)

    # ---------------------------------------------------------------- bytes

    def prefill(self, local: xc.Local) -> np.ndarray:
        """Fills ``local`` with a byte unique to the coming transfer; returns its bytes."""
        fill = next(self._fills) % 251 + 1  # never 0 (zeroed memory) nor 0x5A (big caches)
        for v in local.views:
            v.fill(fill)
        return local.matrix()

    def randomize(self, local: xc.Local) -> np.ndarray:
        """Fills ``local`` with random bytes of its own (a push's source); returns them."""
        rng = np.random.default_rng([self.seed, 0xB0, next(self._rngs)])
        for v in local.views:
            v[...] = rng.integers(0, 256, v.size, dtype=np.uint8)
        return local.matrix()

    async def pull(
        self,
        dst: str,
        src: str,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        *,
        src_layers: tuple[int, int] | None = None,
        dst_layers: tuple[int, int] | None = None,
        tpl: int = 2,
        model_id: int | None = None,
        ref: np.ndarray | None = None,
        timeout: float = 10.0,
    ) -> None:
        """``pull_blocks`` of the prompt's ``src`` (or ``model_id``, holding ``ref``) into the
        decoder's ``dst``; every byte of ``dst`` checked, and the path."""
        local = self.local[dst]
        before = self.prefill(local)
        spec = xc.SPECS[src]
        await self.dd.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT, spec.model_id if model_id is None else model_id),
            local.cache,
            list(src_blocks),
            list(dst_blocks),
            src_layer_range=xc.layer_range(src_layers),
            dst_layer_range=xc.layer_range(dst_layers),
            tensor_num_per_layer=tpl,
            timeout=timeout,
        )
        span = xc.tensor_span(spec.num_tensors, src_layers, dst_layers, tpl)
        source = self.ref(src) if ref is None else ref
        assert_same(
            local.matrix(),
            xc.expect_blocks(before, source, spec.unit, src_blocks, dst_blocks, span),
        )
        self.check_path()

    def check_path(self) -> None:
        """The link's last transfer, and every transfer its metrics counted, used the path."""
        lk = self.link()
        used = lk.path.used or lk.data_path
        assert str(used) == self.path, (used, self.path)
        counted = {str(p) for _, p in lk.metrics.counts}
        assert counted <= {self.path}, counted

    async def check_prompt_path(self) -> None:
        """The prompt's side of the link moved its bytes on the path too (its pushes)."""
        r = await self.prompt.ok("used", cluster_id=DECODER)
        assert r["used"] == self.path and set(r["paths"]) <= {self.path}, r

    async def big(self) -> tuple[xc.Local, int]:
        """A ``BIG_MIB`` cache on both ends (the prompt's filled with 0x5A, in shared memory
        for shm); returns the decoder's and the prompt's model id."""
        model = xc.MODEL_BIG
        await self.prompt.ok("big", model_id=model, mib=BIG_MIB, allocate=self.path == "shm")
        local = xc.make_cache(self.dd, xc.big_spec(BIG_MIB), None, DECODER)
        self.local["big"] = local
        return local, model

    async def wait_idle(self, timeout: float = BOUND_S) -> None:
        """Until no job of the decoder runs, the link's slot is free and no local cache is
        fenced (an aborted NIXL request still on the wire: its destination refuses
        transfers until the request ended) (bounded)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        executor = self.dd._rt.executor
        assert executor is not None
        entries = self.dd.cache_manager._caches.entries
        while (
            executor.in_flight
            or self.link().slot.busy
            or any(e.late_writes for e in list(entries.values()))
        ):
            assert loop.time() < end, "a job, the link's slot or a fence is still busy"
            await asyncio.sleep(0.002)
