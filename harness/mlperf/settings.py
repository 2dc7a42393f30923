"""LoadGen settings: mlperf.conf-style files, the benchmark table, and `lg.TestSettings`.

Files live in `configs/mlperf/`: `mlperf.conf` (rule values), `user.conf` (what a submitter tunes),
`benchmarks.yaml` (datasets, output lengths, submission names) and `accuracy_targets.yaml`.
Conf lines are `<model>.<scenario>.<key> = <value>`; a more specific line wins over a wildcard
one (`m.s` > `m.*` > `*.s` > `*.*`), and user.conf wins over mlperf.conf at equal specificity,
which is what LoadGen itself does when it layers user.conf over mlperf.conf.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "mlperf"
SCENARIOS = ("Offline", "Server", "Interactive")
MODES = ("PerformanceOnly", "AccuracyOnly")
CONF_SCENARIOS = ("SingleStream", "MultiStream", "Server", "Offline", "*")

# Keys LoadGen accepts in mlperf.conf / user.conf (LoadGen 6.0 test_settings_internal.cc).
# Times are milliseconds, as in the files.
KNOWN_KEYS = frozenset(
    """target_qps target_latency target_latency_percentile target_duration min_duration max_duration
    min_query_count max_query_count samples_per_query max_async_queries coalesce_queries
    qsl_rng_seed sample_index_rng_seed schedule_rng_seed accuracy_log_rng_seed
    accuracy_log_probability accuracy_log_sampling_target print_timestamps
    performance_issue_unique performance_issue_same performance_issue_same_index
    performance_sample_count_override accuracy_sample_count_override
    sample_concatenate_permutation use_token_latencies ttft_latency tpot_latency
    infer_token_latencies token_latency_scaling_factor server_num_issue_query_threads mode
    test05 test05_qsl_rng_seed test05_sample_index_rng_seed test05_schedule_rng_seed""".split()
)
# model names may contain dots (wan-2.2-t2v-a14b): scenario and key are the last two fields
_LINE = re.compile(r"^\s*(\S+)\.([^.\s]+)\.([A-Za-z0-9_]+)\s*=\s*(\S+)\s*$")


class SettingsError(ValueError):
    """A settings file or argument is wrong; the message names the file, line and key."""


@dataclasses.dataclass(frozen=True)
class ConfLine:
    model: str
    scenario: str
    key: str
    value: str
    source: str  # "file:line", for error messages and the effective-settings log


def parse_conf(path: Path) -> list[ConfLine]:
    """Parse an mlperf.conf-style file, rejecting unknown keys and scenarios by line."""
    path = Path(path)
    if not path.is_file():
        raise SettingsError(f"{path}: settings file not found")
    return parse_conf_text(path.read_text(), str(path))


def parse_conf_text(text: str, path: str) -> list[ConfLine]:
    """Parse conf text; `path` only names the source in errors ("<file>:<line>: ...")."""
    lines = []
    for n, raw in enumerate(text.splitlines(), 1):
        body = raw.split("#", 1)[0].strip()
        if not body:
            continue
        m = _LINE.match(body)
        if not m:
            raise SettingsError(f"{path}:{n}: expected '<model>.<scenario>.<key> = <value>', got {raw.strip()!r}")
        model, scenario, key, value = m.groups()
        if scenario not in CONF_SCENARIOS:
            raise SettingsError(f"{path}:{n}: scenario {scenario!r}; allowed: {', '.join(CONF_SCENARIOS)}")
        if key not in KNOWN_KEYS:
            raise SettingsError(f"{path}:{n}: unknown key {key!r}; allowed: {', '.join(sorted(KNOWN_KEYS))}")
        try:
            float(value)
        except ValueError:
            raise SettingsError(f"{path}:{n}: {key} = {value!r} is not a number") from None
        lines.append(ConfLine(model, scenario, key, value, f"{path}:{n}"))
    return lines


def loadgen_mlperf_conf_text() -> str:
    """The official mlperf.conf that the installed LoadGen embeds in its binary.

    LoadGen applies it only on the first `FromConfig` call of a process, so Kiln never relies on
    that: our mlperf.conf carries the same rule values explicitly (a test keeps them equal)."""
    import mlperf_loadgen

    data = Path(mlperf_loadgen.__file__).read_bytes()
    start = data.find(b"# The format of this config file is 'key = value'.")
    if start < 0:
        raise SettingsError(f"{mlperf_loadgen.__file__}: no embedded mlperf.conf found")
    return data[start:data.find(b"\0", start)].decode()


def resolve(layers: list[list[ConfLine]], model: str, scenario: str) -> dict[str, ConfLine]:
    """Effective value of every key for (model, scenario); later layers override earlier ones
    at equal or lower specificity, matching LoadGen's user.conf-over-mlperf.conf behaviour."""
    best: dict[str, tuple[tuple[int, int], ConfLine]] = {}
    for layer_idx, layer in enumerate(layers):
        for line in layer:
            if line.model not in (model, "*") or line.scenario not in (scenario, "*"):
                continue
            rank = ((line.model == model) * 2 + (line.scenario == scenario), layer_idx)
            if line.key not in best or rank >= best[line.key][0]:
                best[line.key] = (rank, line)
    return {k: v[1] for k, v in sorted(best.items())}


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    loadgen_model: str
    interactive_model: str
    dataset_kind: str
    dataset_path: str | None
    max_output_tokens: int
    min_output_tokens: int
    eos_token_ids: tuple[int, ...] | None
    accuracy_metric: str
    submission: dict[str, str]
    engine_config: str
    reference_engine_config: str | None = None

    def loadgen_name(self, scenario: str) -> str:
        return self.interactive_model if scenario == "Interactive" else self.loadgen_model


