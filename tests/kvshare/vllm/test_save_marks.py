"""Save marks between the connector's worker and scheduler sides: a real second process marks,
this one waits (kvshare.vllm.connector.save_marks)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvshare.vllm.connector import save_marks
from kvshare.vllm.connector.save_marks import RING, SaveMarker, SaveMarks

MARK_LATER = """
import sys, time
from kvshare.vllm.connector.save_marks import SaveMarker
m = SaveMarker(sys.argv[1])
print("attached", flush=True)
time.sleep(float(sys.argv[2]))
for seq in sys.argv[3:]:
    m.mark(int(seq))
print("marked", flush=True)
time.sleep(5)
"""


@pytest.fixture
def marks() -> SaveMarks:
    m = SaveMarks.create()
    yield m
    m.close()


def test_a_wait_ends_when_the_other_process_marks_the_saves(marks: SaveMarks) -> None:
    seqs = [marks.next_seq() for _ in range(3)]
    assert seqs == [1, 2, 3]
    child = subprocess.Popen([sys.executable, "-c", MARK_LATER, marks.path, "0.3",
                              *map(str, seqs[:2])], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "attached"
        assert marks.attached
        t0 = time.perf_counter()
        assert marks.wait(seqs[:2], timeout_s=5.0)
        waited = time.perf_counter() - t0
        assert 0.2 <= waited < 3.0, waited
        # the third save was never marked: the wait gives up at its limit, says so
        t0 = time.perf_counter()
        assert not marks.wait(seqs, timeout_s=0.2)
        assert 0.2 <= time.perf_counter() - t0 < 1.0
    finally:
        child.kill()
        child.wait()


def test_nothing_is_waited_for_while_no_worker_has_mapped_the_file(marks: SaveMarks) -> None:
    seq = marks.next_seq()
    t0 = time.perf_counter()
    assert not marks.attached
    assert marks.wait([seq], timeout_s=2.0)
    assert time.perf_counter() - t0 < 0.1


def test_a_slot_reused_a_ring_later_counts_the_older_save_done(marks: SaveMarks) -> None:
    marker = SaveMarker(marks.path)
    try:
        first = marks.next_seq()
        assert not marks.done(first)
        marker.mark(first + RING)  # the same slot, a later save: the older one had ended
        assert marks.done(first)
        # slot 0 holds the worker's pid: numbering skips it
        marks._next = RING - 1
        assert marks.next_seq() == RING + 1
        assert int(marks.slots[0]) == os.getpid()
    finally:
        marker.close()


def test_stale_files_of_dead_engines_are_swept_and_close_removes_the_file(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tmp_path / f"kvshare-saves-{dead.stdout.strip()}-abc123"
    live = tmp_path / f"kvshare-saves-{os.getpid()}-def456"
    other = tmp_path / "kvshare-host-slab"
    for f in (stale, live, other):
        f.write_bytes(b"\0" * 16)
    assert save_marks.sweep_stale(str(tmp_path)) == 1
    assert not stale.exists() and live.exists() and other.exists()
    m = SaveMarks.create()
    path = m.path
    assert Path(path).exists()
    m.close()
    assert not Path(path).exists()
