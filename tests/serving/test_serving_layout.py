"""backend/serving's sub-packages import one way: text_models -> engine_model -> (conversion,
metrics), and conversion and metrics import no other serving sub-package, so the groups stay
apart and no package cycle forms between them. Pure AST: nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

SERVING = Path(__file__).resolve().parents[2] / "backend" / "serving"
# each sub-package and the other serving sub-packages it may import
ALLOWED = {
    "conversion": set(),
    "metrics": set(),
    "engine_model": {"conversion", "metrics"},
    "text_models": {"engine_model", "conversion", "metrics"},
}


def _serving_imports(path: Path) -> set[str]:
    """The serving sub-packages ``path`` imports (any import, anywhere in the file)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["backend", "serving"] and len(parts) > 2:
                out.add(parts[2])
    return out


def test_every_serving_module_sits_in_a_sub_package():
    assert sorted(p.name for p in SERVING.glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in SERVING.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(ALLOWED)


def test_sub_packages_import_one_way():
    bad = []
    for package, allowed in ALLOWED.items():
        for path in sorted((SERVING / package).glob("*.py")):
            for other in _serving_imports(path) - allowed - {package}:
                bad.append(f"{package}/{path.name} imports backend.serving.{other}")
    assert bad == []


def test_the_check_sees_a_back_edge(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from backend.serving.text_models.bls import BlsHost\n")
    assert _serving_imports(f) == {"text_models"}
