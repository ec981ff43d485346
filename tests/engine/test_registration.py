"""Registration and allocation: raw addresses, buffers, their checks, shared memory, freeing.

Every accepted registration is proven by moving real bytes through it.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMCacheNotFoundError,
    LLMException,
    LLMLinkError,
    LLMParamError,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import Pair
from tests.engine._util import instrument, wait_until

pytestmark = pytest.mark.asyncio

SHAPE = [8, 64, 8, 16]  # 8 blocks of 16 KiB (fp16)


def _desc(num_tensors: int = 4, shape: list[int] | None = None,
          dtype: DataType = DataType.DT_FLOAT16) -> CacheDesc:
    return CacheDesc(num_tensors, shape or SHAPE, dtype, Placement.HOST)


def _random_arrays(n: int, seed: int, shape: list[int] | None = None) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = np.empty(shape or SHAPE, dtype=np.float16)
        a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, dtype=np.uint8)
        out.append(a)
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _shm_names(pid: int, cluster_id: int) -> set[str]:
    """Names of the instance's segments in /dev/shm: there must never be any (memfds)."""
    prefix = f"aiodd-{pid}-{cluster_id}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def _memfds(pid: int, cluster_id: int) -> dict[str, int]:
    """The instance's segments this process holds open: label -> fd."""
    prefix = f"/memfd:/aiodd-{pid}-{cluster_id}-"
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix) and "lease" not in target:
            out[target.removeprefix("/memfd:").split(" ")[0]] = int(fd)
    return out


# ------------------------------------------------------------- registration


async def test_raw_addresses_move_real_bytes(pair: Pair) -> None:
    src_arrays = _random_arrays(4, 1)
    dst_arrays = [np.zeros(SHAPE, np.float16) for _ in range(4)]
    src = pair.prompt.cache_manager.register_blocks_cache(
        _desc(), [a.ctypes.data for a in src_arrays], BlocksCacheKey(1, 0)
    )
    dst = pair.decoder.cache_manager.register_blocks_cache(
        _desc(), [a.ctypes.data for a in dst_arrays]
    )
    assert src.is_blocks_cache and dst.is_blocks_cache
    assert src.tensor_addrs == [a.ctypes.data for a in src_arrays]
    assert src.cache_id != dst.cache_id and src.cache_id >= 1

    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst, [7, 0], [1, 2])

    for s, d in zip(src_arrays, dst_arrays, strict=True):
        assert _same(d[1], s[7]) and _same(d[2], s[0])
        assert not d[[0, 3, 4, 5, 6, 7]].view(np.uint8).any()
    # tensors() of a raw-address cache views the same memory.
    views = dst.tensors()
    assert [v.ctypes.data for v in views] == [a.ctypes.data for a in dst_arrays]
    assert views[0].shape == tuple(SHAPE) and views[0].dtype == np.float16


@pytest.mark.parametrize("kind", ["ndarray", "bytearray", "memoryview", "larger-buffer"])
async def test_buffers_move_real_bytes(pair: Pair, kind: str) -> None:
    src_arrays = _random_arrays(4, 2)
    nbytes = int(np.prod(SHAPE)) * 2
    if kind == "ndarray":
        bufs: list = [np.zeros(SHAPE, np.float16) for _ in range(4)]
    elif kind == "bytearray":
        bufs = [bytearray(nbytes) for _ in range(4)]
    elif kind == "memoryview":
        bufs = [memoryview(bytearray(nbytes)) for _ in range(4)]
    else:
        bufs = [np.zeros(nbytes + 4096, np.uint8) for _ in range(4)]
    pair.prompt.cache_manager.register_blocks_cache(_desc(), src_arrays, BlocksCacheKey(1, 0))
    dst = pair.decoder.cache_manager.register_blocks_cache(_desc(), bufs)

    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst, [3, 4, 5], [0, 1, 7])

    views = dst.tensors()
    for t in range(4):
        raw = np.frombuffer(bufs[t], dtype=np.uint8)[:nbytes].reshape(8, -1)
        want = src_arrays[t].view(np.uint8).reshape(8, -1)
        assert np.array_equal(raw[[0, 1, 7]], want[[3, 4, 5]])
        assert not raw[2:7].any()
        assert _same(views[t][7], src_arrays[t][5])  # tensors() views the buffer itself


