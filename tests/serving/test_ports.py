"""harness.ports.free_port: concurrent callers never share a port, a bound port is never handed out."""
from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from pathlib import Path

from harness import ports

ROOT = Path(__file__).resolve().parents[2]
# every process draws from the same seeded generator, so without the shared registry they would all
# pick the same ports: the test fails if the lock or the registry does not work
ASK = """
import random, sys
from pathlib import Path
from harness import ports
ports.REGISTRY = Path(sys.argv[1])
rng = random.Random(0)
print(" ".join(str(ports.free_port(rng)) for _ in range(int(sys.argv[2]))))
"""


def test_processes_asking_at_once_get_distinct_ports(tmp_path):
    registry, n, procs = tmp_path / "ports.json", 5, 4
    runs = [subprocess.Popen([sys.executable, "-c", ASK, str(registry), str(n)], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True) for _ in range(procs)]
    got = [int(p) for r in runs for p in r.communicate(timeout=60)[0].split()]
    assert all(r.returncode == 0 for r in runs)
    assert len(got) == n * procs and len(set(got)) == len(got), sorted(got)
    assert all(ports.LOW <= p < ports.HIGH for p in got)


def _draws(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(ports.LOW, ports.HIGH) for _ in range(n)]


def test_a_port_in_use_or_recently_handed_out_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "REGISTRY", tmp_path / "ports.json")
    d = _draws(7, 3)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", d[0]))
        s.listen()
        assert ports.free_port(random.Random(7)) == d[1]     # the first draw is listened on
    assert ports.free_port(random.Random(7)) == d[0]         # free again, never handed out
    assert ports.free_port(random.Random(7)) == d[2]         # both handed out within HOLD_S


def test_an_unreadable_registry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "REGISTRY", tmp_path / "ports.json")
    ports.REGISTRY.write_text('{"20001": ')                  # a writer killed mid-write
    p = ports.free_port(random.Random(1))
    assert p == _draws(1, 1)[0]
    assert list(json.loads(ports.REGISTRY.read_text())) == [str(p)]
