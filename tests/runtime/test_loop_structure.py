"""The two step loops are peers over the request table (backend/engine/request_table.py): neither
imports the executor, and neither reads another object's private members (the overlapped loop once
used eleven of Executor's). Pure AST: nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "backend" / "engine"
LOOPS = ("sync_loop.py", "overlap.py", "request_table.py")


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def _foreign_private_reads(tree: ast.AST) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` (``handle._deliver`` is the event handle's own
    delivery hook, named so that clients of a handle leave it alone)."""
    return [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
            and n.attr != "_deliver"]


@pytest.mark.parametrize("name", LOOPS)
def test_a_loop_module_does_not_reach_into_the_executor(name):
    tree = ast.parse((ENGINE / name).read_text(encoding="utf-8"))
    assert "backend.engine.executor" not in _imports(tree)
    assert _foreign_private_reads(tree) == []


def test_the_check_sees_a_private_read():
    assert _foreign_private_reads(ast.parse("ex._handles.get(rid)\nself._ok\nh._deliver(e)")) == \
        ["line 1: ex._handles"]
