"""Reading a trace file into a :class:`~kvshare.router.sim.trace.Trace`: the format detected
(Mooncake JSONL or kv-cache-tester agentic JSON) and handed to its reader."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from kvshare.router.sim.trace import Trace
from kvshare.router.sim.trace_agentic import read_agentic
from kvshare.router.sim.trace_mooncake import read_mooncake

FORMATS = ("mooncake", "agentic")


def read_trace(
    path: str | Path | Sequence[str | Path], limit: int | None = None, *,
    fmt: str | None = None, block_tokens: int | None = None,
    progress: Callable[[int], None] | None = None, **options: float | int | None,
) -> Trace:
    """The requests of a trace file or directory, validated, in arrival order.

    ``path``: a file, a directory of agentic files, or several agentic files.
    ``fmt``: ``mooncake`` or ``agentic`` (default: detected; a directory is agentic).
    ``block_tokens``: tokens per hash id (default: the format's, 512 for Mooncake, the
    ``block_size`` the agentic files declare). ``limit``: the first N requests of the source
    (N >= 1). ``progress(n)``: bytes read (Mooncake). ``options``: the agentic replay's knobs
    (:func:`kvshare.router.sim.trace_agentic.read_agentic`); None means that knob's default.
    FileNotFoundError or ValueError naming what to change.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 request, got {limit} (drop --limit to replay all)")
    if block_tokens is not None and block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens} (--block-tokens)")
    paths = [Path(path)] if isinstance(path, str | Path) else [Path(x) for x in path]
    if not paths:
        raise ValueError("no trace given")
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(
                f"trace {str(p)!r} not found: pass a Mooncake-format JSONL file (e.g. "
                "synthetic_trace.jsonl from github.com/kvcache-ai/Mooncake, FAST25-release/"
                "traces) or kv-cache-tester JSON traces (a directory or files)"
            )
    fmt = fmt or detect_format(paths[0])
    options = {k: v for k, v in options.items() if v is not None}
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}: choose one of {list(FORMATS)} (--format)")
    if fmt == "mooncake":
        if options:
            raise ValueError(f"{sorted(options)} apply to the agentic format only (--format agentic)")
        if len(paths) > 1:
            raise ValueError("replay one Mooncake JSONL file at a time")
        return read_mooncake(paths[0], limit, block_tokens or 512, progress)
    return read_agentic(paths, limit, block_tokens, **options)  # type: ignore[arg-type]


def detect_format(path: Path) -> str:
    """``agentic`` for a directory, or a file holding one JSON object with a ``requests``
    list; ``mooncake`` otherwise (JSONL: one request object a line)."""
    if path.is_dir():
        return "agentic"
    with open(path, "rb") as f:
        first = f.readline(1 << 26)
    try:
        obj = json.loads(first)
    except ValueError:
        obj = None
    return "agentic" if isinstance(obj, dict) and isinstance(obj.get("requests"), list) else "mooncake"
