"""docs/perf/README.md, rendered from the result files beside it: one row per JSON file with the
machine, date, command, commit and headline figure read from that file, so the table cannot
disagree with its files. ``python -m harness.perf report`` writes it; ``--check`` fails when the
committed README differs from a fresh render (tests/perf/test_report.py runs that check).

A headline is the first ``HEADLINES`` rule whose keys the file has; files older than the common
result header (machine, date, command, commit) show what they recorded and "-" for the rest.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

from harness.perf.lib.results import DOCS, REPO, product_path


def _get(doc: Any, *path: str | int) -> Any:
    for key in path:
        if isinstance(doc, dict) and key in doc:
            doc = doc[key]
        elif isinstance(doc, list) and isinstance(key, int) and -len(doc) <= key < len(doc):
            doc = doc[key]
        else:
            return None
    return doc


def _num(x: Any, digits: int = 2) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    return f"{x:,.{digits}f}" if isinstance(x, float) else f"{x:,}"


def _gpu_bench(d: dict) -> str | None:
    ss = _get(d, "single_stream_cuda_graphs", "decode_ms_per_token")
    tp = _get(d, "throughput", "output_tok_s")
    parts = ([f"single stream {_num(ss)} ms/token"] if ss is not None else []) + \
            ([f"{_num(tp, 0)} output tok/s"
              + ("" if _get(d, "throughput", "complete") in (True, None) else " (partial run)")] if tp is not None else [])
    return ", ".join(parts) or None


def _serving_rows(d: dict) -> str | None:
    rows = [r for r in d.get("rows") or [] if isinstance(r, dict) and "output_token_throughput" in r]
    if not rows:
        return None
    best = max(rows, key=lambda r: r["output_token_throughput"])
    out = f"{_num(best['output_token_throughput'], 1)} output tok/s at {best.get('concurrency', '?')} streams"
    ratio = _get(d, "ratio_vs_hf", "ratio")
    return out + (f", {_num(ratio)}x HF generate" if ratio is not None else "")


def _host_overhead(d: dict) -> str | None:
    res = d.get("results") or {}
    if not isinstance(res, dict):
        return None
    for name in ("decode", "executor"):
        p50 = _get(res, name, "host_overhead_ms_per_step", "p50")
        if p50 is not None:
            return f"{name}: {_num(p50, 3)} ms host time per step (p50)"
    ratio = _get(res, "ratio_new_over_base_p50")
    return f"new/base host time {_num(ratio, 3)}" if ratio is not None else None


def _eagle_cost(d: dict) -> str | None:
    rows = [r for r in d.get("costs") or [] if isinstance(r, dict) and r.get("draft_len")]
    if not rows:
        return None
    r = rows[-1]
    out = f"k={r['draft_len']}: {_num(r.get('cost_vs_plain'))}x a plain pass"
    return out + (f", projected {_num(r['projected_speedup'])}x" if "projected_speedup" in r else "")


def _gpu_check(d: dict) -> str | None:
    b = d.get("bundles")
    if not isinstance(b, dict) or not b:
        return None
    ok = sum(1 for v in b.values() if isinstance(v, dict) and v.get("ok"))
    return f"{ok}/{len(b)} formats ok"


def _build_memory(d: dict) -> str | None:
    dw = d.get("done_when")
    if not isinstance(dw, dict) or "deep_over_shallow_peak" not in dw:
        return None
    return (f"deep/shallow peak RSS {_num(dw['deep_over_shallow_peak'], 3)}, "
            f"deep peak / checkpoint {_num(dw.get('deep_peak_over_deep_checkpoint'), 3)}")


def _decode_perf(d: dict) -> str | None:
    keys = sorted((k for k in d if k.startswith("speedup_b")), key=lambda k: int(k[len("speedup_b"):]))
    if not keys:
        return None
    return "fused vs unfused step: " + ", ".join(f"{_num(d[k])}x at batch {k[len('speedup_b'):]}" for k in keys)


def _serving_ceiling(d: dict) -> str | None:
    alone = _get(d, "executor_alone", "output_tok_s")
    med = d.get("triton_median_output_tok_s") or d.get("triton_by_stream_interval")
    if alone is None:
        return None
    out = f"executor alone {_num(alone, 0)} tok/s"
    if isinstance(med, dict) and med:
        vals = [v for v in med.values() if isinstance(v, (int, float))]
        if vals:
            out += f", through Triton up to {_num(max(vals), 0)} tok/s"
    return out


def _aiperf(d: dict) -> str | None:
    tp = _get(d, "aiperf", "output_token_throughput", "avg")
    ttft = _get(d, "aiperf", "time_to_first_token", "avg")
    if tp is None:
        return None
    return f"{_num(tp, 1)} output tok/s" + (f", TTFT {_num(ttft, 1)} ms (mean)" if ttft is not None else "")


def _grammar(d: dict) -> str | None:
    res = d.get("results")
    if not isinstance(res, dict):
        return None
    parts = []
    for lib in ("xgrammar", "llguidance"):
        mask = _get(res, lib, "mask_us_mean")
        if isinstance(mask, (int, float)):
            parts.append(f"{lib} mask {_num(mask, 1)} us per token (mean)")
    return ", ".join(parts) or None


def _eagle(d: dict) -> str | None:
    res = d.get("results")
    if not isinstance(res, dict):
        return None
    spec = {k: v for k, v in res.items() if k.endswith("@batch1") and isinstance(v, dict) and "speedup_vs_off" in v}
    if not spec:
        return None
    k, v = max(spec.items(), key=lambda kv: kv[1]["speedup_vs_off"])
    return (f"best at batch 1: {k.split('@')[0]} {_num(v['speedup_vs_off'], 3)}x plain decoding, "
            f"{_num(v.get('tokens_per_target_pass'))} tokens per target pass")


def _cpu_linear(d: dict) -> str | None:
    rows = d.get("results")
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
        return None
    r = rows[0]
    times = {k[:-3]: v for k, v in r.items() if k.endswith("_ms") and isinstance(v, (int, float))}
    if not times:
        return None
    best = min(times, key=times.get)
    return f"{r.get('rows', '?')} row(s): fastest {best} {_num(times[best])} ms ({len(times)} paths)"


def _cancel_storm(d: dict) -> str | None:
    rep = d.get("report")
    if not isinstance(rep, dict) or "cancelled" not in rep:
        return None
    return (f"{rep['cancelled']} cancelled, {rep.get('completed')} completed, {rep.get('unanswered')} unanswered, "
            f"server failure: {d.get('server_failure') or 'none'}")


def _ab_runs(d: dict) -> str | None:
    runs = [r for r in d.get("runs") or [] if isinstance(r, dict)]
    ratios = [_get(r, "results", "ratio_new_over_base_p50") for r in runs]
    ratios = [x for x in ratios if isinstance(x, (int, float))]
    if not ratios:
        return None
    return "new/base host time per step: " + ", ".join(_num(x, 3) for x in ratios)


def _before_after(d: dict) -> str | None:
    res = d.get("results")
    if not isinstance(res, dict):
        return None
    pairs = {k: v.get("before_over_after") for k, v in res.items() if isinstance(v, dict) and "before_over_after" in v}
    return ("before/after: " + ", ".join(f"{k} {_num(v)}x" for k, v in pairs.items())) if pairs else None


def _mlperf(d: dict) -> str | None:
    runs = [r for r in d.get("runs") or [] if isinstance(r, dict) and "scenario" in r]
    if not runs:
        return None
    return f"{len(runs)} LoadGen runs: " + ", ".join(f"{r['scenario']} {r.get('mode')}" for r in runs)


# (keys the file must have, the headline made from it), first match wins
HEADLINES: tuple[tuple[tuple[str, ...], Callable[[dict], str | None]], ...] = (
    (("bundles",), _gpu_check),
    (("single_stream_cuda_graphs",), _gpu_bench),
    (("throughput",), _gpu_bench),
    (("costs",), _eagle_cost),
    (("rows",), _serving_rows),
    (("executor_alone",), _serving_ceiling),
    (("aiperf",), _aiperf),
    (("done_when",), _build_memory),
    (("speedup_vs_hf",), lambda d: f"executor {_num(_get(d, 'executor', 'output_tok_per_s'), 1)} tok/s, "
                                   f"{_num(d['speedup_vs_hf'])}x HF generate ({d.get('hf_best_dtype', '?')})"),
    (("speedup_of_means",), lambda d: f"kernels on / off: {_num(d['speedup_of_means'])}x"),
    (("per_layer",), lambda d: f"{_get(d, 'per_layer', 'total')} launches per decoder layer"),
    (("wall_seconds",), lambda d: f"full build {_num(d['wall_seconds'], 1)} s"),
    (("passed", "outcomes"), lambda d: f"{'passed' if d['passed'] else 'FAILED'}: {d.get('requests')} requests in "
                                       f"{_num(d.get('wall_s'), 1)} s"),
    (("phases",), lambda d: f"{'complete' if d.get('complete') else 'partial'}, {_num(d.get('total_s'), 1)} s"),
    (("speedup_b1",), _decode_perf),
    (("results",), _host_overhead),
    (("results",), _grammar),
    (("results",), _eagle),
    (("results",), _cpu_linear),
    (("results",), _before_after),
    (("report",), _cancel_storm),
    (("runs", "base"), _ab_runs),
    (("runs",), _mlperf),
    (("result",), lambda d: str(d["result"]).split("; ")[0][:100]),
    (("copy_gbs",), lambda d: f"copy bandwidth {_num(d['copy_gbs'], 0)} GB/s"),
    (("conclusion",), lambda d: str(d["conclusion"]).split(". ")[0][:90]),
)


def headline(doc: dict) -> str:
    for keys, make in HEADLINES:
        if all(k in doc for k in keys):
            try:
                text = make(doc)
            except (KeyError, TypeError, ValueError):
                text = None
            if text:
                return text
    return "-"


def machine(doc: dict) -> str:
    m = doc.get("machine")
    if isinstance(m, dict) and m.get("host_processor_model_name"):   # MLPerf's system description
        return f"{m['host_processor_model_name']}, {m.get('host_processor_core_count', '?')} cores"
    gpu = (m.get("gpu") if isinstance(m, dict) else None) or doc.get("gpu")
    if isinstance(gpu, str) and gpu:
        return gpu
    if isinstance(m, dict):
        cpu = m.get("cpu")
        cores = m.get("cores")
        if cpu:
            return f"{cpu}" + (f", {cores} cores" if cores else "")
    if isinstance(m, str) and m:
        return m
    return str(doc.get("cpu") or "-")


def command(doc: dict) -> str:
    c = doc.get("command")
    if isinstance(c, list):
        c = "; ".join(map(str, c))
    if not c:
        return "-"
    # a --note is free text about the run, not part of reproducing it: left to the file
    c = re.sub(r" --note (?:(?! --).)*", "", str(c))
    return " ".join(product_path(w) for w in c.split(" "))


def commit(doc: dict) -> str:
    c = doc.get("commit") or doc.get("new") or ""
    return str(c).split()[0][:12] if c else "-"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def result_files(docs: Path = DOCS) -> list[Path]:
    return sorted(p for p in docs.rglob("*.json") if p.is_file())


HEAD = """# Benchmark results

