"""harness/perf/serving/sweep.py: the serving benchmark's CPU split by process kind, read from /proc."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from harness.perf.serving import sweep as proc_cpu


def test_cores_used_sums_a_kinds_instances_and_skips_processes_not_in_both_snapshots():
    before = {1: ("tritonserver", 10.0), 2: ("postprocessing", 1.0), 3: ("postprocessing", 2.0), 4: ("client", 5.0)}
    after = {1: ("tritonserver", 10.5), 2: ("postprocessing", 1.25), 3: ("postprocessing", 2.25),
             4: ("client", 5.1), 9: ("preprocessing", 3.0)}          # 9 started after the first snapshot
    assert proc_cpu.cores_used(before, after, 2.0) == {"tritonserver": 0.25, "postprocessing": 0.25, "client": 0.05}
    assert list(proc_cpu.cores_used(before, after, 2.0)) == ["tritonserver", "postprocessing", "client"]


def test_a_busy_process_counts_as_the_server_and_this_one_as_the_client():
    """A real process standing in for the server: its CPU time grows while it spins, by no more than
    one core (one thread), and it is labelled as the server; this process is the client."""
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    try:
        time.sleep(0.2)
        before, t0 = proc_cpu.snapshot(busy.pid), time.perf_counter()
        time.sleep(0.5)
        after, wall = proc_cpu.snapshot(busy.pid), time.perf_counter() - t0
    finally:
        busy.kill()
        busy.wait()
    assert before[busy.pid][0] == "tritonserver" and after[os.getpid()][0] == "client"
    cores = proc_cpu.cores_used(before, after, wall)
    assert 0 < cores["tritonserver"] <= 1.05, cores     # clock ticks: a little over one core can round up
    assert proc_cpu.cpu_seconds(busy.pid) is None        # gone once reaped
