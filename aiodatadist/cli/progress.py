"""A one-line progress bar on stderr, for the commands that take a while (demo, bench)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """A one-line progress bar on stderr (drawn only when it is a terminal).

    Args:
        label: what is progressing.
        total: the count at completion.
        enabled: draw it; None = when ``stream`` is a terminal.
    """

    WIDTH = 28

    def __init__(
        self,
        label: str,
        total: int,
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label = label
        self.total = max(1, total)
        self.done = 0
        self._t0 = time.perf_counter()
        self._last = 0.0
        self._drawn = False

    def update(self, done: int, total: int | None = None) -> None:
        """Sets the count (redraws at most 20 times a second, and at completion)."""
        if total is not None:
            self.total = max(1, total)
        self.done = min(done, self.total)
        now = time.perf_counter()
        if self.enabled and (now - self._last >= 0.05 or self.done == self.total):
            self._last = now
            self._draw(now)

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total
        fill = int(frac * self.WIDTH)
        bar = "#" * fill + "." * (self.WIDTH - fill)
        self.stream.write(
            f"\r{self.label:<24} [{bar}] {frac * 100:5.1f}% "
            f"{self.done}/{self.total} {now - self._t0:6.1f}s"
        )
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Ends the line (clears it). Idempotent."""
        if self._drawn:
            self.stream.write("\r" + " " * (self.WIDTH + 60) + "\r")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
