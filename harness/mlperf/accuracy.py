"""Accuracy from `mlperf_log_accuracy.json`: detokenize, score, compare with the targets.

Metrics follow the MLPerf reference evaluation scripts: llama2-70b reports ROUGE-1/2/L and
`tokens_per_sample` (mean output tokens), llama3.1-8b ROUGE-1/2/L/Lsum and `gen_len` (total
characters of the decoded outputs). The default smollm2 benchmark scores ROUGE against the
unquantized engine's greedy outputs. `accuracy.txt` starts with the metrics dict on one line (the
form the submission checker parses), then one PASS/FAIL line per accuracy level.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from harness.mlperf.rouge import rouge_scores
from harness.mlperf.sut import OUTPUT_DTYPE


class AccuracyError(ValueError):
    pass


def read_accuracy_log(path: Path) -> dict[int, list[int]]:
    """qsl_idx -> output token ids (one entry per sample; duplicates must agree)."""
    path = Path(path)
    if not path.is_file():
        raise AccuracyError(f"{path}: accuracy log not found (run with --mode AccuracyOnly first)")
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise AccuracyError(f"{path}: not valid JSON ({e})") from None
    outputs: dict[int, list[int]] = {}
    for e in entries:
        toks = np.frombuffer(bytes.fromhex(e["data"]), dtype=OUTPUT_DTYPE).tolist()
        outputs.setdefault(int(e["qsl_idx"]), toks)
    return outputs


def load_tokenizer(tokenizer_dir: Path):
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise AccuracyError(f"{path}: tokenizer not found (the engine bundle's tokenizer/ folder)")
    return Tokenizer.from_file(str(path))


def compute_metrics(metric: str, predictions: list[str], references: list[str | None],
                    token_counts: list[int]) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    if all(r is not None for r in references):
        out.update(rouge_scores(predictions, references))  # type: ignore[arg-type]
    out["gen_len"] = int(sum(len(p) for p in predictions))
    out["gen_num"] = len(predictions)
    out["tokens_per_sample"] = round(float(np.mean(token_counts)), 2) if token_counts else 0.0
    if metric == "rouge_tokens_per_sample":
        out.pop("rougeLsum", None)  # llama2-70b's reference script does not report it
    return out


def check_targets(metrics: dict, targets: dict) -> dict[str, list[str]]:
    """Level -> list of failures (empty = pass). A metric missing from `metrics` is a failure."""
    ref = targets["reference"]
    lower, upper = targets.get("lower_factor", {}), targets.get("upper_factor", {})
    result = {}
    for level, factor in targets["levels"].items():
        fails = []
        for key, value in ref.items():
            if key not in metrics:
                fails.append(f"{key} not computed")
                continue
            lo = value * lower.get(key, factor)
            if metrics[key] < lo:
                fails.append(f"{key} {metrics[key]} < {lo:.4f}")
            if key in upper and metrics[key] > value * upper[key]:
                fails.append(f"{key} {metrics[key]} > {value * upper[key]:.4f}")
        result[level] = fails
    return result


def evaluate(log_path: Path, samples, tokenizer_dir: Path, metric: str, targets: dict | None,
             out_path: Path) -> dict:
    """Score an accuracy log against the samples' references and write `accuracy.txt`."""
    outputs = read_accuracy_log(log_path)
    if not outputs:
        raise AccuracyError(f"{log_path}: empty accuracy log")
    tok = load_tokenizer(tokenizer_dir)
    idx = sorted(outputs)
    bad = [i for i in idx if i >= len(samples)]
    if bad:
        raise AccuracyError(f"{log_path}: qsl_idx {bad[0]} is outside the dataset ({len(samples)} samples)")
    preds = [tok.decode(outputs[i], skip_special_tokens=True).strip() for i in idx]
    refs = [samples[i].reference for i in idx]
    metrics = compute_metrics(metric, preds, refs, [len(outputs[i]) for i in idx])
    lines = [repr(metrics)]
    if any(r is None for r in refs):
        lines.append("ROUGE not computed: the dataset has no reference outputs "
                     "(for smollm2 run the unquantized engine once: python -m harness.mlperf --config "
                     "configs/smollm2-135m-bf16.yaml --mode AccuracyOnly --save-reference)")
        verdict = {}
    elif targets is None:
        verdict = {}
    else:
        verdict = check_targets(metrics, targets)
        for level, fails in verdict.items():
            lines.append(f"accuracy level {level}: " + ("PASS" if not fails else "FAIL: " + "; ".join(fails)))
    out_path = Path(out_path)
    out_path.write_text("\n".join(lines) + "\n")
    return {"metrics": metrics, "levels": {k: not v for k, v in verdict.items()},
            "texts": dict(zip(idx, preds))}


def rescore(log_dir: Path, reference: Path | None = None, trust_pickle: bool = False) -> dict:
    """Score an existing AccuracyOnly run folder again (e.g. after the targets or the reference
    changed): rewrites its accuracy.txt and the accuracy entry of its run.json."""
    from harness.mlperf import settings
    from harness.mlperf.samples import load_samples

    log_dir = Path(log_dir)
    info_path = log_dir / "run.json"
    if not info_path.is_file():
        raise AccuracyError(f"{info_path}: not a harness run folder (no run.json)")
    info = json.loads(info_path.read_text())
    bench = settings.load_benchmarks().get(info["benchmark"])
    if info.get("max_output_tokens"):
        import dataclasses
        bench = dataclasses.replace(bench, max_output_tokens=info["max_output_tokens"])
    engine_dir = Path(info["engine_dir"])
    samples = load_samples(bench, engine_dir.parent, None, reference, trust_pickle=trust_pickle)
    res = evaluate(log_dir / "mlperf_log_accuracy.json", samples, engine_dir / "tokenizer", bench.accuracy_metric,
                   settings.load_accuracy_targets().get(bench.name), log_dir / "accuracy.txt")
    info["accuracy"] = {"metrics": res["metrics"], "levels": res["levels"]}
    info_path.write_text(json.dumps(info, indent=1))
    return info["accuracy"]


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m harness.mlperf.accuracy",
                                description="Score an AccuracyOnly run folder again and rewrite its accuracy.txt.")
    p.add_argument("log_dir", type=Path, help="e.g. build/smollm2-135m-fp8/mlperf/Offline/AccuracyOnly")
    p.add_argument("--reference", type=Path, help="reference outputs JSON (smollm2)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow a .pkl dataset (unpickling runs any code the file holds)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from harness.mlperf.datasets import DatasetError

    try:
        print(json.dumps(rescore(args.log_dir, args.reference, args.trust_pickle)))
    except (AccuracyError, DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
