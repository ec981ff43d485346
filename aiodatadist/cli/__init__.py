"""The ``aiodatadist`` command line (also ``python -m aiodatadist``).

One module per concern: :mod:`.main` parses the arguments and dispatches to the
commands (:mod:`.demo`, :mod:`.doctor`, :mod:`.bench`), which share :mod:`.progress`
and :mod:`.workloads` and never import :mod:`.main`; :mod:`.measure` is the bench's
measurement (engine vs a baseline, alternated), which the source tree's ``bench/``
scripts reuse with their own baselines. The console script is
``aiodatadist = "aiodatadist.cli:main"``.
"""

from __future__ import annotations

from .main import DESCRIPTION, build_parser, main
from .progress import Progress

__all__ = ["DESCRIPTION", "Progress", "build_parser", "main"]
