"""``aiodatadist._plan``: keys, layer spans and plans, from tables of hand-made caches.

No instance, no pair, no loop: each case names the peer's table, a request and the
segments (``(src tensor, src offset, dst tensor, dst offset, bytes)``) the plan must
hold after the native core merged adjacent ones, or the status code it must fail with.
"""

from __future__ import annotations

from typing import Any

import pytest

from aiodatadist._caches import CacheEntry, CacheTable
from aiodatadist._plan import (
    CopyRequest,
    PullRequest,
    PushRequest,
    copy_plan,
    plan,
    pull_blocks_plan,
    pull_row_plan,
    push_addr_plan,
    push_key_plan,
    resolve,
    row_key,
    tensor_span,
)
from aiodatadist._validate import INVALID_ID
from aiodatadist.errors import LLMException, LLMStatusCode, api_scope
from aiodatadist.types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex

PARAM = LLMStatusCode.LLM_PARAM_INVALID
MISSING = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
PEER = 7


def _entry(
    cache_id: int,
    *,
    tensors: int = 4,
    blocks: int = 8,
    bb: int = 64,
    is_blocks: bool = True,
    base: int = 0x100000,
    model_id: int | None = None,
    row_keys: dict[tuple[int, int], int] | None = None,
) -> CacheEntry:
    return CacheEntry(
        cache_id=cache_id,
        num_tensors=tensors,
        num_blocks=blocks,
        block_bytes=bb,
        is_blocks=is_blocks,
        addrs=[base + t * blocks * bb for t in range(tensors)],
        model_id=model_id,
        row_keys=dict(row_keys or {}),
        local=False,
    )


# The peer's table every case reads: a blocks cache under model 1 (4 tensors x 8
# blocks x 64 B), a row cache of 4 rows x 256 B with rows bound to req 11 and
# prefix 12, an MLA-like odd cache, and a second blocks cache (model 2, 6 tensors).
REMOTE_BLOCKS = _entry(1, model_id=1, base=0x100000)
REMOTE_ROWS = _entry(
    2, blocks=4, bb=256, is_blocks=False, base=0x200000, row_keys={(11, 0): 1, (12, 0): 3}
)
REMOTE_ODD = _entry(3, tensors=3, blocks=4, bb=32, base=0x300000)
REMOTE_SIX = _entry(4, tensors=6, model_id=2, base=0x400000)


def _table() -> CacheTable:
    table = CacheTable()
    for e in (REMOTE_BLOCKS, REMOTE_ROWS, REMOTE_ODD, REMOTE_SIX):
        table.add(e)
    return table


LOCAL_BLOCKS = _entry(100, base=0x900000)
LOCAL_ROWS = _entry(101, blocks=2, bb=256, is_blocks=False, base=0xA00000)
LOCAL_SMALL_BLOCKS = _entry(102, blocks=8, bb=128, base=0xB00000)


def _segments(result: tuple[CacheEntry, Any]) -> tuple[int, list[tuple[int, ...]]]:
    remote, p = result
    return remote.cache_id, [tuple(int(x) for x in row) for row in p.segments()]


def _code(fn: Any, *args: Any) -> LLMStatusCode:
    with pytest.raises(LLMException) as ei:
        fn(*args)
    return ei.value.status_code


# ------------------------------------------------------------------ row keys


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (CacheKey(PEER, req_id=5), (5, 0)),
        (CacheKey(PEER, req_id=5, model_id=3), (5, 3)),
        (CacheKey(PEER, INVALID_ID, model_id=3, prefix_id=9), (9, 3)),
        (CacheKey(PEER, req_id=5, prefix_id=9), (5, 0)),  # req_id wins when both are set
        (CacheKey(PEER, INVALID_ID), (INVALID_ID, 0)),  # upstream's placeholder for an unused row
    ],
)
def test_row_key(key: CacheKey, expected: tuple[int, int]) -> None:
    assert row_key(key) == expected


# ------------------------------------------------------------------- resolve


@pytest.mark.parametrize(
    ("key", "cache_id", "row"),
    [
        (BlocksCacheKey(PEER, 1), 1, 0),
        (BlocksCacheKey(PEER, 2), 4, 0),
        (CacheKeyByIdAndIndex(PEER, 2, 3), 2, 3),
        (CacheKeyByIdAndIndex(PEER, 1, 7), 1, 7),
        (CacheKey(PEER, req_id=11), 2, 1),
        (CacheKey(PEER, INVALID_ID, prefix_id=12), 2, 3),
        # One rule: (12, 0) is the same row key whichever field set it.
        (CacheKey(PEER, req_id=12), 2, 3),
    ],
)
def test_resolve(key: Any, cache_id: int, row: int) -> None:
    entry, r = resolve(_table(), key)
    assert (entry.cache_id, r) == (cache_id, row)


