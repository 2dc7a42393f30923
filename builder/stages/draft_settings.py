"""The draft's tree settings as the runtime reads them from engine.json.

Its own module because both the draft stage (what it records) and compile (what it writes, fresh on
every build) need them, and compile's packing code is what the draft stage runs its target with.
"""
from __future__ import annotations


def runtime_settings(config) -> dict:
    """The tree settings the runtime reads from engine.json. Not part of the draft stage's key
    (see builder/stages/__init__.py): compile refreshes them from the config on every build."""
    s = config.speculative
    return {"max_draft_len": s.max_draft_len, "tree": s.tree,
            "tree_choices": [list(p) for p in s.tree_choices] if s.tree_choices else None,
            "top_k": s.top_k, "depth": s.depth, "min_draft_prob": s.min_draft_prob}


__all__ = ["runtime_settings"]
