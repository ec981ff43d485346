"""The code under test: a decode worker's KV loading, with its error handling.

A decode worker asks for a request's KV and must never hang or crash on a transfer
failure: it reports what happened so the server can retry, reroute or fail the request.
`test_decode_worker.py` tests exactly that, against a real prefill process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiodatadist import (
    BlocksCacheKey,
    KvCache,
    LLMDataDist,
    LLMException,
    LLMLinkError,
    LLMTimeoutError,
)


@dataclass(frozen=True)
class Outcome:
    """What happened to one request's KV load."""

    ok: bool
    error: str | None = None  # the LLMStatusCode name, e.g. "LLM_TIMEOUT"
    action: str | None = None  # what the server should do: "retry", "reroute" or "fail"


class DecodeWorker:
    """Loads requests' KV blocks from prefill instances into one local blocks cache."""

    def __init__(self, datadist: LLMDataDist, cache: KvCache, pull_timeout: float) -> None:
        self.datadist = datadist
        self.cache = cache
        self.pull_timeout = pull_timeout

    async def load(
        self, key: BlocksCacheKey, remote_blocks: Sequence[int], local_blocks: Sequence[int]
    ) -> Outcome:
        try:
            await self.datadist.cache_manager.pull_blocks(
                key, self.cache, remote_blocks, local_blocks, timeout=self.pull_timeout
            )
        except LLMTimeoutError as e:  # the link is still usable: try again
            return Outcome(False, e.status_code.name, "retry")
        except LLMLinkError as e:  # the prefill instance is gone: go elsewhere
            return Outcome(False, e.status_code.name, "reroute")
        except LLMException as e:  # a bad request (LLMParamError) or a missing cache
            return Outcome(False, e.status_code.name, "fail")
        return Outcome(True)