@pytest.mark.parametrize(
    ("key", "code"),
    [
        (BlocksCacheKey(PEER, 9), MISSING),
        (CacheKeyByIdAndIndex(PEER, 99, 0), MISSING),
        (CacheKeyByIdAndIndex(PEER, 2, 4), PARAM),  # row 4 of a 4-row cache
        (CacheKey(PEER, req_id=11, model_id=1), MISSING),  # the model is part of the key
        (CacheKey(PEER, INVALID_ID, prefix_id=11, model_id=2), MISSING),
    ],
)
def test_resolve_failures(key: Any, code: LLMStatusCode) -> None:
    assert _code(resolve, _table(), key) == code


# --------------------------------------------------------------- tensor span


@pytest.mark.parametrize(
    ("src", "dst", "src_lr", "dst_lr", "t", "expected"),
    [
        (4, 4, None, None, 2, (0, 0, 4)),
        (3, 3, None, None, 2, (0, 0, 3)),  # no range: T need not divide (MLA caches)
        (4, 6, range(1, 2), range(2, 3), 2, (2, 4, 2)),
        (6, 4, range(0, 2), None, 2, (0, 0, 4)),
        (4, 6, None, range(1, 3), 2, (0, 2, 4)),
        (6, 6, range(1, 2), range(0, 1), 3, (3, 0, 3)),
        (6, 6, range(5, 6), range(5, 6), 1, (5, 5, 1)),
    ],
)
def test_tensor_span(
    src: int,
    dst: int,
    src_lr: range | None,
    dst_lr: range | None,
    t: int,
    expected: tuple[int, int, int],
) -> None:
    assert tensor_span(src, dst, src_lr, dst_lr, t) == expected


@pytest.mark.parametrize(
    ("src", "dst", "src_lr", "dst_lr", "t", "words"),
    [
        (3, 4, range(0, 1), None, 2, "does not divide the source"),
        (4, 3, None, range(0, 1), 2, "does not divide the destination"),
        (4, 4, range(1, 3), None, 2, "src_layer_range=range(1, 3) selects tensors [2, 6)"),
        (4, 4, None, range(2, 3), 2, "dst_layer_range=range(2, 3) selects tensors [4, 6)"),
        (4, 6, None, None, 2, "different tensor counts (4 != 6"),
        (6, 6, range(0, 1), range(0, 2), 2, "different tensor counts (2 != 4"),
    ],
)
def test_tensor_span_failures(
    src: int, dst: int, src_lr: range | None, dst_lr: range | None, t: int, words: str
) -> None:
    with api_scope("pull_blocks"), pytest.raises(LLMException) as ei:
        tensor_span(src, dst, src_lr, dst_lr, t)
    assert ei.value.status_code == PARAM
    assert str(ei.value).startswith("[pull_blocks] failed, error code is")
    assert words in str(ei.value)


# -------------------------------------------------------------------- pulls


def _pull(key: Any, local: CacheEntry = LOCAL_BLOCKS, **kw: Any) -> PullRequest:
    return PullRequest(local=local, key=key, deadline=0.0, **kw)


