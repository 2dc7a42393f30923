"""Launches per decoder layer of a decode step (harness/perf/step/launches.py) may not grow past what
docs/perf/launches.json commits: a new separate op in the layer must be noticed (and the file
re-generated with its command when the growth is meant)."""
import json
from pathlib import Path

import torch

from harness.perf.step import launches

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "perf" / "launches.json"


def test_launches_per_layer_do_not_grow(device):
    """Counted where the kernel tests run: the interpreter here, the real GPU under KILN_KERNEL_TESTS_ON_GPU."""
    committed = json.loads(COMMITTED.read_text())
    res = launches.measure(device, context=committed["context"])
    got = res["per_layer"]
    assert got["total"] <= committed["per_layer"]["total"], (
        f"{got['total']} launches per decoder layer > {committed['per_layer']['total']} committed in "
        f"{COMMITTED.name}: {got['ops']} vs {committed['per_layer']['ops']}")
    assert got["triton"] >= 3, "the count must see the Triton kernels (KV write, decode, its reduction)"


def test_the_rule_skips_views_and_counts_copies():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = torch.randn(4, 8)
        with launches.LaunchCounter() as c:
            y.view(8, 4).t()[1:]            # views: nothing
            y.to(torch.float32)             # no-op conversion: nothing
            torch.empty(3)                  # allocation: nothing
            x.float()                       # a copy kernel
            (y * 2).sum()                   # two kernels
    assert sum(c.counts.values()) == 3, c.counts
