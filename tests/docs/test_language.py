"""The documentation, configs and model repository speak of the product: no issue numbers, no words
about who measured or on whose machine, no paths of one machine (tests/docs/doc_checks.py's rules)."""
from __future__ import annotations

import json

from tests.docs.doc_checks import REPO, language_files, language_problems, recent_results


def test_the_documentation_speaks_of_the_product():
    files = language_files()
    assert REPO / "README.md" in files and any(p.name == "config.pbtxt.tmpl" for p in files) \
        and any(p.parent.name == "configs" for p in files)
    problems = language_problems(files)
    assert not problems, "reword these in terms of the product:\n" + "\n".join(problems)


def test_each_rule_fires_on_a_sample(tmp_path):
    bad = ["fixed in #18 last week", "see issue 20", "on a lent H100", "the VM was slow",
           "seven other engineers", "written to /tmp/out/a.json", "as /root/out says", "in /work/main",
           "under /home/me", "see shared/notes/environment.md"]
    good = ["FP8 on one H100 80GB", "the [Multi-GPU](#multi-gpu) page", "/dev/shm files removed",
            "build/logs/tritonserver.log", "color #fff", "python -m harness.serve --config configs/x.yaml"]
    sample = tmp_path / "sample.md"
    sample.write_text("\n".join(bad + good) + "\n")
    lines = sorted({int(p.split(":")[1]) for p in language_problems([sample])})
    assert lines == list(range(1, len(bad) + 1)), language_problems([sample])


def test_result_files_written_from_now_on_join_the_check(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"date": "2026-11-27T05:21:45+00:00", "command": "--out /root/x"}))
    (tmp_path / "new.json").write_text(json.dumps({"date": "2026-12-03T01:00:00+00:00", "command": "--out /root/x"}))
    found = recent_results(tmp_path)
    assert found == [tmp_path / "new.json"]
    assert len(language_problems(found)) == 1
