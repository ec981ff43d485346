"""``_runner.run``, the one path, against a fake data path (no pair, no native mover).

The fake records what reached it and can be told to find the peer's table stale (a
refresh brings a new one) or the lease stale (``LeaseStale`` before a byte moved).
Each test states one rule of the path: one refresh on a miss, re-plan when the table
moved while queued, one retry on a stale lease, holds released on every exit.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiodatadist import _native, _runner
from aiodatadist._caches import CacheEntry, CacheTable
from aiodatadist._leases import LeaseStale
from aiodatadist._plan import PullRequest, PushRequest
from aiodatadist.config import DataPath
from aiodatadist.errors import (
    LLMCacheNotFoundError,
    LLMStatusCode,
    api_scope,
    current_api,
    failure,
)
from aiodatadist.links import Link
from aiodatadist.transports.base import Call, Path
from aiodatadist.types import BlocksCacheKey

pytestmark = pytest.mark.asyncio

PEER = 7


def _entry(cache_id: int, model_id: int | None = None, *, local: bool = False) -> CacheEntry:
    return CacheEntry(
        cache_id=cache_id,
        num_tensors=2,
        num_blocks=4,
        block_bytes=16,
        is_blocks=True,
        addrs=[0x1000 * cache_id, 0x1000 * cache_id + 0x800],
        model_id=model_id,
        local=local,
    )


def _table(*entries: CacheEntry) -> CacheTable:
    table = CacheTable()
    for e in entries:
        table.add(e)
    return table


class FakePath(Path):
    """Records each pull/push as (kind, remote cache id, segments, api)."""

    kinds = (DataPath.INPROC,)

    def __init__(self, table: CacheTable) -> None:
        self._table = table
        self.next_table: CacheTable | None = None  # what a refresh brings, if anything
        self.stale = 0  # how many calls find the lease stale
        self.refreshes = 0
        self.moves: list[tuple[str, int, list[list[int]], str]] = []

    @property
    def remote_table(self) -> CacheTable:
        return self._table

    async def refresh(self, deadline: float | None) -> bool:
        self.refreshes += 1
        if self.next_table is not None:
            self._table.replace_with(self.next_table)
            self.next_table = None
        return True

    async def _move(self, kind: str, plan: _native.Plan, remote: CacheEntry, call: Call) -> None:
        assert remote.busy == 1  # held while the path runs
        if self.stale:
            self.stale -= 1
            raise failure(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "stale", kind=LeaseStale)
        self.moves.append((kind, remote.cache_id, plan.segments().tolist(), call.api))

    async def pull(
        self, plan: _native.Plan, remote: CacheEntry, local: CacheEntry, call: Call
    ) -> None:
        assert local.busy == 1
        await self._move("pull", plan, remote, call)

    async def push(
        self, plan: _native.Plan, local: CacheEntry, remote: CacheEntry, call: Call
    ) -> None:
        assert local.busy == 1
        await self._move("push", plan, remote, call)


class FakeRuntime:
    """What the runner needs of a Runtime: a call's budget."""

    def call(self, deadline: float | None) -> Call:
        return Call(api=current_api(), deadline=deadline, executor=None)  # type: ignore[arg-type]


def _pull(local: CacheEntry, model_id: int = 1) -> PullRequest:
    deadline = asyncio.get_running_loop().time() + 5
    return PullRequest(
        local=local,
        key=BlocksCacheKey(PEER, model_id),
        deadline=deadline,
        src_blocks=(1,),
        dst_blocks=(2,),
    )


async def _run(path: FakePath, request: Any, link: Link | None = None) -> Link:
    link = link or Link(1, PEER, path)
    with api_scope("pull_blocks"):
        await _runner.run(FakeRuntime(), link, request)  # type: ignore[arg-type]
    return link


async def test_a_pull_moves_the_planned_segments_once() -> None:
    remote, local = _entry(1, model_id=1), _entry(50, local=True)
    path = FakePath(_table(remote))
    link = await _run(path, _pull(local))
    assert path.moves == [("pull", 1, [[0, 16, 0, 32, 16], [1, 16, 1, 32, 16]], "pull_blocks")]
    assert (path.refreshes, link.transfers, local.busy, remote.busy) == (0, 1, 0, 0)


