"""Shared header (machine, versions, commit) and result writing for the GPU checks and benchmarks."""
from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

from harness.bench.perfinfo import git_commit

REPO = Path(__file__).resolve().parents[2]


def header(torch, module: str) -> dict:
    """Machine, versions, commit and the command (``python -m <module> <args>``) of a GPU result."""
    import triton
    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(), "sm": f"{props.major}{props.minor}",
            "gpu_mem_gib": round(props.total_memory / 2**30, 1), "host": platform.node(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python -m", module] + sys.argv[1:]),
            "commit": git_commit(), "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda}


def default_path(res: dict, stem: str) -> Path:
    gpu = res["gpu"].lower().replace("nvidia ", "").replace(" ", "-")
    return REPO / "docs" / "perf" / f"{stem}-{gpu}.json"


def write_report(res: dict, out: str | None, stem: str) -> int:
    """Write the JSON; 0 when every entry with an "ok" says so."""
    path = Path(out) if out else default_path(res, stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    bad = [k for k, v in (res.get("bundles") or {}).items() if not v.get("ok")]
    print(f"{stem}: {'all ok' if not bad else 'FAILED: ' + ', '.join(bad)}; written {path}")
    return 1 if bad else 0
