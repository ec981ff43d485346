"""The peer-identity check warns only about a peer that lies about its pid.

A prompt (the server) checks that the pid a linking peer gives holds the peer's end of
the connection. An honest peer that links and leaves at once (``doctor``, ``demo``) may
be gone by the time the server looks: its socket then has no owner, which proves
nothing, and must not be reported as a lie (it was, on most first runs of ``doctor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from typing import Any

import pytest

from aiodatadist import LLMDataDist, LLMRole, _control, _wire
from aiodatadist._control import host_identity

CLIENT_ID = 77
WARNING = "claims pid"


@pytest.fixture(autouse=True)
def _spy_on_adopt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A link the control plane adopts for a watched instance (its Peer is made, so the
    identity check has run) is recorded and wakes the test's event."""
    adopt = _control._adopt

    async def spy(rt: Any, peer: Any, server: Any) -> None:
        for want, peers, adopted in _WATCHED:
            if rt is want:
                peers.append(peer)
                adopted.set()
        await adopt(rt, peer, server)

    monkeypatch.setattr(_control, "_adopt", spy)
    _WATCHED.clear()


_WATCHED: list[tuple[Any, list[Any], asyncio.Event]] = []


async def _prompt() -> tuple[LLMDataDist, asyncio.Event, list[Any]]:
    """A PROMPT instance on loopback; ``(dd, adopted, peers)``: set once it adopted a link."""
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    await dd.init({"llm.listenIpInfo": "127.0.0.1:0"})
    adopted = asyncio.Event()
    peers: list[Any] = []
    _WATCHED.append((dd._rt, peers, adopted))
    return dd, adopted, peers


async def _handshake(port: int, pid: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw client up to (not including) its TABLE, claiming ``pid`` on this host."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _wire.write_message(writer, _wire.MsgType.HELLO, {
        "version": _wire.PROTOCOL_VERSION, "cluster_id": CLIENT_ID, "host_id": host_identity(),
        "pid": pid, "role": int(LLMRole.DECODER), "nonce": _wire.new_nonce(), "want_auth": False,
    })  # fmt: skip
    msg = await _wire.read_message(reader, timeout=5)
    assert msg.type == _wire.MsgType.CHALLENGE
    await _wire.write_message(writer, _wire.MsgType.AUTH, {"mac": ""})
    msg = await _wire.read_message(reader, timeout=5)
    assert msg.type == _wire.MsgType.WELCOME, msg
    return reader, writer


# The client's last handshake frame, written by hand so that the close can follow it at once.
TABLE = _wire.encode(_wire.MsgType.TABLE, {"version": 0, "table": []})


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("aiodatadist") and r.levelno >= logging.WARNING
    ]


@pytest.mark.asyncio
async def test_an_honest_peer_that_left_at_once_is_not_accused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiodatadist")
    dd, adopted, peers = await _prompt()
    try:
        assert dd.listen_address is not None
        _, writer = await _handshake(dd.listen_address[1], os.getpid())
        # The last handshake frame and the close leave together: the server reads the
        # TABLE only after this end is closed (the same loop runs both), as it does when a
        # short-lived decoder links, pulls and finalizes before the prompt gets to it.
        writer.write(TABLE)
        writer.close()
        async with asyncio.timeout(10):
            await adopted.wait()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        assert peers[0].same_host is False  # unverified: tcp only, silently
        assert not [m for m in _warnings(caplog) if WARNING in m], _warnings(caplog)
        assert any("cannot be checked" in r.getMessage() for r in caplog.records)
    finally:
        await dd.finalize()


@pytest.mark.asyncio
async def test_a_peer_claiming_another_pid_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiodatadist")
    victim = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; sys.stdin.read()", stdin=asyncio.subprocess.PIPE
    )
    dd, adopted, peers = await _prompt()
    try:
        assert dd.listen_address is not None
        _, writer = await _handshake(dd.listen_address[1], victim.pid)
        writer.write(TABLE)  # and stays connected: its end is open, held by us, not the victim
        await writer.drain()
        async with asyncio.timeout(10):
            await adopted.wait()
        assert peers[0].same_host is False
        (msg,) = [m for m in _warnings(caplog) if WARNING in m]
        assert f"cluster {CLIENT_ID} claims pid {victim.pid}" in msg
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    finally:
        await dd.finalize()
        assert victim.stdin is not None
        victim.stdin.close()
        async with asyncio.timeout(10):
            await victim.wait()


@pytest.mark.asyncio
async def test_an_honest_peer_that_stays_is_verified(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiodatadist")
    dd, adopted, peers = await _prompt()
    try:
        assert dd.listen_address is not None
        _, writer = await _handshake(dd.listen_address[1], os.getpid())
        writer.write(TABLE)
        await writer.drain()
        async with asyncio.timeout(10):
            await adopted.wait()
        assert peers[0].same_host is True  # we hold that end: the one-sided paths may act
        assert not _warnings(caplog)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    finally:
        await dd.finalize()
