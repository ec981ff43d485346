"""``LeaseHold`` and pinned lease pages: a lease kept past its transfer (an engine
request handed to a reaper) ends exactly once, when the last of the transfer and the
kept requests let go, and its page stays mapped until then (a real page, real lease
words: ``lease_readers`` counts us)."""

from __future__ import annotations

import threading

import pytest

from aiodatadist import LLMException
from aiodatadist import _native as native
from aiodatadist._leases import LeaseHold, LeasePage, holding, keep_current, page_lease


def _entered(label: str) -> tuple[LeasePage, int]:
    page = LeasePage.create(label, 8)
    addr = page.addr(3)
    native.lease_publish(addr, 7)
    assert native.lease_enter(addr, 7)
    return page, addr


def test_a_hold_nobody_keeps_ends_at_close_once() -> None:
    ended: list[int] = []
    hold = LeaseHold(lambda: ended.append(1))
    hold.close()
    hold.close()
    assert ended == [1]


@pytest.mark.parametrize("order", ["close-first", "let-go-first"])
def test_a_kept_hold_ends_when_the_last_one_lets_go(order: str) -> None:
    ended: list[int] = []
    hold = LeaseHold(lambda: ended.append(1))
    let_go = [hold.keep(), hold.keep()]
    assert hold.kept == 2
    if order == "close-first":
        hold.close()
        let_go[0]()
        assert ended == []
        let_go[1]()
    else:
        let_go[0]()
        let_go[1]()
        assert ended == []
        hold.close()
    assert ended == [1] and hold.kept == 0


def test_keep_current_sees_only_the_hold_of_this_thread() -> None:
    hold = LeaseHold(lambda: None)
    assert keep_current() is None
    seen: list[object] = []
    with holding(hold):
        t = threading.Thread(target=lambda: seen.append(keep_current()))
        t.start()
        t.join()
        let_go = keep_current()
    assert seen == [None] and let_go is not None and hold.kept == 1
    assert keep_current() is None  # (restored after the body)
    let_go()


def test_a_kept_page_lease_is_left_from_a_reaper_thread_after_the_page_closed() -> None:
    page, addr = _entered("/aiodd-test-hold-1")
    hold = page_lease(page, addr)
    let_go = hold.keep()
    hold.close()  # the transfer returned: the reaped request still keeps the lease
    assert native.lease_readers(addr) == 1
    page.close()  # the link let go of its page meanwhile: still mapped, no new lease
    assert page.closed and not page.seg.closed
    with pytest.raises(LLMException):
        page.addr(3)
    t = threading.Thread(target=let_go)  # the reaper, once its request ended
    t.start()
    t.join()
    assert page.seg.closed  # left the lease, then unmapped


def test_a_page_lease_nobody_keeps_is_left_at_close() -> None:
    page, addr = _entered("/aiodd-test-hold-2")
    hold = page_lease(page, addr)
    hold.close()
    assert native.lease_readers(addr) == 0
    page.close()
    assert page.seg.closed