@pytest.mark.parametrize(
    ("request_", "cache_id", "segments"),
    [
        # Blocks 5 and 2 of every tensor -> local blocks 0 and 6.
        (
            _pull(BlocksCacheKey(PEER, 1), src_blocks=(5, 2), dst_blocks=(0, 6)),
            1,
            [(t, off, t, dst, 64) for t in range(4) for off, dst in ((320, 0), (128, 384))],
        ),
        # Consecutive on both sides: one segment per tensor.
        (
            _pull(BlocksCacheKey(PEER, 1), src_blocks=(2, 3), dst_blocks=(4, 5)),
            1,
            [(t, 128, t, 256, 128) for t in range(4)],
        ),
        # Layer 1 of the 6-tensor cache into layer 0 of ours (T=2).
        (
            _pull(
                BlocksCacheKey(PEER, 2),
                src_blocks=(1,),
                dst_blocks=(7,),
                src_layers=range(2, 3),
                dst_layers=range(1, 2),
            ),
            4,
            [(4, 64, 2, 448, 64), (5, 64, 3, 448, 64)],
        ),
        # A row (row 1 of cache 2, 256 B) cut into local 64 B blocks 6, 1, 3, 0.
        (
            _pull(CacheKey(PEER, req_id=11), dst_blocks=(6, 1, 3, 0)),
            2,
            [
                (t, 256 + i * 64, t, d * 64, 64)
                for t in range(4)
                for i, d in enumerate((6, 1, 3, 0))
            ],
        ),
        (
            _pull(
                CacheKeyByIdAndIndex(PEER, 2, 3),
                dst_blocks=(2,),
                src_layers=range(1, 2),
                dst_layers=range(0, 1),
            ),
            2,
            [(2, 768, 0, 128, 64), (3, 768, 1, 128, 64)],
        ),
    ],
)
def test_pull_blocks_plan(request_: PullRequest, cache_id: int, segments: list[Any]) -> None:
    assert _segments(pull_blocks_plan(request_, _table())) == (cache_id, segments)
    assert _segments(plan(request_, _table())) == (cache_id, segments)


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (_pull(BlocksCacheKey(PEER, 9), src_blocks=(0,), dst_blocks=(0,)), MISSING),
        (_pull(CacheKey(PEER, req_id=99), dst_blocks=(0,)), MISSING),
        (_pull(CacheKeyByIdAndIndex(PEER, 2, 9), dst_blocks=(0,)), PARAM),
        (_pull(BlocksCacheKey(PEER, 1), src_blocks=(8,), dst_blocks=(0,)), PARAM),  # src oob
        (_pull(BlocksCacheKey(PEER, 1), src_blocks=(0, 1), dst_blocks=(3, 3)), PARAM),  # overlap
        (_pull(BlocksCacheKey(PEER, 2), src_blocks=(0,), dst_blocks=(0,)), PARAM),  # 6 != 4
        (_pull(CacheKey(PEER, req_id=11), dst_blocks=(0, 1, 2, 3, 4)), PARAM),  # 320 B > row
        (_pull(CacheKey(PEER, req_id=11), dst_blocks=(0,), src_layers=range(2, 3)), PARAM),
    ],
)
def test_pull_blocks_plan_failures(request_: PullRequest, code: LLMStatusCode) -> None:
    assert _code(pull_blocks_plan, request_, _table()) == code


def test_pull_blocks_plan_refuses_a_row_cache_under_a_blocks_key() -> None:
    table = _table()
    rows_by_model = _entry(5, blocks=4, bb=256, is_blocks=False, base=0x500000, model_id=3)
    table.add(rows_by_model)
    req = _pull(BlocksCacheKey(PEER, 3), src_blocks=(0,), dst_blocks=(0,))
    with pytest.raises(LLMException, match="remote cache 5 is not a blocks cache") as ei:
        pull_blocks_plan(req, table)
    assert ei.value.status_code == PARAM


@pytest.mark.parametrize(
    ("request_", "cache_id", "segments"),
    [
        # Remote row 1 (256 B) -> local row 1, whole rows.
        (
            _pull(CacheKey(PEER, req_id=11), LOCAL_ROWS, row=1, nbytes=256),
            2,
            [(t, 256, t, 256, 256) for t in range(4)],
        ),
        # Remote row 3, the first 100 bytes, layer 1 only, into local row 0.
        (
            _pull(
                CacheKeyByIdAndIndex(PEER, 2, 3),
                LOCAL_ROWS,
                row=0,
                nbytes=100,
                src_layers=range(1, 2),
                dst_layers=range(1, 2),
            ),
            2,
            [(2, 768, 2, 0, 100), (3, 768, 3, 0, 100)],
        ),
    ],
)
def test_pull_row_plan(request_: PullRequest, cache_id: int, segments: list[Any]) -> None:
    assert _segments(pull_row_plan(request_, _table())) == (cache_id, segments)
    assert _segments(plan(request_, _table())) == (cache_id, segments)


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (_pull(CacheKey(PEER, req_id=99), LOCAL_ROWS, row=0, nbytes=256), MISSING),
        # 512 B of a 64 B row of the blocks cache (read by id and index).
        (_pull(CacheKeyByIdAndIndex(PEER, 1, 0), LOCAL_ROWS, row=0, nbytes=128), PARAM),
        (
            _pull(CacheKey(PEER, req_id=11), LOCAL_ROWS, row=0, nbytes=256, dst_layers=range(2, 3)),
            PARAM,
        ),
        (_pull(CacheKeyByIdAndIndex(PEER, 3, 0), LOCAL_ROWS, row=0, nbytes=32), PARAM),  # 3 != 4
    ],
)
def test_pull_row_plan_failures(request_: PullRequest, code: LLMStatusCode) -> None:
    assert _code(pull_row_plan, request_, _table()) == code


