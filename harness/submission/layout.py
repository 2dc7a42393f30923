"""Submission tree layouts by MLPerf Inference round: one table, no branching elsewhere.

v6.0 (the current round, LoadGen 6.0.x; paths from the v6.0 submission checker): measurements
and compliance results moved into each result folder and `code/` became `src/`.
v5.1 is the earlier layout: `code/`, `measurements/` and `compliance/` as separate trees.
Placeholders: {org} {system} {benchmark} {scenario} {impl}.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Layout:
    round: str
    perf_dir: str            # LoadGen performance logs (run_1)
    acc_dir: str             # accuracy logs + accuracy.txt
    scenario_dir: str        # user.conf, README.md, measurements file
    measurements_file: str   # model/implementation description JSON
    compliance_dir: str      # <test id>/verify_accuracy.txt, <test id>/accuracy/
    src_dir: str             # source code reference
    systems_dir: str
    extra_scenario_files: tuple[str, ...] = ()   # files beside user.conf besides README.md

    def fmt(self, template: str, **kw) -> str:
        return template.format(**kw)


LAYOUTS: dict[str, Layout] = {
    "v6.0": Layout(
        round="v6.0",
        perf_dir="closed/{org}/results/{system}/{benchmark}/{scenario}/performance/run_1",
        acc_dir="closed/{org}/results/{system}/{benchmark}/{scenario}/accuracy",
        scenario_dir="closed/{org}/results/{system}/{benchmark}/{scenario}",
        measurements_file="closed/{org}/results/{system}/{benchmark}/{scenario}/measurements.json",
        compliance_dir="closed/{org}/results/{system}/{benchmark}/{scenario}",
        src_dir="closed/{org}/src",
        systems_dir="closed/{org}/systems",
    ),
    "v5.1": Layout(
        round="v5.1",
        perf_dir="closed/{org}/results/{system}/{benchmark}/{scenario}/performance/run_1",
        acc_dir="closed/{org}/results/{system}/{benchmark}/{scenario}/accuracy",
        scenario_dir="closed/{org}/measurements/{system}/{benchmark}/{scenario}",
        measurements_file="closed/{org}/measurements/{system}/{benchmark}/{scenario}/{system}_{impl}_{scenario}.json",
        compliance_dir="closed/{org}/compliance/{system}/{benchmark}/{scenario}",
        src_dir="closed/{org}/code/{benchmark}/{impl}",
        systems_dir="closed/{org}/systems",
        extra_scenario_files=("mlperf.conf",),
    ),
}

PERF_FILES = ("mlperf_log_summary.txt", "mlperf_log_detail.txt")
ACC_FILES = ("mlperf_log_summary.txt", "mlperf_log_detail.txt", "mlperf_log_accuracy.json", "accuracy.txt")
TEST06_FILES = ("verify_accuracy.txt", "accuracy/mlperf_log_accuracy.json")
# system description fields that must be non-empty (submission rules, "Meaningful response required")
REQUIRED_SYSTEM_FIELDS = (
    "submitter", "division", "system_type", "status", "system_name", "number_of_nodes",
    "host_processors_per_node", "host_processor_model_name", "host_processor_core_count",
    "host_memory_capacity", "host_storage_type", "host_storage_capacity", "accelerators_per_node",
    "accelerator_model_name", "accelerator_memory_capacity", "framework", "operating_system",
    "other_software_stack")
MEASUREMENT_FIELDS = ("input_data_types", "retraining", "starting_weights_filename",
                      "weight_data_types", "weight_transformations")
