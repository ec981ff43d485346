"""Decode server (role DECODER): pulls each request's KV from a prefill server.

    .venv/bin/python examples/pd_server/decode.py --port 8200 --prefill-url http://127.0.0.1:8100

HTTP API (JSON):

    POST /generate {"prompt_id": int, "n_blocks": int, "timeout": float (optional, seconds)}
        asks the prefill server to compute the prompt (POST /prefill), links to it on first
        use, allocates local blocks, pulls the prompt's blocks with one deadline
        (``timeout``, default --pull-timeout), checks every byte, and answers
        {"prompt_id", "blocks", "bytes", "pull_ms", "data_path"}.

Failures of the transfer are HTTP errors with the status code's name in the body,
{"error": "LLM_TIMEOUT", "message": "..."}:

    LLMTimeoutError -> 504    LLMLinkError -> 502    LLMParamError -> 400
    any other LLMException -> 500

On startup it prints one line, ``READY http://127.0.0.1:<port>``; SIGINT or SIGTERM stop it.
`run.py` starts it for you.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kv
import numpy as np
import numpy.typing as npt
from aiohttp import web

from aiodatadist import (
    BlocksCacheKey,
    KvCache,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMLinkError,
    LLMParamError,
    LLMRole,
    LLMStatusCode,
    LLMTimeoutError,
)


@dataclass
class Decode:
    dd: LLMDataDist
    cache: KvCache
    tensors: list[npt.NDArray[Any]]
    http: aiohttp.ClientSession
    prefill_url: str
    pull_timeout: float
    free: list[int] = field(default_factory=lambda: list(range(kv.NUM_BLOCKS)))
    link_locks: dict[int, asyncio.Lock] = field(default_factory=dict)


DECODE = web.AppKey("decode", Decode)

# Most specific first: LLMTimeoutError etc. are all LLMExceptions.
HTTP_STATUS: list[tuple[type[LLMException], int]] = [
    (LLMTimeoutError, 504),
    (LLMLinkError, 502),
    (LLMParamError, 400),
    (LLMException, 500),
]


def error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)


@web.middleware
async def llm_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turns a failed transfer into an HTTP error that names the status code."""
    try:
        return await handler(request)
    except LLMException as e:
        status = next(code for cls, code in HTTP_STATUS if isinstance(e, cls))
        return error(status, e.status_code.name, str(e))


async def ensure_linked(state: Decode, cluster_id: int, host: str, port: int) -> None:
    """Links to a prefill cluster once; concurrent first requests wait for one link."""
    lock = state.link_locks.setdefault(cluster_id, asyncio.Lock())
    async with lock:
        if any(link.remote_cluster_id == cluster_id for link in state.dd.links):
            return
        info = LLMClusterInfo()
        info.remote_cluster_id = cluster_id
        info.append_remote_ip_info(host, port)
        status, _ = await state.dd.link_clusters([info], timeout=3000)
        if status not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
            raise LLMException(
                f"link to prefill cluster {cluster_id} at {host}:{port} failed: {status}",
                status_code=status,
            )


async def generate(request: web.Request) -> web.Response:
    state = request.app[DECODE]
    body = await request.json()
    if not isinstance(body, dict):
        return error(400, "BAD_REQUEST", "expected a JSON object")
    prompt_id, n_blocks = body.get("prompt_id"), body.get("n_blocks")
    if not isinstance(prompt_id, int) or not isinstance(n_blocks, int):
        return error(400, "BAD_REQUEST", "prompt_id and n_blocks must be integers")
    timeout = body.get("timeout", state.pull_timeout)  # checked by pull_blocks itself

    # 1. The prefill server computes the prompt and tells us where its KV is.
    try:
        async with state.http.post(
            f"{state.prefill_url}/prefill", json={"prompt_id": prompt_id, "n_blocks": n_blocks}
        ) as resp:
            if resp.status != 200:
                return error(resp.status, "PREFILL_FAILED", await resp.text())
            where = await resp.json()
    except aiohttp.ClientError as e:
        return error(502, "PREFILL_UNREACHABLE", str(e))
    remote_ids: list[int] = where["block_ids"]

    try:
        # 2. Link on first use.
        await ensure_linked(state, where["cluster_id"], where["host"], where["port"])
        if len(state.free) < len(remote_ids):
            return error(503, "NO_FREE_BLOCK", "no free local KV blocks")
        local_ids = [state.free.pop() for _ in remote_ids]
        try:
            # 3. Pull every layer of the prompt's blocks under one deadline.
            start = time.perf_counter()
            await state.dd.cache_manager.pull_blocks(
                BlocksCacheKey(where["cluster_id"], kv.MODEL_ID),
                state.cache,
                remote_ids,
                local_ids,
                src_layer_range=range(kv.LAYERS),
                dst_layer_range=range(kv.LAYERS),
                tensor_num_per_layer=kv.TENSORS_PER_LAYER,
                timeout=timeout,
            )
            pull_ms = (time.perf_counter() - start) * 1000
            # 4. Check what landed against what the prefill "model" computed.
            for position, block in enumerate(local_ids):
                expected = kv.prompt_block(prompt_id, position)
                for t, tensor in enumerate(state.tensors):
                    if not np.array_equal(tensor[block].view(np.uint8).reshape(-1), expected[t]):
                        return error(500, "VERIFY_FAILED", f"tensor {t} of block {position}")
        finally:
            state.free.extend(local_ids)
    finally:
        # The prefill server may free the prompt's blocks now, whatever happened.
        with contextlib.suppress(aiohttp.ClientError):
            await state.http.post(f"{state.prefill_url}/release", json={"block_ids": remote_ids})

    link = next(lk for lk in state.dd.links if lk.remote_cluster_id == where["cluster_id"])
    return web.json_response(
        {
            "prompt_id": prompt_id,
            "blocks": len(local_ids),
            "bytes": len(local_ids) * kv.NUM_TENSORS * kv.block_bytes(),
            "pull_ms": round(pull_ms, 3),
            "data_path": link.data_path,
        }
    )


def make_app(cluster_id: int, prefill_url: str, pull_timeout: float) -> web.Application:
    app = web.Application(middlewares=[llm_errors])

    async def datadist(app: web.Application) -> AsyncIterator[None]:
        dd = LLMDataDist(LLMRole.DECODER, cluster_id)
        await dd.init({"llm.SyncKvCacheWaitTime": "1000"})  # the default budget, in ms
        desc = kv.cache_desc()
        # The decode cache is our own memory: numpy arrays, registered as they are.
        tensors = [np.zeros(desc.shape, np.float16) for _ in range(desc.num_tensors)]
        cache = dd.cache_manager.register_blocks_cache(desc, tensors)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            app[DECODE] = Decode(dd, cache, tensors, http, prefill_url, pull_timeout)
            yield
        await dd.finalize()

    app.cleanup_ctx.append(datadist)
    app.router.add_post("/generate", generate)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200, help="HTTP port (0: any free port)")
    parser.add_argument("--cluster-id", type=int, default=2)
    parser.add_argument("--prefill-url", default="http://127.0.0.1:8100")
    parser.add_argument("--pull-timeout", type=float, default=1.0, help="seconds per pull")
    args = parser.parse_args()

    sock = socket.create_server((args.host, args.port))
    url = "http://{}:{}".format(*sock.getsockname()[:2])
    app = make_app(args.cluster_id, args.prefill_url.rstrip("/"), args.pull_timeout)

    async def ready(app: web.Application) -> None:
        print(f"READY {url}", flush=True)

    app.on_startup.append(ready)
    web.run_app(app, sock=sock, print=None)


if __name__ == "__main__":
    main()
