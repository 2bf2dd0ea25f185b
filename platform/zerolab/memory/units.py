"""Byte units and how the estimator's reports write sizes and counts."""

from __future__ import annotations

KIB, MIB, GIB = 1024, 1024**2, 1024**3


def format_gib(n: int | float | None) -> str:
    """``12.3 GiB``, or ``512 MiB`` below 0.1 GiB; ``?`` when unknown."""
    return "?" if n is None else f"{n / GIB:.1f} GiB" if n >= 0.1 * GIB else f"{n / MIB:.0f} MiB"


def format_count(n: int) -> str:
    """``7.62B``, ``20.19M``, ``77.82K`` or the number itself."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def pow2(x: int) -> int:
    """The smallest power of two ≥ ``x`` (0 for 0)."""
    return 1 << (x - 1).bit_length() if x > 0 else 0
