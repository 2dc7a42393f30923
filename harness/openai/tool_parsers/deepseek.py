"""DeepSeek V3 / R1's calls (and V3.1's), written between DeepSeek's own marker tokens.

V3 and R1 write a group of calls as
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
(more calls follow after a newline) and ``<｜tool▁calls▁end｜>``; V3.1 drops the type and the code
fence: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``. Both are read; Kiln's grammar
and built-in prompt write the V3 form. The markers are fullwidth bars (U+FF5C) and U+2581 blocks.
"""
from __future__ import annotations

import json
import re

from harness.openai.tool_parsers.base import NAME, BlockParser

__all__ = ["DeepSeekParser", "CALLS_BEGIN", "CALLS_END", "CALL_BEGIN", "CALL_END", "SEP"]

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class DeepSeekParser(BlockParser):
    """Each ``<｜tool▁call▁begin｜>`` ... ``<｜tool▁call▁end｜>`` block is a call; the group markers
    around them are dropped. A block that opens as V3 (``function<｜tool▁sep｜>NAME`` and the fence) or
    V3.1 (``NAME<｜tool▁sep｜>``) streams its arguments; the head is taken only once the arguments'
    ``{`` is there, so a block whose arguments are not an object is checked whole at its end and,
    failing that, passed on as the text it is."""

    OPEN, CLOSE, DROP = CALL_BEGIN, CALL_END, (CALLS_BEGIN, CALLS_END)
    HEAD = re.compile(rf"\s*(?:function{SEP}({NAME})\s*```(?:json)?|({NAME}){SEP})\s*(?=\{{)")
    _WHOLE = re.compile(rf"\s*(?:\w+{SEP}({NAME})\s*```(?:json)?(.*?)```|({NAME}){SEP}(.*?))\s*", re.S)

    def whole(self, block: str) -> tuple[str, dict] | None:
        m = self._WHOLE.fullmatch(block)
        if not m:
            return None
        name, args = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        try:
            obj = json.loads(args)
        except ValueError:
            return None
        return (name, obj) if isinstance(obj, dict) else None