async def test_registration_keeps_the_buffer_alive(pair: Pair) -> None:
    src_arrays = _random_arrays(4, 3)
    pair.prompt.cache_manager.register_blocks_cache(
        _desc(), [a.copy() for a in src_arrays], BlocksCacheKey(1, 0)
    )  # the only references to these copies are the registration's
    dst = pair.decoder.cache_manager.register_blocks_cache(
        _desc(), [np.zeros(SHAPE, np.float16) for _ in range(4)]
    )
    import gc

    gc.collect()
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst, [6], [6])
    for t, view in enumerate(dst.tensors()):
        assert _same(view[6], src_arrays[t][6])


def _bad_buffers(case: str) -> tuple[list, type[BaseException]]:
    n = int(np.prod(SHAPE))
    ok = [np.zeros(SHAPE, np.float16) for _ in range(4)]
    if case == "too-small":
        return [*ok[:3], np.zeros(n - 1, np.float16)], LLMParamError
    if case == "non-contiguous":
        return [*ok[:3], np.zeros([16, *SHAPE[1:]], np.float16)[::2]], LLMParamError
    if case == "fortran-order":
        return [*ok[:3], np.asfortranarray(np.zeros(SHAPE, np.float16))], LLMParamError
    if case == "read-only":
        ro = np.zeros(SHAPE, np.float16)
        ro.setflags(write=False)
        return [*ok[:3], ro], LLMParamError
    if case == "bytes":
        return [*ok[:3], bytes(n * 2)], LLMParamError
    if case == "mixed":
        return [*ok[:3], ok[3].ctypes.data], TypeError
    if case == "not-a-buffer":
        return [*ok[:3], object()], TypeError
    if case == "too-few":
        return ok[:3], LLMParamError
    if case == "too-many":
        return [*ok, np.zeros(SHAPE, np.float16)], LLMParamError
    if case == "empty":
        return [], LLMParamError
    if case == "null-address":
        return [a.ctypes.data for a in ok[:3]] + [0], LLMParamError
    if case == "negative-address":
        return [a.ctypes.data for a in ok[:3]] + [-4096], LLMParamError
    if case == "bool-address":
        return [a.ctypes.data for a in ok[:3]] + [True], TypeError
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    ["too-small", "non-contiguous", "fortran-order", "read-only", "bytes", "mixed",
     "not-a-buffer", "too-few", "too-many", "empty", "null-address", "negative-address",
     "bool-address"],
)
async def test_bad_buffers_are_refused(pair: Pair, case: str) -> None:
    addrs, exc = _bad_buffers(case)
    cm = pair.decoder.cache_manager
    with pytest.raises(exc) as info:
        cm.register_blocks_cache(_desc(), addrs)
    if exc is LLMParamError:
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(exc):
        cm.register_cache(_desc(), addrs)
    # Nothing was registered: the good buffers can be registered now.
    good = [np.zeros(SHAPE, np.float16) for _ in range(4)]
    cache = cm.register_blocks_cache(_desc(), good)
    assert cache.cache_id >= 1


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        (lambda a: ({"shape": SHAPE}, a), TypeError),  # cache_desc not a CacheDesc
        (lambda a: (_desc(), tuple(a), "key"), TypeError),  # blocks_cache_key not a key
        (lambda a: (_desc(), a, None, 1), TypeError),  # remote_accessible not a bool
        (lambda a: (_desc(), np.array([x.ctypes.data for x in a])), TypeError),
    ],
    ids=["desc", "key", "remote-accessible", "addrs-ndarray"],
)
async def test_bad_argument_types(pair: Pair, args, exc: type[BaseException]) -> None:
    arrays = [np.zeros(SHAPE, np.float16) for _ in range(4)]
    with pytest.raises(exc):
        pair.decoder.cache_manager.register_blocks_cache(*args(arrays))


