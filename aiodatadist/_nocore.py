"""The ImportError for a package whose compiled core (``aiodatadist._native``) cannot load.

Typically a source tree without a build: run from a checkout's root (``python -m ...``,
``python -c ...``, a REPL), the checkout's ``aiodatadist/`` shadows the installed package,
and Python's own message ("cannot import name '_native' from partially initialized module
... (most likely due to a circular import)") points the wrong way. Standard library only:
it runs when nothing else of the package can.
"""

from __future__ import annotations

import glob
import os
import sys

__all__ = ["no_core_error"]


def _has_core(package_dir: str) -> bool:
    return bool(glob.glob(os.path.join(package_dir, "_native*.so")))


def _installed_elsewhere(here: str) -> list[str]:
    """Other ``aiodatadist`` packages on ``sys.path`` that have a compiled core."""
    out = []
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or os.curdir), "aiodatadist")
        if candidate != here and os.path.isdir(candidate) and _has_core(candidate):
            out.append(candidate)
    return out


def no_core_error(cause: ImportError, package_file: str) -> ImportError:
    """What to raise from ``aiodatadist/__init__.py`` when ``_native`` did not import."""
    here = os.path.dirname(os.path.abspath(package_file))
    if _has_core(here):
        # The core is there but does not load (wrong Python, a missing system library, a
        # glibc older than the build's): Python's reason is the useful part.
        return ImportError(
            f"aiodatadist: the compiled core in {here} does not load: {cause}. Reinstall "
            "aiodatadist for this Python (`pip install --force-reinstall aiodatadist`) or, in "
            "a source tree, rebuild it (`pip install -e .`).",
            name="aiodatadist._native",
        )
    lines = [
        f"aiodatadist cannot be imported from {here}: it is a source tree without the "
        "compiled native core (aiodatadist/_native*.so)."
    ]
    others = _installed_elsewhere(here)
    if others:
        lines.append(
            f"An installed aiodatadist ({others[0]}) is shadowed by it, because "
            f"{os.path.dirname(here)} comes first on sys.path (Python puts the current "
            "directory there for `python -m`, `python -c` and the REPL)."
        )
        lines.append(
            "Run from another directory, or with `python -P` (Python >= 3.11), to use the "
            "installed package; or build this tree: `pip install -e .` (needs a C++17 "
            "compiler and CMake)."
        )
    else:
        lines.append(
            "Install it (`pip install aiodatadist`: a wheel, no compiler needed) and run from "
            "another directory, or build this source tree where it is: `pip install -e .` "
            "(needs a C++17 compiler and CMake)."
        )
    return ImportError("\n".join(lines), name="aiodatadist._native")
