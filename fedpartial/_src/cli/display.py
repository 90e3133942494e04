"""Numbers for people, as ``run`` and ``compare`` print them: megabytes and simulated durations."""

from __future__ import annotations


def mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def duration(seconds: float) -> str:
    """Simulated seconds for people: '42.0 s', '12.5 min', '3.20 h'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:,.2f} h"