async def test_overlapping_registrations_are_refused(pair: Pair) -> None:
    cm = pair.decoder.cache_manager
    arrays = [np.zeros(SHAPE, np.float16) for _ in range(4)]
    first = cm.register_blocks_cache(_desc(), arrays)
    with pytest.raises(LLMParamError, match="overlap"):
        cm.register_blocks_cache(_desc(), arrays)  # the same memory again
    with pytest.raises(LLMParamError, match="overlap"):
        cm.register_cache(_desc(), [a.ctypes.data for a in reversed(arrays)])
    # A tensor that starts inside another cache's tensor.
    big = np.zeros(int(np.prod(SHAPE)) * 2, np.float16)
    cm.register_blocks_cache(_desc(1), [big[: int(np.prod(SHAPE))]])
    with pytest.raises(LLMParamError, match="overlap"):
        cm.register_blocks_cache(_desc(1), [big.ctypes.data + 1024])
    # Two tensors of one cache on the same memory.
    other = np.zeros(SHAPE, np.float16)
    fresh = [np.zeros(SHAPE, np.float16) for _ in range(3)]
    with pytest.raises(LLMParamError, match="overlap"):
        cm.register_blocks_cache(_desc(), [other.ctypes.data, other.ctypes.data,
                                           fresh[0].ctypes.data, fresh[1].ctypes.data])
    # Freed memory can be registered again.
    cm.unregister_cache(first.cache_id)
    again = cm.register_blocks_cache(_desc(), arrays)
    assert again.cache_id != first.cache_id


# --------------------------------------------------------------- allocation


async def test_allocate_blocks_cache_in_shared_memory(pair: Pair) -> None:
    pid = os.getpid()
    before_p, before_d = _memfds(pid, 1), _memfds(pid, 2)
    src = pair.prompt.cache_manager.allocate_blocks_cache(_desc(), BlocksCacheKey(1, 0))
    dst = pair.decoder.cache_manager.allocate_blocks_cache(_desc())
    new_p = set(_memfds(pid, 1)) - set(before_p)
    new_d = set(_memfds(pid, 2)) - set(before_d)
    assert len(new_p) == 1 and len(new_d) == 1, "each allocation is one shm segment"
    assert not _shm_names(pid, 1) and not _shm_names(pid, 2), "segments are nameless"

    views = src.tensors()
    assert len(views) == 4
    for t, v in enumerate(views):
        assert isinstance(v, np.ndarray)
        assert v.shape == tuple(SHAPE) and v.dtype == np.float16
        assert v.flags.c_contiguous and v.flags.writeable
        assert v.ctypes.data == src.tensor_addrs[t]
        assert not v.view(np.uint8).any(), "allocated memory starts zeroed"
    rng = np.random.default_rng(4)
    for v in views:
        v.view(np.uint8)[...] = rng.integers(0, 256, v.view(np.uint8).shape, dtype=np.uint8)

    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst, [0, 1, 2, 5], [4, 5, 6, 0])

    dviews = dst.tensors()
    for t in range(4):
        for s, d in ((0, 4), (1, 5), (2, 6), (5, 0)):
            assert _same(dviews[t][d], views[t][s])
        assert not dviews[t][[1, 2, 3, 7]].view(np.uint8).any()
    # The memfd really holds the bytes (a peer maps it from the fd it is sent).
    (name,) = new_p
    fd = _memfds(pid, 1)[name]
    head = np.fromfile(f"/proc/self/fd/{fd}", dtype=np.uint8, count=views[0].nbytes)
    assert np.array_equal(head, views[0].view(np.uint8).reshape(-1))

    pair.prompt.cache_manager.deallocate_blocks_cache(src)
    pair.decoder.cache_manager.deallocate_blocks_cache(dst)
    assert not _shm_names(pid, 1) and not _shm_names(pid, 2)
    with pytest.raises(LLMException) as info:
        src.tensors()
    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    # Views taken earlier stay valid (the mapping lives as long as they do).
    assert views[0].shape == tuple(SHAPE)
    int(views[0].view(np.uint8)[-1, -1, -1, -1])


