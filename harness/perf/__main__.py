"""python -m harness.perf list | run NAME [--dry-run] [--output F] [-- ARGS] | gpu-host OUT [--dry-run] | report

  list       the suite table: name, group, device, budget, result file, make target
  run        one suite (ARGS go to it; --output names its result file, default under build/perf/)
  gpu-host   the GPU host's parts in order with their budgets (PARTS, T_TOTAL, T_<STEP>: harness/perf/runner.py)
  report     docs/perf/README.md from the result files in docs/perf/ (--check: fail when it is stale)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _list() -> int:
    from harness.perf.suites import GROUPS, SUITES
    for group, question in GROUPS.items():
        print(f"{group}: {question}")
        for s in (s for s in SUITES if s.group == group):
            print(f"  {s.name:24s} {s.device}  {s.budget_s:5d} s  {s.output or '-':24s} "
                  f"{'make ' + s.make if s.make else '':20s} {s.about}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m harness.perf", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the suite table")
    r = sub.add_parser("run", help="run one suite")
    r.add_argument("name")
    r.add_argument("--dry-run", action="store_true", help="print what would run; run nothing")
    r.add_argument("--output", help="the result file (default: under build/perf/)")
    r.add_argument("--limit", type=float, default=None, help="stop the suite after this many seconds")
    g = sub.add_parser("gpu-host", help="the GPU host's run, in the table's order and budgets")
    g.add_argument("out", type=Path, help="folder for the results and logs")
    g.add_argument("--dry-run", action="store_true", help="print each step with its limit; run nothing")
    rep = sub.add_parser("report", help="write docs/perf/README.md from the result files")
    rep.add_argument("--check", action="store_true", help="fail (exit 1) when the committed README is stale")
    a = ap.parse_args(argv)
    if a.cmd == "list":
        return _list()
    if a.cmd == "run":
        from harness.perf.runner import run
        return run(a.name, extra, output=a.output, dry_run=a.dry_run, limit_s=a.limit)
    if a.cmd == "gpu-host":
        from harness.perf.runner import gpu_host
        return gpu_host(a.out, dry_run=a.dry_run)
    from harness.perf.report import main as report
    return report(check=a.check)


if __name__ == "__main__":
    sys.exit(main())