# -------------------------------------------------------------------- pushes


def _push(**kw: Any) -> PushRequest:
    kw.setdefault("local", LOCAL_BLOCKS)
    return PushRequest(cluster_id=PEER, deadline=0.0, **kw)


@pytest.mark.parametrize(
    ("request_", "cache_id", "segments"),
    [
        # Layer 1 (tensors 2, 3), blocks 0 and 4 -> the peer's blocks 6 and 1 of layer 0.
        (
            _push(
                key=BlocksCacheKey(PEER, 1),
                layer=1,
                dst_layer=0,
                src_blocks=(0, 4),
                dst_blocks=(6, 1),
            ),
            1,
            [(2, 0, 0, 384, 64), (2, 256, 0, 64, 64), (3, 0, 1, 384, 64), (3, 256, 1, 64, 64)],
        ),
        # Into layer 2 of the 6-tensor cache.
        (
            _push(
                key=BlocksCacheKey(PEER, 2), layer=0, dst_layer=2, src_blocks=(3,), dst_blocks=(3,)
            ),
            4,
            [(0, 192, 4, 192, 64), (1, 192, 5, 192, 64)],
        ),
        # A row source (row 1 of 256 B) into row 3 of the peer's row cache, layer 1.
        (
            _push(
                local=LOCAL_ROWS,
                key=CacheKeyByIdAndIndex(PEER, 2, 3),
                layer=1,
                dst_layer=1,
                src_row=1,
            ),
            2,
            [(2, 256, 2, 768, 256), (3, 256, 3, 768, 256)],
        ),
        # The smaller of the two row sizes: a 256 B row into a 64 B "row" (block 5).
        (
            _push(local=LOCAL_ROWS, key=CacheKeyByIdAndIndex(PEER, 1, 5), layer=0, src_row=0),
            1,
            [(0, 0, 0, 320, 64), (1, 0, 1, 320, 64)],
        ),
    ],
)
def test_push_key_plan(request_: PushRequest, cache_id: int, segments: list[Any]) -> None:
    assert _segments(push_key_plan(request_, _table())) == (cache_id, segments)
    assert _segments(plan(request_, _table())) == (cache_id, segments)


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (_push(key=BlocksCacheKey(PEER, 9), layer=0, src_blocks=(0,), dst_blocks=(0,)), MISSING),
        (_push(key=CacheKeyByIdAndIndex(PEER, 2, 4), layer=0), PARAM),
        (
            _push(
                key=BlocksCacheKey(PEER, 1), layer=0, dst_layer=2, src_blocks=(0,), dst_blocks=(0,)
            ),
            PARAM,
        ),  # the peer has 2 layers
        (_push(key=BlocksCacheKey(PEER, 1), layer=0, src_blocks=(0,), dst_blocks=(8,)), PARAM),
        (_push(key=BlocksCacheKey(PEER, 1), layer=2, src_blocks=(0,), dst_blocks=(0,)), PARAM),
        (_push(key=BlocksCacheKey(PEER, 1), layer=0, src_blocks=(0, 1), dst_blocks=(2, 2)), PARAM),
    ],
)
def test_push_key_plan_failures(request_: PushRequest, code: LLMStatusCode) -> None:
    assert _code(push_key_plan, request_, _table()) == code


def _addr(entry: CacheEntry, tensor: int, offset: int) -> int:
    return entry.addrs[tensor] + offset


