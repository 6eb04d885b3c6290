"""Byte counts for people: the one formatter every report of memopt uses.

Pure Python: never imports torch.
"""

from __future__ import annotations


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
