"""pytest entry point (``pytest11``: ``aiodatadist``): loads :mod:`aiodatadist.pytest_plugin`.

pytest imports every installed plugin before it runs any test, and an entry point that
fails to import ends the whole run. This module lives outside the package so that a
package that cannot be imported (typically a source tree without its compiled core,
shadowing the installed package because it is in the current directory) costs only the
tests that use the aiodatadist fixtures: they fail with the reason, every other test runs,
and the report header says why the plugin is off. ``-p no:aiodatadist`` disables it.
"""

from __future__ import annotations

from typing import Any

import pytest

try:
    import aiodatadist.pytest_plugin  # noqa: F401  (registered below, by name)
except ImportError as e:
    _WHY: str | None = str(e) or type(e).__name__
else:
    _WHY = None

if _WHY is None:
    # pytest registers the real plugin (its hooks and fixtures) from this list.
    pytest_plugins = ["aiodatadist.pytest_plugin"]
else:
    _FIXTURES = (
        "datadist_pair",
        "datadist_remote_pair",
        "datadist_faults",
        "datadist_pair_factory",
    )

    def pytest_configure(config: pytest.Config) -> None:
        # The marker stays known, so --strict-markers does not fail modules that use it.
        config.addinivalue_line(
            "markers", "datadist(...): aiodatadist pair fixtures (the plugin is off: see header)"
        )

    def pytest_report_header(config: pytest.Config) -> list[str]:
        first = (_WHY or "").strip().splitlines()[0]
        return [f"aiodatadist: pytest plugin off, the package cannot be imported: {first}"]

    def _unavailable(name: str) -> Any:
        @pytest.fixture(name=name)
        def fixture() -> None:
            pytest.fail(f"the aiodatadist fixture {name} is unavailable: {_WHY}", pytrace=False)

        return fixture

    for _name in _FIXTURES:
        globals()[_name] = _unavailable(_name)
