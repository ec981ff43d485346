"""``transfer_cache_async``'s layer pipeline and its handle, :class:`CacheTask`.

The facade checks the call and hands over one :class:`PipelineRequest`;
:meth:`Pipelines.start` runs it as a background task on the instance's loop. For
each source layer in order the pipeline waits for ``synchronize_layer`` (the
compute that fills the layer), then sends that layer to every config covering it,
one :class:`~aiodatadist._plan.PushRequest` through the one path
(:func:`aiodatadist._runner.run`) each, with its own ``sync_kv_timeout`` deadline.
The first failure stops the whole job.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _runner
from ._bridge import public
from ._plan import PushRequest
from ._validate import INT32_MAX, INT64_MAX, check_int, check_int_list, require
from .errors import LLMException, LLMStatusCode
from .types import BlocksCacheKey, LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig

if TYPE_CHECKING:
    from ._caches import CacheEntry
    from ._runtime import Runtime

__all__ = [
    "CacheTask",
    "PipelineRequest",
    "Pipelines",
    "check_push_blocks",
    "check_push_span",
    "stop_abandoned",
]

log = logging.getLogger("aiodatadist.cache_manager")

Config = TransferConfig | TransferWithCacheKeyConfig


class CacheTask:
    """The handle ``transfer_cache_async`` returns: one background layer pipeline.

    Awaiting the task itself is ``await task.synchronize()``. Like the instance's own
    coroutines, its coroutines awaited on another thread's loop run on the loop that
    runs the pipeline (the instance's loop).
    """

    def __init__(self, num_configs: int) -> None:
        self._results: list[LLMStatusCode | None] = [None] * num_configs
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _start(self, task: asyncio.Task[None]) -> None:
        self._task = task
        self._loop = task.get_loop()

    def _home_loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def done(self) -> bool:
        return self._task is not None and self._task.done()

    async def _wait(self, timeout_in_millis: int | None) -> bool:
        assert self._task is not None
        timeout = None
        if timeout_in_millis is not None:
            # int32 ms, as upstream: a larger one would overflow the loop's timer.
            ms = check_int("timeout_in_millis", timeout_in_millis, min_value=0, max_value=INT32_MAX)
            timeout = ms / 1000
        # asyncio.wait never cancels the pipeline: a timed-out synchronize leaves it running.
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        return bool(done)

    @public("synchronize")
    async def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Waits for the pipeline; the first failure, else ``LLM_SUCCESS``.

        ``LLM_FAILED`` when the pipeline was stopped (``cancel``, ``finalize``) before
        every config completed: success means every layer of every config landed.
        On timeout returns ``LLM_TIMEOUT`` and the pipeline keeps running (as upstream).
        A cancel of the awaiting task does not cancel the pipeline either.

        Raises:
            TypeError, LLMParamError: a bad ``timeout_in_millis``.
        """
        if not await self._wait(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        for r in self._results:
            if r is not None and r != LLMStatusCode.LLM_SUCCESS:
                return r
        if any(r is None for r in self._results):
            return LLMStatusCode.LLM_FAILED  # stopped without a recorded failure: cancelled
        return LLMStatusCode.LLM_SUCCESS

    @public("get_results")
    async def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """One status per transfer config.

        ``LLM_SUCCESS`` once a config's last layer was sent; the failing config's status
        for the failure that stopped the job; ``None`` for a config that did not complete
        (never started, or stopped part-way by another config's failure, a False from
        ``synchronize_layer`` or a cancel). If the pipeline is still running after the
        timeout, every entry is ``LLM_TIMEOUT``.

        Raises:
            TypeError, LLMParamError: a bad ``timeout_in_millis``.
        """
        if not await self._wait(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._results)
        return list(self._results)

    @public("cancel")
    async def cancel(self) -> None:
        """Stops the pipeline after the layer in flight (that layer is aborted and awaited)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})

    def __await__(self) -> Any:
        return self.synchronize().__await__()


async def stop_abandoned(task: CacheTask) -> None:
    """A CacheTask whose caller was cancelled before it got the task: stop its pipeline."""
    await task.cancel()


@dataclass(frozen=True)
class PipelineRequest:
    """One checked ``transfer_cache_async`` call.

    Attributes:
        local: the source cache.
        sync: the caller's layer synchronizer.
        configs: private copies of the caller's configs (a change the caller makes
            later cannot undo the checks).
        spans: the source layers each config covers.
        src_blocks, dst_blocks: block ids for a blocks source, else None.
        num_layers: the source's layers (K,V tensor pairs).
    """

    local: CacheEntry
    sync: LayerSynchronizer
    configs: tuple[Config, ...]
    spans: tuple[range, ...]
    src_blocks: tuple[int, ...] | None
    dst_blocks: tuple[int, ...] | None
    num_layers: int

    def layer_request(self, i: int, layer: int, deadline: float) -> PushRequest:
        """Config ``i``'s transfer of source layer ``layer``."""
        cfg = self.configs[i]
        common: dict[str, Any] = {
            "local": self.local,
            "cluster_id": cfg.dst_cluster_id,
            "deadline": deadline,
            "layer": layer,
            "src_row": cfg.src_batch_index,
            "src_blocks": self.src_blocks,
            "dst_blocks": self.dst_blocks,
        }
        if isinstance(cfg, TransferWithCacheKeyConfig):
            dst_layer = cfg.dst_layer_range.start + (layer - self.spans[i].start)
            return PushRequest(key=cfg.cache_key, dst_layer=dst_layer, **common)
        lr = cfg.src_layer_range
        k = layer - (lr.start if lr is not None else 0)
        return PushRequest(dst_addrs=tuple(cfg.dst_addrs[2 * k : 2 * k + 2]), **common)


# ----------------------------------------------- the facade's argument checks


def check_push_blocks(
    local: CacheEntry,
    src_block_indices: object,
    dst_block_indices: object,
    dst_block_memory_size: object,
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """``transfer_cache_async``'s block lists: both (a blocks source) or neither (a
    blocks source then sends every block ``i`` to block ``i``); and
    ``dst_block_memory_size``, which upstream needs and which must match the source."""
    blocks = _check_block_lists(local, src_block_indices, dst_block_indices)
    if dst_block_memory_size is not None:
        check_int("dst_block_memory_size", dst_block_memory_size, min_value=0)
        require(
            dst_block_memory_size in (0, local.block_bytes),
            f"dst_block_memory_size {dst_block_memory_size} must equal the source block "
            f"size {local.block_bytes}",
        )
    return blocks


def _check_block_lists(
    local: CacheEntry, src_block_indices: object, dst_block_indices: object
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    if src_block_indices is None and dst_block_indices is None:
        if local.is_blocks:
            # Upstream sends empty block lists: the whole layer, block i -> block i (the
            # destination's block count is checked against the peer's table per layer).
            every = tuple(range(local.num_blocks))
            return every, every
        return None, None
    require(
        src_block_indices is not None,
        "dst_block_indices without src_block_indices (contiguous -> blocks) is not supported",
    )
    require(
        dst_block_indices is not None,
        "src_block_indices needs dst_block_indices (blocks -> contiguous is not supported)",
    )
    # The source's size is known here, the destination's only per layer: ids
    # beyond int64 never reach native code, lists are bounded before reading.
    src_blocks = check_int_list(
        "src_block_indices",
        src_block_indices,
        allow_empty=False,
        max_value=max(0, local.num_blocks - 1) if local.is_blocks else INT64_MAX,
    )
    dst_blocks = check_int_list(
        "dst_block_indices", dst_block_indices, allow_empty=False, max_value=INT64_MAX
    )
    require(
        len(src_blocks) == len(dst_blocks),
        f"src_block_indices and dst_block_indices differ in length "
        f"({len(src_blocks)} != {len(dst_blocks)})",
    )
    require(local.is_blocks, "src_block_indices needs a blocks src_cache")
    return tuple(src_blocks), tuple(dst_blocks)


def check_push_span(
    i: int, c: TransferConfig | TransferWithCacheKeyConfig, num_layers: int, blocks: bool
) -> range:
    """The source layers config ``i`` covers, checked against the source and itself."""
    lr = c.src_layer_range if c.src_layer_range is not None else range(num_layers)
    require(
        lr.stop <= num_layers,
        f"transfer_configs[{i}].src_layer_range {lr!r} exceeds the {num_layers} "
        "layers of src_cache",
    )
    if isinstance(c, TransferWithCacheKeyConfig):
        # The constructor checks this; the setters cannot (one range at a time).
        require(
            len(c.dst_layer_range) == len(lr),
            f"transfer_configs[{i}]: src_layer_range {lr!r} and dst_layer_range "
            f"{c.dst_layer_range!r} differ in length",
        )
    if isinstance(c, TransferConfig):
        require(
            len(c.dst_addrs) == 2 * len(lr),
            f"transfer_configs[{i}].dst_addrs must have {2 * len(lr)} addresses "
            f"(2 per layer of {lr!r}), got {len(c.dst_addrs)}",
        )
    elif isinstance(c.cache_key, BlocksCacheKey):
        require(
            blocks,
            f"transfer_configs[{i}] targets a blocks cache: src_block_indices needed",
        )
    return lr


class Pipelines:
    """The running ``transfer_cache_async`` pipelines of one instance."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self, request: PipelineRequest) -> CacheTask:
        """Starts the pipeline on the running loop; its handle."""
        task = CacheTask(len(request.configs))
        t = asyncio.get_running_loop().create_task(
            self._run(task._results, request),
            name=f"aiodatadist-transfer-{request.local.cache_id}",
        )
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        task._start(t)
        return task

    async def shutdown(self, timeout: float | None = None) -> None:
        """Cancels running pipelines and waits for them, at most ``timeout`` seconds: a
        pipeline blocked in a plain (sync) ``synchronize_layer`` ends only when that call
        returns, and finalize must not wait on user code forever.
        """
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def _sync_layer(self, sync: LayerSynchronizer, layer: int) -> bool:
        fn = sync.synchronize_layer
        if inspect.iscoroutinefunction(fn):
            return bool(await fn(layer, None))
        # A sync synchronizer may block (waiting on compute): it runs on the
        # instance's callback thread, never on the loop or a transfer thread.
        result = await self._rt.callbacks().run(
            lambda _ctl: fn(layer, None), deadline=None, api="synchronize_layer"
        )
        if inspect.isawaitable(result):
            result = await result
        return bool(result)

    async def _run(self, results: list[LLMStatusCode | None], request: PipelineRequest) -> None:
        rt = self._rt
        for layer in range(request.num_layers):
            covering = [i for i, lr in enumerate(request.spans) if layer in lr]
            if not covering:
                continue
            try:
                ok = await self._sync_layer(request.sync, layer)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("synchronize_layer(%d) raised", layer)
                for i in covering:
                    results[i] = LLMStatusCode.LLM_FAILED
                return
            if not ok:
                for i in covering:
                    results[i] = LLMStatusCode.LLM_PARAM_INVALID
                return
            for i in covering:
                cluster = request.configs[i].dst_cluster_id
                # results[i] stays None until this config's last layer is sent (or it is the
                # one that fails): a config stopped part-way, by another config's failure,
                # a False from synchronize_layer or a cancel, reports None, as upstream.
                try:
                    link = rt.links.get(cluster)
                    push = request.layer_request(i, layer, rt.deadline(None))
                    await _runner.run(rt, link, push)
                except LLMException as e:
                    # Per transfer: DEBUG only (counted in the link's metrics; the status
                    # reaches the caller through synchronize / get_results).
                    log.debug(
                        "transfer_cache_async: layer %d to cluster %d failed: %s",
                        layer,
                        cluster,
                        e,
                    )
                    results[i] = e.status_code
                    return
                except Exception:
                    # Not an engine error (an OS error from a data path, a bug): still this
                    # config's failure, never a silent stop that synchronize reads as success.
                    log.exception(
                        "transfer_cache_async: layer %d to cluster %d failed", layer, cluster
                    )
                    results[i] = LLMStatusCode.LLM_FAILED
                    return
                if layer == request.spans[i].stop - 1:
                    results[i] = LLMStatusCode.LLM_SUCCESS
