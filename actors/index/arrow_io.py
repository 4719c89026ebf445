"""Arrow helpers of the index: reading event batches fast, inventories and snapshots.

Event batches follow :func:`kvshare.events.event_schema` (``kind, namespace, location, tier,
hash, generation, seq``). Snapshots are tables with a variable-length ``hash`` column so one
file holds namespaces with 16- and 32-byte hashes; they are written as Parquet.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvshare.events import AllCleared, BlockStored, Event, EventKind, event_schema
from kvshare.types import Tier

SNAPSHOT_SCHEMA = pa.schema(
    [
        ("namespace", pa.string()),
        ("location", pa.string()),
        ("tier", pa.string()),
        ("hash", pa.binary()),
        ("generation", pa.int64()),
        ("seq", pa.int64()),
    ]
)

_EVENT_COLUMNS = ("kind", "namespace", "location", "tier", "hash", "generation", "seq")
_SCHEMA32 = event_schema(32)
_SCHEMA16 = event_schema(16)
_LAST_SCHEMA: list[pa.Schema | None] = [None]  # the last schema seen equal to _SCHEMA32


Row = tuple[int, str, str, str, bytes, int, int]  # kind, ns, loc, tier, hash, gen, seq


def event_rows(events: Iterable[Event]) -> list[Row]:
    """Event objects (BlockStored / BlockRemoved / AllCleared) as rows, in order."""
    rows: list[Row] = []
    for ev in events:
        if isinstance(ev, AllCleared):
            rows.append((EventKind.CLEARED, ev.namespace, ev.location, "", b"",
                         ev.generation, ev.seq))
        else:
            kind = EventKind.STORED if isinstance(ev, BlockStored) else EventKind.REMOVED
            rows.append((kind, ev.namespace, ev.location, Tier(ev.tier).value,
                         ev.block_hash, ev.generation, ev.seq))
    return rows


def hash_width(batch: pa.RecordBatch) -> int:
    """Bytes per block hash of an event batch (32 unless its hash column is fixed-size)."""
    t = batch.schema.field("hash").type
    return int(t.byte_width) if pa.types.is_fixed_size_binary(t) else 32


def check_event_batch(batch: Any) -> pa.RecordBatch:
    """ValueError unless ``batch`` is an event record batch (or a one-chunk table of one)."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else pa.RecordBatch.from_pylist([], schema=batch.schema)
    if not isinstance(batch, pa.RecordBatch):
        raise ValueError(
            f"expected an Arrow RecordBatch from kvshare.events.events_to_arrow, got {type(batch).__name__}"
        )
    if batch.schema is _LAST_SCHEMA[0] or batch.schema.equals(_SCHEMA32):
        _LAST_SCHEMA[0] = batch.schema
        return batch
    names = set(batch.schema.names)
    missing = [c for c in _EVENT_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"event batch lacks columns {missing}: build it with events_to_arrow")
    return batch


def validate_events(batch: pa.RecordBatch, group: tuple[str, str, int] | None) -> None:
    """ValueError naming the first bad value (kind, tier, location, hash width); checks every
    row before anything is applied, so a bad batch changes nothing. ``group``: the batch's
    single (namespace, location, generation), if it has one (cheaper checks)."""
    from kvshare.types import parse_location

    hash_type = batch.schema.field("hash").type
    if not pa.types.is_fixed_size_binary(hash_type) or hash_type.byte_width not in (16, 32):
        raise ValueError(f"event hash column must be FixedSizeBinary(32 or 16), got {hash_type}")
    if batch.num_rows == 0:
        return
    kinds = column_np(batch, "kind")
    if kinds.min() < 0 or kinds.max() > 2:
        raise ValueError(f"event batch has unknown event kinds {sorted(set(kinds.tolist()) - {0, 1, 2})}")
    tier_col = batch.column(batch.schema.get_field_index("tier"))
    one = _uniform(tier_col)
    tiers = {one} if one is not None else set(pc.unique(tier_col).to_pylist())
    bad = tiers - {"gpu", "host", "disk", ""}
    if bad:
        raise ValueError(f"event batch has unknown tiers {sorted(map(str, bad))}: use gpu, host or disk")
    locs = [group[1]] if group is not None else pc.unique(
        batch.column(batch.schema.get_field_index("location"))).to_pylist()
    for loc in locs:
        parse_location(str(loc))


