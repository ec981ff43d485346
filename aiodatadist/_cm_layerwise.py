"""``CacheManager.pull_blocks_layerwise``: a pull that hands over each layer as it lands.

A mixin of :class:`~aiodatadist.cache_manager.CacheManager`. The call is checked like
``pull_blocks`` (the same checks, at the call, synchronously) and returns a
:class:`LayerStream`: an async iterator, and an async context manager, whose every
step yields one :class:`LayerPulled` once that layer's bytes have all landed.

The whole iteration is ONE transfer on the one path (:func:`aiodatadist._runner.run`
with a :class:`~aiodatadist.transports.base.LayerCut`): one FIFO slot, one hold of
each cache (one lease bracket on the one-sided paths), one deadline, one native job
(``inproc``, ``shm``, ``cma``) that copies the layers in order and adds 1 to an eventfd
as each one has landed, without the GIL. The loop watches the eventfd
(``loop.add_reader``) and wakes the caller waiting for that layer. On ``tcp`` one
request asks for every layer and the layered receive signals each once every stream's
part of it has landed; the engines move the layers one after another inside the same
slot hold and signal the same eventfd. An iteration small enough for the path's pull to
move without a thread handoff or a control message (an inline copy, a ``tcp``
request-stream pull) is that one pull, every layer signalled once it has landed
(``Path.pull_at_once``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import _runner
from ._bridge import bridged, public
from ._checks import blocks_pull_request
from ._executor import quiesce
from ._plan import PullRequest
from ._validate import check_int, require
from .errors import LLMStatusCode, api_scope, failure
from .transports.base import LayerCut
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


class _Flight:
    """The one transfer of a stream: its task, its eventfd and the layers landed so far.

    Nothing here refers to the stream, so a stream dropped mid-iteration is collected
    (and aborts its transfer) while the transfer still runs.
    """

    __slots__ = ("fd", "landed", "loop", "task", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.landed = 0
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[object] | None = None
        try:
            loop.add_reader(self.fd, self._readable)
        except BaseException:
            os.close(self.fd)
            raise

    def read(self) -> None:
        if self.fd < 0:
            return
        try:  # (once per layer: a plain try is cheaper than contextlib.suppress)
            self.landed += os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def _readable(self) -> None:
        self.read()
        self.wake()

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def close(self) -> None:
        """Once the transfer has returned (nothing writes the fd any more). Idempotent."""
        if self.fd < 0:
            return
        self.read()
        self.loop.remove_reader(self.fd)
        os.close(self.fd)
        self.fd = -1

    def finished(self, task: asyncio.Task[object]) -> None:
        # The task's done callback: its error is not "never retrieved" (a stream dropped
        # with the transfer in flight never asks), the fd goes, a waiting caller wakes.
        if not task.cancelled():
            task.exception()
        self.close()
        self.wake()


class LayerStream:
    """The layers of one ``pull_blocks_layerwise`` call, in order, as they land.

    ``async for layer in stream`` (or ``async with stream as layers: async for ...``).
    Nothing moves before the first ``__anext__``, which starts the one transfer of the
    whole iteration; every layer moves as soon as the path can move it, while the
    caller computes on the layers handed over. Leaving early (``break``, an exception
    in the loop body, :meth:`aclose`, a cancel) aborts the transfer, as a cancelled
    ``pull_blocks`` does: the native job is aborted and awaited, the link stays usable,
    and the destination blocks of the layers not yet handed over are undefined.
    ``async with`` (or :meth:`aclose`) does that before it returns; a plain ``async for``
    left by ``break`` aborts when the stream is collected (at once in CPython, unless
    something else still refers to it).
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_cut",
        "_flight",
        "_layers",
        "_link",
        "_loop",
        "_nbytes",
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
        del depth  # accepted (checked by the caller); the one transfer never waits for it
        self._rt = rt
        self._loop = rt.loop
        self._link = link
        self._whole = whole
        self._layers = tuple(layers)
        self._nbytes = nbytes
        self._flight: _Flight | None = None
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
        """Aborts the transfer if it still runs and waits until its native job has returned.

        Idempotent.

        Raises:
            asyncio.CancelledError: cancelled meanwhile; raised once it has returned.
        """
        self._closed = True
        await self._drain()

    @bridged
    async def __anext__(self) -> LayerPulled:
        """The next layer, once its bytes have all landed.

        The last layer is handed over once the whole transfer has returned (the link's
        slot and the caches are let go by then).

        Raises:
            StopAsyncIteration: every layer was handed over, or the stream was closed
                (or ended by an error raised earlier).
            LLMException: the transfer failed in this layer (as ``pull_blocks``); the
                stream is closed.
            asyncio.CancelledError: cancelled; raised once the stream's native job has
                returned (the stream is closed).
        """
        n = len(self._layers)
        if self._closed or self._yielded == n:
            raise StopAsyncIteration
        if not self._started:
            # The peer's side (key, tensor count, block ids) is checked by the runner's
            # plan before a byte moves; its error is raised here, at layer 0.
            self._started = True
            try:
                self._start()
            except BaseException:
                self._closed = True
                raise
        fl = self._flight
        assert fl is not None and fl.task is not None
        k = self._yielded
        task = fl.task
        # Layer k is ready once it landed; the last one once the transfer returned too.
        while not (fl.landed > k and (k + 1 < n or task.done())):
            if task.done():
                fl.read()  # the done callback may not have run yet
                if fl.landed > k and k + 1 < n:
                    break
                self._closed = True
                fl.close()
                task.result()  # raises the transfer's error (or CancelledError)
                if fl.landed > k:
                    break
                raise failure(
                    LLMStatusCode.LLM_FAILED,
                    f"the transfer returned after {fl.landed} of {n} layers",
                    api=_API,
                )
            waiter = fl.waiter = self._loop.create_future()
            try:
                await waiter
            except asyncio.CancelledError as exc:
                self._closed = True
                await self._drain(exc)  # raises exc once the native job has returned
                raise
            finally:
                fl.waiter = None
        self._yielded = k + 1
        if self._yielded == n:
            fl.close()
        src, dst = self._layers[k]
        return LayerPulled(k, src, dst, self._nbytes)

    def _start(self) -> None:
        """Starts the one transfer of the iteration (its task copies this call's api)."""
        t = self._whole.tensors_per_layer
        fl = _Flight(self._loop)
        try:
            cut = LayerCut(fl.fd, self._layers[0][1] * t, t, len(self._layers))
            with api_scope(_API):
                fl.task = self._loop.create_task(
                    _runner.run(self._rt, self._link, self._whole_span(), cut)
                )
        except BaseException:
            fl.close()
            raise
        fl.task.add_done_callback(fl.finished)
        self._flight = fl

    def _whole_span(self) -> PullRequest:
        # The request over exactly the iteration's layers (both ranges explicit).
        (s0, d0), (s1, d1) = self._layers[0], self._layers[-1]
        return self._whole._replace(src_layers=range(s0, s1 + 1), dst_layers=range(d0, d1 + 1))

    async def _drain(self, cancelled: asyncio.CancelledError | None = None) -> None:
        """Cancels the transfer if it runs and waits (through cancels) until it has ended."""
        fl = self._flight
        task = fl.task if fl is not None else None
        if fl is None or task is None or task.done():
            if fl is not None:
                fl.close()
            if cancelled is not None:
                raise cancelled
            return
        task.cancel()
        try:
            await quiesce(task, cancelled=cancelled)
        finally:
            if task.done():
                fl.close()

    def __del__(self) -> None:
        # Dropped with the transfer in flight (a plain ``async for`` left by ``break``).
        fl = getattr(self, "_flight", None)
        task = fl.task if fl is not None else None
        if task is None or task.done():
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing of ours runs
            self._loop.call_soon_threadsafe(task.cancel)

    def __repr__(self) -> str:
        fl = self._flight
        running = fl is not None and fl.task is not None and not fl.task.done()
        return (
            f"<LayerStream {self._yielded}/{len(self._layers)} layers"
            f"{', in flight' if running else ''}{' closed' if self._closed else ''}>"
        )


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

        The whole iteration is one transfer on the link: it takes the link's FIFO slot
        once (other transfers on the link wait until it ends: upstream's "one transfer
        per link at a time"), holds both caches (on ``shm`` / ``cma`` the peer cache's
        lease) throughout, and is counted once in the metrics. On ``inproc``, ``shm``
        and ``cma`` one native job moves every layer in order and signals each landed
        layer on an eventfd the loop watches; ``tcp`` moves the layers one after another
        in the same slot hold. Every layer moves as soon as the path can move it, while
        the caller computes; the last layer is handed over once the transfer returned.

        An error in layer ``k`` (the peer died, its lease was revoked, the deadline
        passed, ...) is raised when the caller asks for layer ``k``: every layer handed
        over before it is valid, the transfer has ended and the stream ends. The peer
        cannot free its cache under the iteration (``LLM_LINK_BUSY``, as under a
        ``pull_blocks``).

        Args:
            src_cache_key, dst_cache, src_blocks, dst_blocks: as ``pull_blocks``.
            src_layer_range: remote layers (step 1); None = ``range(n)`` for the ``n``
                destination layers (the peer must then hold exactly as many tensors).
            dst_layer_range: local layers (step 1); None = every layer of ``dst_cache``
                (``tensor_num_per_layer`` must divide its tensor count). With both
                ranges given they have the same length.
            tensor_num_per_layer: tensors per layer (K,V = 2; MLA = 1).
            timeout: seconds for the whole iteration; None = ``sync_kv_timeout``.
            depth: >= 1; accepted for compatibility, changes nothing any more (the one
                transfer never waits for the caller).

        Returns:
            A :class:`LayerStream` (an async iterator and async context manager).

        Raises:
            TypeError, LLMParamError (a ValueError): bad arguments, here.
            LLMLinkError: LLM_NOT_YET_LINK without a link to the key's cluster, here.

        The iteration raises as ``pull_blocks`` does (``LLMCacheNotFoundError``,
        ``LLMParamError`` for the peer's side, ``LLMTimeoutError``, ``LLMLinkError``), each
        where the layer it hit is asked for, and ``asyncio.CancelledError`` once the
        stream's native job has returned.
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
