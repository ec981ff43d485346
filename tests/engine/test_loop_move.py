"""``LoopMove``: a tiny transfer moved on the loop thread takes nothing past its deadline.

An answer already waiting in the socket when the deadline has passed is not taken: the
call is a timeout, the destination untouched (before, the first step ran before the
deadline was looked at, and a late call succeeded). A real socket pair, the threaded
sender writing the whole answer first.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiodatadist import LLMException, LLMStatusCode
from aiodatadist import _native as n
from aiodatadist.transports.tcp_streams import LoopMove
from tests.native._helpers import bases, differing
from tests.native.test_sock_step import TAG, case, pair, send

pytestmark = pytest.mark.asyncio


async def test_an_answer_waiting_past_the_deadline_is_not_taken() -> None:
    src, dst, plan, want = case(7)
    before = dst.copy()
    with pair() as (a, b):
        send([a.fileno()], plan, bases(src))  # every byte is in b's buffer now

        def receiver() -> n.SockStep:
            return n.SockStep(b.fileno(), plan, bases(dst), False, tag=TAG)

        loop = asyncio.get_running_loop()
        with pytest.raises(LLMException) as ei:
            await LoopMove(receiver).run(loop.time())  # due now
        assert ei.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert np.array_equal(dst, before), "bytes were taken past the deadline"
        await LoopMove(receiver).run(loop.time() + 10)  # in time: it lands
    assert np.array_equal(dst, want), differing(dst, want)
