"""The real link server (``ControlServer``) under random, truncated and mutated input.

Every bad connection must be closed by the server (EOF or reset, never a hang), the
server must not crash, and afterwards a real decoder still links and pulls.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from aiodatadist import BlocksCacheKey, LLMDataDist, LLMRole, LLMStatusCode
from aiodatadist import _wire as w
from aiodatadist.testing import cluster_info, make_blocks_cache

pytestmark = pytest.mark.slow  # fuzz: hundreds of handshakes against a real server

HELLO = {
    "version": w.PROTOCOL_VERSION,
    "cluster_id": 99,
    "host_id": "fuzz",
    "pid": 1,
    "role": 2,
    "nonce": "ab" * 32,
    "want_auth": False,
}


def _inputs(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    hello = w.encode(w.MsgType.HELLO, HELLO)
    data_hello = w.encode(
        w.MsgType.DATA_HELLO, {"link_token": "00" * 16, "stream": 0, "epoch": 1}
    )
    out: list[bytes] = [b"", b"\x00", hello[:3], hello[:16], hello[:-1], data_hello]
    for _ in range(count):
        kind = rng.randrange(4)
        if kind == 0:
            out.append(rng.randbytes(rng.randrange(1, 64)))
        elif kind == 1:  # a valid header followed by garbage
            out.append(hello[:16] + rng.randbytes(rng.randrange(0, 200)))
        elif kind == 2:  # bit flips of a valid HELLO
            b = bytearray(hello)
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            out.append(bytes(b))
        else:  # truncated valid HELLO
            out.append(hello[: rng.randrange(1, len(hello))])
    return out


async def _poke(port: int, data: bytes) -> bytes:
    """Sends ``data``, half-closes, and reads until the server closes (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(15):  # the server's handshake timeout is 10 s
            return await reader.read()
    except ConnectionError:
        return b""
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_server_survives_fuzzed_handshakes() -> None:
    prompt = LLMDataDist(LLMRole.PROMPT, 1)
    decoder = LLMDataDist(LLMRole.DECODER, 2)
    await prompt.init({"llm.listenIpInfo": "127.0.0.1:0"})
    await decoder.init({"aiodatadist.DataPath": "tcp"})
    try:
        src = make_blocks_cache(prompt, num_tensors=2, num_blocks=4, block_shape=(64,),
                                model_id=0, seed=3)  # fmt: skip
        addr = prompt.listen_address
        assert addr is not None
        inputs = _inputs(seed=20261130, count=120)
        replies = await asyncio.gather(*(_poke(addr[1], d) for d in inputs))
        for data, reply in zip(inputs, replies, strict=True):
            # Only a well-formed HELLO earns an answer (a CHALLENGE, then the server waits
            # for AUTH and closes on EOF); nothing else gets a byte back.
            if reply:
                header = w.decode_header(reply[: w.HEADER_SIZE])
                msg = w.decode(reply[: w.HEADER_SIZE + header.json_len])
                assert msg.type in (w.MsgType.CHALLENGE, w.MsgType.REFUSE), (data, msg)
                assert "table" not in msg.body
        # The server is unharmed: a real decoder links and pulls correct bytes.
        status, _ = await decoder.link_clusters([cluster_info(1, "127.0.0.1", addr[1])])
        assert status == LLMStatusCode.LLM_SUCCESS
        dst = make_blocks_cache(decoder, num_tensors=2, num_blocks=4, block_shape=(64,))
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst.cache, [1, 3], [0, 2],
                                                timeout=5)  # fmt: skip
        for t in range(2):
            assert dst.tensors[t][[0, 2]].tobytes() == src.tensors[t][[1, 3]].tobytes()
    finally:
        await decoder.finalize()
        await prompt.finalize()
