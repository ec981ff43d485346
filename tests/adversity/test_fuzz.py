"""API fuzz: every public method and value type, fed hostile values (hypothesis).

Each example takes a valid call and replaces one or two of its arguments with hostile
values: wrong types, bools, huge and negative integers, ``inf``/``nan`` timeouts,
``range(10**12)``, numpy scalars and arrays, nested junk. The only outcomes allowed:
success, ``TypeError``, ``ValueError`` (``LLMParamError``), or an ``LLMException``
with a documented status; never another exception (``OverflowError``,
``MemoryError``, a pybind ``TypeError`` message is still a TypeError and allowed),
never a hang, never a crash. A failed call changes nothing (registrations, links);
a successful pull brings the right bytes; after the fuzz a verified pull works.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import operator
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiodatadist as add
from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMException,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import cluster_info, inproc_pair, make_blocks_cache
from tests.adversity._common import (
    LONG,
    Figures,
    check_pull,
    fill_blocks,
    long_seconds,
    new_cluster_id,
    snapshot,
)

S = LLMStatusCode
DOCUMENTED = {
    S.LLM_PARAM_INVALID,
    S.LLM_KV_CACHE_NOT_EXIST,
    S.LLM_NOT_YET_LINK,
    S.LLM_ALREADY_LINK,
    S.LLM_LINK_FAILED,
    S.LLM_UNLINK_FAILED,
    S.LLM_EXIST_LINK,
    S.LLM_LINK_BUSY,
    S.LLM_PROCESSING_LINK,
    S.LLM_TIMEOUT,
    S.LLM_WAIT_PROCESS_TIMEOUT,
    S.LLM_FEATURE_NOT_ENABLED,
    S.LLM_FAILED,  # a call on an instance of the wrong role
}
CALL_BOUND = 15.0
# The targets that may write into the decoder's destination cache (checked byte by byte).
TOUCH_DST = frozenset(
    {
        "pull_blocks",
        "pull_cache",
        "pull_by_id",
        "copy_blocks",
        "deallocate_cache",
        "deallocate_blocks_cache",
        "transfer_cache_async",
    }
)  # seconds any one call may take (a hang fails the example)

SEED = 4242
NT, NB, SHAPE = 4, 16, (16, 2, 64)


def _hostile_fixed() -> list[Any]:
    return [
        None,
        True,
        False,
        0,
        -1,
        1,
        2**31,
        2**32,
        2**63 - 1,
        2**63,
        2**64 - 1,
        2**64,
        -(2**63) - 1,
        10**12,
        10**400,
        0.0,
        -0.0,
        1.5,
        1e308,
        float("inf"),
        float("-inf"),
        float("nan"),
        "",
        "0",
        "abc",
        "\x00",
        b"",
        b"\x00" * 8,
        bytearray(8),
        (),
        [],
        {},
        {1: [2]},
        {0: [10**12]},
        [True, False],
        [1.5],
        ["a"],
        [None],
        [2**63],
        [2**64],
        [-1],
        [0, 0],
        [[0]],
        range(10**12),
        range(-1, 3),
        range(0),
        range(2**63, 2**63 + 2),
        np.int64(1),
        np.int32(-1),
        np.uint64(2**64 - 1),
        np.bool_(True),
        np.float64(1.0),
        np.array([0, 1]),
        np.array([[0, 1]]),
        np.array([0.5]),
        np.array([], dtype=np.int64),
        np.array([True]),
        np.array([2**63], dtype=np.uint64),
        np.zeros(3, dtype=np.uint8),
        object(),
        Placement.HOST,
        DataType.DT_FLOAT16,
        S.LLM_SUCCESS,
        BlocksCacheKey(1, 0),
        CacheKey(1, 1),
        LLMClusterInfo(),
        frozenset({1}),
        iter([1, 2]),
        slice(0, 2),
    ]


HOSTILE = _hostile_fixed()
hostile = st.one_of(
    st.sampled_from(HOSTILE),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-4, max_value=2**64 + 4), max_size=6),
    st.lists(st.integers(min_value=0, max_value=NB + 2), min_size=1, max_size=4).map(np.array),
)


class _Always(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


@dataclass
class Env:
    loop: asyncio.AbstractEventLoop
    pair: Any
    src: Any
    dst: Any
    fig: Figures
    violations: dict[str, str] | None = None

    def violation(self, key: str, what: str) -> None:
        if self.violations is None:
            self.violations = {}
        self.violations.setdefault(key, what[:400])

    @property
    def dcm(self) -> add.CacheManager:
        return self.pair.decoder.cache_manager

    @property
    def pcm(self) -> add.CacheManager:
        return self.pair.prompt.cache_manager

    @property
    def key(self) -> BlocksCacheKey:
        return BlocksCacheKey(self.pair.prompt.cluster_id, 0)


@dataclass
class Target:
    name: str
    call: Callable[[list[Any]], Any]
    template: list[Any]
    must_mutate: tuple[int, ...] = ()  # the template itself would change state


def desc() -> CacheDesc:
    return CacheDesc(2, [4, *SHAPE], DataType.DT_FLOAT16, Placement.HOST)


def arrays(n: int = 2) -> list[Any]:
    return [np.zeros((4, *SHAPE), dtype=np.float16) for _ in range(n)]


def targets(env: Env) -> list[Target]:
    d, p = env.dcm, env.pcm
    pid = env.pair.prompt.cluster_id
    did = env.pair.decoder.cluster_id
    addr = env.pair.extra.get("address", ("127.0.0.1", 1))
    cfg = LLMConfig()
    info = LLMClusterInfo()
    t: list[Target] = [
        Target(
            "pull_blocks",
            lambda a: d.pull_blocks(
                a[0],
                a[1],
                a[2],
                a[3],
                src_layer_range=a[4],
                dst_layer_range=a[5],
                tensor_num_per_layer=a[6],
                timeout=a[7],
            ),
            [env.key, env.dst.cache, [0, 1], [2, 3], None, None, 2, 5.0],
        ),
        Target(
            "pull_cache",
            lambda a: d.pull_cache(
                a[0],
                a[1],
                a[2],
                a[3],
                src_layer_range=a[4],
                dst_layer_range=a[5],
                tensor_num_per_layer=a[6],
                timeout=a[7],
            ),
            [CacheKey(pid, 1), env.dst.cache, 0, -1, None, None, 2, 5.0],
        ),
        Target(
            "pull_by_id",
            lambda a: d.pull_cache(a[0], a[1], a[2], timeout=a[3]),
            [CacheKeyByIdAndIndex(pid, 10**6, 0), env.dst.cache, 0, 5.0],
        ),
        Target(
            "copy_blocks",
            lambda a: d.copy_blocks(a[0], a[1], timeout=a[2]),
            [env.dst.cache, {0: [1]}, 5.0],
        ),
        Target(
            "transfer_cache_async",
            lambda a: p.transfer_cache_async(a[0], a[1], a[2], a[3], a[4], a[5]),
            [
                env.src.cache,
                _Always(),
                [TransferWithCacheKeyConfig(BlocksCacheKey(did, 77), range(2), range(2))],
                [0],
                [0],
                None,
            ],
        ),
        Target(
            "register_blocks_cache",
            lambda a: d.register_blocks_cache(a[0], a[1], a[2], a[3]),
            [desc(), arrays(), BlocksCacheKey(did, 9), None],
        ),
        Target(
            "register_cache",
            lambda a: d.register_cache(a[0], a[1], a[2], a[3]),
            [desc(), arrays(), [CacheKey(did, 5)], None],
        ),
        Target(
            "allocate_blocks_cache",
            lambda a: d.allocate_blocks_cache(a[0], a[1]),
            [desc(), BlocksCacheKey(did, 10)],
        ),
        Target(
            "allocate_cache", lambda a: d.allocate_cache(a[0], a[1]), [desc(), [CacheKey(did, 6)]]
        ),
        Target("unregister_cache", lambda a: d.unregister_cache(_not_ours(env, a[0])), [10**9]),
        Target("deallocate_cache", lambda a: d.deallocate_cache(a[0]), [env.dst.cache], (0,)),
        Target(
            "deallocate_blocks_cache",
            lambda a: d.deallocate_blocks_cache(a[0]),
            [env.dst.cache],
            (0,),
        ),
        Target("remove_cache_key", lambda a: p.remove_cache_key(a[0]), [CacheKey(pid, 77)]),
        Target(
            "link_clusters",
            lambda a: env.pair.decoder.link_clusters(a[0], a[1]),
            [[cluster_info(pid, *addr)], 3000],
        ),
        Target(
            "unlink_clusters",
            lambda a: env.pair.decoder.unlink_clusters(a[0], a[1], a[2]),
            [[cluster_info(10**6)], 3000, False],
        ),
        Target("init", lambda a: env.pair.decoder.init(a[0]), [{}]),
        Target(
            "CacheDesc",
            lambda a: CacheDesc(*a),
            [4, [8, *SHAPE], DataType.DT_FLOAT16, Placement.HOST, 0, -1, None],
        ),
        Target("BlocksCacheKey", lambda a: BlocksCacheKey(a[0], a[1]), [1, 0]),
        Target("CacheKey", lambda a: CacheKey(a[0], a[1], a[2], a[3]), [1, 1, 0, 2**64 - 1]),
        Target("CacheKeyByIdAndIndex", lambda a: CacheKeyByIdAndIndex(*a), [1, 1, 0]),
        Target("TransferConfig", lambda a: TransferConfig(*a), [1, [4096, 8192], range(2), 0]),
        Target(
            "TransferWithCacheKeyConfig",
            lambda a: TransferWithCacheKeyConfig(*a),
            [BlocksCacheKey(1, 0), range(2), range(2), 0],
        ),
        Target("MemInfo", lambda a: MemInfo(*a), [next(iter(Memtype)), 4096, 4096]),
        Target(
            "KvCache.create_cpu_cache",
            lambda a: KvCache.create_cpu_cache(a[0], a[1]),
            [desc(), [4096, 8192]],
        ),
        Target(
            "LLMClusterInfo.append",
            lambda a: (
                info.append_local_ip_info(a[0], a[1]),
                info.append_remote_ip_info(a[2], a[3]),
            ),
            ["127.0.0.1", 1, "127.0.0.1", 2],
        ),
        Target(
            "LLMClusterInfo.remote_cluster_id",
            lambda a: setattr(info, "remote_cluster_id", a[0]),
            [5],
        ),
    ]
    for prop in sorted(
        n
        for n, v in inspect.getmembers(LLMConfig)
        if isinstance(v, property) and v.fset is not None
    ):

        def setter(a: list[Any], prop: str = prop) -> Any:
            setattr(cfg, prop, a[0])
            return cfg.generate_options()

        t.append(Target(f"LLMConfig.{prop}", setter, [getattr(cfg, prop, None)], (0,)))
    return t


def state(env: Env) -> Any:
    def ids(cm: add.CacheManager) -> list[tuple[int, Any]]:
        return sorted((int(x["cache_id"]), x.get("model_id")) for x in cm.table.describe())

    return (
        ids(env.dcm),
        ids(env.pcm),
        sorted((lk.remote_cluster_id, lk.data_path) for lk in env.pair.decoder.links),
        sorted(lk.remote_cluster_id for lk in env.pair.prompt.links),
        env.pair.decoder.is_initialized,
        env.pair.prompt.is_initialized,
    )


def _ids(v: Any) -> list[int] | None:
    with contextlib.suppress(Exception):
        if isinstance(v, (bool, np.bool_)) or isinstance(v, (str, bytes)):
            return None
        out = []
        for x in list(v)[:64]:
            if isinstance(x, (bool, np.bool_)):
                return None
            out.append(operator.index(x))
        return out
    return None


def _not_ours(env: Env, value: Any) -> Any:
    """A hostile cache id, but never the id of the fuzz's own caches: unregistering one of
    them is a legal call, and the verified pull at the end would have no cache to pull into
    (hypothesis draws small integers such as 1 and 2 often)."""
    if isinstance(value, (bool, np.bool_)):
        return value
    try:
        cid = operator.index(value)
    except TypeError:
        return value
    return 10**9 if cid in (env.src.cache.cache_id, env.dst.cache.cache_id) else value


async def run_one(env: Env, target: Target, args: list[Any]) -> None:
    fig = env.fig
    before_state = state(env)
    touches = target.name in TOUCH_DST
    before = snapshot(env.dst.tensors) if touches else None
    result: Any = None
    try:
        async with asyncio.timeout(CALL_BOUND):
            result = target.call(args)
            if inspect.isawaitable(result):
                result = await result
    except TimeoutError as e:
        if not isinstance(e, LLMException):
            env.violation(
                f"{target.name}:hang", f"{target.name}({args!r:.300}): no answer in {CALL_BOUND} s"
            )
            return
        fig.error(e)
    except LLMException as e:
        if e.status_code not in DOCUMENTED:
            env.violation(
                f"{target.name}:{e.status_code}",
                f"{target.name}({args!r:.200}): undocumented status {e!r:.200}",
            )
        fig.error(e)
    except (TypeError, ValueError) as e:
        fig.error(e)
    except Exception as e:
        fig.error(e)
        env.violation(
            f"{target.name}:{type(e).__name__}",
            f"{target.name}({args!r:.300}) raised {type(e).__name__}: {e!s:.200}",
        )
        return
    else:
        fig.pulls += target.name == "pull_blocks"
        fig.errors["success"] += 1
        await after_success(env, target, args, result, before)
        return
    after = state(env)
    if after != before_state:
        env.violation(
            f"{target.name}:state",
            f"a failed {target.name}({args!r:.200}) changed the state: {before_state} -> {after}",
        )
    # A failed call wrote nothing into the destination (a failed pull may leave the
    # blocks it named undefined, nothing else).
    if before is None:
        return
    named = _ids(args[3]) if target.name == "pull_blocks" else None
    valid = named is not None and all(0 <= b < NB for b in named)
    _, canary = check_pull(env.dst.tensors, before, [], named if valid else None, None)
    if canary:
        env.fig.bad(
            f"failed {target.name}({args!r:.200}) changed {canary} destination bytes", canary
        )


async def after_success(
    env: Env, target: Target, args: list[Any], result: Any, before: np.ndarray | None
) -> None:
    if isinstance(result, KvCache) and target.name != "KvCache.create_cpu_cache":
        cm = env.dcm
        if "allocate" in target.name:
            (cm.deallocate_blocks_cache if result.is_blocks_cache else cm.deallocate_cache)(result)
        else:
            cm.unregister_cache(result.cache_id)
    if isinstance(result, add.CacheTask):
        with contextlib.suppress(LLMException):
            await result.synchronize(5000)
    if target.name == "pull_blocks" and before is not None and args[4] is None and args[5] is None:
        src, dst = _ids(args[2]), _ids(args[3])
        if src is None or dst is None:
            env.violation("pull_blocks:accepted", f"pull_blocks accepted {args[2:4]!r:.200}")
            return
        bad, canary = check_pull(env.dst.tensors, before, src, dst, SEED)
        if bad or canary:
            env.fig.bad(
                f"pull_blocks({args[2]!r:.80}, {args[3]!r:.80}) succeeded with "
                f"{bad} + {canary} wrong bytes",
                bad + canary,
            )


@contextlib.contextmanager
def environment(loop: asyncio.AbstractEventLoop, fig: Figures) -> Iterator[Env]:
    cm = inproc_pair(prompt_id=new_cluster_id(), decoder_id=new_cluster_id(), data_path="tcp")
    pair = loop.run_until_complete(cm.__aenter__())
    ok = False
    try:
        src = make_blocks_cache(
            pair.prompt,
            num_tensors=NT,
            num_blocks=NB,
            block_shape=SHAPE,
            model_id=0,
            seed=SEED,
            pattern=True,
        )
        dst = make_blocks_cache(pair.decoder, num_tensors=NT, num_blocks=NB, block_shape=SHAPE)
        yield Env(loop, pair, src, dst, fig)
        ok = True
    finally:
        exc = (None, None, None) if ok else (RuntimeError, RuntimeError("fuzz"), None)
        loop.run_until_complete(asyncio.wait_for(cm.__aexit__(*exc), 60))


LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.mark.adversity(ci=0.0, weight=1.0)
@pytest.mark.parametrize("loop_kind", list(LOOPS))
def test_api_fuzz(loop_kind: str) -> None:
    fig = Figures(f"api-fuzz[{loop_kind}]")
    loop = LOOPS[loop_kind]()
    try:
        with environment(loop, fig) as env:
            tlist = targets(env)

            @settings(
                max_examples=max(200, int(long_seconds() * 8)) if LONG else 100,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow],
            )
            @given(
                which=st.integers(min_value=0, max_value=len(tlist) - 1),
                muts=st.lists(
                    st.tuples(st.integers(min_value=0, max_value=7), hostile),
                    min_size=1,
                    max_size=2,
                ),
            )
            def fuzz(which: int, muts: list[tuple[int, Any]]) -> None:
                target = tlist[which]
                args = list(target.template)
                touched = set()
                for pos, value in muts:
                    i = pos % len(args)
                    args[i] = value
                    touched.add(i)
                for i in target.must_mutate:
                    if i not in touched:
                        args[i] = muts[0][1]
                loop.run_until_complete(run_one(env, target, args))

            # Every hostile value in every argument position of every target, one at a
            # time (deterministic: the contract holds for each), then random mixes.
            for target in tlist:
                for i in range(len(target.template)):
                    for value in HOSTILE:
                        args = list(target.template)
                        args[i] = value
                        if any(j != i for j in target.must_mutate):
                            continue
                        loop.run_until_complete(run_one(env, target, args))
            fuzz()
            # Every target once more, unmutated where that changes nothing.
            for target in tlist:
                if not target.must_mutate:
                    loop.run_until_complete(run_one(env, target, list(target.template)))
            # The instance still works: a verified pull of every block, fresh pattern.
            seed = random.randrange(1 << 40)
            blocks = list(range(NB))
            fill_blocks(env.src.tensors, seed, blocks)
            before = snapshot(env.dst.tensors)
            loop.run_until_complete(
                env.dcm.pull_blocks(env.key, env.dst.cache, blocks, blocks, timeout=10.0)
            )
            bad, _ = check_pull(env.dst.tensors, before, blocks, blocks, seed)
            fig.pulls += 1
            assert bad == 0, f"the verified pull after the fuzz: {bad} bytes wrong"
            fig.other["violations"] = env.violations or {}
            assert not env.violations, (
                f"{len(env.violations)} kind(s) of contract violation:\n"
                + "\n".join(env.violations.values())
            )
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
    fig.check()


@pytest.mark.adversity(ci=0.0, weight=0.1)
@pytest.mark.parametrize("path", ["inproc", "tcp"])
@pytest.mark.asyncio
async def test_numpy_ids_accepted_bools_refused(path: str) -> None:
    """Block tables are numpy arrays: numpy integer scalars and 1-D integer arrays are ids
    (``operator.index``); bools are not (issue 9, finding 9)."""
    async with inproc_pair(
        prompt_id=new_cluster_id(), decoder_id=new_cluster_id(), data_path=path
    ) as pair:
        src = make_blocks_cache(
            pair.prompt, num_tensors=NT, num_blocks=NB, block_shape=SHAPE, model_id=0
        )
        dst = make_blocks_cache(pair.decoder, num_tensors=NT, num_blocks=NB, block_shape=SHAPE)
        key = BlocksCacheKey(pair.prompt.cluster_id, 0)
        cm = pair.decoder.cache_manager
        cases: list[tuple[Any, Any]] = [
            (np.array([1, 2, 3]), np.array([4, 5, 6], dtype=np.int32)),
            ([np.int64(7), np.uint32(8)], [np.int16(9), np.uint64(10)]),
            (np.arange(NB, dtype=np.uint64), np.arange(NB)[::-1].copy()),
        ]
        for k, (s, d) in enumerate(cases):
            seed = random.randrange(1 << 40) + k
            s_ids = [int(x) for x in s]
            d_ids = [int(x) for x in d]
            fill_blocks(src.tensors, seed, s_ids)
            before = snapshot(dst.tensors)
            await cm.pull_blocks(key, dst.cache, s, d, timeout=5.0)
            bad, canary = check_pull(dst.tensors, before, s_ids, d_ids, seed)
            assert bad == 0 and canary == 0, (k, bad, canary)
        for s, d in ([True], [0]), ([0], [np.bool_(False)]), (np.array([True]), [0]):
            with pytest.raises(TypeError):
                await cm.pull_blocks(key, dst.cache, s, d, timeout=5.0)
        for s in ([2**63], [2**64 - 1], range(10**12)):
            with pytest.raises((ValueError, LLMException)) as ei:
                await cm.pull_blocks(key, dst.cache, s, s, timeout=5.0)
            if isinstance(ei.value, LLMException):
                assert ei.value.status_code == S.LLM_PARAM_INVALID
        # inf: refused (ValueError) or "no limit"; never OverflowError.
        with contextlib.suppress(ValueError, TypeError):
            await cm.pull_blocks(key, dst.cache, [0], [1], timeout=float("inf"))