Every result file in this folder, one row each: the machine it ran on, the date, the command that
produced it, the commit, and its headline figure, all read from the file itself. This page is
generated: `python -m harness.perf report` writes it, and a test fails when a result file has no
row or the page differs from a fresh render.

Reproduce a figure with the row's command (`python -m harness.perf list` shows every suite and its
make target; `python -m harness.perf run NAME` runs one). New results are written under
`build/perf/`; a file here is replaced only when a run names it with `--output`. Files measured
before the common result header show "-" where they did not record a field; commands name the
module paths of the commit they ran at.
"""


def render(docs: Path = DOCS) -> str:
    files = result_files(docs)
    by_folder: dict[str, list[Path]] = {}
    for f in files:
        by_folder.setdefault(str(f.parent.relative_to(docs)), []).append(f)
    out = [HEAD]
    for folder in sorted(by_folder, key=lambda k: (k != ".", k)):
        out.append(f"\n## {'Results' if folder == '.' else folder + '/'}\n")
        out.append("| file | machine | date | command | commit | headline |")
        out.append("|---|---|---|---|---|---|")
        for f in by_folder[folder]:
            rel = f.relative_to(docs).as_posix()
            try:
                doc = json.loads(f.read_text())
            except (OSError, ValueError) as exc:
                out.append(f"| [{rel}]({rel}) | - | - | - | - | unreadable: {_cell(type(exc).__name__)} |")
                continue
            if not isinstance(doc, dict):
                doc = {}
            runs = doc.get("runs")
            if isinstance(runs, list) and runs and isinstance(runs[0], dict):   # header kept per run
                doc = {**{k: runs[0][k] for k in ("machine", "date", "command", "commit") if k in runs[0]}, **doc}
            date = str(doc.get("date") or "-")[:10]
            out.append(f"| [{rel}]({rel}) | {_cell(machine(doc))} | {date} | `{_cell(command(doc))}` | "
                       f"{_cell(commit(doc))} | {_cell(headline(doc))} |")
    others = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*")
                    if p.is_file() and p.suffix not in (".json",) and p.name != "README.md")
    if others:
        out.append("\n## Other files\n")
        out.append("Plots, CSV rows and logs that accompany the results above: "
                   + ", ".join(f"[{o}]({o})" for o in others) + ".")
    return "\n".join(out) + "\n"


def main(check: bool = False, docs: Path = DOCS) -> int:
    path = docs / "README.md"
    fresh = render(docs)
    if check:
        if not path.is_file() or path.read_text() != fresh:
            print(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path} is stale: "
                  "run python -m harness.perf report", file=sys.stderr)
            return 1
        return 0
    path.write_text(fresh)
    print(f"wrote {path}")
    return 0
