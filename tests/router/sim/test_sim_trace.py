"""Trace input checks: every bad row is refused with its line and the fix, nothing replayed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from paths import TRACES

from kvshare.router.sim.report import format_table
from kvshare.router.sim.trace_read import read_trace

DYNAMO = TRACES / "dynamo_mooncake_trace_1000.jsonl"
needs_dynamo = pytest.mark.skipif(not DYNAMO.exists(), reason=f"trace {DYNAMO} not present")


def _write(tmp_path: Path, rows: list[dict[str, object]], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _row(ts: object = 0, n: object = 1000, ids: object = (1, 2), out: object = 5) -> dict[str, object]:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": list(ids)}  # type: ignore[call-overload]


def test_a_good_trace_reads_in_arrival_order(tmp_path: Path) -> None:
    p = _write(tmp_path, [_row(2000, 1000, (1, 2)), _row(1000, 600, (1, 3)), _row(1000, 10, (9,))])
    t = read_trace(p)
    assert [r.index for r in t] == [1, 2, 0] and t[0].arrival_s == 1.0
    assert t[0].hash_ids == [1, 3] and t[1].input_tokens == 10 and t.warnings == ()


@needs_dynamo
def test_block_size_mismatch_names_the_row_and_the_block_size(tmp_path: Path) -> None:
    # the public trace uses 512-token blocks: replayed as 64-token blocks, it must be refused
    with pytest.raises(ValueError, match=r"line 1 .*needs ceil.*--block-tokens 512"):
        read_trace(DYNAMO, block_tokens=64)
    # a 64-token trace replayed as 512-token blocks: refused, and the fix is named
    rows = [_row(i, 640, range(10 * i, 10 * i + 10)) for i in range(5)]
    with pytest.raises(ValueError, match=r"line 1 \(and 4 more\).*--block-tokens 64"):
        read_trace(_write(tmp_path, rows))
    assert len(read_trace(_write(tmp_path, rows), block_tokens=64)) == 5
    # a row whose ids cover 50x fewer tokens than it has
    bad = [_row(0, 1000, (1, 2)), _row(1, 50 * 1024, (1, 2))]
    with pytest.raises(ValueError, match=r"line 2: 2 hash ids but input_length 51200 needs"):
        read_trace(_write(tmp_path, bad))


@pytest.mark.parametrize(("row", "message"), [
    (_row(ts=None), r"line 2: timestamp is missing \(null\)"),
    (_row(ts=-5), r"line 2: timestamp -5 is negative"),
    (_row(n=1000.5), r"line 2: input_length is 1000.5; it must be a whole number"),
    (_row(n=0, ids=()), r"line 2: input_length is 0"),
    (_row(out=-3), r"line 2: output_length is -3"),
    (_row(out=2.5), r"line 2: output_length is 2.5"),
    (_row(ids=(1, -2)), r"line 2: a hash id is not a whole number"),
    (_row(ids=(1, 2**32)), r"line 2: a hash id is not a whole number in \[0, 2\^32\)"),
    (_row(ids=(1, 2.5)), r"line 2: a hash id is not a whole number"),
    (_row(ts="soon"), r"line 2: not valid Mooncake JSONL .*timestamp.* to string"),
])
def test_bad_values_name_the_line(tmp_path: Path, row: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_trace(_write(tmp_path, [_row(), row]))


def test_ids_that_break_prefix_semantics_are_refused(tmp_path: Path) -> None:
    # id 2 follows id 1 in line 1 but id 7 in line 3: the same id cannot name two prefixes
    rows = [_row(0, 1000, (1, 2)), _row(1, 1000, (1, 3)), _row(2, 1000, (7, 2))]
    with pytest.raises(ValueError, match=r"line 3: hash id 2 follows a different prefix than at line 1"):
        read_trace(_write(tmp_path, rows))
    # id 2 follows id 1 in line 1 but starts line 3 (no parent there)
    rows = [_row(0, 1000, (1, 2)), _row(1, 1000, (1, 3)), _row(2, 1000, (2, 5))]
    with pytest.raises(ValueError, match=r"line 3: hash id 2 follows a different prefix than at line 1"):
        read_trace(_write(tmp_path, rows))
    # ids beyond 2^31 (uint32) keep their value
    big = 2**32 - 1
    t = read_trace(_write(tmp_path, [_row(0, 1000, (big - 1, big))]))
    assert list(t[0].hash_ids) == [big - 1, big]


def test_seconds_in_a_millisecond_format_warn(tmp_path: Path) -> None:
    rows = [_row(i // 10, 1000, (2 * i, 2 * i + 1)) for i in range(200)]  # 200 requests in 19 "ms"
    t = read_trace(_write(tmp_path, rows))
    assert len(t.warnings) == 1 and "multiply them by 1000" in t.warnings[0]
    ok = [_row(i * 250, 1000, (2 * i, 2 * i + 1)) for i in range(200)]  # 4 req/s
    assert read_trace(_write(tmp_path, ok)).warnings == ()


@needs_dynamo
def test_limit_and_missing_file(tmp_path: Path) -> None:
    for bad in (0, -5):
        with pytest.raises(ValueError, match="limit must be >= 1"):
            read_trace(DYNAMO, bad)
    assert len(read_trace(DYNAMO, 7)) == 7
    with pytest.raises(FileNotFoundError) as e:
        read_trace(tmp_path / "none.jsonl")
    assert "shared" not in str(e.value) and "Mooncake" in str(e.value)


def test_table_columns_stay_apart_for_huge_ttfts() -> None:
    stats = {"hit_rate": 0.5, "hit_gpu": 0.0, "hit_host": 0.5, "hit_disk": 0.0, "hit_remote": 0.0,
             "ttft_mean_s": 12345.678, "ttft_p50_s": 1234.5, "ttft_p90_s": 99999.25,
             "ttft_p99_s": 123456.5, "prefill_saved": 0.1, "imbalance": 1.0, "unfit": 0}
    table = format_table(0.6, {"cost": stats, "a_much_longer_policy_name": stats}, "global")
    header, *rest = table.splitlines()[1:]
    row = rest[-1].split()
    assert row[0] == "a_much_longer_policy_name" and len(row) == len(header.split())
    assert row[6:10] == ["12345.678", "1234.500", "99999.250", "123456.500"]
