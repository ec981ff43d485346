"""Figures people can trust: percentiles, spreads, the disagreement warning, the load.

One definition for every benchmark the project ships (``aiodatadist bench`` and the
source tree's ``bench/*.py``, which import it from here: the installed package cannot
import ``bench/``).

* :func:`percentile` interpolates linearly between order statistics (numpy's default,
  "type 7"), so a figure does not jump between samples as their count changes.
* :class:`Summary` is a sample's n, min, p10, p50, p90, p99 and max. Its *band* is
  p10-p90 from :data:`MIN_FOR_PERCENTILES` samples up, else min-max (a p10 of 5 samples
  says nothing min and max do not say better), and it is named wherever it is printed.
* :func:`disagreement` = (max - min) / median of the medians of repeated rounds (or
  runs) of one figure; :func:`disagree_warning` writes a ``WARNING`` line when it is
  above :data:`DISAGREE` (20%).
* :func:`fmt` writes ``"14.2 us (p10-p90 13.9-15.1)"``.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DISAGREE",
    "MIN_FOR_PERCENTILES",
    "SMALL_PULL_BYTES",
    "Summary",
    "disagree_warning",
    "disagreement",
    "fmt",
    "fmt_latency",
    "fmt_load",
    "fmt_num",
    "load_average",
    "percentile",
    "summarize",
]

DISAGREE = 0.20
"""Rounds of one figure whose (max - min) / median of round medians exceeds this get a WARNING."""

MIN_FOR_PERCENTILES = 10
"""From this many samples up the band is p10-p90; below, min-max."""

SMALL_PULL_BYTES = 1 << 20
"""Pulls of at most this many bytes are reported as latency (us), not only GB/s."""


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs``, interpolated linearly between order statistics.

    Raises:
        ValueError: ``xs`` is empty, or ``q`` is outside 0..1 (or NaN).
    """
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of no samples")
    if not 0.0 <= q <= 1.0:  # also rejects NaN
        raise ValueError(f"quantile must be in 0..1, got {q}")
    h = (len(s) - 1) * q
    lo = math.floor(h)
    if lo + 1 >= len(s):
        return float(s[-1])
    return float(s[lo] + (h - lo) * (s[lo + 1] - s[lo]))


@dataclass(frozen=True)
class Summary:
    """A sample's order statistics (same unit as the samples)."""

    n: int
    min: float
    p10: float
    p50: float
    p90: float
    p99: float
    max: float

    @property
    def median(self) -> float:
        return self.p50

    @property
    def band(self) -> tuple[str, float, float]:
        """(name, low, high): p10-p90 from :data:`MIN_FOR_PERCENTILES` samples up, else min-max."""
        if self.n >= MIN_FOR_PERCENTILES:
            return "p10-p90", self.p10, self.p90
        return "min-max", self.min, self.max

    def as_json(self, digits: int = 4) -> dict[str, Any]:
        """The figures, rounded, with the band's name and bounds (what the text prints)."""
        kind, lo, hi = self.band
        out: dict[str, Any] = {"n": self.n}
        out.update({k: round(getattr(self, k), digits) for k in _ORDER})
        out.update({"band": kind, "band_lo": round(lo, digits), "band_hi": round(hi, digits)})
        return out


_ORDER = ("min", "p10", "p50", "p90", "p99", "max")


def summarize(xs: Iterable[float]) -> Summary | None:
    """The :class:`Summary` of ``xs``; None when there are none."""
    s = sorted(xs)
    if not s:
        return None
    return Summary(
        len(s), float(s[0]), percentile(s, 0.10), percentile(s, 0.50),
        percentile(s, 0.90), percentile(s, 0.99), float(s[-1]),
    )  # fmt: skip


def disagreement(round_medians: Sequence[float]) -> float | None:
    """(max - min) / median of the round medians; None with fewer than 2 or a median <= 0."""
    if len(round_medians) < 2:
        return None
    med = statistics.median(round_medians)
    if not med > 0:
        return None
    return (max(round_medians) - min(round_medians)) / med


def disagree_warning(name: str, round_medians: Sequence[float], unit: str = "") -> str | None:
    """A ``WARNING`` line when the rounds of ``name`` disagree by more than :data:`DISAGREE`."""
    d = disagreement(round_medians)
    if d is None or d <= DISAGREE:
        return None
    shown = ", ".join(fmt_num(m) for m in round_medians)
    return (
        f"WARNING: {name}: its {len(round_medians)} rounds disagree by {100 * d:.0f}% "
        f"((max-min)/median of the round medians > {100 * DISAGREE:.0f}%): {shown}"
        f"{' ' + unit if unit else ''}"
    )


def fmt_num(x: float) -> str:
    """About 3 significant digits (14.2, 1.43, 0.512, 1234)."""
    if not math.isfinite(x):
        return str(x)
    a = abs(x)
    digits = 0 if a >= 100 else 1 if a >= 10 else 2 if a >= 1 else 3
    return f"{x:.{digits}f}"


def fmt(s: Summary | None, unit: str = "", *, band: bool = True) -> str:
    """``"14.2 us (p10-p90 13.9-15.1)"``; ``"-"`` for no samples."""
    if s is None:
        return "-"
    text = fmt_num(s.p50) + (f" {unit}" if unit else "")
    if band and s.n > 1:
        kind, lo, hi = s.band
        text += f" ({kind} {fmt_num(lo)}-{fmt_num(hi)})"
    return text


def fmt_latency(s: Summary | None, unit: str = "us") -> str:
    """``"p50 14.2 / p90 15.1 / p99 18.0 us"``; ``"-"`` for no samples."""
    if s is None:
        return "-"
    return f"p50 {fmt_num(s.p50)} / p90 {fmt_num(s.p90)} / p99 {fmt_num(s.p99)} {unit}".rstrip()


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, rounded; None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def fmt_load(when: str, load: Sequence[float] | None) -> str:
    """``"load average at start (1/5/15 min): 1.45 0.92 1.16 on 2 CPUs"``."""
    if load is None:
        return f"load average at {when}: unknown"
    return (
        f"load average at {when} (1/5/15 min): {' '.join(f'{x:.2f}' for x in load)} "
        f"on {os.cpu_count()} CPUs"
    )
