"""Mooncake-format JSONL traces (kvcache-ai/Mooncake FAST25-release/traces), read in chunks.

Each line: ``timestamp`` (ms from trace start), ``input_length``, ``output_length`` (tokens,
optional), ``hash_ids`` (one id per ``block_tokens`` block, ``ceil(input_length /
block_tokens)`` of them; an id stands for its block and every block before it).

The file is parsed by ``pyarrow.json`` ~16 MB at a time, straight into flat numpy columns (no
per-request Python objects), so memory stays near the size of the ids themselves; ``progress``
is called with the bytes of each chunk.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from kvshare.router.sim.trace import (
    F64,
    I64,
    U32,
    Trace,
    build_trace,
    check_prefix_semantics,
    hash_ids,
    validate,
)

_REQUIRED = ("timestamp", "input_length", "hash_ids")
_CHUNK = 16 << 20
_SECONDS_RATE = 1000.0  # req/s: above this, ms timestamps probably are seconds


def read_mooncake(
    path: Path, limit: int | None, block_tokens: int,
    progress: Callable[[int], None] | None = None,
) -> Trace:
    """The validated requests of a Mooncake JSONL file (first ``limit`` lines if given)."""
    cols: dict[str, list[F64]] = {k: [] for k in ("ts", "in", "out")}
    id_chunks: list[U32] = []
    counts: list[I64] = []
    n_rows = 0
    for table in _tables(path, progress):
        missing = [c for c in _REQUIRED if c not in table.column_names]
        if missing:
            raise ValueError(
                f"trace {path.name} lacks column(s) {missing} (lines {n_rows + 1}-"
                f"{n_rows + table.num_rows}): expected Mooncake format, one JSON object a line "
                "with timestamp, input_length, hash_ids (or pass --format agentic)"
            )
        if limit is not None:
            table = table.slice(0, max(0, limit - n_rows))
        ids = table.column("hash_ids").combine_chunks()
        if not pa.types.is_list(ids.type) and not pa.types.is_null(ids.type):
            raise ValueError(f"trace {path.name}: hash_ids must be a list of integers, got {ids.type}")
        n = table.num_rows
        cols["ts"].append(_floats(path, table, "timestamp"))
        cols["in"].append(_floats(path, table, "input_length"))
        has_out = "output_length" in table.column_names
        cols["out"].append(np.nan_to_num(_floats(path, table, "output_length"), nan=0.0)
                           if has_out else np.zeros(n))
        if pa.types.is_null(ids.type):
            counts.append(np.zeros(n, np.int64))
        else:
            count = pc.fill_null(pc.list_value_length(ids), 0).to_numpy().astype(np.int64)
            counts.append(count)
            bounds = np.zeros(n + 1, np.int64)
            np.cumsum(count, out=bounds[1:])
            id_chunks.append(hash_ids(path.name, np.arange(n_rows, n_rows + n, dtype=np.int64),
                                      _floats(path, ids.flatten(), "hash_ids"), bounds))
        n_rows += n
        if limit is not None and n_rows >= limit:
            break
    ts, lens, outs = (np.concatenate(cols[k]) if cols[k] else np.zeros(0) for k in ("ts", "in", "out"))
    ids = np.concatenate(id_chunks) if id_chunks else np.zeros(0, np.uint32)
    del id_chunks
    offsets = np.zeros(n_rows + 1, np.int64)
    if counts:
        np.cumsum(np.concatenate(counts), out=offsets[1:])
    if n_rows == 0:
        raise ValueError(f"trace {path.name} has no requests")
    rows = np.arange(n_rows, dtype=np.int64)
    validate(path.name, rows, ts, lens, outs, offsets, block_tokens, full_blocks_only=False)
    check_prefix_semantics(path.name, rows, ids, offsets)
    return build_trace(
        path.name, block_tokens, rows, ts / 1000.0, lens.astype(np.int64), outs.astype(np.int64),
        ids, offsets, warnings=_timestamp_warnings(path.name, ts),
    )


def _tables(path: Path, progress: Callable[[int], None] | None) -> Iterator[pa.Table]:
    """pyarrow tables of ~16 MB of whole lines each, lazily."""
    first_line = 0
    with open(path, "rb") as f:
        rest = b""
        while True:
            block = f.read(_CHUNK)
            data = rest + block
            if not block:
                cut = len(data)
            else:
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    rest = data
                    continue
            chunk, rest = data[:cut], data[cut:]
            lines = chunk.count(b"\n") + (not chunk.endswith(b"\n"))
            if chunk.strip():
                try:
                    table = pj.read_json(pa.BufferReader(chunk),
                                         pj.ReadOptions(block_size=len(chunk) + 1))
                except pa.ArrowInvalid as e:
                    at = re.search(r"in row (\d+)", str(e))
                    where = (f"line {first_line + int(at.group(1)) + 1}" if at
                             else f"lines {first_line + 1}-{first_line + lines}")
                    raise ValueError(
                        f"trace {path.name} {where}: not valid Mooncake JSONL ({e}); each line "
                        "must be one JSON "
                        "object with numeric timestamp, input_length, output_length and a "
                        "hash_ids list of integers"
                    ) from None
                first_line += lines
            if progress is not None:
                progress(len(block))
            if chunk.strip():
                yield table
            if not block:
                return


def _floats(path: Path, source: pa.Table | pa.Array, name: str) -> F64:
    """A numeric column as float64 with NaN for nulls (so fractions and gaps stay visible)."""
    col = source.column(name).combine_chunks() if isinstance(source, pa.Table) else source
    if pa.types.is_null(col.type):
        return np.full(len(col), np.nan)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
        raise ValueError(f"trace {path.name}: {name} must be numbers, got {col.type} values")
    return np.asarray(pc.fill_null(col.cast(pa.float64()), np.nan).to_numpy(zero_copy_only=False))


def _timestamp_warnings(name: str, ts_ms: F64) -> list[str]:
    """Warn when ms timestamps replay at an implausible rate, as seconds would."""
    span_s = (float(ts_ms.max()) - float(ts_ms.min())) / 1000.0 if ts_ms.size else 0.0
    if ts_ms.size < 100 or span_s <= 0:
        return []
    rate = ts_ms.size / span_s
    if rate <= _SECONDS_RATE:
        return []
    return [
        f"trace {name}: {ts_ms.size} requests within {span_s:.3g} s ({rate:,.0f} req/s): "
        "Mooncake timestamps are milliseconds; if these are seconds, multiply them by 1000 "
        "(the replay now compresses the trace 1000x)"
    ]
