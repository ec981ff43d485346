"""The blocking, upstream-shaped API: ``import aiodatadist.sync as llm_datadist``.

Code written for Huawei's ``llm_datadist`` runs with nothing changed but the import::

    import aiodatadist.sync as llm_datadist
    from aiodatadist.sync import LLMDataDist, LLMRole, LLMClusterInfo, BlocksCacheKey

    dd = LLMDataDist(LLMRole.DECODER, 2)
    dd.init(options)
    dd.link_clusters([cluster], timeout=3000)            # milliseconds, as upstream
    dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks, dst_blocks)
    dd.finalize()

Every call is a plain blocking call with upstream's names, arguments, units and
exceptions (``LLMException`` and its subclasses, ``TypeError``, ``ValueError``,
``RuntimeError("llm datadist is not initialized")``). It is a thin layer over the async
API, which stays the first-class one: each call runs the async method on the library's
one **portal** loop (a daemon thread named ``aiodatadist-portal``, started on first use)
and blocks the calling thread, GIL released, until it is done.

* **Threads**: safe from any thread. Calls on one link are serialized by the link's FIFO,
  as in the async API (a ``ThreadPoolExecutor(32)`` hammering one link is fine).
* **Interrupts**: ``KeyboardInterrupt`` (or any exception raised in the waiting thread)
  cancels the call on the portal with the async API's cancel semantics (a transfer's
  native job is aborted and awaited, its destination blocks are undefined), then
  propagates once the call has ended.
* **Event loops**: calling from the portal thread raises ``RuntimeError`` (it would wait
  for itself: a coroutine or callback on the portal awaits ``.aio`` instead). Calling from
  a thread that runs its own asyncio loop works but blocks that loop for the whole call,
  as upstream would: async code should use :mod:`aiodatadist` directly.
* **Mixed use**: ``LLMDataDist.aio`` is the async instance underneath (its home loop is
  the portal); awaiting it from another loop is bridged to the portal.
* **Shutdown**: ``finalize()`` per instance. At interpreter exit every sync instance still
  initialized is finalized (each within its ``aiodatadist.FinalizeTimeout``), then the
  portal loop stops and its thread is joined (bounded). A call after that raises
  ``RuntimeError``; ``finalize()`` of an already finalized instance stays a no-op.
* **fork**: a forked child starts a portal of its own on its first call; instances made
  before the fork are not usable in the child (as upstream).
* **Portal loop**: plain asyncio; uvloop with ``AIODATADIST_PORTAL_LOOP=uvloop`` in the
  environment when the portal starts, or :func:`set_portal_loop` before the first call.
* Timeouts the async API takes as an extension (``pull_blocks(..., timeout=)``) keep its
  unit, seconds; upstream's own arguments keep upstream's (``link_clusters`` ms).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from . import cache_manager as _acm
from . import datadist as _add
from ._portal import portal, set_portal_loop
from .config import DataPath, LLMConfig, LlmConfig
from .errors import (
    LLMCacheNotFoundError,
    LLMException,
    LLMLinkError,
    LLMParamError,
    LLMStatusCode,
    LLMTimeoutError,
    Status,
)
from .types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMRole,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataPath",
    "DataType",
    "KvCache",
    "LLMCacheNotFoundError",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMLinkError",
    "LLMParamError",
    "LLMRole",
    "LLMStatusCode",
    "LLMTimeoutError",
    "LayerSynchronizer",
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "set_portal_loop",
]

log = logging.getLogger("aiodatadist.sync")

# Slack over the longest FinalizeTimeout for finalizing everything at interpreter exit.
_EXIT_SLACK_S = 2.0


def _blocking(
    name: str,
    source: type,
    *,
    on_abandoned: Callable[[Any], Awaitable[None]] | None = None,
    wrap: Callable[[Any], Any] | None = None,
) -> Callable[..., Any]:
    """A blocking method calling ``self._aio.<name>(*args, **kwargs)`` on the portal.

    Forwarded generically (the async method's signature is the only truth); the method
    takes the async one's signature and docstring when ``source`` has it.
    """

    if wrap is None:

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return portal.call(getattr(self._aio, name), args, kwargs, on_abandoned=on_abandoned)

    else:

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return wrap(
                portal.call(getattr(self._aio, name), args, kwargs, on_abandoned=on_abandoned)
            )

    method.__name__ = name
    method.__qualname__ = f"{source.__name__}.{name}"
    target = getattr(source, name, None)
    if target is not None:
        method.__doc__ = target.__doc__
        try:
            # A plain def's signature: inspect shows nothing async about it.
            method.__signature__ = inspect.signature(target)  # type: ignore[attr-defined]
        except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
            pass
    else:
        method.__doc__ = f"Blocking ``{source.__name__}.{name}`` (see the async API)."
    return method


def _blocking_getattr(self: Any, name: str) -> Any:
    """A public attribute the wrapper does not define: the async object's, calls made blocking.

    Keeps the sync API whole while the async one grows.
    """
    if name.startswith("_"):
        raise AttributeError(name)
    attr = getattr(self._aio, name)
    if not callable(attr):
        return attr

    @functools.wraps(attr)
    def call(*args: Any, **kwargs: Any) -> Any:
        return portal.call(attr, args, kwargs)

    return call


# ------------------------------------------------------------------------ CacheTask


class CacheTask:
    """The handle ``CacheManager.transfer_cache_async`` returns (upstream's ``CacheTask``).

    ``synchronize`` / ``get_results`` block; a timed-out wait returns ``LLM_TIMEOUT`` and
    leaves the push running, as upstream. ``.aio`` is the async ``CacheTask``.
    """

    __slots__ = ("_aio",)

    def __init__(self, task: _acm.CacheTask) -> None:
        self._aio = task

    @property
    def aio(self) -> _acm.CacheTask:
        """The async :class:`aiodatadist.CacheTask` underneath."""
        return self._aio

    synchronize = _blocking("synchronize", _acm.CacheTask)
    get_results = _blocking("get_results", _acm.CacheTask)
    cancel = _blocking("cancel", _acm.CacheTask)

    def done(self) -> bool:
        """Whether the pipeline has ended (success, failure or cancel)."""
        return self._aio.done()

    def __repr__(self) -> str:
        return f"<aiodatadist.sync.CacheTask done={self.done()}>"


async def _stop_task(task: _acm.CacheTask) -> None:
    await task.cancel()


async def _next_layer(stream: Any) -> Any:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:  # not carried across threads: None ends the iteration
        return None


class LayerIterator:
    """What the blocking ``pull_blocks_layerwise`` returns: the layers as they land.

    ``for layer in it`` (or ``with ... as it: for layer in it``); each step is one portal
    call that blocks until that layer's bytes have landed, while the next layers move.
    ``close()`` (or leaving the ``with``) aborts what is in flight and returns once its
    native jobs have; a dropped iterator aborts when collected. ``.aio`` is the async
    ``LayerStream``; the semantics are its own.
    """

    __slots__ = ("_aio",)

    def __init__(self, stream: Any) -> None:
        self._aio = stream

    @property
    def aio(self) -> Any:
        """The async ``LayerStream`` underneath."""
        return self._aio

    def __iter__(self) -> LayerIterator:
        return self

    def __next__(self) -> Any:
        layer = portal.call(_next_layer, (self._aio,))
        if layer is None:
            raise StopIteration
        return layer

    def __len__(self) -> int:
        return len(self._aio)

    def close(self) -> None:
        """Aborts the layers in flight; returns once their native jobs have returned."""
        portal.call(self._aio.aclose)

    def __enter__(self) -> LayerIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------- CacheManager


class CacheManager:
    """Blocking :class:`aiodatadist.CacheManager`: every method, upstream's names.

    Obtained as ``LLMDataDist.cache_manager``. Every call, registration included, runs on
    the portal (thread safety by serialization on its loop). ``.aio`` is the async manager.
    """

    __slots__ = ("_aio",)

    def __init__(self, manager: _acm.CacheManager) -> None:
        self._aio = manager

    @property
    def aio(self) -> _acm.CacheManager:
        """The async :class:`aiodatadist.CacheManager` underneath."""
        return self._aio

    _src = _acm.CacheManager
    register_blocks_cache = _blocking("register_blocks_cache", _src)
    register_cache = _blocking("register_cache", _src)
    allocate_blocks_cache = _blocking("allocate_blocks_cache", _src)
    allocate_cache = _blocking("allocate_cache", _src)
    unregister_cache = _blocking("unregister_cache", _src)
    deallocate_cache = _blocking("deallocate_cache", _src)
    deallocate_blocks_cache = _blocking("deallocate_blocks_cache", _src)
    remove_cache_key = _blocking("remove_cache_key", _src)
    pull_blocks = _blocking("pull_blocks", _src)
    pull_cache = _blocking("pull_cache", _src)
    push_blocks = _blocking("push_blocks", _src)
    push_cache = _blocking("push_cache", _src)
    copy_blocks = _blocking("copy_blocks", _src)
    copy_cache = _blocking("copy_cache", _src)
    swap_blocks = _blocking("swap_blocks", _src)
    remap_registered_memory = _blocking("remap_registered_memory", _src)
    transfer_cache_async = _blocking(
        "transfer_cache_async", _src, on_abandoned=_stop_task, wrap=CacheTask
    )
    pull_blocks_layerwise = _blocking("pull_blocks_layerwise", _src, wrap=LayerIterator)
    del _src

    __getattr__ = _blocking_getattr

    def __repr__(self) -> str:
        return f"<aiodatadist.sync.CacheManager of {self._aio!r}>"


# ---------------------------------------------------------------------- LLMDataDist

# Every sync instance initialized and not yet finalized (strong: finalized at exit even
# when the program dropped it).
_live: dict[int, _add.LLMDataDist] = {}
_live_lock = threading.Lock()


class LLMDataDist:
    """Blocking ``LLMDataDist(role, cluster_id, options=None)``, upstream's API.

    ``with LLMDataDist(role, cluster_id, options) as dd:`` inits with ``options`` and
    finalizes at exit. Instances of one process all live on the portal loop, so a prompt
    and a decoder in one process link in-process.

    Args:
        role: ``LLMRole.PROMPT``, ``DECODER`` or ``MIX``.
        cluster_id: uint64, unique among everything that links.
        options: the default options of ``init()`` (upstream's ``init(options)`` keys).

    Raises:
        TypeError, ValueError: a bad role, cluster id or options.
    """

    __slots__ = ("__weakref__", "_aio", "_cm", "_options")

    def __init__(
        self, role: LLMRole, cluster_id: int, options: dict[str, str] | None = None
    ) -> None:
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options must be a dict or None, got {type(options).__name__}")
        self._options = None if options is None else dict(options)
        # Created on the portal loop, like everything it does later.
        self._aio: _add.LLMDataDist = portal.call(_add.LLMDataDist, (role, cluster_id))
        self._cm: CacheManager | None = None

    # ------------------------------------------------------------ properties

    @property
    def aio(self) -> _add.LLMDataDist:
        """The async :class:`aiodatadist.LLMDataDist` underneath (home loop: the portal)."""
        return self._aio

    @property
    def role(self) -> LLMRole:
        return self._aio.role

    @property
    def cluster_id(self) -> int:
        return self._aio.cluster_id

    @property
    def is_initialized(self) -> bool:
        return self._aio.is_initialized

    @property
    def options(self) -> Any:
        """The parsed options of the last ``init``."""
        return self._aio.options

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` the link server listens on, or None."""
        return self._aio.listen_address

    @property
    def links(self) -> list[Any]:
        """The active links, one per remote cluster."""
        if not self._aio.is_initialized:
            return []
        return list(portal.call(lambda: self._aio.links))

    @property
    def cache_manager(self) -> CacheManager:
        """The blocking :class:`CacheManager`.

        Raises:
            RuntimeError: ``init`` has not completed (upstream's message).
        """
        inner = self._aio.cache_manager
        cm = self._cm
        if cm is None or cm._aio is not inner:  # a new one after finalize + init
            cm = self._cm = CacheManager(inner)
        return cm

    @property
    def kv_cache_manager(self) -> CacheManager:
        """Alias of :attr:`cache_manager`."""
        return self.cache_manager

    # ------------------------------------------------------------- lifecycle

    def init(self, options: dict[str, str] | None = None) -> None:
        """Initializes the instance (on the portal); ``options`` default to the constructor's.

        Idempotent. Raises as the async ``init``.
        """
        opts = self._options if options is None else options
        portal.call(self._aio.init, (opts,))
        with _live_lock:
            _live[id(self._aio)] = self._aio

    def finalize(self) -> None:
        """Unlinks everything, waits for transfers in flight and frees; idempotent (a
        no-op on an instance that is not initialized, after interpreter-exit cleanup too).
        """
        if self._aio.is_initialized:
            portal.call(self._aio.finalize)
        with _live_lock:
            _live.pop(id(self._aio), None)

    def __enter__(self) -> LLMDataDist:
        self.init()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finalize()

    # ----------------------------------------------------------------- links

    _src = _add.LLMDataDist
    link_clusters = _blocking("link_clusters", _src)
    unlink_clusters = _blocking("unlink_clusters", _src)
    link = _blocking("link", _src)
    unlink = _blocking("unlink", _src)
    query_register_mem_status = _blocking("query_register_mem_status", _src)
    switch_role = _blocking("switch_role", _src)
    check_link_status = _blocking("check_link_status", _src)
    del _src

    __getattr__ = _blocking_getattr

    def __repr__(self) -> str:
        state = "initialized" if self._aio.is_initialized else "not initialized"
        return (
            f"<aiodatadist.sync.LLMDataDist {self.role.name} cluster_id={self.cluster_id} {state}>"
        )


# --------------------------------------------------------------------- exit, tests


def _finalize_live(bound: float | None = None) -> None:
    """Finalizes every live sync instance on the portal, all at once, within ``bound`` s
    (default: the longest FinalizeTimeout plus slack)."""
    with _live_lock:
        live = [dd for dd in _live.values() if dd.is_initialized]
        _live.clear()
    if not live or not portal.started or portal.stopped:
        return
    if bound is None:
        bound = max(dd.options.finalize_timeout_ms for dd in live) / 1000 + _EXIT_SLACK_S

    async def finalize_all() -> None:
        # Pushes still running (transfer_cache_async) finish first, as upstream's push
        # threads keep the interpreter alive until they end; bounded, then finalize
        # cancels what is left.
        pushing = [
            t
            for dd in live
            if dd.is_initialized
            for t in dd.cache_manager._pipelines.tasks
            if not t.done()
        ]
        if pushing:
            log.info("exit: waiting for %d transfer_cache_async task(s)", len(pushing))
            await asyncio.wait(pushing, timeout=bound)
        tasks = [asyncio.ensure_future(dd.finalize()) for dd in live]
        done, pending = await asyncio.wait(tasks, timeout=bound)
        for t in pending:
            t.cancel()
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                log.warning("finalize at exit failed: %r", t.exception())

    portal.call(finalize_all)


def _forget_after_fork() -> None:
    # A forked child has none of its parent's threads: its instances cannot run here.
    global _live_lock
    _live_lock = threading.Lock()
    _live.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


@atexit.register
def _at_exit() -> None:
    try:
        _finalize_live()
    except BaseException as e:  # never a traceback at exit
        log.warning("aiodatadist.sync: finalizing at exit failed: %r", e)
    finally:
        portal.stop()


def _restart_portal_for_tests(kind: str) -> None:
    """Tests only: stops the portal and makes the next call start one of ``kind``.

    Raises:
        RuntimeError: a sync instance is still initialized (its loop would be gone).
    """
    with _live_lock:
        busy = [dd for dd in _live.values() if dd.is_initialized]
    if busy:
        raise RuntimeError(f"finalize every sync instance first: {busy!r}")
    portal.stop(final=False)
    portal.set_kind(kind)
