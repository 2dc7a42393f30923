"""One LoadGen run: settings -> dataset -> server -> SUT/QSL -> logs -> accuracy / TEST06.

Logs go to `<output>/mlperf/<scenario>/<mode>/` (mode = PerformanceOnly | AccuracyOnly | TEST06),
with `run.json` beside LoadGen's files recording what produced them (the submission packager
reads it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import multiprocessing
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from backend import bundle
from harness.mlperf import accuracy, compliance, settings
from harness.mlperf.build_check import check_build_matches
from harness.mlperf.datasets import REPO_ROOT, Sample
from harness.mlperf.samples import REFERENCE_FILE, engine_config, load_samples
from harness.model_names import DEFAULT, repository_names

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunRequest:
    config: Path                       # engine config (configs/<engine>.yaml)
    scenario: str
    mode: str                          # PerformanceOnly | AccuracyOnly
    benchmark: str | None = None
    test_run: bool = False
    compliance: str | None = None      # "TEST06" or None
    server_url: str | None = None
    output: Path | None = None
    dataset_path: Path | None = None
    user_conf: Path | None = None
    mlperf_conf: Path | None = None
    num_clients: int = 4
    save_reference: bool = False       # write the decoded outputs as the benchmark's reference
    log_root: Path | None = None       # default <output>/mlperf
    max_output_tokens: int | None = None   # debugging/CI only: shorter outputs than the benchmark's
    test_queries: int | None = None    # --test-run size (default benchmarks.yaml test_run)
    reference: Path | None = None      # reference outputs file (default: see reference_path)
    trust_pickle: bool = False         # allow a .pkl dataset (unpickling runs the file's code)
    overrides: tuple[str, ...] = ()    # key=value on the engine config, as `make build OVERRIDES=...` got them


def server_reachable(url: str) -> bool:
    import tritonclient.grpc as grpcclient

    try:
        with contextlib.closing(grpcclient.InferenceServerClient(url)) as c:
            return c.is_server_ready(client_timeout=2.0)
    except Exception:
        return False


@contextlib.contextmanager
def ensure_server(url: str | None, repo: Path, default_port: int):
    """Yield the gRPC url of a ready server: the given/default one if it answers, else a server
    started on free ports from `repo` (serving's TritonServer) and stopped afterwards."""
    url = url or f"127.0.0.1:{default_port}"
    if server_reachable(url):
        yield url
        return
    if not (repo / repository_names(repo).engine).is_dir():
        raise RuntimeError(f"no Triton server at {url} and no model repository at {repo} to start one "
                           f"(build it first: make build CONFIG=...)")
    from harness.serve_gpus import check_repository_gpus
    from harness.serving_server import TritonServer

    check_repository_gpus(repo)   # PlacementError (a RuntimeError): too few GPUs, before the server starts
    log.info("no server at %s: starting one from %s (free ports)", url, repo)
    with TritonServer(repo) as server:
        yield server.grpc_url


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def parse_summary(path: Path) -> dict[str, str]:
    """`key : value` lines of mlperf_log_summary.txt (first occurrence of each key)."""
    out: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        m = re.match(r"^\s*([^:=]+?)\s*:\s*(.+?)\s*$", line)
        if m and m.group(1) not in out:
            out[m.group(1)] = m.group(2)
    return out


def _loadgen_session(run_settings: settings.RunSettings, log_dir: Path, audit: Path, url: str,
                     samples: list[Sample], num_clients: int, engine_model: str = DEFAULT.engine) -> None:
    """Child process: one LoadGen test over the Triton SUT; request errors go to sut_errors.json."""
    import mlperf_loadgen as lg
    from harness.mlperf.sut import SampleLibrary, TritonSUT

    ts = settings.to_loadgen(run_settings, log_dir / "loadgen.conf")
    log_settings = lg.LogSettings()
    log_settings.log_output.outdir = str(log_dir)
    log_settings.log_output.copy_summary_to_stdout = False
    log_settings.enable_trace = False
    bench = run_settings.benchmark
    sut_obj = TritonSUT(url, samples, max_output_tokens=bench.max_output_tokens,
                        min_output_tokens=bench.min_output_tokens, num_clients=num_clients,
                        model_name=engine_model)
    qsl_obj = SampleLibrary(samples, ts.performance_sample_count_override or len(samples))
    sut = lg.ConstructSUT(sut_obj.issue_queries, sut_obj.flush_queries)
    qsl = qsl_obj.construct()
    try:
        lg.StartTestWithLogSettings(sut, qsl, ts, log_settings, str(audit))
        sut_obj.wait_idle(60)
    finally:
        lg.DestroyQSL(qsl)
        lg.DestroySUT(sut)
        sut_obj.close()
        (log_dir / "sut_errors.json").write_text(json.dumps(sut_obj.errors))


def run(req: RunRequest) -> dict:
    table = settings.load_benchmarks()
    if req.test_queries is not None:
        table = dataclasses.replace(table, test_run={**table.test_run, "min_query_count": req.test_queries,
                                                     "performance_sample_count_override": req.test_queries})
    bench = table.get(req.benchmark)
    if req.max_output_tokens is not None:
        bench = dataclasses.replace(bench, max_output_tokens=req.max_output_tokens)
    config = Path(req.config) if req.config else REPO_ROOT / bench.engine_config
    cfg = engine_config(config, tuple(req.overrides))
    out_dir, stem, grpc_port = cfg.output_dir(req.output), cfg.stem, cfg.serving.grpc_port
    # tp_size / engine_instances / device of the build served = the config's with these overrides
    layout = check_build_matches(cfg, out_dir, config, tuple(req.overrides))
    mode_dir = req.compliance or req.mode
    mode = "PerformanceOnly" if req.compliance else req.mode
    run_settings = settings.build_run_settings(bench, req.scenario, mode, test_run=req.test_run, table=table,
                                               mlperf_conf=req.mlperf_conf, user_conf=req.user_conf)
    if req.compliance not in (None, "TEST06"):
        raise settings.SettingsError(f"--compliance {req.compliance!r}; allowed: TEST06")
    if req.reference and not req.save_reference and not Path(req.reference).is_file():
        raise settings.SettingsError(f"--reference {req.reference}: file not found")
    samples = load_samples(bench, out_dir, req.dataset_path, None if req.save_reference else req.reference,
                           trust_pickle=req.trust_pickle)  # before touching the log folder
    if req.test_run:
        # AccuracyOnly runs every sample of the QSL: a test run keeps its QSL to the test size
        samples = samples[:int(table.test_run["performance_sample_count_override"])]
    eos = bench.eos_token_ids
    if eos is None:
        if not (out_dir / "engine" / bundle.MANIFEST).is_file():
            raise RuntimeError(f"{out_dir / 'engine' / bundle.MANIFEST}: engine bundle not found "
                               f"(build it: make build CONFIG={config})")
        eos = bundle.read(out_dir / "engine").model.eos_token_ids
    log_dir = Path(req.log_root or out_dir / "mlperf") / req.scenario / mode_dir
    if log_dir.exists():
        shutil.rmtree(log_dir)  # stale logs from an earlier run must not be mistaken for this one's
    log_dir.mkdir(parents=True)
    (log_dir / "user.conf").write_text(run_settings.user_conf_text)
    audit = log_dir / "audit.config"  # absent for normal runs: LoadGen must not pick up a stray one
    if req.compliance == "TEST06":
        compliance.write_audit_config(audit, min_query_count=table.test_run["min_query_count"] if req.test_run else None)
    started = time.time()
    with ensure_server(req.server_url, out_dir / "model_repository", grpc_port) as url:
        # LoadGen reads its embedded mlperf.conf (seeds included) only on the first FromConfig of a
        # process and flags any second one as invalid, so every test runs in a fresh process.
        ctx = multiprocessing.get_context("spawn")
        child = ctx.Process(target=_loadgen_session, name="loadgen",
                            args=(run_settings, log_dir, audit, url, samples, req.num_clients,
                                  repository_names(out_dir / "model_repository").engine))
        child.start()
        child.join()
    errors_file = log_dir / "sut_errors.json"
    sut_errors = json.loads(errors_file.read_text()) if errors_file.is_file() else []
    if child.exitcode != 0:
        sut_errors.append(f"LoadGen process exited with code {child.exitcode}")
    result: dict = {"benchmark": bench.name, "scenario": req.scenario, "mode": mode_dir,
                    "test_run": req.test_run, "config": str(config), "engine_stem": stem,
                    "overrides": list(req.overrides), "layout": layout,
                    "engine_dir": str((out_dir / "engine").resolve()),
                    "max_output_tokens": bench.max_output_tokens,
                    "server_url": url, "log_dir": str(log_dir), "commit": _git_commit(),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join([Path(sys.executable).name, "-m", "harness.mlperf", *sys.argv[1:]]),
                    "wall_s": round(time.time() - started, 1), "sut_errors": sut_errors[:20],
                    "summary": parse_summary(log_dir / "mlperf_log_summary.txt"),
                    "round": table.round}
    acc_log = log_dir / "mlperf_log_accuracy.json"
    if mode_dir == "AccuracyOnly":
        targets = settings.load_accuracy_targets().get(bench.name)
        acc = accuracy.evaluate(acc_log, samples, out_dir / "engine" / "tokenizer", bench.accuracy_metric,
                                targets, log_dir / "accuracy.txt")
        result["accuracy"] = {"metrics": acc["metrics"], "levels": acc["levels"]}
        if req.save_reference:
            ref = Path(req.reference or out_dir / "mlperf" / REFERENCE_FILE)
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(json.dumps({"engine": str(out_dir / "engine"), "max_output_tokens": bench.max_output_tokens,
                                       "outputs": {str(k): v for k, v in acc["texts"].items()}}, indent=1))
            result["reference_written"] = str(ref)
    if req.compliance == "TEST06":
        verdict = compliance.verify_test06(acc_log, req.scenario, eos)
        (log_dir / "verify_accuracy.txt").write_text(compliance.report_text(verdict))
        result["test06"] = verdict
    (log_dir / "run.json").write_text(json.dumps(result, indent=1))
    if sut_errors:
        raise RuntimeError(f"{len(sut_errors)} error(s), first: {sut_errors[0]} (logs: {log_dir})")
    return result
