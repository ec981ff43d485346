"""``swap_blocks``: block ``s`` -> block ``src_to_dst[s]`` of every tensor between a HOST
and a DEVICE blocks cache (the placement is a label here), including a
``KvCache.create_cpu_cache`` host side, which is accepted only inside registered memory."""

from __future__ import annotations

import numpy as np
import pytest
import pytest_asyncio

from aiodatadist import (
    CacheDesc,
    DataType,
    KvCache,
    LLMDataDist,
    LLMParamError,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.testing.patterns import fill_pattern

pytestmark = pytest.mark.asyncio

NB = 6
BB = 4096


class Blocks:
    """A registered blocks cache of ``n`` tensors x ``nb`` blocks of ``bb`` bytes."""

    def __init__(self, dd, n: int, placement: Placement, seed: int, nb: int = NB, bb: int = BB):
        self.desc = CacheDesc(n, [nb, bb], DataType.DT_UINT8, placement)
        self.tensors = [np.zeros((nb, bb), np.uint8) for _ in range(n)]
        fill_pattern(self.tensors, seed)
        self.cache = dd.cache_manager.register_blocks_cache(self.desc, self.tensors)

    def copy(self) -> list[np.ndarray]:
        return [t.copy() for t in self.tensors]


def _same(got, want) -> None:
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"tensor {t} differs from the reference"


@pytest_asyncio.fixture
async def dd():
    async with LLMDataDist(LLMRole.DECODER, 71) as d:
        yield d


async def test_swap_out_and_in(dd: LLMDataDist) -> None:
    dev = Blocks(dd, 4, Placement.DEVICE, seed=401)
    host = Blocks(dd, 4, Placement.HOST, seed=1401)
    want_host = host.copy()
    for t in range(4):
        want_host[t][5] = dev.tensors[t][0]
        want_host[t][1] = dev.tensors[t][3]
    before_dev = dev.copy()
    await dd.cache_manager.swap_blocks(dev.cache, host.cache, {0: 5, 3: 1})
    _same(host.tensors, want_host)
    _same(dev.tensors, before_dev)
    # Swap in: host block 2 -> device block 4.
    want_dev = dev.copy()
    for t in range(4):
        want_dev[t][4] = host.tensors[t][2]
    await dd.cache_manager.swap_blocks(host.cache, dev.cache, {2: 4}, timeout=5)
    _same(dev.tensors, want_dev)
    # An empty mapping moves nothing.
    await dd.cache_manager.swap_blocks(host.cache, dev.cache, {})
    _same(dev.tensors, want_dev)


async def test_a_cpu_cache_inside_registered_memory(dd: LLMDataDist) -> None:
    dev = Blocks(dd, 2, Placement.DEVICE, seed=402)
    # A big registered host buffer; the CPU cache wraps 3 blocks of each tensor's middle.
    pool = Blocks(dd, 2, Placement.HOST, seed=1402, nb=16)
    desc = CacheDesc(2, [3, BB], DataType.DT_UINT8, Placement.HOST)
    addrs = [t[5:8].ctypes.data for t in pool.tensors]
    cpu = KvCache.create_cpu_cache(desc, addrs)
    assert cpu.cache_id == -1
    want = pool.copy()
    for t in range(2):
        want[t][5 + 2] = dev.tensors[t][1]
        want[t][5 + 0] = dev.tensors[t][4]
    await dd.cache_manager.swap_blocks(dev.cache, cpu, {1: 2, 4: 0})
    _same(pool.tensors, want)
    # And back in.
    want_dev = dev.copy()
    for t in range(2):
        want_dev[t][0] = pool.tensors[t][6]
    await dd.cache_manager.swap_blocks(cpu, dev.cache, {1: 0})
    _same(dev.tensors, want_dev)


async def test_a_cpu_cache_outside_registered_memory_is_refused(dd: LLMDataDist) -> None:
    dev = Blocks(dd, 2, Placement.DEVICE, seed=403)
    pool = Blocks(dd, 2, Placement.HOST, seed=1403, nb=4)
    stray = [np.zeros((3, BB), np.uint8) for _ in range(2)]  # never registered
    desc = CacheDesc(2, [3, BB], DataType.DT_UINT8, Placement.HOST)
    before = dev.copy()
    cases = [
        [t.ctypes.data for t in stray],
        # Starts inside the pool, runs past its end.
        [pool.tensors[0][2:].ctypes.data, pool.tensors[1].ctypes.data],
    ]
    for addrs in cases:
        cpu = KvCache.create_cpu_cache(desc, addrs)
        for args in ((dev.cache, cpu, {0: 0}), (cpu, dev.cache, {0: 0})):
            with pytest.raises(LLMParamError, match="not inside memory") as info:
                await dd.cache_manager.swap_blocks(*args)
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    _same(dev.tensors, before)
    assert not any(t.any() for t in stray)
    # A CPU cache wrapping the device cache's own memory is refused too.
    cpu = KvCache.create_cpu_cache(
        CacheDesc(2, [NB, BB], DataType.DT_UINT8, Placement.HOST),
        [t.ctypes.data for t in dev.tensors],
    )
    with pytest.raises(LLMParamError, match="share memory"):
        await dd.cache_manager.swap_blocks(dev.cache, cpu, {0: 1})
    _same(dev.tensors, before)
    # Once the pool is unregistered, a CPU cache inside it is refused.
    inside = KvCache.create_cpu_cache(desc, [t[0:3].ctypes.data for t in pool.tensors])
    await dd.cache_manager.swap_blocks(dev.cache, inside, {0: 0})
    dd.cache_manager.unregister_cache(pool.cache.cache_id)
    with pytest.raises(LLMParamError, match="not inside memory"):
        await dd.cache_manager.swap_blocks(dev.cache, inside, {0: 1})


async def test_bad_arguments_change_nothing(dd: LLMDataDist) -> None:
    dev = Blocks(dd, 2, Placement.DEVICE, seed=404)
    host = Blocks(dd, 2, Placement.HOST, seed=1404)
    host2 = Blocks(dd, 2, Placement.HOST, seed=1405)
    dev2 = Blocks(dd, 2, Placement.DEVICE, seed=405)
    three = Blocks(dd, 3, Placement.HOST, seed=1406)
    wide = Blocks(dd, 2, Placement.HOST, seed=1407, bb=2 * BB)
    rows = dd.cache_manager.register_cache(
        CacheDesc(2, [NB, BB], DataType.DT_UINT8, Placement.HOST),
        [np.zeros((NB, BB), np.uint8) for _ in range(2)],
    )
    caches = [dev, host, host2, dev2, three, wide]
    before = [c.copy() for c in caches]
    cm = dd.cache_manager
    bad = [
        ((dev.cache, host.cache, {NB: 0}), LLMParamError),
        ((dev.cache, host.cache, {0: NB}), LLMParamError),
        ((dev.cache, host.cache, {-1: 0}), LLMParamError),
        ((dev.cache, host.cache, {0: 1.0}), TypeError),
        ((dev.cache, host.cache, {0: 2, 1: 2}), LLMParamError),  # one destination twice
        ((dev.cache, host.cache, {i: 0 for i in range(NB + 1)}), LLMParamError),
        ((dev.cache, host.cache, [(0, 0)]), TypeError),
        ((host.cache, host2.cache, {0: 0}), LLMParamError),  # HOST -> HOST
        ((dev.cache, dev2.cache, {0: 0}), LLMParamError),  # DEVICE -> DEVICE
        ((dev.cache, three.cache, {0: 0}), LLMParamError),  # tensor counts differ
        ((dev.cache, wide.cache, {0: 0}), LLMParamError),  # block sizes differ
        ((dev.cache, rows, {0: 0}), LLMParamError),  # not a blocks cache
        ((rows, dev.cache, {0: 0}), LLMParamError),
        ((dev.cache, object(), {0: 0}), TypeError),
    ]
    for args, exc in bad:
        with pytest.raises(exc):
            await cm.swap_blocks(*args)
        for c, b in zip(caches, before, strict=True):
            _same(c.tensors, b)
    with pytest.raises(LLMParamError):
        await cm.swap_blocks(dev.cache, host.cache, {0: 0}, timeout=0)