def hash_list(col: pa.Array) -> list[bytes]:
    """The hashes of a ``FixedSizeBinary`` column as bytes objects (fast slicing)."""
    if not pa.types.is_fixed_size_binary(col.type) or col.null_count:
        return [bytes(h) for h in col.to_pylist()]
    size = col.type.byte_width
    raw = col.buffers()[1]
    if raw is None:
        return []
    data = raw.to_pybytes()[col.offset * size : (col.offset + len(col)) * size]
    return [data[i : i + size] for i in range(0, len(data), size)]


def packed_hashes(col: pa.Array) -> memoryview | list[bytes]:
    """The hashes of a ``FixedSizeBinary`` column as one zero-copy buffer of packed hashes
    (a list of bytes where the column has nulls or another type)."""
    if not pa.types.is_fixed_size_binary(col.type) or col.null_count:
        return hash_list(col)
    size = col.type.byte_width
    raw = col.buffers()[1]
    if raw is None:
        return []
    return memoryview(raw)[col.offset * size : (col.offset + len(col)) * size]


class StoredGroup(NamedTuple):
    """A batch of BlockStored events of one (namespace, location, generation) into one tier,
    as pools publish them: what :func:`stored_group` found."""

    namespace: str
    location: str
    generation: int
    tier: str
    seqs: np.ndarray[Any, Any]
    consecutive: bool


def stored_group(batch: pa.RecordBatch) -> StoredGroup | None:
    """The batch as a :class:`StoredGroup` when it is exactly one (columns in
    :func:`kvshare.events.event_schema` order, no nulls), else None (the general path takes
    it). Byte-level comparisons of the Arrow buffers: the hot path of event ingestion."""
    n = batch.num_rows
    schema = batch.schema
    if n == 0 or not (schema is _LAST_SCHEMA[0] or schema.equals(_SCHEMA32)
                      or schema.equals(_SCHEMA16)):
        return None
    kind, ns, loc, tier, hashes, gen, seq = batch.columns
    if kind.null_count or hashes.null_count or gen.null_count or seq.null_count:
        return None
    if _raw(kind, 1) != bytes(n):  # every row EventKind.STORED (0)
        return None
    graw = _raw(gen, 8)
    if graw != graw[:8] * n:
        return None
    values = [_uniform_str(c, n) for c in (ns, loc, tier)]
    if None in values:
        return None
    sraw = _raw(seq, 8)
    seqs = np.frombuffer(sraw, dtype=np.int64)
    first = int(seqs[0])
    consecutive = sraw == np.arange(first, first + n, dtype=np.int64).tobytes()
    return StoredGroup(values[0], values[1], int.from_bytes(graw[:8], "little", signed=True),  # type: ignore[arg-type]
                       values[2], seqs, consecutive)  # type: ignore[arg-type]


def _raw(col: pa.Array, width: int) -> bytes:
    """The data bytes of a fixed-width column (its slice)."""
    buf = col.buffers()[1]
    return b"" if buf is None else buf.to_pybytes()[col.offset * width : (col.offset + len(col)) * width]


def _uniform_str(col: pa.Array, n: int) -> str | None:
    """The value of a string column whose rows all hold it, else None."""
    if col.null_count:
        return None
    bufs = col.buffers()
    offs = np.frombuffer(bufs[1], dtype=np.int32)[col.offset : col.offset + n + 1]
    start, width = int(offs[0]), int(offs[1] - offs[0])
    if int(offs[-1]) - start != width * n or offs.tobytes() != _offsets(start, width, n):
        return None
    data = b"" if bufs[2] is None else bufs[2].to_pybytes()[start : start + width * n]
    first = data[:width]
    return first.decode() if data == first * n else None


@functools.lru_cache(maxsize=256)
def _offsets(start: int, width: int, n: int) -> bytes:
    """The offsets buffer of ``n`` strings of ``width`` bytes each from ``start``."""
    return (np.arange(n + 1, dtype=np.int32) * width + start).tobytes()


