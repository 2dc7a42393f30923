"""Imports run one way only: harness -> builder -> backend -> plugins -> quant (README.md, Layout).

A module may import its own layer and the layers after it, never one before it; the Triton model
files under model_repository/ may import backend only. Every import counts, wherever it is (module
level, inside a function, under ``if TYPE_CHECKING``), and so does a "module" or "module:attr" string
naming a project module (the registries import those lazily). Pure AST: nothing is imported.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("harness", "builder", "backend", "plugins", "quant")  # each imports only those after it
MODEL_REPOSITORY = "model_repository"
_MODULE_STRING = re.compile(rf"(?:{'|'.join(LAYERS)})(?:\.\w+)+(?::\w+)?")


def allowed(importer: str) -> set[str]:
    """The project layers files under top-level folder ``importer`` may import."""
    if importer == MODEL_REPOSITORY:
        return {"backend"}
    return set(LAYERS[LAYERS.index(importer):])


def imported_modules(path: Path, root: Path) -> list[tuple[int, str, str]]:
    """(line, absolute module name, how it was named) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = list(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, f"import {a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                up = node.level - 1
                base = package[:len(package) - up] if up <= len(package) else None
                assert base, f"{path.relative_to(root)}:{node.lineno}: relative import above the top-level folder"
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            what = ", ".join(a.name for a in node.names)
            out.append((node.lineno, module, f"from {'.' * node.level}{node.module or ''} import {what}"))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and _MODULE_STRING.fullmatch(node.value)):
            out.append((node.lineno, node.value.partition(":")[0], f"module string {node.value!r}"))
    return out


def back_edges(files: list[Path], root: Path = ROOT) -> list[str]:
    """"file:line: what (why)" for each import in ``files`` that runs back up the layering."""
    bad = []
    for path in files:
        importer = path.relative_to(root).parts[0]
        ok = allowed(importer)
        for line, module, how in imported_modules(path, root):
            layer = module.split(".")[0]
            if layer in LAYERS and layer not in ok:
                bad.append(f"{path.relative_to(root)}:{line}: {how} ({importer} may import "
                           f"{', '.join(sorted(ok, key=LAYERS.index))} only)")
    return bad


def project_files() -> list[Path]:
    return sorted(p for top in (*LAYERS, MODEL_REPOSITORY) for p in (ROOT / top).rglob("*.py"))


def test_every_layer_has_files():
    tops = {p.relative_to(ROOT).parts[0] for p in project_files()}
    assert tops == {*LAYERS, MODEL_REPOSITORY}


def test_no_import_runs_back_up_the_layering():
    bad = back_edges(project_files())
    assert not bad, ("imports must run harness -> builder -> backend -> plugins -> quant; these run back "
                     "up:\n" + "\n".join(bad))


def test_a_back_edge_is_found_wherever_it_is(tmp_path):
    # the checker itself: a function-level import, a relative one and a registry string all count
    pkg = tmp_path / "plugins" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text("import quant.formats\n\ndef f():\n    from backend.engine import request\n"
                                "\nfrom ..reference import gemm\nTABLE = {'x': 'builder.cli:main'}\n")
    repo = tmp_path / MODEL_REPOSITORY / "engine" / "1"
    repo.mkdir(parents=True)
    (repo / "model.py").write_text("from backend.serving import engine_host\nimport plugins.registry\n")
    bad = back_edges([pkg / "mod.py", repo / "model.py"], tmp_path)
    assert [b.split(" (")[0] for b in bad] == [
        "plugins/sub/mod.py:4: from backend.engine import request",
        "plugins/sub/mod.py:7: module string 'builder.cli:main'",
        "model_repository/engine/1/model.py:2: import plugins.registry",
    ]