async def test_allocate_cache_rows_and_keys(pair: Pair) -> None:
    desc = CacheDesc(2, [4, 1024], DataType.DT_FLOAT, Placement.HOST)
    keys = [CacheKey(1, 10), CacheKey(1, 2**64 - 1), CacheKey(1, 12)]  # row 1: placeholder
    cache = pair.prompt.cache_manager.allocate_cache(desc, keys)
    assert not cache.is_blocks_cache
    views = cache.tensors()
    assert [v.shape for v in views] == [(4, 1024)] * 2
    for t, v in enumerate(views):
        v[...] = np.arange(4 * 1024, dtype=np.float32).reshape(4, 1024) + 10000 * t
    dst = pair.decoder.cache_manager.allocate_cache(desc)
    await pair.decoder.cache_manager.pull_cache(CacheKey(1, 12), dst, batch_index=3)
    for t in range(2):
        assert np.array_equal(dst.tensors()[t][3], views[t][2])
    with pytest.raises(LLMCacheNotFoundError):
        await pair.decoder.cache_manager.pull_cache(CacheKey(1, 2**64 - 1, prefix_id=11), dst)
    pair.prompt.cache_manager.deallocate_cache(cache)
    with pytest.raises(LLMCacheNotFoundError):
        await pair.decoder.cache_manager.pull_cache(CacheKey(1, 12), dst, batch_index=0)


async def test_row_key_rules(pair: Pair) -> None:
    cm = pair.prompt.cache_manager
    desc = CacheDesc(2, [2, 256], DataType.DT_FLOAT16, Placement.HOST)
    with pytest.raises(LLMParamError):
        cm.allocate_cache(desc, [CacheKey(1, 5), CacheKey(1, 5)])  # duplicate
    with pytest.raises(LLMParamError):
        cm.allocate_cache(desc, [CacheKey(1, 5), CacheKey(1, 6), CacheKey(1, 7)])  # > rows
    with pytest.raises(TypeError):
        cm.allocate_cache(desc, [BlocksCacheKey(1, 0)])
    cm.allocate_cache(desc, [CacheKey(1, 5)])
    with pytest.raises(LLMParamError):
        cm.allocate_cache(desc, [CacheKey(1, 5)])  # already bound elsewhere
    cm.allocate_cache(desc, [CacheKey(1, 5, model_id=1)])  # another model: fine


async def test_deallocate_and_unregister_rules(pair: Pair) -> None:
    cm = pair.decoder.cache_manager
    arrays = [np.zeros(SHAPE, np.float16) for _ in range(4)]
    registered = cm.register_blocks_cache(_desc(), arrays)
    allocated = cm.allocate_blocks_cache(_desc())
    rows = cm.allocate_cache(_desc())
    cm.deallocate_blocks_cache(registered)  # upstream: a no-op for registered caches
    assert registered.tensors()[0].ctypes.data == arrays[0].ctypes.data
    with pytest.raises(LLMParamError):
        cm.unregister_cache(allocated.cache_id)  # allocated: use deallocate_*
    with pytest.raises(LLMParamError):
        cm.deallocate_cache(allocated)  # a blocks cache
    with pytest.raises(LLMParamError):
        cm.deallocate_blocks_cache(rows)  # not a blocks cache
    with pytest.raises(TypeError):
        cm.deallocate_blocks_cache(allocated.cache_id)
    with pytest.raises(TypeError):
        cm.unregister_cache("1")
    cm.unregister_cache(10**12)  # unknown id: no-op
    cm.deallocate_blocks_cache(allocated)
    cm.deallocate_blocks_cache(allocated)  # twice: no-op
    cm.deallocate_cache(rows)
    cm.unregister_cache(registered.cache_id)
    cm.unregister_cache(registered.cache_id)  # twice: no-op
    for gone in (registered, allocated):
        with pytest.raises(LLMParamError):
            await cm.pull_blocks(BlocksCacheKey(1, 0), gone, [0], [0])


async def test_unregistered_source_is_not_found(pair: Pair) -> None:
    src = pair.prompt_cache(num_tensors=4, num_blocks=8, block_shape=(64, 8, 16))
    dst = pair.decoder_cache(num_tensors=4, num_blocks=8, block_shape=(64, 8, 16))
    await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1], [1])
    pair.prompt.cache_manager.unregister_cache(src.cache.cache_id)
    with pytest.raises(LLMCacheNotFoundError) as info:
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [1], [1])
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


