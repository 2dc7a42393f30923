"""`python -m harness.mlperf`: run LoadGen against a Kiln engine served by Triton.

Kiln style:   python -m harness.mlperf --config configs/smollm2-135m-fp8.yaml --scenario Offline
                  --mode PerformanceOnly [--test-run] [--server-url 127.0.0.1:8001]
NVIDIA style: python -m harness.mlperf --benchmarks=llama2-70b --scenarios=Offline,Server
                  [--test_mode=AccuracyOnly] [--audit_test=TEST06]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from harness.mlperf import settings


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.mlperf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, help="engine config (default: the benchmark's engine_config)")
    p.add_argument("--output", type=Path, help="engine build folder (default: build/<config stem>)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="engine config override, as given to make build (OVERRIDES); repeatable. The build "
                        "served must have been made with the same engine.tp_size / serving.engine_instances")
    p.add_argument("--benchmark", "--benchmarks", dest="benchmarks",
                   help="benchmark name(s), comma separated (configs/mlperf/benchmarks.yaml; default smollm2)")
    p.add_argument("--scenario", "--scenarios", dest="scenarios", default="Offline",
                   help="Offline | Server | Interactive (comma separated for several)")
    p.add_argument("--mode", "--test_mode", dest="mode", default="PerformanceOnly",
                   help="PerformanceOnly | AccuracyOnly")
    p.add_argument("--test-run", "--test_run", dest="test_run", action="store_true",
                   help="short run (min_duration 0, a dozen queries): checks plumbing, never a valid result")
    p.add_argument("--compliance", "--audit_test", dest="compliance", choices=["TEST06"],
                   help="run a compliance test instead of a normal run")
    p.add_argument("--server-url", help="Triton gRPC host:port (default: the config's grpc_port; "
                                        "a server is started when none answers)")
    p.add_argument("--dataset-path", type=Path,
                   help="dataset file (Open-Orca / CNN-DailyMail reference formats: JSON, JSONL, Parquet)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow a .pkl dataset (the MLPerf Open-Orca reference file); unpickling runs any code "
                        "the file holds, so only for a file you trust (or convert it to Parquet/JSON)")
    p.add_argument("--user-conf", type=Path, help="user.conf overriding configs/mlperf/user.conf")
    p.add_argument("--mlperf-conf", type=Path, help="mlperf.conf overriding configs/mlperf/mlperf.conf")
    p.add_argument("--num-clients", type=int, default=4, help="gRPC connections (default 4)")
    p.add_argument("--log-root", type=Path, help="where <scenario>/<mode>/ logs go (default <output>/mlperf)")
    p.add_argument("--max-output-tokens", type=int,
                   help="debug only: cap outputs below the benchmark's length (results are not comparable)")
    p.add_argument("--test-queries", type=int, help="--test-run size (default from benchmarks.yaml)")
    p.add_argument("--reference", type=Path,
                   help="reference outputs JSON (smollm2; default build/smollm2-135m-bf16/mlperf/reference.json)")
    p.add_argument("--save-reference", action="store_true",
                   help="AccuracyOnly: store the decoded outputs as the benchmark's accuracy reference")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from harness.mlperf.run import RunRequest, run
    from harness.mlperf.datasets import DatasetError
    from harness.mlperf.accuracy import AccuracyError

    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    benchmarks = (args.benchmarks or settings.load_benchmarks().default).split(",")
    status = 0
    try:
        for name in benchmarks:
            for scenario in args.scenarios.split(","):
                res = run(RunRequest(config=args.config, scenario=scenario.strip(), mode=args.mode,
                                     benchmark=name.strip(), test_run=args.test_run, compliance=args.compliance,
                                     server_url=args.server_url, output=args.output,
                                     dataset_path=args.dataset_path, user_conf=args.user_conf,
                                     mlperf_conf=args.mlperf_conf, num_clients=args.num_clients,
                                     save_reference=args.save_reference, log_root=args.log_root,
                                     max_output_tokens=args.max_output_tokens,
                                     test_queries=args.test_queries, reference=args.reference,
                                     trust_pickle=args.trust_pickle, overrides=tuple(args.override)))
                s = res["summary"]
                tps = s.get("Tokens per second", s.get("Completed tokens per second"))
                perf = f"LoadGen result {s.get('Result is')}, tokens/s {tps}" if tps else "done"
                print(f"{name} {scenario} {res['mode']}{' (test run)' if args.test_run else ''}: {perf} "
                      f"-> {res['log_dir']}")
                if "accuracy" in res:
                    print("  accuracy:", json.dumps(res["accuracy"]))
                if "test06" in res:
                    print("  TEST06:", "PASS" if res["test06"]["passed"] else "FAIL")
                    status |= 0 if res["test06"]["passed"] else 1
    except (settings.SettingsError, DatasetError, AccuracyError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