@dataclasses.dataclass(frozen=True)
class BenchmarkTable:
    round: str
    default: str
    test_run: dict[str, int]
    benchmarks: dict[str, Benchmark]

    def get(self, name: str | None) -> Benchmark:
        name = name or self.default
        if name not in self.benchmarks:
            raise SettingsError(f"benchmark {name!r} is unknown; allowed: {', '.join(self.benchmarks)}")
        return self.benchmarks[name]


_BENCH_FIELDS = {"loadgen_model", "interactive_model", "dataset", "max_output_tokens",
                 "min_output_tokens", "eos_token_ids", "accuracy_metric", "submission", "engine_config"}
_BENCH_OPTIONAL = {"reference_engine_config"}


def load_benchmarks(path: Path | None = None) -> BenchmarkTable:
    path = Path(path or CONFIG_DIR / "benchmarks.yaml")
    raw = yaml.safe_load(path.read_text())
    table = {}
    for name, b in raw["benchmarks"].items():
        missing = _BENCH_FIELDS - set(b)
        extra = set(b) - _BENCH_FIELDS - _BENCH_OPTIONAL
        if missing or extra:
            raise SettingsError(f"{path}: benchmarks.{name}: missing {sorted(missing)} / unknown {sorted(extra)}")
        eos = b["eos_token_ids"]
        table[name] = Benchmark(
            name=name, loadgen_model=b["loadgen_model"], interactive_model=b["interactive_model"],
            dataset_kind=b["dataset"]["kind"], dataset_path=b["dataset"].get("path"),
            max_output_tokens=int(b["max_output_tokens"]), min_output_tokens=int(b["min_output_tokens"]),
            eos_token_ids=tuple(eos) if eos is not None else None,
            accuracy_metric=b["accuracy_metric"], submission=dict(b["submission"]),
            engine_config=b["engine_config"], reference_engine_config=b.get("reference_engine_config"))
    if raw["default"] not in table:
        raise SettingsError(f"{path}: default: {raw['default']!r} is not a benchmark")
    return BenchmarkTable(round=str(raw["round"]), default=raw["default"],
                          test_run=dict(raw["test_run"]), benchmarks=table)


def load_accuracy_targets(path: Path | None = None) -> dict[str, Any]:
    path = Path(path or CONFIG_DIR / "accuracy_targets.yaml")
    return yaml.safe_load(path.read_text())


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Everything LoadGen needs for one run, plus the text of the files a submission keeps."""
    benchmark: Benchmark
    scenario: str                       # Offline | Server | Interactive
    mode: str                           # PerformanceOnly | AccuracyOnly
    values: dict[str, ConfLine]         # effective settings (after test-run overrides)
    user_conf_text: str                 # the user.conf lines that apply to this run

    @property
    def loadgen_model(self) -> str:
        return self.benchmark.loadgen_name(self.scenario)

    @property
    def loadgen_scenario(self) -> str:
        return "Server" if self.scenario == "Interactive" else self.scenario

    def conf_text(self) -> str:
        """The effective settings as explicit `model.scenario.key = value` lines for LoadGen."""
        m, s = self.loadgen_model, self.loadgen_scenario
        # LoadGen's parser only accepts comments on their own line.
        return "".join(f"# {line.source}\n{m}.{s}.{k} = {line.value}\n" for k, line in self.values.items())


def build_run_settings(benchmark: Benchmark, scenario: str, mode: str, *, test_run: bool,
                       table: BenchmarkTable, mlperf_conf: Path | None = None,
                       user_conf: Path | None = None) -> RunSettings:
    if scenario not in SCENARIOS:
        raise SettingsError(f"--scenario {scenario!r}; allowed: {', '.join(SCENARIOS)}")
    if mode not in MODES:
        raise SettingsError(f"--mode {mode!r}; allowed: {', '.join(MODES)}")
    mlperf_lines = parse_conf(Path(mlperf_conf or CONFIG_DIR / "mlperf.conf"))
    user_path = Path(user_conf or CONFIG_DIR / "user.conf")
    user_lines = parse_conf(user_path)
    model = benchmark.loadgen_name(scenario)
    lg_scenario = "Server" if scenario == "Interactive" else scenario
    values = resolve([mlperf_lines, user_lines], model, lg_scenario)
    if not any(line.model == model for line in mlperf_lines):
        raise SettingsError(f"{mlperf_conf or CONFIG_DIR / 'mlperf.conf'}: no settings for model {model!r}")
    if "target_qps" not in values:
        raise SettingsError(f"{user_path}: no {model}.{lg_scenario}.target_qps (or wildcard) line")
    if test_run:
        for key, value in table.test_run.items():
            values[key] = ConfLine(model, lg_scenario, key, str(value), "--test-run")
    user_text = "".join(f"{line.model}.{line.scenario}.{line.key} = {line.value}\n"
                        for line in user_lines
                        if line.model in (model, "*") and line.scenario in (lg_scenario, "*"))
    return RunSettings(benchmark, scenario, mode, dict(sorted(values.items())), user_text)


def to_loadgen(run: RunSettings, conf_path: Path):
    """Build `lg.TestSettings`: LoadGen first applies its own embedded mlperf.conf for the model,
    then our resolved lines (written to `conf_path`, kept beside the logs for inspection)."""
    import mlperf_loadgen as lg

    conf_path = Path(conf_path)
    conf_path.write_text(run.conf_text())
    ts = lg.TestSettings()
    rc = ts.FromConfig(str(conf_path), run.loadgen_model, run.loadgen_scenario, 1)
    if rc != 0:
        raise SettingsError(f"{conf_path}: LoadGen rejected the settings (FromConfig returned {rc})")
    ts.scenario = getattr(lg.TestScenario, run.loadgen_scenario)
    ts.mode = getattr(lg.TestMode, run.mode)
    return ts
