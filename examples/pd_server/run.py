"""Starts a prefill server and a decode server (two processes) and sends a few requests.

    .venv/bin/pip install -e ".[examples]"     # aiohttp
    .venv/bin/python examples/pd_server/run.py

Each request goes to the decode server, which asks the prefill server to compute the
prompt, links to it on first use, pulls the KV blocks and checks them. Two requests fail
on purpose, to show how transfer errors become HTTP errors: one with an impossible
deadline (504, LLM_TIMEOUT), one with an invalid timeout (400, LLM_PARAM_INVALID). The
request after them shows the link is still fine. Exits 0 when every request got the
status it expected.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
START_TIMEOUT = 30.0  # seconds for a server to print READY


async def start(script: str, *args: str) -> tuple[asyncio.subprocess.Process, str]:
    """Starts ``script`` with ``--port 0`` and returns it with the URL it prints."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / script), "--port", "0", *args, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(START_TIMEOUT):
            while line := (await proc.stdout.readline()).decode():
                if line.startswith("READY "):
                    return proc, line.split()[1]
    except TimeoutError:
        pass
    proc.kill()
    await proc.wait()
    raise RuntimeError(f"{script} did not start (exit code {proc.returncode})")


async def stop(proc: asyncio.subprocess.Process) -> None:
    """SIGINT (the servers finalize their LLMDataDist on the way out), then SIGKILL."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def generate(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with http.post(f"{url}/generate", json=body) as resp:
        reply = await resp.json()
    if resp.status == 200:
        outcome = (
            f"pulled {reply['blocks']} blocks ({reply['bytes'] / 2**20:.2f} MiB) over "
            f"a {reply['data_path']} link in {reply['pull_ms']:.2f} ms, verified"
        )
    else:
        outcome = f"{reply['error']}: {reply['message']}"
    print(f"POST /generate {json.dumps(body)} -> {resp.status} {outcome}", flush=True)
    return resp.status


async def main() -> int:
    prefill, prefill_url = await start("prefill.py", "--cluster-id", "1")
    decode = None
    try:
        decode, decode_url = await start(
            "decode.py", "--cluster-id", "2", "--prefill-url", prefill_url
        )
        print(f"prefill server (PROMPT, cluster 1): {prefill_url}")
        print(f"decode server (DECODER, cluster 2): {decode_url}", flush=True)
        failures = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

            async def expect(status: int, body: dict[str, Any]) -> None:
                nonlocal failures
                if await generate(http, decode_url, body) != status:
                    failures += 1
                    print(f"  expected HTTP {status}")

            await expect(200, {"prompt_id": 1, "n_blocks": 4})  # links on first use
            await expect(200, {"prompt_id": 2, "n_blocks": 16})
            # Concurrent requests: their pulls queue on the one link, in order.
            await asyncio.gather(*(expect(200, {"prompt_id": p, "n_blocks": 8}) for p in (3, 4, 5)))
            await expect(504, {"prompt_id": 6, "n_blocks": 64, "timeout": 1e-6})
            await expect(400, {"prompt_id": 7, "n_blocks": 2, "timeout": -1})
            await expect(200, {"prompt_id": 8, "n_blocks": 32})  # the link survived the timeout
        print(f"done: {'all requests as expected' if not failures else f'{failures} unexpected'}")
        return 1 if failures else 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            if decode is not None:
                await stop(decode)
            await stop(prefill)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
