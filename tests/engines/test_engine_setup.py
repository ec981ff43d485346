"""Engines at ``init``: options, lazy imports, and an engine that cannot run.

Subprocesses (a fresh interpreter each): what ``import aiodatadist`` loads, and ``init``
with NIXL blocked (``sys.modules["nixl_cu12"] = None``, as a process without the package).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from aiodatadist import CacheDesc, DataPath, DataType, LLMConfig, LLMParamError, Placement
from aiodatadist.config import parse_options
from aiodatadist.testing import engine_unavailable
from aiodatadist.transports.engine import engine_problem


def run_child(code: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_options_name_the_engines() -> None:
    assert parse_options({}).engines == ()
    assert parse_options({"aiodatadist.Engines": "mooncake, nixl"}).engines == (
        DataPath.NIXL,
        DataPath.MOONCAKE,
    )
    # A forced engine path starts that engine.
    forced = parse_options({"aiodatadist.DataPath": "nixl"})
    assert forced.data_path == DataPath.NIXL and forced.engines == (DataPath.NIXL,)
    with pytest.raises(LLMParamError, match="unknown engine 'ucx'"):
        parse_options({"aiodatadist.Engines": "nixl,ucx"})
    assert DataPath.engines() == (DataPath.NIXL, DataPath.MOONCAKE)
    assert DataPath.remote() == (DataPath.SHM, DataPath.CMA, DataPath.TCP)


def test_llmconfig_engines_attribute() -> None:
    cfg = LLMConfig()
    cfg.engines = ["nixl"]
    assert cfg.generate_options()["aiodatadist.Engines"] == "nixl"
    cfg.engines = "mooncake,nixl"
    assert cfg.engines == "nixl,mooncake"
    with pytest.raises(LLMParamError):
        cfg.engines = "rdma"
    with pytest.raises(TypeError):
        cfg.engines = 3


@pytest.mark.slow  # a child interpreter
def test_import_loads_no_engine_and_no_torch() -> None:
    got = run_child(
        """
        import json, sys
        import aiodatadist, aiodatadist.config, aiodatadist.transports.select
        bad = [m for m in sys.modules if m.split(".")[0] in ("nixl_cu12", "mooncake", "torch")]
        print(json.dumps({"loaded": bad}))
        """
    )
    assert got == {"loaded": []}


@pytest.mark.slow  # a child interpreter
def test_init_with_an_engine_that_cannot_be_imported() -> None:
    got = run_child(
        """
        import asyncio, json, sys
        sys.modules["nixl_cu12"] = None  # as a process without the package
        from aiodatadist import LLMDataDist, LLMRole, LLMException

        async def main():
            dd = LLMDataDist(LLMRole.DECODER, 5)
            try:
                await dd.init({"aiodatadist.Engines": "nixl"})
            except LLMException as e:
                return {"status": e.status_code.name, "info": str(e), "init": dd.is_initialized}
            return {"status": "none"}

        print(json.dumps(asyncio.run(main())))
        """
    )
    assert got["status"] == "LLM_FEATURE_NOT_ENABLED", got
    assert "nixl" in str(got["info"]) and "pip install" in str(got["info"]), got
    assert got["init"] is False


def test_unknown_engine_module_is_a_reason_not_a_crash() -> None:
    # Mooncake's module may be absent (another package): the reason says so.
    why = engine_problem("mooncake")
    assert why is None or isinstance(why, str)
    assert engine_unavailable("nixl") == engine_problem("nixl")


@pytest.mark.asyncio
async def test_nixl_init_and_finalize_in_process() -> None:
    why = engine_unavailable("nixl")
    if why is not None:
        pytest.skip(why)
    from aiodatadist import LLMDataDist, LLMRole

    dd = LLMDataDist(LLMRole.DECODER, 7)
    await dd.init({"aiodatadist.Engines": "nixl"})
    try:
        rt = dd._rt
        assert [a.kind for a in rt.engines] == [DataPath.NIXL]
        agent = rt.engines[0]
        info = agent.info()
        assert set(info) == {"name", "md"} and info["name"].startswith("aiodd-")
        # Registration reaches the engine (its metadata grows); a free takes it back.
        cache = dd.cache_manager.allocate_blocks_cache(
            CacheDesc(2, [4, 1024], DataType.DT_UINT8, Placement.HOST)
        )
        assert cache.cache_id in agent._regs
        assert len(agent.info()["md"]) > len(info["md"])
        dd.cache_manager.deallocate_blocks_cache(cache)
        assert cache.cache_id not in agent._regs
    finally:
        await dd.finalize()
    assert rt.engines == []
