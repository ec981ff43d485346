"""Linked prompt/decoder pairs with real caches and real bytes.

* :func:`inproc_pair`: a prompt and a decoder in this process, linked in-process (or,
  with ``data_path``, over loopback with both ends here)::

      async with inproc_pair() as pair:
          src = pair.prompt_cache(num_tensors=4, num_blocks=8, block_shape=(16, 2, 64))
          dst = pair.decoder_cache(num_tensors=4, num_blocks=8, block_shape=(16, 2, 64))
          await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0], [1])

* :func:`remote_pair`: the prompt in a :class:`~aiodatadist.testing.peer.PeerProcess`
  serving a pattern-filled cache, the decoder here, linked over loopback with a chosen
  data path, optionally through a :class:`~aiodatadist.testing.faults.FaultInjector`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..config import OPT_DATA_PATH, DataPath
from ..datadist import LLMDataDist
from ..errors import LLMException, LLMStatusCode
from ..types import BlocksCacheKey, LLMRole
from .caches import FilledCache, PromptSpec, cluster_info, make_blocks_cache
from .faults import FaultInjector
from .patterns import Mismatch, pattern_blocks, pattern_mismatches
from .peer import PeerProcess

__all__ = ["Pair", "RemotePair", "inproc_pair", "remote_pair"]

_CROSS_PROCESS = (DataPath.SHM, DataPath.CMA, DataPath.TCP)
_ANY_PATH = (DataPath.AUTO, DataPath.INPROC, *_CROSS_PROCESS)


def _data_path(value: DataPath | str, allowed: Sequence[DataPath]) -> DataPath:
    """``value`` as a :class:`DataPath` among ``allowed``; ValueError otherwise."""
    if value not in allowed:
        names = ", ".join(str(p) for p in allowed[:-1]) + f" or {allowed[-1]}"
        raise ValueError(f"data_path must be one of {names}, got {value!r}")
    return DataPath(value)


@dataclass
class Pair:
    """A prompt and a decoder in this process, linked (decoder -> prompt)."""

    prompt: LLMDataDist
    decoder: LLMDataDist
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self, model_id: int = 0) -> BlocksCacheKey:
        """The key a decoder uses to pull the prompt's blocks cache ``model_id``."""
        return BlocksCacheKey(self.prompt.cluster_id, model_id)

    def prompt_cache(self, *, model_id: int = 0, seed: int = 1, **kw: Any) -> FilledCache:
        """A blocks cache of the prompt under ``model_id``, filled from ``seed``."""
        return make_blocks_cache(self.prompt, model_id=model_id, seed=seed, **kw)

    def decoder_cache(self, **kw: Any) -> FilledCache:
        """A zeroed blocks cache of the decoder (``make_blocks_cache`` keywords)."""
        return make_blocks_cache(self.decoder, **kw)


@asynccontextmanager
async def inproc_pair(
    *,
    prompt_id: int = 1,
    decoder_id: int = 2,
    options: dict[str, str] | None = None,
    prompt_role: LLMRole = LLMRole.PROMPT,
    decoder_role: LLMRole = LLMRole.DECODER,
    link: bool = True,
    data_path: DataPath | str = DataPath.INPROC,
) -> AsyncIterator[Pair]:
    """A linked prompt/decoder pair in this process; finalized on exit.

    Args:
        prompt_id, decoder_id: cluster ids.
        options: ``init`` options of both instances.
        prompt_role, decoder_role: their roles.
        link: link the decoder to the prompt.
        data_path: ``inproc`` (or ``auto``): an in-process link. ``shm``, ``cma`` or ``tcp``:
            the prompt listens on loopback and the decoder, forced to that path, links to
            its address: a real cross-process link, both ends in this process
            (``pair.extra["address"]`` holds the prompt's address).

    Raises:
        ValueError: unknown ``data_path``.
        RuntimeError: the link failed.
        LLMException: ``init`` refused the options or a cluster id is in use.

    Cancel: a cancel while setting up (or in the body) finalizes what was set up and
    propagates. Timeout: linking is bounded by ``link_clusters``' default 3 s.
    """
    path = _data_path(data_path, _ANY_PATH)
    remote = path in _CROSS_PROCESS
    prompt_opts = dict(options or {})
    decoder_opts = dict(options or {})
    if remote:
        prompt_opts.setdefault("llm.listenIpInfo", "127.0.0.1:0")
        decoder_opts[OPT_DATA_PATH] = path
    prompt = LLMDataDist(prompt_role, prompt_id)
    decoder = LLMDataDist(decoder_role, decoder_id)
    await prompt.init(prompt_opts)
    try:
        await decoder.init(decoder_opts)
        try:
            extra: dict[str, Any] = {}
            if link:
                if remote:
                    address = prompt.listen_address
                    assert address is not None
                    extra["address"] = address
                    info = cluster_info(prompt_id, *address)
                else:
                    info = cluster_info(prompt_id)
                status, _ = await decoder.link_clusters([info])
                if status != 0:
                    raise RuntimeError(f"{path} link failed: {status!r}")
            yield Pair(prompt, decoder, extra)
        finally:
            await decoder.finalize()
    finally:
        await prompt.finalize()


