"""The portal: one loop thread, its kind, interrupts, and shutdown at interpreter exit."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import threading
import time

import pytest

import aiodatadist.sync as sd
from aiodatadist._portal import PORTAL_THREAD_NAME, Portal, portal
from aiodatadist.testing import python_argv, python_env
from tests.sync._util import BOUND_S, SyncPair, assert_pulled, holding_link, untouched


def _portal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == PORTAL_THREAD_NAME]


def test_one_portal_thread_of_the_asked_kind(pair: SyncPair, portal_kind: str) -> None:
    pair.prompt_cache(seed=201)
    dst = pair.decoder_cache()
    seen: list[str] = []
    for i in range(5):
        pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [i], [i])
        seen.append(type(portal.loop()).__module__)
    (t,) = _portal_threads()
    assert t.daemon
    assert len(set(seen)) == 1
    assert seen[0].startswith("uvloop") == (portal_kind == "uvloop")
    assert_pulled(dst, list(range(5)), list(range(5)), 201)
    with pytest.raises(RuntimeError, match="already started"):
        sd.set_portal_loop(portal_kind)
    with pytest.raises(RuntimeError, match="finalize every sync instance"):
        sd._restart_portal_for_tests(portal_kind)


def test_portal_kind_checks() -> None:
    p = Portal()
    with pytest.raises(ValueError):
        p.set_kind("trio")
    with pytest.raises(TypeError):
        p.set_kind(1)  # type: ignore[arg-type]
    p.set_kind("uvloop")
    assert p.kind == "uvloop"
    assert not p.started
    p.stop()
    with pytest.raises(RuntimeError, match="shut down"):
        p.call(lambda: 1)


@pytest.mark.slow  # a child interpreter
def test_portal_kind_from_the_environment() -> None:
    code = textwrap.dedent("""
        import aiodatadist.sync as sd
        from aiodatadist._portal import portal
        sd.LLMDataDist(sd.LLMRole.PROMPT, 5)
        print(type(portal.loop()).__module__)
    """)
    env = python_env()
    env["AIODATADIST_PORTAL_LOOP"] = "uvloop"
    out = subprocess.run(
        python_argv("-c", code), env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip().startswith("uvloop"), out


class _Interrupt(Exception):
    pass


def test_an_interrupted_wait_cancels_the_call_on_the_portal(pair: SyncPair) -> None:
    pair.prompt_cache(seed=202)
    dst = pair.decoder_cache()
    cm = pair.decoder.cache_manager

    def handler(signum: int, frame: object) -> None:
        raise _Interrupt

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        main = threading.get_ident()
        with holding_link(pair.decoder, pair.prompt.cluster_id):
            # The pull queues behind the held link; a signal interrupts the waiting thread.
            timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGUSR1))
            timer.start()
            start = time.monotonic()
            with pytest.raises(_Interrupt):
                cm.pull_blocks(pair.key(), dst.cache, [2], [2], timeout=60)
            assert time.monotonic() - start < BOUND_S
            timer.join()
            (link,) = pair.decoder.aio.links
            # Cancelled on the portal, not merely abandoned: nobody waits for the link.
            assert portal.call(lambda: link.slot._waiting) == 0
        # Once the link is free, the cancelled pull never runs.
        time.sleep(0.05)
        assert untouched(dst, [2])
        cm.pull_blocks(pair.key(), dst.cache, [3], [3])
        assert_pulled(dst, [3], [3], 202)
        assert untouched(dst, [2])
    finally:
        signal.signal(signal.SIGUSR1, old)


EXIT_SCRIPT = textwrap.dedent("""
    import atexit, sys, threading
    from concurrent.futures import ThreadPoolExecutor

    report = []

    def after_the_library():  # registered first: runs after aiodatadist.sync's hook
        import aiodatadist.sync as sd
        report.append(f"initialized={[dd.is_initialized for dd in live]}")
        try:
            sd.LLMDataDist(sd.LLMRole.PROMPT, 99)
        except RuntimeError as e:
            report.append(f"late call: RuntimeError: {'shut down' in str(e)}")
        n = sum(t.name == "aiodatadist-portal" for t in threading.enumerate())
        report.append(f"portal threads={n}")
        sys.stdout.write("\\n".join(report) + "\\n")
        sys.stdout.flush()

    atexit.register(after_the_library)

    import aiodatadist.sync as sd
    from aiodatadist.testing import cluster_info, make_blocks_cache, pattern_mismatches

    prompt = sd.LLMDataDist(sd.LLMRole.PROMPT, 1, {"aiodatadist.FinalizeTimeout": "2000"})
    decoder = sd.LLMDataDist(sd.LLMRole.DECODER, 2)
    prompt.init()
    decoder.init({"llm.listenIpInfo": "127.0.0.1:0"})
    live = [prompt, decoder]
    make_blocks_cache(prompt, model_id=0, seed=9, pattern=True)
    dst = make_blocks_cache(decoder)
    assert decoder.link_clusters([cluster_info(1)])[0] == 0
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: decoder.cache_manager.pull_blocks(
            sd.BlocksCacheKey(1, 0), dst.cache, [i], [i]), range(8)))
    assert not pattern_mismatches(dst.tensors, range(8), range(8), 9)
    print("pulled", flush=True)
    # No finalize: the interpreter's exit does it.
