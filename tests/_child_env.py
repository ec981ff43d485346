"""The environment a suite's peer-process plugin needs on top of the library's own.

A plugin (``tests/xproc/peer_main.py``, ``tests/adversity/actor.py``) imports its suite as
``tests.<suite>``: the repository root goes on the child's ``PYTHONPATH`` (behind the
library's own location, which :func:`aiodatadist.testing.peer.python_env` puts first),
wherever aiodatadist itself is installed.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CHILD_PATH"]

_ROOT = str(Path(__file__).resolve().parents[1])

CHILD_PATH = {
    "PYTHONPATH": os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
}
