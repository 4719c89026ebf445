"""Type stub of the optional C extension ``kvshare._native._plan`` (source: ``_plan.c``)."""

from collections.abc import Sequence

def scan(
    fetch: tuple[float, ...],
    a: float,
    b: float,
    block_tokens: int,
    total_tokens: int,
    lat_remote: float,
    lat_local: float,
    runs: Sequence[tuple[int, int]],
) -> tuple[int, float, float]:
    """:func:`kvshare.cost._scan_py` in C: the same cut and floats; TypeError/ValueError
    outside the plain case (exact floats, small ints, sources within ``fetch``)."""