""")


@pytest.mark.slow  # a child interpreter
def test_exit_without_finalize_is_clean(tmp_path: os.PathLike[str]) -> None:
    start = time.monotonic()
    out = subprocess.run(
        python_argv("-c", EXIT_SCRIPT), env=python_env(), capture_output=True, text=True, timeout=60
    )
    elapsed = time.monotonic() - start
    assert out.returncode == 0, out
    assert out.stderr == "", out.stderr
    lines = out.stdout.splitlines()
    assert lines == [
        "pulled",
        "initialized=[False, False]",
        "late call: RuntimeError: True",
        "portal threads=0",
    ], out.stdout
    assert elapsed < 30, elapsed


FORK_SCRIPT = textwrap.dedent("""
    import os
    import aiodatadist.sync as sd
    from aiodatadist.testing import cluster_info, make_blocks_cache, pattern_mismatches

    def round_trip(prompt_id, seed):
        with sd.LLMDataDist(sd.LLMRole.PROMPT, prompt_id) as p, \\
                sd.LLMDataDist(sd.LLMRole.DECODER, prompt_id + 1) as d:
            make_blocks_cache(p, model_id=0, seed=seed, pattern=True)
            dst = make_blocks_cache(d)
            assert d.link_clusters([cluster_info(prompt_id)])[0] == 0
            d.cache_manager.pull_blocks(sd.BlocksCacheKey(prompt_id, 0), dst.cache, [4], [1])
            return not pattern_mismatches(dst.tensors, [4], [1], seed)

    assert round_trip(1, 11)          # the parent's portal is running now
    pid = os.fork()
    if pid == 0:                      # the child gets a portal of its own
        os._exit(0 if round_trip(3, 12) else 1)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    assert round_trip(5, 13)          # and the parent's still works
    print("parent ok", flush=True)
""")


@pytest.mark.slow  # a child interpreter that forks
def test_a_forked_child_gets_its_own_portal() -> None:
    out = subprocess.run(
        python_argv("-c", FORK_SCRIPT), env=python_env(), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out
    assert out.stdout.splitlines() == ["child 0", "parent ok"], out
    assert out.stderr == "", out.stderr


FORKED_INSTANCE_SCRIPT = textwrap.dedent("""
    import os, time
    import aiodatadist.sync as sd
    from aiodatadist.testing import cluster_info

    d = sd.LLMDataDist(sd.LLMRole.DECODER, 21)
    d.init()
    pid = os.fork()
    if pid == 0:   # the parent's instance: its loop stayed in the parent
        codes = []
        for call in (lambda: d.link_clusters([cluster_info(20)]),
                     lambda: d.unlink_clusters([cluster_info(20)], force=True),
                     d.finalize):
            t0 = time.monotonic()
            try:
                call()
                codes.append("returned")
            except RuntimeError as e:
                ok = "before a fork" in str(e) and time.monotonic() - t0 < 5
                codes.append("refused" if ok else repr(e))
        print(" ".join(codes), flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    d.finalize()   # the parent's instance is untouched
    print("parent ok", flush=True)
""")


@pytest.mark.slow  # a child interpreter that forks
def test_an_instance_made_before_fork_is_refused_in_the_child() -> None:
    # Not a hang: a call on the parent's instance fails at once in the child.
    out = subprocess.run(
        python_argv("-c", FORKED_INSTANCE_SCRIPT), env=python_env(), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out
    assert out.stdout.splitlines() == ["refused refused refused", "child 0", "parent ok"], out


PUSH_AT_EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    import aiodatadist.sync as sd
    from aiodatadist.testing import cluster_info

    path = sys.argv[1]
    p = sd.LLMDataDist(sd.LLMRole.PROMPT, 31)
    d = sd.LLMDataDist(sd.LLMRole.DECODER, 32)
    p.init()
    d.init()
    desc = sd.CacheDesc(2, [4, 4096], sd.DataType.DT_UINT8, sd.Placement.DEVICE)
    src = [np.full((4, 4096), 0x31 + t, np.uint8) for t in range(2)]
    # The decoder's cache is a file mapping, so the test can read it after this exits.
    dst = [np.memmap(path, np.uint8, "r+", offset=t * 4 * 4096, shape=(4, 4096)) for t in range(2)]
    sc = p.cache_manager.register_blocks_cache(desc, src)
    d.cache_manager.register_blocks_cache(desc, dst, sd.BlocksCacheKey(32, 0))
    assert p.link_clusters([cluster_info(32)])[0] == 0

    class Slow(sd.LayerSynchronizer):
        def synchronize_layer(self, layer_index, timeout_in_millis):
            time.sleep(0.3)  # the forward pass of this layer
            return True

    config = sd.TransferWithCacheKeyConfig(sd.BlocksCacheKey(32, 0), range(0, 1), range(0, 1))
    p.cache_manager.transfer_cache_async(sc, Slow(), [config], [0, 1, 2, 3], [3, 2, 1, 0])
    print("exiting", flush=True)   # no synchronize, no finalize
""")


@pytest.mark.slow  # a child interpreter
def test_a_push_in_flight_at_exit_completes(tmp_path) -> None:
    # Upstream's push thread keeps the interpreter alive until it ends: the exit hook waits
    # for running transfer_cache_async tasks (bounded), then finalizes.
    path = tmp_path / "decoder.bin"
    path.write_bytes(bytes(2 * 4 * 4096))
    out = subprocess.run(
        python_argv("-c", PUSH_AT_EXIT_SCRIPT, str(path)), env=python_env(),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "exiting", out
    data = path.read_bytes()
    for t in range(2):
        for block in range(4):
            start = (t * 4 + block) * 4096
            assert data[start : start + 4096] == bytes([0x31 + t]) * 4096, (t, block)
