"""Settings: our mlperf.conf agrees with LoadGen's embedded one; layering and errors."""

import mlperf_loadgen as lg
import pytest

from harness.mlperf import settings

TABLE = settings.load_benchmarks()


OFFICIAL = settings.parse_conf_text(settings.loadgen_mlperf_conf_text(), "loadgen:mlperf.conf")
OURS = settings.parse_conf(settings.CONFIG_DIR / "mlperf.conf")


@pytest.mark.parametrize("bench", ["llama2-70b", "llama3.1-8b"])
@pytest.mark.parametrize("scenario", ["Offline", "Server", "Interactive"])
def test_llm_rule_values_match_loadgen(bench, scenario):
    """The llama lines of configs/mlperf/mlperf.conf must equal the mlperf.conf LoadGen 6.0 embeds
    (user-tuned target_qps and the retired TEST05 seeds aside)."""
    run = settings.build_run_settings(TABLE.get(bench), scenario, "PerformanceOnly", test_run=False, table=TABLE)
    official = settings.resolve([OFFICIAL], run.loadgen_model, run.loadgen_scenario)
    ours = settings.resolve([OURS], run.loadgen_model, run.loadgen_scenario)
    keys = {k for k in official if k != "target_qps" and not k.startswith("test05")}
    assert keys  # the official file has entries for this model
    assert {k: ours[k].value for k in keys if k in ours} == {k: official[k].value for k in keys}
    assert keys <= set(ours)


def test_loadgen_applies_our_resolved_settings(tmp_path):
    run = settings.build_run_settings(TABLE.get("llama3.1-8b"), "Server", "PerformanceOnly", test_run=False,
                                      table=TABLE)
    ts = settings.to_loadgen(run, tmp_path / "lg.conf")
    assert (ts.ttft_latency, ts.tpot_latency) == (2_000_000_000, 100_000_000)
    assert ts.use_token_latencies and ts.performance_sample_count_override == 13368


def test_interactive_uses_interactive_limits_and_server_scenario(tmp_path):
    b = TABLE.get("llama2-70b")
    run = settings.build_run_settings(b, "Interactive", "PerformanceOnly", test_run=False, table=TABLE)
    assert (run.loadgen_model, run.loadgen_scenario) == ("llama2-70b-interactive", "Server")
    ts = settings.to_loadgen(run, tmp_path / "lg.conf")
    assert ts.scenario == lg.TestScenario.Server
    assert (ts.ttft_latency, ts.tpot_latency) == (450_000_000, 40_000_000)


def test_user_conf_overrides_and_test_run(tmp_path):
    user = tmp_path / "user.conf"
    user.write_text("smollm2.Server.target_qps = 7.5\n*.*.min_duration = 1234\n")
    b = TABLE.get("smollm2")
    run = settings.build_run_settings(b, "Server", "AccuracyOnly", test_run=False, table=TABLE, user_conf=user)
    # user.conf wins at equal specificity, but a wildcard line must not beat a specific rule line
    assert run.values["target_qps"].value == "7.5"
    assert run.values["min_duration"].value == "60000"
    assert "smollm2.Server.target_qps = 7.5" in run.user_conf_text
    ts = settings.to_loadgen(run, tmp_path / "lg.conf")
    assert ts.server_target_qps == 7.5 and ts.mode == lg.TestMode.AccuracyOnly
    short = settings.build_run_settings(b, "Server", "PerformanceOnly", test_run=True, table=TABLE, user_conf=user)
    ts = settings.to_loadgen(short, tmp_path / "lg2.conf")
    assert ts.min_duration_ms == 0 and ts.min_query_count == TABLE.test_run["min_query_count"]


@pytest.mark.parametrize("line,needle", [
    ("smollm2.Server.target_qpz = 1", "unknown key 'target_qpz'"),
    ("smollm2.Serverr.target_qps = 1", "scenario 'Serverr'"),
    ("smollm2.Server.target_qps = fast", "is not a number"),
    ("target_qps = 1", "expected '<model>.<scenario>.<key> = <value>'"),
])
def test_bad_conf_lines_name_file_and_line(tmp_path, line, needle):
    f = tmp_path / "user.conf"
    f.write_text("# comment\n" + line + "\n")
    with pytest.raises(settings.SettingsError) as e:
        settings.parse_conf(f)
    assert f"{f}:2" in str(e.value) and needle in str(e.value)


def test_missing_target_qps_and_bad_choices(tmp_path):
    f = tmp_path / "user.conf"
    f.write_text("")
    b = TABLE.get("smollm2")
    with pytest.raises(settings.SettingsError, match="target_qps"):
        settings.build_run_settings(b, "Offline", "PerformanceOnly", test_run=False, table=TABLE, user_conf=f)
    with pytest.raises(settings.SettingsError, match="allowed: Offline, Server, Interactive"):
        settings.build_run_settings(b, "SingleStream", "PerformanceOnly", test_run=False, table=TABLE)
    with pytest.raises(settings.SettingsError, match="allowed: PerformanceOnly, AccuracyOnly"):
        settings.build_run_settings(b, "Offline", "Perf", test_run=False, table=TABLE)
    with pytest.raises(settings.SettingsError, match="unknown; allowed: llama2-70b"):
        TABLE.get("gpt-j")
