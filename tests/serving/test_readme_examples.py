"""Every ``curl`` example of the README and the serving page (docs/serving.md), run as printed against
the real Triton server.

The commands are read from those pages themselves (so an edited example is tested as edited); only the
ports change, to the test server's (the README's are 8000 for HTTP and 8002 for metrics, the
defaults of ``make serve``). Each one must answer what the README implies: a JSON body with a
non-empty ``text_output``, a server-sent-event stream whose pieces make a text, or metric lines.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.serving.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.server]


DOCS = ("README.md", "docs/serving.md", "docs/openai.md")   # the pages whose curl lines are run as printed


def readme_curl_commands() -> list[str]:
    """The pages' shell lines that start with ``curl``, backslash continuations joined."""
    lines = [line for doc in DOCS for line in (ROOT / doc).read_text(encoding="utf-8").splitlines()]
    out, i = [], 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("curl "):
            cmd = line
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
            out.append(cmd)
        i += 1
    return out


def test_the_readme_has_the_examples_this_test_runs():
    cmds = readme_curl_commands()
    assert len(cmds) >= 4, cmds
    assert any("/tensorrt_llm_bls/generate" in c for c in cmds)  # NVIDIA's model name, as its README uses
    assert any("generate_stream" in c for c in cmds) and any("/metrics" in c for c in cmds)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed on this machine")
# OpenAI's (localhost:9000) are run by test_openai_api.py; those to a remote Triton with its API key
# (SERVER:8000, docs/serving.md "Addresses and API keys") by test_triton_keys.py, with its headers
@pytest.mark.parametrize("cmd", [c for c in readme_curl_commands() if "localhost:9000" not in c and "SERVER:" not in c])
def test_readme_curl_example_works_as_printed(triton_server, cmd):
    http_port, metrics_port = triton_server.http_url.rsplit(":", 1)[1], triton_server.metrics_url.split(":")[2].split("/")[0]
    local = cmd.replace("localhost:8000", f"127.0.0.1:{http_port}").replace("localhost:8002", f"127.0.0.1:{metrics_port}")
    assert local != cmd, "the example names no port the test server can stand in for"
    run = subprocess.run(["bash", "-o", "pipefail", "-c", local], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (local, run.stdout[-2000:], run.stderr[-2000:])
    out = run.stdout
    if "/metrics" in cmd:
        assert re.search(r"^kiln_\w+(\{[^}]*\})? [0-9.e+-]+$", out, re.M), out[:500]
    elif "generate_stream" in cmd:
        events = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("data:")]
        assert events and not any("error" in e for e in events), out[:1000]
        assert "".join(e["text_output"] for e in events).strip()
    else:
        body = json.loads(out)
        assert "error" not in body, body
        assert body["text_output"].strip(), body
        prompt = json.loads(cmd.split("-d '", 1)[1].rsplit("'", 1)[0])["text_input"]
        assert body["text_output"].startswith(prompt)  # not streamed: the prompt, then the completion
