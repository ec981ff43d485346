"""``CacheManager.pull_blocks_layerwise``: a pull that hands over each layer as it lands.

A mixin of :class:`~aiodatadist.cache_manager.CacheManager`. The call is checked like
``pull_blocks`` (the same checks, at the call, synchronously) and returns a
:class:`LayerStream`: an async iterator, and an async context manager, whose every
step yields one :class:`LayerPulled` once that layer's bytes have all landed.

Each layer is its own transfer on the one path (:func:`aiodatadist._runner.run`, a
:class:`~aiodatadist._plan.PullRequest` restricted to that layer's tensors), started
as a task before the previous layer is handed to the caller, so up to ``depth`` layers
are queued on the link while the caller computes. Every layer takes the link's FIFO
slot on its own (other transfers on the link may run between two layers) and copies
under its own lease, exactly as a ``pull_blocks`` of that one layer would.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import _runner
from ._bridge import bridged, public
from ._checks import blocks_pull_request
from ._executor import quiesce
from ._plan import PullRequest, resolve, tensor_span
from ._validate import check_int, require
from .errors import LLMException, LLMStatusCode, api_scope
from .types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, KvCache

if TYPE_CHECKING:
    from types import TracebackType

    from ._registration import CacheRegistry
    from ._runtime import Runtime
    from .links import Link

__all__ = ["LayerPulled", "LayerStream", "LayerwiseMixin"]

_API = "pull_blocks_layerwise"


@dataclass(frozen=True, slots=True)
class LayerPulled:
    """One layer of a layer-by-layer pull whose bytes have all landed.

    Attributes:
        index: its position in the iteration (0, 1, ...).
        src_layer: the remote layer it came from.
        dst_layer: the local layer it landed in (its tensors ``dst_layer * T .. + T``).
        nbytes: the bytes that landed for it (every tensor of the layer).
    """

    index: int
    src_layer: int
    dst_layer: int
    nbytes: int


def _retrieve(task: asyncio.Task[None]) -> None:
    # A layer nobody will ask for (the stream was dropped): its error is not "never retrieved".
    if not task.cancelled():
        task.exception()


class LayerStream:
    """The layers of one ``pull_blocks_layerwise`` call, in order, as they land.

    ``async for layer in stream`` (or ``async with stream as layers: async for ...``).
    Nothing moves before the first ``__anext__``; from then on up to ``depth`` layers
    not yet handed over are in flight. Leaving early (``break``, an exception in the
    loop body, :meth:`aclose`, a cancel) aborts what is in flight, as a cancelled
    ``pull_blocks`` does: the native jobs are aborted and awaited, the link stays
    usable, and the destination blocks of the layers not yet handed over are undefined.
    ``async with`` (or :meth:`aclose`) does that before it returns; a plain ``async for``
    left by ``break`` aborts when the stream is collected (at once in CPython, unless
    something else still refers to it).
    """

    __slots__ = (
        "__weakref__",
        "_base",
        "_closed",
        "_depth",
        "_inflight",
        "_layers",
        "_link",
        "_loop",
        "_nbytes",
        "_next",
        "_rt",
        "_started",
        "_whole",
        "_yielded",
    )

    def __init__(
        self,
        rt: Runtime,
        link: Link,
        whole: PullRequest,
        layers: Sequence[tuple[int, int]],
        nbytes: int,
        depth: int,
    ) -> None:
        self._rt = rt
        self._loop = rt.loop
        self._link = link
        self._whole = whole
        self._layers = tuple(layers)
        self._nbytes = nbytes
        self._depth = depth
        self._inflight: deque[asyncio.Task[None]] = deque()
        self._next = 0  # the next layer to start
        self._yielded = 0
        self._started = False
        self._closed = False

    def _home_loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def __len__(self) -> int:
        """The number of layers the iteration yields."""
        return len(self._layers)

    def __aiter__(self) -> LayerStream:
        return self

    async def __aenter__(self) -> LayerStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @bridged
    async def aclose(self) -> None:
        """Aborts the layers in flight and waits until their native jobs have returned.

        Idempotent.

        Raises:
            asyncio.CancelledError: cancelled meanwhile; raised once they have returned.
        """
        self._closed = True
        await self._drain()

    @bridged
    async def __anext__(self) -> LayerPulled:
        """The next layer, once its bytes have all landed.

        Raises:
            StopAsyncIteration: every layer was handed over, or the stream was closed
                (or ended by an error raised earlier).
            LLMException: that layer's transfer failed (as ``pull_blocks``); the layers
                in flight after it were aborted, the stream is closed.
            asyncio.CancelledError: cancelled; raised once every native job of the
                stream has returned (the stream is closed).
        """
        if self._closed or self._yielded == len(self._layers):
            raise StopAsyncIteration
        if not self._started:
            self._started = True
            try:
                with api_scope(_API):
                    await self._check_remote()
            except BaseException:
                self._closed = True
                raise
        self._fill()
        task = self._inflight[0]
        if not task.done():
            try:
                await asyncio.wait((task,))  # never cancels what it waits for
            except asyncio.CancelledError as exc:
                self._closed = True
                await self._drain(exc)  # raises exc once every native job has returned
                raise
        self._inflight.popleft()
        if task.cancelled() or task.exception() is not None:
            self._closed = True
            await self._drain()
            task.result()  # raises the layer's error (or CancelledError: the task was)
        k = self._yielded
        self._yielded = k + 1
        self._fill()  # the next layers go in flight before the caller gets this one
        src, dst = self._layers[k]
        return LayerPulled(k, src, dst, self._nbytes)

    async def _check_remote(self) -> None:
        """What ``pull_blocks`` would check against the peer's cache before a byte moves:
        the key (fetched once on a miss) and the layers against its tensor count."""
        whole, link = self._whole, self._link
        try:
            remote, _ = resolve(link.path.remote_table, whole.key)
        except LLMException as e:
            if e.status_code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                raise
            if not await link.path.refresh(whole.deadline):
                raise
            remote, _ = resolve(link.path.remote_table, whole.key)
        tensor_span(
            remote.num_tensors,
            whole.local.num_tensors,
            whole.src_layers,
            whole.dst_layers,
            whole.tensors_per_layer,
        )

    def _fill(self) -> None:
        """Starts layers until ``depth`` of them are started and not yet handed over."""
        top = min(len(self._layers), self._yielded + self._depth)
        if self._next >= top:
            return
        whole, rt, link = self._whole, self._rt, self._link
        with api_scope(_API):  # the tasks copy it: their errors name this call
            while self._next < top:
                s, d = self._layers[self._next]
                request = whole._replace(src_layers=range(s, s + 1), dst_layers=range(d, d + 1))
                task = self._loop.create_task(_runner.run(rt, link, request))
                task.add_done_callback(_retrieve)
                self._inflight.append(task)
                self._next += 1

    async def _drain(self, cancelled: asyncio.CancelledError | None = None) -> None:
        """Cancels every layer in flight and waits (through cancels) until each has ended."""
        tasks = list(self._inflight)
        self._inflight.clear()
        self._next = len(self._layers)  # nothing starts any more
        if not tasks:
            if cancelled is not None:
                raise cancelled
            return
        for task in reversed(tasks):  # the queued ones first: none takes the slot meanwhile
            task.cancel()
        await quiesce(asyncio.gather(*tasks, return_exceptions=True), cancelled=cancelled)

    def __del__(self) -> None:
        # Dropped with layers in flight (a plain ``async for`` left by ``break``): abort them.
        inflight = getattr(self, "_inflight", None)
        if not inflight:
            return
        tasks = list(inflight)
        inflight.clear()
        try:
            self._loop.call_soon_threadsafe(_cancel_all, tasks)
        except RuntimeError:  # the loop is closed: nothing of ours runs there any more
            pass

    def __repr__(self) -> str:
        return (
            f"<LayerStream {self._yielded}/{len(self._layers)} layers, "
            f"{len(self._inflight)} in flight{' closed' if self._closed else ''}>"
        )


def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    for task in reversed(tasks):
        task.cancel()


class LayerwiseMixin:
    """``pull_blocks_layerwise``: ``pull_blocks`` handed over one layer at a time."""

    _rt: Runtime
    _caches: CacheRegistry

    @public(_API)
    def pull_blocks_layerwise(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst_cache: KvCache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        *,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
        timeout: float | None = None,
        depth: int = 2,
    ) -> LayerStream:
        """``pull_blocks``, layer by layer: yields each layer as soon as its bytes landed.

        ::

            async with cm.pull_blocks_layerwise(key, cache, src_blocks, dst_blocks) as layers:
                async for layer in layers:          # a LayerPulled
                    compute(layer.dst_layer)        # the next layers move meanwhile

        The same pull as ``pull_blocks`` with the same arguments, cut at layer
        boundaries: layer ``k`` is source layer ``src_layer_range[k]`` into destination
        layer ``dst_layer_range[k]`` (``tensor_num_per_layer`` tensors each). A plain call
        (not a coroutine): the arguments are checked here, synchronously, and nothing
        moves until the first ``__anext__``. The peer's side (the key, its tensor count,
        its block ids) is checked when the first layer is asked for, before a byte moves.

        One deadline for the whole iteration: it starts at this call and ends
        ``timeout`` (None: ``sync_kv_timeout``) seconds later, the caller's own work
        between layers included. A layer still in flight then fails with
        ``LLMTimeoutError``, raised where the caller asks for it; layers that landed
        earlier are still handed over.

        Each layer is one transfer on the link, taking the link's FIFO slot on its own:
        other transfers on the same link may run between two layers (upstream's "one
        transfer per link at a time" holds per layer), and each one-sided copy holds the
        peer cache's lease only while its own layer moves.

        An error in layer ``k`` (the link closed, the peer freed its cache, ...) is
        raised when the caller asks for layer ``k``: every layer handed over before it
        is valid, the layers after it are aborted and the stream ends.

        Args:
            src_cache_key, dst_cache, src_blocks, dst_blocks: as ``pull_blocks``.
            src_layer_range: remote layers (step 1); None = ``range(n)`` for the ``n``
                destination layers (the peer must then hold exactly as many tensors).
            dst_layer_range: local layers (step 1); None = every layer of ``dst_cache``
                (``tensor_num_per_layer`` must divide its tensor count). With both
                ranges given they have the same length.
            tensor_num_per_layer: tensors per layer (K,V = 2; MLA = 1).
            timeout: seconds for the whole iteration; None = ``sync_kv_timeout``.
            depth: layers kept in flight ahead of the caller (>= 1).

        Returns:
            A :class:`LayerStream` (an async iterator and async context manager).

        Raises:
            TypeError, LLMParamError (a ValueError): bad arguments, here.
            LLMLinkError: LLM_NOT_YET_LINK without a link to the key's cluster, here.

        The iteration raises as ``pull_blocks`` does (``LLMCacheNotFoundError``,
        ``LLMParamError`` for the peer's side, ``LLMTimeoutError``, ``LLMLinkError``), each
        where the layer it hit is asked for, and ``asyncio.CancelledError`` once the
        stream's native jobs have returned.
        """
        whole = blocks_pull_request(
            self._rt,
            self._caches,
            src_cache_key,
            dst_cache,
            src_blocks,
            dst_blocks,
            tensor_num_per_layer,
            src_layer_range,
            dst_layer_range,
            timeout,
        )
        ahead = check_int("depth", depth, min_value=1)
        local = whole.local
        layers = _layer_pairs(local.num_tensors, whole)
        nbytes = len(whole.dst_blocks) * local.block_bytes * whole.tensors_per_layer
        link = self._rt.links.get(whole.cluster_id)
        return LayerStream(self._rt, link, whole, layers, nbytes, ahead)


def _layer_pairs(dst_tensors: int, whole: PullRequest) -> list[tuple[int, int]]:
    """(src layer, dst layer) per step, from the checked ranges and the local cache."""
    t = whole.tensors_per_layer
    dst_lr = whole.dst_layers
    if dst_lr is None:
        require(
            dst_tensors % t == 0,
            f"tensor_num_per_layer={t} does not divide the destination cache's "
            f"{dst_tensors} tensors",
        )
        dst_lr = range(dst_tensors // t)
    else:
        require(
            dst_lr.stop * t <= dst_tensors,
            f"dst_layer_range={dst_lr!r} selects tensors [{dst_lr.start * t}, "
            f"{dst_lr.stop * t}) of a destination cache with {dst_tensors}",
        )
    src_lr = whole.src_layers if whole.src_layers is not None else range(len(dst_lr))
    require(
        len(src_lr) == len(dst_lr),
        f"src_layer_range {src_lr!r} and dst_layer_range {dst_lr!r} select different "
        f"layer counts ({len(src_lr)} != {len(dst_lr)}; tensor_num_per_layer={t})",
    )
    return list(zip(src_lr, dst_lr, strict=True))
