"""Hermes' and Qwen's calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks."""
from __future__ import annotations

import json
import re

from harness.openai.tool_parsers.base import NAME, BlockParser

__all__ = ["HermesParser"]


class HermesParser(BlockParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks among free text
    (Hermes, Qwen 2.5/3). A call whose JSON starts with its name and then its arguments (how the
    grammar writes it) streams its arguments as they come; any other call is checked whole at its
    closing tag and sent in one piece, or passed on as text if it is not a call at all."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    HEAD = re.compile(rf'\s*\{{\s*"name"\s*:\s*"({NAME})"\s*,\s*"arguments"\s*:\s*')

    def whole(self, block: str) -> tuple[str, dict] | None:
        try:
            call = json.loads(block)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", {})
        return (call["name"], args) if isinstance(args, dict) else None