async def test_a_push_goes_to_the_paths_push() -> None:
    remote, local = _entry(1, model_id=1), _entry(50, local=True)
    path = FakePath(_table(remote))
    deadline = asyncio.get_running_loop().time() + 5
    request = PushRequest(
        local=local,
        cluster_id=PEER,
        deadline=deadline,
        layer=0,
        key=BlocksCacheKey(PEER, 1),
        src_blocks=(3,),
        dst_blocks=(0,),
    )
    await _run(path, request)
    assert path.moves == [("push", 1, [[0, 48, 0, 0, 16], [1, 48, 1, 0, 16]], "pull_blocks")]


async def test_a_miss_refreshes_once_and_finds_a_new_registration() -> None:
    local = _entry(50, local=True)
    path = FakePath(_table())
    path.next_table = _table(_entry(2, model_id=1))
    await _run(path, _pull(local))
    assert path.refreshes == 1
    assert [m[1] for m in path.moves] == [2]


async def test_a_miss_after_the_refresh_is_cache_not_found() -> None:
    local = _entry(50, local=True)
    path = FakePath(_table(_entry(1, model_id=1)))
    with pytest.raises(LLMCacheNotFoundError) as ei:
        await _run(path, _pull(local, model_id=9))
    assert ei.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert str(ei.value).startswith("[pull_blocks] failed")
    assert (path.refreshes, path.moves, local.busy) == (1, [], 0)


async def test_a_bad_request_is_not_refreshed_for() -> None:
    local = _entry(50, local=True)
    path = FakePath(_table(_entry(1, model_id=1)))
    bad = PullRequest(
        local=local,
        key=BlocksCacheKey(PEER, 1),
        deadline=asyncio.get_running_loop().time() + 5,
        src_blocks=(4,),  # the peer has blocks 0-3
        dst_blocks=(0,),
    )
    with pytest.raises(ValueError):  # LLMParamError
        await _run(path, bad)
    assert (path.refreshes, path.moves) == (0, [])


async def test_a_table_change_while_queued_is_planned_again() -> None:
    local = _entry(50, local=True)
    path = FakePath(_table(_entry(1, model_id=1)))
    link = Link(1, PEER, path)
    await link.slot.acquire(None)  # another transfer holds the link
    run = asyncio.ensure_future(_run(path, _pull(local), link))
    await asyncio.sleep(0)
    assert not run.done()
    path.remote_table.add(_entry(3, model_id=1))  # the peer re-registered model 1
    link.slot.release()
    await run
    assert [m[1] for m in path.moves] == [3]


async def test_a_stale_lease_is_refreshed_and_retried_once() -> None:
    remote, local = _entry(1, model_id=1), _entry(50, local=True)
    path = FakePath(_table(remote))
    path.stale = 1
    path.next_table = _table(_entry(4, model_id=1))
    link = await _run(path, _pull(local))
    assert path.refreshes == 1
    assert [m[1] for m in path.moves] == [4]
    assert (link.transfers, local.busy, remote.busy) == (1, 0, 0)


async def test_a_lease_stale_twice_raises_it() -> None:
    remote, local = _entry(1, model_id=1), _entry(50, local=True)
    path = FakePath(_table(remote))
    path.stale = 2
    link = Link(1, PEER, path)
    with pytest.raises(LeaseStale) as ei:
        await _run(path, _pull(local), link)
    assert ei.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert (path.refreshes, path.moves, link.transfers) == (1, [], 0)
    assert (local.busy, remote.busy) == (0, 0)
    assert not link.slot.busy


async def test_a_freed_local_cache_is_not_moved_into() -> None:
    local = _entry(50, local=True)
    local.freed = True
    path = FakePath(_table(_entry(1, model_id=1)))
    with pytest.raises(LLMCacheNotFoundError, match=r"\[pull_blocks\] failed.*was unregistered"):
        await _run(path, _pull(local))
    assert path.moves == []