async def test_last_registration_wins_per_model_id(pair: Pair) -> None:
    first = pair.prompt_cache(model_id=5, seed=1, num_tensors=2, num_blocks=4,
                              block_shape=(64, 8, 16))
    second = pair.prompt_cache(model_id=5, seed=2, num_tensors=2, num_blocks=4,
                               block_shape=(64, 8, 16))
    other = pair.prompt_cache(model_id=6, seed=3, num_tensors=2, num_blocks=4,
                              block_shape=(64, 8, 16))
    dst = pair.decoder_cache(num_tensors=2, num_blocks=4, block_shape=(64, 8, 16))
    cm = pair.decoder.cache_manager
    await cm.pull_blocks(pair.key(5), dst.cache, [0, 1], [0, 1])
    await cm.pull_blocks(pair.key(6), dst.cache, [2], [2])
    for t in range(2):
        assert _same(dst.tensors[t][:2], second.tensors[t][:2])
        assert not _same(dst.tensors[t][:2], first.tensors[t][:2])
        assert _same(dst.tensors[t][2], other.tensors[t][2])
    # A third registration under the same model id takes over again.
    third = pair.prompt_cache(model_id=5, seed=4, num_tensors=2, num_blocks=4,
                              block_shape=(64, 8, 16))
    await cm.pull_blocks(pair.key(5), dst.cache, [3], [3])
    for t in range(2):
        assert _same(dst.tensors[t][3], third.tensors[t][3])


@pytest.mark.parametrize("side", ["prompt", "decoder"])
@pytest.mark.parametrize("allocate", [False, True], ids=["registered", "allocated"])
async def test_free_while_a_pull_is_in_flight_is_link_busy(
    pair: Pair, side: str, allocate: bool
) -> None:
    shape = (64, 8, 16)
    src = pair.prompt_cache(seed=1, num_tensors=4, num_blocks=8, block_shape=shape,
                            allocate=allocate)
    dst = pair.decoder_cache(num_tensors=4, num_blocks=8, block_shape=shape, allocate=allocate)
    channel = instrument(pair.decoder, 1)
    channel.gate = asyncio.Event()  # the pull holds both caches inside the link
    pull = asyncio.create_task(
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0, 1], [2, 3])
    )
    await wait_until(channel.inside.is_set, what="the pull to enter the link")
    dd, fc = (pair.prompt, src) if side == "prompt" else (pair.decoder, dst)
    free = (dd.cache_manager.deallocate_blocks_cache if allocate
            else lambda c: dd.cache_manager.unregister_cache(c.cache_id))

    with pytest.raises(LLMLinkError) as info:
        free(fc.cache)
    assert info.value.status_code == LLMStatusCode.LLM_LINK_BUSY

    channel.gate.set()
    await asyncio.wait_for(pull, 10)
    for t in range(4):
        assert _same(dst.tensors[t][2:4], src.tensors[t][0:2])
    free(fc.cache)  # now it is free
    with pytest.raises((LLMCacheNotFoundError, LLMParamError)):
        await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [0], [0])


async def test_registration_needs_init() -> None:
    from aiodatadist import LLMDataDist, LLMRole

    dd = LLMDataDist(LLMRole.PROMPT, 77)
    with pytest.raises(RuntimeError):
        dd.cache_manager.register_blocks_cache(_desc(), [np.zeros(SHAPE, np.float16)] * 4)
    await dd.init()
    cm = dd.cache_manager
    await dd.finalize()
    with pytest.raises(RuntimeError):
        cm.register_blocks_cache(_desc(), [np.zeros(SHAPE, np.float16) for _ in range(4)])
    with pytest.raises(RuntimeError):
        cm.allocate_blocks_cache(_desc())


async def test_kvcache_handle_is_plain() -> None:
    # create_cpu_cache makes a handle this process's manager does not know.
    arr = np.zeros(SHAPE, np.float16)
    cache = KvCache.create_cpu_cache(_desc(1), [arr.ctypes.data])
    assert cache.cache_id == -1 and cache.is_blocks_cache
    with pytest.raises(LLMException):
        cache.tensors()
