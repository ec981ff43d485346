"""Prefill server (role PROMPT): computes a prompt's KV and lets decode servers pull it.

    .venv/bin/python examples/pd_server/prefill.py --port 8100

HTTP API (JSON):

    POST /prefill {"prompt_id": int, "n_blocks": int}
        "computes" the prompt's KV into free blocks of a shared-memory cache and answers
        {"cluster_id", "host", "port", "block_ids"}: link to host:port (the aiodatadist
        listener, on loopback) and pull block_ids from BlocksCacheKey(cluster_id, 0).
    POST /release {"block_ids": [int, ...]}
        the decoder is done with those blocks; they return to the free list.

On startup it prints one line, ``READY http://127.0.0.1:<port>``; SIGINT or SIGTERM stop it
(the LLMDataDist is finalized on the way out). `run.py` starts it for you.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import kv
from aiohttp import web

from aiodatadist import BlocksCacheKey, KvCache, LLMDataDist, LLMRole


@dataclass
class Prefill:
    dd: LLMDataDist
    cache: KvCache
    free: list[int] = field(default_factory=lambda: list(range(kv.NUM_BLOCKS)))


PREFILL = web.AppKey("prefill", Prefill)


def read_int(body: object, name: str, low: int, high: int) -> int:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise web.HTTPBadRequest(text=f"{name} must be an integer in [{low}, {high}]")
    return value


async def prefill(request: web.Request) -> web.Response:
    state = request.app[PREFILL]
    body = await request.json()
    prompt_id = read_int(body, "prompt_id", 0, 2**31)
    n_blocks = read_int(body, "n_blocks", 1, kv.NUM_BLOCKS)
    if len(state.free) < n_blocks:
        raise web.HTTPServiceUnavailable(text="no free KV blocks")
    block_ids = [state.free.pop() for _ in range(n_blocks)]
    tensors = state.cache.tensors()  # numpy views of the shared-memory cache
    for position, block in enumerate(block_ids):
        data = kv.prompt_block(prompt_id, position)
        for t, tensor in enumerate(tensors):
            tensor[block].view("u1").reshape(-1)[...] = data[t]
    host, port = state.dd.listen_address or ("", 0)
    return web.json_response(
        {"cluster_id": state.dd.cluster_id, "host": host, "port": port, "block_ids": block_ids}
    )


async def release(request: web.Request) -> web.Response:
    state = request.app[PREFILL]
    body = await request.json()
    ids = body.get("block_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(b, int) for b in ids):
        raise web.HTTPBadRequest(text="block_ids must be a list of integers")
    state.free.extend(b for b in ids if 0 <= b < kv.NUM_BLOCKS and b not in state.free)
    return web.json_response({"free": len(state.free)})


def make_app(cluster_id: int, link_host: str) -> web.Application:
    app = web.Application()

    async def datadist(app: web.Application) -> AsyncIterator[None]:
        dd = LLMDataDist(LLMRole.PROMPT, cluster_id)
        # Listen for links on loopback; port 0 picks a free port (see dd.listen_address).
        await dd.init({"llm.listenIpInfo": f"{link_host}:0"})
        cache = dd.cache_manager.allocate_blocks_cache(
            kv.cache_desc(), BlocksCacheKey(cluster_id, kv.MODEL_ID)
        )
        app[PREFILL] = Prefill(dd, cache)
        yield
        await dd.finalize()

    app.cleanup_ctx.append(datadist)
    app.router.add_post("/prefill", prefill)
    app.router.add_post("/release", release)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="HTTP port (0: any free port)")
    parser.add_argument("--cluster-id", type=int, default=1)
    args = parser.parse_args()

    sock = socket.create_server((args.host, args.port))
    url = "http://{}:{}".format(*sock.getsockname()[:2])
    app = make_app(args.cluster_id, args.host)

    async def ready(app: web.Application) -> None:
        print(f"READY {url}", flush=True)

    app.on_startup.append(ready)
    web.run_app(app, sock=sock, print=None)


if __name__ == "__main__":
    main()
