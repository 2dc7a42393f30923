"""`python -m harness.submission`: lay out a submission tree from build/*/mlperf runs, then check it.

    python -m harness.submission [--org Kiln] [--system NAME] [--round v6.0|v5.1]
                                 [--build-root build] [--output build/submission]
    python -m harness.submission --check-only build/submission
Exit status: 0 complete, 1 problems found (listed), 2 bad arguments / nothing to package.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.submission.check import check_tree
from harness.submission.layout import LAYOUTS
from harness.submission.package import SubmissionError, package


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.submission", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--org", default="Kiln", help="submitting organization (default Kiln)")
    p.add_argument("--system", help="system name (default: from the machine, e.g. 1xH100_80GB_HBM3_kiln)")
    p.add_argument("--round", default="v6.0", choices=sorted(LAYOUTS), help="layout of this MLPerf round")
    p.add_argument("--build-root", type=Path, default=Path("build"), help="where build/<engine>/mlperf runs are")
    p.add_argument("--output", type=Path, default=Path("build/submission"))
    p.add_argument("--engine", help="engine (config stem) whose runs to package when several ran a benchmark "
                                    "(default: the benchmark's engine_config)")
    p.add_argument("--check-only", type=Path, metavar="TREE", help="only self-check an existing tree")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        tree = args.check_only or package(args.build_root, args.output, args.org, args.system, args.round,
                                           engine=args.engine)
    except SubmissionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problems, warnings = check_tree(tree, args.round)
    print(f"submission tree: {tree} (MLPerf Inference {args.round} layout)")
    for w in warnings:
        print(f"  warning: {w}")
    for pr in problems:
        print(f"  PROBLEM: {pr}")
    print("self-check: " + ("complete" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
