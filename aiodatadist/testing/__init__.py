"""Test helpers: linked prompt/decoder pairs with real caches and real bytes, and faults.

Everything here works with or without pytest (embedded programs, examples, the
``aiodatadist`` command line); the pytest fixtures in :mod:`aiodatadist.pytest_plugin`
are thin wrappers over it. One concern per module:

* :mod:`.patterns`: the seeded block pattern (:func:`fill_pattern`,
  :func:`pattern_blocks`, :func:`pattern_mismatches`) and the one reference model of a
  pull (:func:`reference_pull`, :func:`block_segments`, :func:`apply_segments`): pure numpy.
* :mod:`.caches`: :func:`make_blocks_cache`, :func:`host_buffer`, :class:`PromptSpec`,
  :func:`cluster_info`.
* :mod:`.peer`: the one peer process (:class:`PeerProcess`; the child is
  ``python -m aiodatadist.testing``), which a suite extends with :class:`PeerCommands`.
* :mod:`.engines`: :func:`engine_unavailable` (why NIXL / Mooncake cannot run here).
* :mod:`.faults`: :class:`FaultInjector`, a proxy that stalls, drops and kills.
* :mod:`.pairs`: :func:`inproc_pair` and :func:`remote_pair`::

      async with remote_pair(PromptSpec(num_blocks=16), data_path="tcp", faults=True) as pair:
          dst = pair.decoder_cache()
          await pair.decoder.cache_manager.pull_blocks(pair.key(), dst.cache, [3], [0])
          assert not pair.mismatches(dst, [3], [0])
          pair.faults.pause()          # the next pull times out ...
          pair.faults.resume()         # ... and then works again
          await pair.faults.drop()     # the link breaks: LLMException, not a hang
          pair.faults.kill_peer()      # SIGKILL the prompt process
"""

from __future__ import annotations

from ._child import PeerCommands
from .caches import (
    HUGE_PAGE_BYTES,
    FilledCache,
    PromptSpec,
    cluster_info,
    host_buffer,
    make_blocks_cache,
)
from .engines import engine_unavailable
from .faults import FaultInjector
from .pairs import Pair, RemotePair, inproc_pair, remote_pair
from .patterns import (
    Mismatch,
    apply_segments,
    as_matrix,
    block_segments,
    fill_pattern,
    layer_span,
    pattern_blocks,
    pattern_mismatches,
    reference_pull,
)
from .peer import PeerControl, PeerProcess, python_argv, python_env

__all__ = [
    "HUGE_PAGE_BYTES",
    "FaultInjector",
    "FilledCache",
    "Mismatch",
    "Pair",
    "PeerCommands",
    "PeerControl",
    "PeerProcess",
    "PromptSpec",
    "RemotePair",
    "apply_segments",
    "as_matrix",
    "block_segments",
    "cluster_info",
    "engine_unavailable",
    "fill_pattern",
    "host_buffer",
    "inproc_pair",
    "layer_span",
    "make_blocks_cache",
    "pattern_blocks",
    "pattern_mismatches",
    "python_argv",
    "python_env",
    "reference_pull",
    "remote_pair",
]
