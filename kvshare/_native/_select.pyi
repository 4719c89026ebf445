"""Type stub of the optional C extension ``kvshare._native._select`` (source: ``_select.c``)."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

def select(
    index_runs: Sequence[tuple[Sequence[tuple[str, int]], int]],
    pending_runs: Sequence[tuple[Sequence[tuple[str, int]], int]],
    roster: tuple[list[str], list[str], list[int], list[str]],
    loc_node: Mapping[str, int],
    node_of: Callable[[str], int],
    private: frozenset[str],
    queues: list[float],
    order: list[int],
    bound: list[float] | None,
    typical: list[float] | None,
    work: float,
    ready: Any,
    namespace: str,
    hashes: Sequence[bytes],
    now: float,
    tokens: int,
    fetch: tuple[float, ...],
    a: float,
    b: float,
    block_tokens: int,
    lat_remote: float,
    lat_local: float,
    tie_s: float,
    remote: bool,
) -> tuple[list[float], list[tuple[int, tuple[tuple[int, int], ...], int, float, float]]]:
    """``kvshare.router.core.policy.CostPolicy._select``'s candidate loop in C (see ``_select.c``): every
    candidate's estimate and, per plan computed, (index, runs, best_k, best_total, best_fetch);
    TypeError/ValueError outside the plain case."""
