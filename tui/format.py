"""Short human-readable numbers for narrow table cells (`12.3k`, `1.2 GB`, `3m`). Each shows a value that is not
a finite number as a dash: a cell must never take the dashboard down."""

from __future__ import annotations

import math

from rich.filesize import pick_unit_and_suffix

_COUNT_SUFFIXES = ["", "k", "M", "G", "T", "P"]


def count(value: float) -> str:
    """A count in at most six characters: 950, 12.3k, 4.56M."""
    if not math.isfinite(value):
        return "-"
    if abs(value) >= 1000 ** len(_COUNT_SUFFIXES):  # beyond the largest suffix: keep the cell short anyway
        return f"{value:.2g}"
    # Pick the unit from the rounded value so that 999_999 reads 1M, not 1000k.
    unit, suffix = pick_unit_and_suffix(int(float(f"{abs(value):.3g}")), _COUNT_SUFFIXES, 1000)
    if unit == 1:
        return f"{value:.0f}"
    scaled = value / unit
    return f"{scaled:.3g}{suffix}" if abs(scaled) < 100 else f"{scaled:.0f}{suffix}"


def size(num_bytes: float) -> str:
    """Bytes with a decimal unit and no space, for narrow cells: 950B, 1.2MB."""
    return count(num_bytes) + "B"


def duration(seconds: float) -> str:
    """A span of time in the largest unit that keeps it short: 0.4s, 12s, 3m05s, 2h10m."""
    if not math.isfinite(seconds):
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def age(seconds: float) -> str:
    """How long ago, coarsely: now, 12s, 4m, 3h, 2d."""
    if not math.isfinite(seconds):
        return "-"
    if seconds < 1:
        return "now"
    for limit, unit, letter in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if seconds < limit:
            return f"{int(seconds // unit)}{letter}"
    return f"{int(seconds // 86400)}d"


def loss(value: float | None) -> str:
    """A loss with three decimals, or a dash before the first step."""
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"
