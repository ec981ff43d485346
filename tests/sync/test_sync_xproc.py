"""A sync decoder here pulling from a sync prompt in another process (real bytes)."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

import aiodatadist.sync as sd
from aiodatadist.testing import cluster_info, make_blocks_cache, python_argv, python_env
from tests.sync._util import BLOCK_SHAPE, assert_pulled

pytestmark = pytest.mark.slow  # a child interpreter

PROMPT_ID = 8101
DECODER_ID = 8102

# The prompt process, written as an upstream program would be (blocking calls only).
PROMPT = textwrap.dedent(f"""
    import json, sys
    import aiodatadist.sync as llm_datadist
    from aiodatadist.testing import make_blocks_cache

    dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, {PROMPT_ID})
    dd.init({{"llm.listenIpInfo": "127.0.0.1:0"}})
    make_blocks_cache(dd, model_id=0, seed=int(sys.argv[1]), pattern=True, num_blocks=16,
                      block_shape={BLOCK_SHAPE!r})
    host, port = dd.listen_address
    print(json.dumps({{"host": host, "port": port}}), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    dd.finalize()
    print("bye", flush=True)
""")


@pytest.mark.parametrize("data_path", ["auto", "tcp"])
def test_sync_decoder_pulls_from_a_sync_prompt_process(portal_kind: str, data_path: str) -> None:
    seed = 401 if data_path == "auto" else 402
    with subprocess.Popen(
        python_argv("-c", PROMPT, str(seed)),
        env=python_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            _drive(child, seed, data_path)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


def _drive(child: subprocess.Popen[str], seed: int, data_path: str) -> None:
    assert child.stdout is not None and child.stdin is not None
    ready = json.loads(child.stdout.readline())
    opts = {} if data_path == "auto" else {"aiodatadist.DataPath": data_path}
    with sd.LLMDataDist(sd.LLMRole.DECODER, DECODER_ID, opts) as dd:
        dst = make_blocks_cache(dd, num_blocks=16, block_shape=BLOCK_SHAPE)
        info = cluster_info(PROMPT_ID, ready["host"], ready["port"])
        status, per = dd.link_clusters([info], timeout=5000)
        assert status == sd.LLMStatusCode.LLM_SUCCESS, per
        cm = dd.cache_manager
        key = sd.BlocksCacheKey(PROMPT_ID, 0)
        cm.pull_blocks(key, dst.cache, [5, 6, 9], [0, 1, 2])
        cm.pull_blocks(
            key, dst.cache, [15], [15], src_layer_range=range(1, 2), dst_layer_range=range(1, 2)
        )
        assert_pulled(dst, [5, 6, 9], [0, 1, 2], seed)
        assert_pulled(dst, [15], [15], seed, tensors=[(2, 2), (3, 3)])
        assert dd.unlink_clusters([info])[0] == sd.LLMStatusCode.LLM_SUCCESS
    child.stdin.close()
    assert child.wait(30) == 0
    assert child.stdout.read().strip() == "bye"
    assert child.stderr is not None and child.stderr.read() == ""
