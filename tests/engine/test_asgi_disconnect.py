"""A Starlette decode endpoint whose client disconnects mid-pull (issue 9, finding 6).

A real uvicorn server on 127.0.0.1 runs a Starlette app whose ``/decode`` endpoint pulls
the KV blocks of a request from a linked prompt while watching ``http.disconnect`` in an
anyio task group, the usual pattern: the disconnect cancels the pull. The client sends
its request and drops the connection while the pull moves bytes. Main let a bare
``CancelledError`` escape the task group on shm and cma: uvicorn logged "Exception in
ASGI application" and answered 500. Now the pull is absorbed by the scope, the server
logs no error, and the next request succeeds with the right bytes (a pattern written
for that request alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from aiodatadist import BlocksCacheKey, DataType
from aiodatadist.testing import inproc_pair, make_blocks_cache, pattern_blocks, pattern_mismatches
from tests.engine._util import SLOW_OPTIONS, executor_of, wait_until

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]  # HTTP servers and big pulls

TENSORS, BLOCKS, BLOCK_BYTES = 2, 32, 4 << 20
ALL = list(range(BLOCKS))


@pytest.mark.parametrize("path", ["shm", "cma", "tcp"])
async def test_client_disconnect_mid_pull_is_not_a_500(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="uvicorn")
    async with inproc_pair(prompt_id=811, decoder_id=812, options=dict(SLOW_OPTIONS),
                           data_path=path) as pair:
        kw: dict[str, Any] = dict(num_tensors=TENSORS, num_blocks=BLOCKS,
                                  block_shape=(BLOCK_BYTES,), data_type=DataType.DT_UINT8)
        src = make_blocks_cache(pair.prompt, model_id=0, allocate=True, **kw)
        dst = make_blocks_cache(pair.decoder, **kw)
        key = BlocksCacheKey(pair.prompt.cluster_id, 0)
        executor = executor_of(pair.decoder)
        outcomes: list[str] = []

        async def decode(request: Request) -> JSONResponse:
            blocks = [int(b) for b in request.query_params["blocks"].split(",")]
            seed = int(request.query_params["seed"])
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while (await request.receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                await pair.decoder.cache_manager.pull_blocks(key, dst.cache, blocks, blocks,
                                                             timeout=60)
                tg.cancel_scope.cancel()  # done: stop watching
            if await request.is_disconnected():
                outcomes.append("cancelled" if executor.in_flight == 0 else "still running")
                return JSONResponse({"disconnected": True})
            bad = pattern_mismatches(dst.tensors, blocks, blocks, seed)
            outcomes.append("pulled")
            return JSONResponse({"mismatches": len(bad)})

        app = Starlette(routes=[Route("/decode", decode)])
        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None,
                                               access_log=True))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            await wait_until(lambda: server.started, what="uvicorn to start")
            # A client that asks for every block and leaves while the pull moves them. A
            # pull that ends before it is seen in flight (the loop thread descheduled for the
            # whole copy) is answered, and the client tries again.
            for _ in range(5):
                outcomes.clear()
                _reader, writer = await asyncio.open_connection("127.0.0.1", port)
                blocks = ",".join(map(str, ALL))
                writer.write(f"GET /decode?blocks={blocks}&seed=0 HTTP/1.1\r\nHost: x\r\n\r\n"
                             .encode())
                await writer.drain()
                await wait_until(lambda: executor.in_flight >= 1 or bool(outcomes),
                                 what="the pull to start", poll=0)
                writer.transport.abort()
                await wait_until(lambda: bool(outcomes), what="the endpoint to end")
                if outcomes != ["pulled"]:
                    break
            assert outcomes == ["cancelled"]

            # The next request succeeds with the bytes written for it alone.
            seed, some = 0xA59_0001, [4, 19, 31]
            for t, arr in enumerate(src.tensors):
                arr[some] = pattern_blocks(seed, t, some, BLOCK_BYTES)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=30) as client:
                reply = await client.get("/decode", params={
                    "blocks": ",".join(map(str, some)), "seed": str(seed)})
            assert reply.status_code == 200
            assert reply.json() == {"mismatches": 0}
            assert pattern_mismatches(dst.tensors, some, some, seed) == []
        finally:
            server.should_exit = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(serving, 10)
            sock.close()
    served = [r for r in caplog.records if r.name.startswith("uvicorn")]
    errors = [r for r in served if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
    assert not any("Exception in ASGI application" in r.getMessage() for r in served)
    assert not any(" 500" in r.getMessage() for r in served)
