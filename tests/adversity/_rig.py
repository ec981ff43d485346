"""A decoder linked to a prompt's cache over one forced data path, with a source that the
test can re-fill (one pattern per transfer) and re-register, wherever the prompt lives.

* ``inproc``: prompt and decoder in this process, linked in-process.
* ``shm`` / ``cma`` / ``tcp``: the prompt is an actor process (``actor.py``); the decoder
  here is forced to the path (``aiodatadist.DataPath``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiodatadist import BlocksCacheKey, LLMDataDist, LLMException, LLMRole
from aiodatadist.testing import FilledCache, cluster_info, inproc_pair, make_blocks_cache
from tests.adversity._common import (
    BLOCK_SHAPE,
    CACHE_FOR_MODEL,
    MODEL_FOR_PATH,
    NUM_BLOCKS,
    NUM_TENSORS,
    ActorProc,
    Session,
    fill_blocks,
    new_cluster_id,
)


def decoder_options(path: str, **extra: str) -> dict[str, str]:
    return {"aiodatadist.DataPath": path, "llm.SyncKvCacheWaitTime": "10000", **extra}


def path_in_use(dd: LLMDataDist, cluster_id: int, model_id: int) -> str:
    """The path a pull of ``model_id`` from ``cluster_id`` takes (internals: best effort)."""
    with contextlib.suppress(Exception):
        path: Any = dd._rt.links.find(cluster_id).path  # type: ignore[union-attr]
        remote = path.remote_table.blocks(model_id)
        return str(path.path_for(remote).kinds[0])
    return "?"


@dataclass
class Rig:
    path: str
    decoder: LLMDataDist
    prompt_id: int
    model_id: int
    dst: FilledCache
    session: Session | None = None  # remote source
    local: LLMDataDist | None = None  # inproc source
    src: FilledCache | None = None
    old: list[FilledCache] = field(default_factory=list)
    reregistrations: int = 0

    @property
    def key(self) -> BlocksCacheKey:
        return BlocksCacheKey(self.prompt_id, self.model_id)

    @property
    def block_bytes(self) -> int:
        return int(self.dst.tensors[0][0].nbytes)

    async def fill(self, seed: int, blocks: Sequence[int]) -> None:
        """Writes the pattern of ``seed`` into the source's ``blocks`` (every tensor)."""
        if self.session is not None:
            await self.session.ok(
                "fill", name=CACHE_FOR_MODEL[self.model_id], seed=seed, blocks=list(blocks)
            )
        else:
            assert self.src is not None
            fill_blocks(self.src.tensors, seed, blocks)

    async def reregister(self, seed: int, poison: int) -> dict[str, Any]:
        """The prompt frees its cache and registers new memory, filled with ``seed``, under
        the same key; the old memory is reused (``poison``). Returns the actor's reply."""
        self.reregistrations += 1
        if self.session is not None:
            r = await self.session.call(
                "reregister", name=CACHE_FOR_MODEL[self.model_id], seed=seed, poison=poison
            )
            return r
        assert self.local is not None and self.src is not None
        cm = self.local.cache_manager
        allocate = self.model_id == 0
        old = self.src
        try:
            r2 = (
                cm.deallocate_blocks_cache(old.cache)
                if allocate
                else cm.unregister_cache(old.cache.cache_id)
            )
            if r2 is not None and hasattr(r2, "__await__"):
                await r2
        except LLMException as e:  # LLM_LINK_BUSY: the registration is unchanged
            return {"ok": False, "status": int(e.status_code), "error": str(e)}
        self.src = make_blocks_cache(
            self.local,
            num_tensors=NUM_TENSORS,
            num_blocks=NUM_BLOCKS,
            block_shape=BLOCK_SHAPE,
            model_id=self.model_id,
            allocate=allocate,
        )
        fill_blocks(self.src.tensors, seed, range(NUM_BLOCKS))
        if not allocate:
            fill_blocks(old.tensors, poison, range(NUM_BLOCKS))
            self.old.append(old)
            del self.old[:-4]
        return {"ok": True}


@contextlib.asynccontextmanager
async def rig(
    path: str,
    prompt: ActorProc | None,
    *,
    model_id: int | None = None,
    dst_blocks: int = NUM_BLOCKS,
    secret: str | None = None,
) -> AsyncIterator[Rig]:
    """A linked decoder (and, for ``inproc``, its prompt) over ``path``; torn down on exit."""
    model = MODEL_FOR_PATH[path] if model_id is None else model_id
    if path == "inproc":
        async with inproc_pair(prompt_id=new_cluster_id(), decoder_id=new_cluster_id()) as pair:
            src = make_blocks_cache(
                pair.prompt,
                num_tensors=NUM_TENSORS,
                num_blocks=NUM_BLOCKS,
                block_shape=BLOCK_SHAPE,
                model_id=model,
                allocate=model == 0,
            )
            dst = make_blocks_cache(
                pair.decoder,
                num_tensors=NUM_TENSORS,
                num_blocks=dst_blocks,
                block_shape=BLOCK_SHAPE,
            )
            yield Rig(
                path, pair.decoder, pair.prompt.cluster_id, model, dst, local=pair.prompt, src=src
            )
        return
    assert prompt is not None
    dd = LLMDataDist(LLMRole.DECODER, new_cluster_id())
    extra = {} if secret is None else {"aiodatadist.SharedSecret": secret}
    await dd.init(decoder_options(path, **extra))
    try:
        host, port = prompt.address
        prompt_id = prompt.cluster_id
        status, _ = await dd.link_clusters([cluster_info(prompt_id, host, port)], 10_000)
        assert status == 0, f"link over {path} failed: {status!r}"
        dst = make_blocks_cache(
            dd, num_tensors=NUM_TENSORS, num_blocks=dst_blocks, block_shape=BLOCK_SHAPE
        )
        async with prompt.session() as s:
            yield Rig(path, dd, prompt_id, model, dst, session=s)
    finally:
        await dd.finalize()
