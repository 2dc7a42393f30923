"""Facts every benchmark records beside its numbers (docs/perf/ rule: machine, date, command,
commit), in one place so the result files stay comparable. Standard library only."""
from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else whatever platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
