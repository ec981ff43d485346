"""Device memory: registered only where an engine moves it, never touched by our own paths.

No GPU here (this task was not lent the device machine): NIXL's VRAM registration
fails on this host, so a registered device cache is simulated where a test needs one
by marking a registered host cache's entry ``device_id = 0`` (the one attribute the
path choice, the serving side and the local operations read). The fake device
tensors below point at addresses nothing maps: any read or write of them would
crash the test process.
"""

from __future__ import annotations

import ctypes.util
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    DataPath,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing import inproc_pair, make_blocks_cache
from tests._engines import require_engine
from tests.test_buffers_dlpack import DeviceDLPack

pytestmark = pytest.mark.asyncio

FAKE = 0xDEAD_0000_0000
DESC = CacheDesc(
    num_tensors=2, shape=(4, 1024), data_type=DataType.DT_UINT8, placement=Placement.DEVICE
)


class FakeCuda:
    """A CUDA tensor seen through ``__cuda_array_interface__`` (CuPy, Numba, torch)."""

    def __init__(self, addr: int, nbytes: int, index: int | None = 0) -> None:
        self.__cuda_array_interface__ = {
            "data": (addr, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "strides": None,
            "version": 3,
        }
        if index is not None:
            self.device = type("Dev", (), {"index": index})()


def _no_gpu() -> None:
    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is present: VRAM registration would not fail here")


def _status(exc: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc.value.status_code


@pytest_asyncio.fixture
async def nixl_dd() -> Any:
    require_engine("nixl")
    dd = LLMDataDist(LLMRole.DECODER, 71)
    await dd.init({"aiodatadist.Engines": "nixl"})
    try:
        yield dd
    finally:
        await dd.finalize()


async def test_without_an_engine_device_tensors_are_refused_untouched() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 72)
    await dd.init({})
    try:
        dlpack = DeviceDLPack((4, 1024), bits=8)
        with pytest.raises(LLMException, match="needs a fabric data path") as e:
            dd.cache_manager.register_blocks_cache(
                DESC, [dlpack, DeviceDLPack((4, 1024), bits=8)], BlocksCacheKey(72, 0)
            )
        assert _status(e) == LLMStatusCode.LLM_PARAM_INVALID
        assert dlpack.exported == 0  # refused without exporting (touching) it
        assert len(dd.cache_manager._caches.table) == 0
    finally:
        await dd.finalize()


async def test_nixl_registers_device_memory_or_says_why_and_changes_nothing(
    nixl_dd: LLMDataDist,
) -> None:
    _no_gpu()
    cm = nixl_dd.cache_manager
    for tensors in (
        [FakeCuda(FAKE, 4096), FakeCuda(FAKE + (1 << 20), 4096)],
        [DeviceDLPack((4, 1024), bits=8), DeviceDLPack((4, 1024), bits=8, offset=1 << 20)],
    ):
        with pytest.raises(LLMException, match="NIXL cannot register") as e:
            cm.register_blocks_cache(DESC, tensors, BlocksCacheKey(71, 0))
        assert _status(e) == LLMStatusCode.LLM_PARAM_INVALID
        assert len(cm._caches.table) == 0 and not cm._caches.entries
    # The instance is unharmed: host memory registers and frees as before.
    host = make_blocks_cache(nixl_dd, num_tensors=2, num_blocks=4, block_shape=(1024,))
    assert host.cache.cache_id in cm._caches.entries
    cm.unregister_cache(host.cache.cache_id)


async def test_one_cache_is_all_host_or_all_one_cuda_device(nixl_dd: LLMDataDist) -> None:
    cm = nixl_dd.cache_manager
    host = np.zeros(4096, np.uint8)
    cases = {
        "host and device": (
            [host, FakeCuda(FAKE, 4096)],
            "all be host memory or all on one device",
        ),
        "two devices": (
            [FakeCuda(FAKE, 4096, 0), FakeCuda(FAKE + (1 << 20), 4096, 1)],
            "all be host memory or all on one device",
        ),
        "rocm": (
            [
                DeviceDLPack((4, 1024), bits=8, device=(10, 0)),
                DeviceDLPack((4, 1024), bits=8, device=(10, 0), offset=1 << 20),
            ],
            "move CUDA device memory only",
        ),
    }
    for name, (tensors, why) in cases.items():
        with pytest.raises(LLMException, match=why) as e:
            cm.register_blocks_cache(DESC, tensors, BlocksCacheKey(71, 0))
        assert _status(e) == LLMStatusCode.LLM_PARAM_INVALID, name
        assert not cm._caches.entries, name


async def test_local_operations_never_read_device_memory() -> None:
    async with inproc_pair() as pair:
        cm = pair.decoder.cache_manager
        filled = make_blocks_cache(pair.decoder, num_blocks=4, seed=5)
        before = [t.copy() for t in filled.tensors]
        cm._caches.entries[filled.cache.cache_id].device_id = 0  # a device cache (see above)
        with pytest.raises(LLMException, match="in device memory") as e:
            await cm.copy_blocks(filled.cache, {0: [1]})
        assert _status(e) == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(LLMException, match="in device memory"):
            filled.cache.tensors()
        cm._caches.entries[filled.cache.cache_id].device_id = None
        for got, want in zip(filled.cache.tensors(), before, strict=True):
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def _set_device(pair: Any, cache_id: int, device: int | None) -> None:
    """Makes the prompt's cache (not) a device cache in place, its serving threads' record
    too (a real one is registered so: ``device_id`` never changes after registration)."""
    caches = pair.prompt.cache_manager._caches
    entry = caches.entries[cache_id]
    entry.device_id = device
    slot, gen = entry.lease
    caches.leases.serve.put(cache_id, slot, gen, entry.geometry, entry.addrs, device is not None)


async def test_a_peer_asking_tcp_for_a_device_cache_is_refused() -> None:
    # The server's own check: whatever the requester's table says (here: host memory,
    # as the table was sent before the cache became a device cache), tcp never reads it.
    async with inproc_pair(data_path="tcp") as pair:
        src = make_blocks_cache(pair.prompt, model_id=3, num_blocks=4, seed=11)
        dst = make_blocks_cache(pair.decoder, num_blocks=4)
        key = BlocksCacheKey(pair.prompt.cluster_id, 3)
        await pair.decoder.cache_manager.pull_blocks(key, dst.cache, [0], [0])  # mirror fresh
        _set_device(pair, src.cache.cache_id, 0)
        for t in dst.tensors:
            t[...] = 0x5A
        with pytest.raises(LLMException, match="in device memory") as e:
            await pair.decoder.cache_manager.pull_blocks(key, dst.cache, [1, 2], [1, 2])
        assert _status(e) == LLMStatusCode.LLM_PARAM_INVALID
        assert all(bool((t == 0x5A).all()) for t in dst.tensors)  # nothing landed
        _set_device(pair, src.cache.cache_id, None)
        await pair.decoder.cache_manager.pull_blocks(key, dst.cache, [1], [1])  # link usable


@pytest.mark.parametrize(
    ("forced", "engines", "outcome"),
    [
        ("tcp", "", LLMStatusCode.LLM_PARAM_INVALID),  # our paths refuse it
        ("auto", "", LLMStatusCode.LLM_FEATURE_NOT_ENABLED),  # no engine to move it
        ("auto", "nixl", DataPath.NIXL),  # routed to the engine that moves it
    ],
)
async def test_device_caches_route_only_to_an_engine_that_moves_them(
    forced: str, engines: str, outcome: object
) -> None:
    if engines:
        require_engine(engines)
    options = {"aiodatadist.Engines": engines} if engines else {}
    async with inproc_pair(data_path="tcp", options=options) as pair:
        make_blocks_cache(pair.prompt, model_id=4, num_blocks=4, seed=12)
        dst = make_blocks_cache(pair.decoder, num_blocks=4)
        key = BlocksCacheKey(pair.prompt.cluster_id, 4)
        await pair.decoder.cache_manager.pull_blocks(key, dst.cache, [0], [0])
        link = pair.decoder._rt.links.get(pair.prompt.cluster_id)
        path = link.path
        path.forced = DataPath(forced)  # (the decoder's choice; both ends are in this process)
        remote = path.remote_table.blocks(4)
        assert remote is not None
        remote.device_id = 0  # the peer said: on cuda:0
        if isinstance(outcome, DataPath):
            assert path.path_for(remote).kinds[0] == outcome
            return
        with pytest.raises(LLMException) as e:
            path.path_for(remote)
        assert _status(e) == outcome
        with pytest.raises(LLMException) as e2:
            await pair.decoder.cache_manager.pull_blocks(key, dst.cache, [1], [1])
        assert _status(e2) == outcome


async def test_an_inproc_link_refuses_device_caches_at_either_end() -> None:
    async with inproc_pair() as pair:
        src = make_blocks_cache(pair.prompt, model_id=6, num_blocks=4, seed=13)
        dst = make_blocks_cache(pair.decoder, num_blocks=4)
        key = BlocksCacheKey(pair.prompt.cluster_id, 6)
        for entry in (
            pair.prompt.cache_manager._caches.entries[src.cache.cache_id],
            pair.decoder.cache_manager._caches.entries[dst.cache.cache_id],
        ):
            for t in dst.tensors:
                t[...] = 0x33
            entry.device_id = 0  # (a device cache: see the module docstring)
            with pytest.raises(LLMException, match="in device memory") as e:
                await pair.decoder.cache_manager.pull_blocks(key, dst.cache, [0, 1], [0, 1])
            assert _status(e) == LLMStatusCode.LLM_PARAM_INVALID
            entry.device_id = None
            assert all(bool((t == 0x33).all()) for t in dst.tensors)  # nothing moved
        await pair.decoder.cache_manager.pull_blocks(key, dst.cache, [0], [0])