def _uniform(col: pa.Array) -> Any:
    """The column's value if all rows hold the same one, else None (vectorised)."""
    n = len(col)
    if n == 0 or col.null_count:
        return None
    first = col[0].as_py()
    if n == 1:
        return first
    if pa.types.is_integer(col.type):
        arr = col.to_numpy()
        return first if (arr == first).all() else None
    if pa.types.is_string(col.type):
        bufs = col.buffers()
        offs = np.frombuffer(bufs[1], dtype=np.int32)[col.offset : col.offset + n + 1]
        width = int(offs[1] - offs[0])
        if not (np.diff(offs) == width).all():
            return None
        data = bufs[2].to_pybytes()[int(offs[0]) : int(offs[-1])] if bufs[2] is not None else b""
        return first if data == first.encode() * n else None
    return first if pc.all(pc.equal(col, first)).as_py() else None


def single_group(batch: pa.RecordBatch) -> tuple[str, str, int] | None:
    """``(namespace, location, generation)`` if every row shares them, else None."""
    if batch.num_rows == 0:
        return None
    out = []
    for name in ("namespace", "location", "generation"):
        v = _uniform(batch.column(batch.schema.get_field_index(name)))
        if v is None:
            return None
        out.append(v)
    return str(out[0]), str(out[1]), int(out[2])


def columns_of(batch: pa.RecordBatch) -> tuple[list[Any], ...]:
    """The event columns as Python lists, hashes as bytes."""
    cols = []
    for name in _EVENT_COLUMNS:
        col = batch.column(batch.schema.get_field_index(name))
        cols.append(hash_list(col) if name == "hash" else col.to_pylist())
    return tuple(cols)


def column_np(batch: pa.RecordBatch, name: str) -> np.ndarray[Any, Any]:
    out: np.ndarray[Any, Any] = batch.column(batch.schema.get_field_index(name)).to_numpy(
        zero_copy_only=False
    )
    return out


def all_stored_one_tier(batch: pa.RecordBatch) -> str | None:
    """The tier if every row is a BlockStored into one tier, else None."""
    kinds = column_np(batch, "kind")
    if not (kinds == EventKind.STORED).all():
        return None
    tier = _uniform(batch.column(batch.schema.get_field_index("tier")))
    return str(tier) if tier is not None else None


def inventory_rows(batch: Any) -> list[tuple[str, str, bytes]]:
    """``(namespace, tier, hash)`` of an inventory batch (BlockStored rows)."""
    batch = check_event_batch(batch)
    kinds = column_np(batch, "kind")
    if len(kinds) and not (kinds == EventKind.STORED).all():
        raise ValueError("an inventory holds BlockStored rows only")
    ns = batch.column(batch.schema.get_field_index("namespace")).to_pylist()
    tiers = batch.column(batch.schema.get_field_index("tier")).to_pylist()
    hashes = hash_list(batch.column(batch.schema.get_field_index("hash")))
    return list(zip(ns, tiers, hashes, strict=True))


def snapshot_table(entries: Sequence[tuple[str, str, str, bytes, int, int]]) -> pa.Table:
    cols: list[Sequence[Any]] = (
        list(zip(*entries, strict=True)) if entries else [[] for _ in SNAPSHOT_SCHEMA]
    )
    return pa.Table.from_arrays(
        [pa.array(list(c), f.type) for c, f in zip(cols, SNAPSHOT_SCHEMA, strict=True)],
        schema=SNAPSHOT_SCHEMA,
    )


def inventory_groups(table: pa.Table) -> Iterator[tuple[tuple[str, str, int, int], pa.RecordBatch]]:
    """Split a snapshot into per ``(namespace, location, generation, seq)`` event batches."""
    rows = table.to_pylist()
    groups: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["namespace"], r["location"], r["generation"], r["seq"]), []).append(r)
    for key, rs in groups.items():
        size = len(rs[0]["hash"])
        yield key, pa.RecordBatch.from_arrays(
            [
                pa.array([int(EventKind.STORED)] * len(rs), pa.int8()),
                pa.array([r["namespace"] for r in rs], pa.string()),
                pa.array([r["location"] for r in rs], pa.string()),
                pa.array([r["tier"] for r in rs], pa.string()),
                pa.array([r["hash"] for r in rs], pa.binary(size)),
                pa.array([r["generation"] for r in rs], pa.int64()),
                pa.array([r["seq"] for r in rs], pa.int64()),
            ],
            names=list(_EVENT_COLUMNS),
        )


def write_snapshot(table: pa.Table, path: str) -> None:
    """Write a snapshot as Parquet (atomically: temp file + rename)."""
    import os

    tmp = f"{path}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_snapshot(path: str) -> pa.Table:
    return pq.read_table(path)