@dataclass
class RemotePair:
    """A decoder in this process linked to a prompt in a subprocess (see :func:`remote_pair`).

    Attributes:
        decoder: the decoder instance (in this process).
        prompt: the prompt's :class:`PeerProcess`.
        spec: the cache the prompt serves (its bytes are ``pattern_blocks(spec.seed, ...)``).
        faults: the :class:`FaultInjector` the link goes through, or None.
        data_path: the decoder's ``aiodatadist.DataPath``.
    """

    decoder: LLMDataDist
    prompt: PeerProcess
    spec: PromptSpec
    faults: FaultInjector | None = None
    data_path: DataPath | str = DataPath.AUTO
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_id(self) -> int:
        return self.prompt.cluster_id

    def key(self) -> BlocksCacheKey:
        """The key naming the prompt's cache."""
        return BlocksCacheKey(self.prompt.cluster_id, self.spec.model_id)

    def decoder_cache(self, num_blocks: int | None = None) -> FilledCache:
        """A zeroed blocks cache of the decoder shaped like the prompt's (``num_blocks`` each)."""
        s = self.spec
        return make_blocks_cache(
            self.decoder,
            num_tensors=s.num_tensors,
            num_blocks=s.num_blocks if num_blocks is None else num_blocks,
            block_shape=s.block_shape,
            data_type=s.data_type,
        )

    def expected(self, tensor: int, block: int) -> npt.NDArray[np.uint8]:
        """The bytes of the prompt's ``block`` of ``tensor`` (as filled, before any corruption)."""
        out: npt.NDArray[np.uint8] = pattern_blocks(
            self.spec.seed, tensor, [block], self.spec.block_bytes
        )[0]
        return out

    def mismatches(
        self,
        dst: FilledCache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        tensors: Sequence[tuple[int, int]] | None = None,
    ) -> list[Mismatch]:
        """Checks blocks pulled into ``dst`` (see :func:`pattern_mismatches`)."""
        return pattern_mismatches(dst.tensors, src_blocks, dst_blocks, self.spec.seed, tensors)

    async def relink(self, timeout_ms: int = 5000) -> LLMStatusCode:
        """Links the decoder to the prompt again (after a fault broke the link).

        Drops what is left of the old link first (``force=True``), then links through the
        fault injector when there is one.

        Returns:
            ``link_clusters``' status: ``LLM_SUCCESS`` or why the link failed (it never
            raises for a failed link).

        Timeout: ``timeout_ms`` bounds each of the unlink and the link (a paused injector
        makes the link fail with ``LLM_LINK_FAILED`` after it). Cancel: propagates; the
        decoder may be left unlinked.
        """
        host, port = self.faults.address if self.faults is not None else self.prompt.address
        info = cluster_info(self.prompt.cluster_id, host, port)
        await self.decoder.unlink_clusters([info], timeout=timeout_ms, force=True)
        status, _ = await self.decoder.link_clusters([info], timeout=timeout_ms)
        return status


@asynccontextmanager
async def remote_pair(
    spec: PromptSpec | None = None,
    *,
    data_path: DataPath | str = DataPath.AUTO,
    faults: bool = False,
    prompt_id: int = 1,
    decoder_id: int = 2,
    options: dict[str, str] | None = None,
    prompt_options: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    link_timeout_ms: int = 10_000,
    start_timeout: float = 60.0,
) -> AsyncIterator[RemotePair]:
    """A prompt in a subprocess and a decoder here, linked over loopback; torn down on exit.

    The prompt serves one blocks cache described by ``spec`` (filled with
    :func:`pattern_blocks`, seed ``spec.seed``) under ``BlocksCacheKey(prompt_id,
    spec.model_id)``.

    Args:
        spec: the prompt's cache; default :class:`PromptSpec()`.
        data_path: the decoder's ``aiodatadist.DataPath``: ``auto``, ``shm``, ``cma`` or ``tcp``.
        faults: link through a :class:`FaultInjector` (``pair.faults``) that can stall,
            drop and kill.
        prompt_id, decoder_id: cluster ids.
        options: extra decoder ``init`` options.
        prompt_options: extra prompt ``init`` options.
        env: extra environment of the prompt process.
        link_timeout_ms: the ``link_clusters`` timeout.
        start_timeout: seconds for the prompt process to fill its cache and listen.

    Raises:
        ValueError: ``data_path`` is not a cross-process path.
        RuntimeError: the prompt process exited or failed before it listened.
        TimeoutError: the prompt process did not listen within ``start_timeout``.
        LLMException: the link failed (its status code says why).

    Timeout: ``start_timeout`` bounds the start, ``link_timeout_ms`` the link; on exit the
    process gets 10 s to stop before it is SIGKILLed. Cancel: at any point, the decoder is
    finalized, the injector closed and the process reaped before the cancel propagates.
    """
    path = _data_path(data_path, (DataPath.AUTO, *_CROSS_PROCESS))
    spec = spec or PromptSpec()
    async with PeerProcess(
        spec, cluster_id=prompt_id, options=prompt_options, env=env, start_timeout=start_timeout
    ) as peer:
        injector: FaultInjector | None = None
        if faults:
            injector = FaultInjector(peer.address, peer=peer)
        try:
            host, port = await injector.start() if injector is not None else peer.address
            decoder = LLMDataDist(LLMRole.DECODER, decoder_id)
            await decoder.init({OPT_DATA_PATH: path, **(options or {})})
            try:
                status, _ = await decoder.link_clusters(
                    [cluster_info(prompt_id, host, port)], timeout=link_timeout_ms
                )
                if status != LLMStatusCode.LLM_SUCCESS:
                    raise LLMException(
                        f"link to the prompt process at {host}:{port} failed: {status.name}",
                        status_code=status,
                    )
                yield RemotePair(decoder, peer, spec, injector, path)
            finally:
                await decoder.finalize()
        finally:
            if injector is not None:
                await injector.close()
