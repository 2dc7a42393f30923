"""TEST06 checks on accuracy logs in LoadGen's format (hex int32 token data)."""
import json

import numpy as np
import pytest

from harness.mlperf.compliance import AUDIT_SETTINGS, report_text, verify_test06, write_audit_config


def _hex(tokens):
    return np.asarray(tokens, dtype=np.int32).tobytes().hex().upper()


def _log(tmp_path, entries):
    f = tmp_path / "mlperf_log_accuracy.json"
    f.write_text(json.dumps([{"seq_id": i, "qsl_idx": i, **e} for i, e in enumerate(entries)]))
    return f


def _entry(tokens, first=None, count=None):
    e = {"data": _hex(tokens), "token_count": len(tokens) if count is None else count}
    if first is not None:
        e["token_data"] = _hex([first])
    return e


def test_good_server_log_passes(tmp_path):
    f = _log(tmp_path, [_entry([5, 6, 2], first=5), _entry([7, 8], first=7)])
    r = verify_test06(f, "Server", (2,))
    assert r["passed"] and r["first_token"] and r["eos"] and r["sample_length"]
    assert report_text(r).splitlines()[-1] == "TEST06 verification complete"


@pytest.mark.parametrize("entry,failed", [
    (_entry([5, 6, 2, 2], first=5), "eos"),          # two EOS at the end
    (_entry([5, 2, 6, 2], first=5), "eos"),          # EOS before the end
    (_entry([5, 6, 7], first=9), "first_token"),     # reported first token differs
    (_entry([5, 6, 7], first=5, count=4), "sample_length"),
])
def test_each_check_fails(tmp_path, entry, failed):
    r = verify_test06(_log(tmp_path, [_entry([1, 2], first=1), entry]), "Server", (2,))
    assert not r["passed"] and r[failed] is False
    assert "TEST06 verification failed" in report_text(r)


def test_offline_skips_first_token_and_empty_log_fails(tmp_path):
    r = verify_test06(_log(tmp_path, [_entry([5, 6, 7], first=9)]), "Offline", (2,))
    assert r["passed"] and r["first_token"] is None
    assert "First token check pass: Skipped" in report_text(r)
    assert not verify_test06(_log(tmp_path, []), "Offline", (2,))["passed"]


def test_audit_config(tmp_path):
    text = write_audit_config(tmp_path / "audit.config").read_text()
    assert "*.*.mode = 2" in text and "*.*.min_query_count = 100" in text
    assert AUDIT_SETTINGS["accuracy_log_sampling_target"] == 100
    short = write_audit_config(tmp_path / "a2.config", min_query_count=12).read_text()
    assert "*.*.min_query_count = 12" in short and "*.*.accuracy_log_sampling_target = 12" in short
