"""The one gate for tests that need a transfer engine (NIXL, Mooncake).

``require_engine("nixl")`` at the top of a test (or in a fixture) skips the test with the
reason the engine cannot run here (the pip or apt command included). Where the engines
must be there (CI sets ``AIODATADIST_REQUIRE_ENGINES=1`` after ``scripts/setup_engines.sh``
installed them), the same call fails the test instead: an engine that stopped installing
or importing shows up as a failure, not as a quiet skip.
"""

from __future__ import annotations

import os

import pytest

import aiodatadist.testing as _testing
from aiodatadist._engine_env import ENGINES, engine_problem

__all__ = [
    "REQUIRE_ENGINES_ENV",
    "engine_reason",
    "engines_required",
    "require_engine",
    "require_engine_installed",
    "unavailable_engine_in",
]

REQUIRE_ENGINES_ENV = "AIODATADIST_REQUIRE_ENGINES"
"""Set to ``1``: an engine test that would skip because its engine is unavailable fails."""


def engines_required() -> bool:
    """Whether this run must have every engine (``AIODATADIST_REQUIRE_ENGINES=1``)."""
    return os.environ.get(REQUIRE_ENGINES_ENV, "").strip() not in ("", "0")


def engine_reason(name: str) -> str | None:
    """Why engine ``name`` cannot run here, or None (the library's own verdict)."""
    # aiodatadist.testing.engine_unavailable (built on EngineAgent.probe) is the library's
    # answer once the engine framework exists; the environment check is what it builds on.
    check = getattr(_testing, "engine_unavailable", None)
    return check(name) if check is not None else engine_problem(name)


def unavailable_engine_in(text: str) -> str | None:
    """The engine whose unavailability ``text`` (a skip's reason) reports, or None.

    For the suite's hook: under ``AIODATADIST_REQUIRE_ENGINES=1`` a test that skipped on
    its own (``pytest.skip(engine_unavailable(name))``) fails as :func:`require_engine`
    would have made it.
    """
    for name in ENGINES:
        reason = engine_reason(name)
        if reason is not None and reason in text:
            return name
    return None


def _gate(name: str, reason: str | None) -> None:
    if reason is None:
        return
    if engines_required():
        pytest.fail(f"{REQUIRE_ENGINES_ENV}=1 but engine {name} cannot run: {reason}")
    pytest.skip(f"engine {name} unavailable: {reason}")


def require_engine(name: str) -> None:
    """Skip the calling test when engine ``name`` cannot run here (fail under the CI variable).

    Args:
        name: ``"nixl"`` or ``"mooncake"``.
    """
    _gate(name, engine_reason(name))


def require_engine_installed(name: str) -> None:
    """Like :func:`require_engine`, on the environment alone (the package imports here).

    For tests of the environment checks themselves (``aiodatadist._engine_env``,
    ``aiodatadist doctor``), which do not go through the engine classes.
    """
    _gate(name, engine_problem(name))
