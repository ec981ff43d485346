"""The documentation builds with ``mkdocs build --strict``, and the migration guide's
claims about the API still hold (so the guide fails a test, not a user, when the API moves).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import aiodatadist
import aiodatadist.sync
from aiodatadist import CacheManager, CacheTask, LLMDataDist, LLMStatusCode

pytestmark = pytest.mark.slow  # a whole mkdocs build

ROOT = Path(__file__).resolve().parents[2]
DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _missing_docs_packages() -> list[str]:
    missing = []
    for name in DOCS_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


def test_docs_build_strict(tmp_path: Path) -> None:
    missing = _missing_docs_packages()
    if missing:
        pytest.skip(f"mkdocs is not importable ({', '.join(missing)}): pip install -e '.[docs]'")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,  # the snippets extension and the hooks resolve paths from the repo root
        capture_output=True,
        text=True,
        timeout=50,  # within the suite's 60 s per test (a build takes seconds)
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert (site / "index.html").is_file()
    for page in ("concepts", "migration", "examples", "troubleshooting", "performance", "native"):
        assert (site / page / "index.html").is_file(), page
    troubleshooting = (site / "troubleshooting" / "index.html").read_text()
    for code in LLMStatusCode:
        assert f'id="{code.name.lower()}"' in troubleshooting, code.name
    reference = (site / "reference" / "cache_manager" / "index.html").read_text()
    assert "pull_blocks" in reference
    changelog = (site / "changelog" / "index.html").read_text()
    assert "Keep a Changelog" in changelog  # included from CHANGELOG.md


# What docs/migration.md says about each upstream call. Keep both in step.
AWAITED = {
    LLMDataDist: [
        "init",
        "finalize",
        "link_clusters",
        "unlink_clusters",
        "link",
        "unlink",
        "switch_role",
    ],
    CacheManager: [
        "pull_blocks",
        "pull_cache",
        "push_blocks",
        "push_cache",
        "copy_blocks",
        "copy_cache",
        "swap_blocks",
        "transfer_cache_async",
    ],
    CacheTask: ["synchronize", "get_results", "cancel"],
}
SYNC = {
    LLMDataDist: ["query_register_mem_status", "check_link_status"],
    CacheManager: [
        "register_blocks_cache",
        "register_cache",
        "unregister_cache",
        "allocate_blocks_cache",
        "allocate_cache",
        "deallocate_blocks_cache",
        "deallocate_cache",
        "remove_cache_key",
        "remap_registered_memory",
    ],
}


def test_migration_guide_matches_the_api() -> None:
    guide = (ROOT / "docs" / "migration.md").read_text()
    for cls, names in AWAITED.items():
        for name in names:
            assert inspect.iscoroutinefunction(getattr(cls, name)), f"{cls.__name__}.{name}"
    for cls, names in SYNC.items():
        for name in names:
            fn = getattr(cls, name)
            assert callable(fn) and not inspect.iscoroutinefunction(fn), f"{cls.__name__}.{name}"
    assert "not available" not in guide, "docs/migration.md lists something as missing"
    # The blocking form of every row: aiodatadist.sync has each call, as a plain call.
    sync_classes = {
        LLMDataDist: aiodatadist.sync.LLMDataDist,
        CacheManager: aiodatadist.sync.CacheManager,
        CacheTask: aiodatadist.sync.CacheTask,
    }
    for table in (AWAITED, SYNC):
        for cls, names in table.items():
            for name in names:
                fn = getattr(sync_classes[cls], name)
                assert callable(fn) and not inspect.iscoroutinefunction(fn), f"sync {name}"
    # Every public method of the facade is in the guide.
    for cls in (LLMDataDist, CacheManager, CacheTask):
        for name, _ in inspect.getmembers(cls, callable):
            if not name.startswith("_"):
                assert name in guide, f"docs/migration.md does not mention {cls.__name__}.{name}"
    for name in aiodatadist.__all__:
        if name.startswith("LLM") and name.endswith("Error"):
            assert name in guide, f"docs/migration.md does not mention {name}"
