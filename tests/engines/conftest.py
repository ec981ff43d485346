"""Fixtures of the engine tests: no peer process outlives its test (as in tests/xproc)."""

from __future__ import annotations

from tests.xproc.conftest import _reap_peers

__all__ = ["_reap_peers"]