@pytest.mark.parametrize(
    ("request_", "cache_id", "segments"),
    [
        # A row source: K and V of layer 1 to raw addresses in tensors 2 and 3 of the peer's
        # row cache, at offset 512 (its row 2).
        (
            _push(
                local=LOCAL_ROWS,
                layer=1,
                src_row=1,
                dst_addrs=(_addr(REMOTE_ROWS, 2, 512), _addr(REMOTE_ROWS, 3, 512)),
            ),
            2,
            [(2, 256, 2, 512, 256), (3, 256, 3, 512, 256)],
        ),
        # Blocks 1, 3 -> blocks 0, 2 counted from addresses at block 4 of tensors 0 and 1.
        (
            _push(
                layer=0,
                src_blocks=(1, 3),
                dst_blocks=(0, 2),
                dst_addrs=(_addr(REMOTE_BLOCKS, 0, 256), _addr(REMOTE_BLOCKS, 1, 256)),
            ),
            1,
            [(0, 64, 0, 256, 64), (0, 192, 0, 384, 64), (1, 64, 1, 256, 64), (1, 192, 1, 384, 64)],
        ),
    ],
)
def test_push_addr_plan(request_: PushRequest, cache_id: int, segments: list[Any]) -> None:
    assert _segments(push_addr_plan(request_, _table())) == (cache_id, segments)
    assert _segments(plan(request_, _table())) == (cache_id, segments)


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        # Not registered at all.
        (
            _push(layer=0, src_blocks=(0,), dst_blocks=(0,), dst_addrs=(0x10, 0x20)),
            "dst address 0x10 (+64 bytes) is not inside memory registered by cluster 7",
        ),
        # Block 7 counted from block 4 runs past the tensor's end (8 blocks).
        (
            _push(
                layer=0,
                src_blocks=(0,),
                dst_blocks=(3,),
                dst_addrs=(_addr(REMOTE_BLOCKS, 0, 320), _addr(REMOTE_BLOCKS, 1, 0)),
            ),
            "(+256 bytes) is not inside memory",
        ),
        # K and V in two different caches.
        (
            _push(
                layer=0,
                src_blocks=(0,),
                dst_blocks=(0,),
                dst_addrs=(_addr(REMOTE_BLOCKS, 0, 0), _addr(REMOTE_SIX, 1, 0)),
            ),
            "the K and V addresses of one layer lie in different remote caches",
        ),
        # Both in one tensor: the native core refuses bytes written twice.
        (
            _push(
                layer=0,
                src_blocks=(0,),
                dst_blocks=(0,),
                dst_addrs=(_addr(REMOTE_BLOCKS, 0, 0), _addr(REMOTE_BLOCKS, 0, 0)),
            ),
            "written twice",
        ),
    ],
)
def test_push_addr_plan_failures(request_: PushRequest, words: str) -> None:
    with api_scope("transfer_cache_async"), pytest.raises(LLMException) as ei:
        push_addr_plan(request_, _table())
    assert ei.value.status_code == PARAM
    assert str(ei.value).startswith("[transfer_cache_async] failed, error code is")
    assert words in str(ei.value)


# --------------------------------------------------------------------- copies


@pytest.mark.parametrize(
    ("pairs", "segments"),
    [
        (((0, 5),), [(t, 0, t, 320, 64) for t in range(4)]),
        (((0, 5), (0, 2)), [(t, 0, t, d, 64) for t in range(4) for d in (320, 128)]),
        (((1, 2), (2, 3)), [(t, 64, t, 128, 128) for t in range(4)]),  # merged: 1,2 -> 2,3
    ],
)
def test_copy_plan(pairs: tuple[tuple[int, int], ...], segments: list[Any]) -> None:
    p = copy_plan(CopyRequest(entry=LOCAL_BLOCKS, pairs=pairs, deadline=0.0))
    assert [tuple(int(x) for x in row) for row in p.segments()] == segments


@pytest.mark.parametrize("pairs", [((0, 8),), ((0, 3), (1, 3))])
def test_copy_plan_failures(pairs: tuple[tuple[int, int], ...]) -> None:
    request = CopyRequest(entry=LOCAL_BLOCKS, pairs=pairs, deadline=0.0)
    assert _code(copy_plan, request) == PARAM


# ------------------------------------------------------------------ requests


def test_requests_are_immutable() -> None:
    pull = _pull(BlocksCacheKey(PEER, 1), src_blocks=(0,), dst_blocks=(0,))
    requests: list[Any] = [
        pull,
        _push(key=BlocksCacheKey(PEER, 1), layer=0),
        CopyRequest(entry=LOCAL_BLOCKS, pairs=((0, 1),), deadline=0.0),
    ]
    for r in requests:
        with pytest.raises(AttributeError):
            r.deadline = 1.0
    assert pull.cluster_id == PEER


def test_plan_reads_the_table_it_is_given() -> None:
    """A re-plan sees the peer's new registration: the request names the key, not the entry."""
    request = _pull(BlocksCacheKey(PEER, 1), src_blocks=(0,), dst_blocks=(0,))
    table = _table()
    assert plan(request, table)[0] is REMOTE_BLOCKS
    again = _entry(9, model_id=1, base=0x700000)
    table.add(again)  # last registration wins
    assert plan(request, table)[0] is again
    table.remove(9)
    table.remove(1)
    assert _code(plan, request, table) == MISSING
