"""Kiln's logging: request ids on serving lines, and Triton's logger as the sink inside the server."""
from __future__ import annotations

import logging

import pytest

from backend.logs import ROOT, for_request, get_logger, route_to_triton


class _PbLogger:
    """Records what would reach Triton's ``pb_utils.Logger`` (only exists inside the server)."""
    calls: list[tuple[str, str]] = []

    @classmethod
    def log_info(cls, m): cls.calls.append(("info", m))
    @classmethod
    def log_warn(cls, m): cls.calls.append(("warn", m))
    @classmethod
    def log_error(cls, m): cls.calls.append(("error", m))
    @classmethod
    def log_verbose(cls, m): cls.calls.append(("verbose", m))


class _Pb:
    Logger = _PbLogger


@pytest.fixture
def clean_root():
    root = logging.getLogger(ROOT)
    saved = (root.handlers[:], root.level, root.propagate)
    _PbLogger.calls = []
    yield root
    root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]


def test_request_lines_name_the_request(caplog):
    log = for_request(get_logger("serving.engine"), "engine-0-42")
    with caplog.at_level(logging.INFO, logger=ROOT):
        log.warning("response not delivered (%s)", "gone")
    assert caplog.records[-1].getMessage() == "[request engine-0-42] response not delivered (gone)"
    assert caplog.records[-1].name == "kiln.serving.engine"


def test_route_to_triton_maps_levels_once(clean_root):
    route_to_triton(_Pb)
    route_to_triton(_Pb)  # every model's initialize calls it; one handler only
    log = get_logger("serving.bls")
    log.debug("hidden below info")
    log.info("loaded")
    log.warning("slow")
    log.error("broken")
    assert _PbLogger.calls == [("info", "kiln.serving.bls: loaded"), ("warn", "kiln.serving.bls: slow"),
                               ("error", "kiln.serving.bls: broken")]
    assert clean_root.propagate is False
