"""The seams new features land on, checked from the source (pure AST like test_layering.py: nothing
is imported).

- No two sibling files (one folder's modules) import each other, directly or round a longer loop.
- No package cycle among backend's sub-packages (``backend/<name>/`` and ``backend/<name>.py``).
- No ``getattr``/``hasattr`` probe on the step runner, the speculator or an attention backend: their
  protocols (``backend/runtime/runtimes.py`` ``StepRunner``, ``backend/engine/speculator_seam.py``
  ``Speculator``, ``backend/ops/attention`` ``AttentionBackend``) give every member a default, so a
  caller reads it.
- Kernel choice is one table (``plugins/registry.py``): no module of the runtime imports or calls a
  kernel the table lists (it asks the table), calls one of PyTorch's operator libraries past it
  (``torch.ops``: oneDNN's and FBGEMM's GEMMs are rows of the table too), or tests an attention
  backend's name.

An import counts wherever it is (module level, in a function, under ``if TYPE_CHECKING``). A registry's
"module:attr" string does not: naming an implementation by string is how an interface's package stays
free of the packages that implement it (test_layering.py still holds those strings to the layering).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("harness", "builder", "backend", "plugins", "quant", "model_repository")

# The interfaces whose members must not be probed for, and the names a caller holds them by.
PROTOCOLS = {"StepRunner": "backend/runtime/runtimes.py", "Speculator": "backend/engine/speculator_seam.py",
             "AttentionBackend": "backend/ops/attention/__init__.py"}
HOLDERS = {"runner", "speculator", "attention"}

KERNEL_TABLE = "plugins/registry.py"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(root: Path, tops=TOPS) -> list[Path]:
    return sorted(p for top in tops for p in (root / top).rglob("*.py"))


def imports(path: Path, root: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from pkg import mod`` names the module ``pkg.mod``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = list(path.relative_to(root).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names}
    return {m for m in out if m in known}


def import_graph(files: list[Path], root: Path) -> dict[str, set[str]]:
    names = {module_name(p, root): p for p in files}
    known = set(names)
    return {m: imports(p, root, known) - {m} for m, p in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def sibling_cycles(files: list[Path], root: Path) -> list[list[str]]:
    """Import cycles among the modules of one folder."""
    graph = import_graph(files, root)
    # a package's __init__ speaks for its folder to the outside: not a sibling of its own modules
    folder = {module_name(p, root): None if p.name == "__init__.py" else module_name(p, root).rpartition(".")[0]
              for p in files}
    same = {m: {d for d in deps if folder.get(d) is not None and folder.get(d) == folder[m]}
            for m, deps in graph.items() if folder[m] is not None}
    return cycles(same)


def backend_unit(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "backend" and len(parts) > 1 else None


def package_cycles(files: list[Path], root: Path) -> list[list[str]]:
    """Cycles among backend's sub-packages, each module's imports lifted to its sub-package."""
    units: dict[str, set[str]] = {}
    for m, deps in import_graph(files, root).items():
        u = backend_unit(m)
        if u is None:
            continue
        units.setdefault(u, set()).update(v for d in deps if (v := backend_unit(d)) and v != u)
    return cycles(units)


def protocol_defaults(root: Path) -> dict[str, set[str]]:
    """Each protocol class's members that have a default (an attribute with a value, a method with a
    body): the optional ones, which are what a caller would probe for."""
    out = {}
    for cls, rel in PROTOCOLS.items():
        tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
        names = set()
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = [b for b in item.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
                if body:   # not just a docstring or "..."
                    names.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                names.add(item.target.id)
            elif isinstance(item, ast.Assign):
                names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        out[cls] = names
    return out


def _holder(node: ast.expr) -> str | None:
    """The name an object is held by: ``runner``, ``self.runner``, ``ex.runner.attention`` -> its last part."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
        probed = node.args[1]
        return probed.value if isinstance(probed, ast.Constant) and isinstance(probed.value, str) else None
    return None


def probes(files: list[Path], root: Path, members: set[str], holders=HOLDERS) -> list[str]:
    """"file:line: call" for each getattr/hasattr on an object held as one of the interfaces, or for
    a member that one of the protocols gives a default."""
    bad = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                continue
            attr = node.args[1]
            name = attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str) else None
            if _holder(node.args[0]) in holders or name in members:
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return bad


def table_targets(root: Path, table: str = KERNEL_TABLE) -> set[str]:
    """The "module:function" of every row of the kernel table (its ``Impl(...)`` calls)."""
    tree = ast.parse((root / table).read_text(encoding="utf-8"))
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}

    def text(node: ast.expr) -> str:   # a string or an f-string of the module's string constants
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.FormattedValue) and isinstance(node.value, ast.Name):
            return consts[node.value.id]
        assert isinstance(node, ast.JoinedStr), ast.unparse(node)
        return "".join(text(v) for v in node.values)
    return {text(n.args[0]) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Impl" and n.args}


def kernel_choices(files: list[Path], root: Path, targets: set[str]) -> list[str]:
    """Kernel choice made outside the one table: a kernel the table lists, imported or called by its
    module instead of asked for (``registry.get``/``load``), a ``torch.ops`` library called past the
    table, or a test of an attention backend's name."""
    modules = {t.partition(":")[0] for t in targets}
    bad = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        aliases: dict[str, str] = {}   # local name -> a kernel module of the table
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if f"{node.module}:{a.name}" in targets:
                        bad.append(f"{rel}:{node.lineno}: from {node.module} import {a.name}")
                    elif f"{node.module}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and f"{aliases.get(node.value.id)}:{node.attr}" in targets):
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                  and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch"
                  and node.value.attr == "ops"):
                # an operator library PyTorch ships (oneDNN, FBGEMM) called straight: a kernel the
                # table does not know of (plugins/cpu/vendor.py holds them as rows)
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Compare):
                if any(isinstance(s, ast.Attribute) and s.attr == "name" and _holder(s.value) == "attention"
                       for s in (node.left, *node.comparators)):
                    bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return sorted(bad)


# -- the checks on the project -------------------------------------------------------------------

def test_no_sibling_file_import_cycle():
    found = sibling_cycles(python_files(ROOT), ROOT)
    assert not found, ("sibling files import each other (move what both need into a third module, or "
                       "pass it in):\n" + "\n".join(" <-> ".join(c) for c in found))


def test_no_package_cycle_in_backend():
    found = package_cycles(python_files(ROOT, ("backend",)), ROOT)
    assert not found, "backend's sub-packages import each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_probe_on_the_runner_speculator_or_attention():
    members = set().union(*protocol_defaults(ROOT).values())
    bad = probes(python_files(ROOT, ("backend", "model_repository")), ROOT, members)
    assert not bad, "read the protocol's member (it has a default) instead of probing for it:\n" + "\n".join(bad)


def test_kernel_choice_is_one_table():
    bad = kernel_choices(python_files(ROOT, ("backend", "model_repository")), ROOT, table_targets(ROOT))
    assert not bad, f"kernels are chosen in {KERNEL_TABLE} only:\n" + "\n".join(bad)


# -- each check can fail ---------------------------------------------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> list[Path]:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return sorted(tmp_path.rglob("*.py"))


def test_a_sibling_cycle_is_found_through_any_import(tmp_path):
    files = _tree(tmp_path, {
        "builder/__init__.py": "", "builder/stages/__init__.py": "",
        "builder/stages/a.py": "def f():\n    from builder.stages.b import g\n",
        "builder/stages/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n",
        "builder/stages/c.py": "from builder.stages import a\n",
        "builder/stages/d.py": "import builder.stages.a\n",                 # imports into the loop only
        "builder/other.py": "from builder.stages import a\n",
        "builder/stages/e.py": "TABLE = {'x': 'builder.stages.f:g'}\n",    # a registry string: no edge
        "builder/stages/f.py": "from builder.stages import e\n",
    })
    assert sibling_cycles(files, tmp_path) == [["builder.stages.a", "builder.stages.b", "builder.stages.c"]]


def test_a_package_cycle_in_backend_is_found(tmp_path):
    files = _tree(tmp_path, {
        "backend/__init__.py": "", "backend/engine/__init__.py": "", "backend/model/__init__.py": "",
        "backend/engine/run.py": "from backend.model.llama import Model\n",
        "backend/model/llama.py": "def f():\n    from backend import bundle\n",
        "backend/bundle.py": "from backend.engine import run\n",
        "backend/ops.py": "import backend.model.llama\n",
    })
    assert package_cycles(files, tmp_path) == [["backend.bundle", "backend.engine", "backend.model"]]


def test_a_probe_is_found_by_member_or_by_holder(tmp_path):
    files = _tree(tmp_path, {"backend/engine/x.py": (
        "a = hasattr(self.runner, 'shutdown')\n"
        "b = getattr(ex.runner.attention, 'aot', None)\n"
        "c = getattr(thing, 'health', None)\n"                   # a protocol member, whatever holds it
        "d = getattr(getattr(self.executor, 'speculator', None), 'x', None)\n"
        "e = getattr(config, 'dtype')\n")})                     # neither: not a probe of these
    bad = probes(files, tmp_path, {"health", "shutdown"})
    assert [b.split(": ", 1)[0] for b in bad] == [f"backend/engine/x.py:{i}" for i in (1, 2, 3, 4)]


def test_the_protocols_defaults_are_read_from_the_classes():
    assert protocol_defaults(ROOT) == {
        "StepRunner": {"health", "shutdown", "dtype_choice", "graphs", "kv_window", "window_kv"},
        "Speculator": {"stats", "last_logprobs", "request_stats"},
        "AttentionBackend": {"aot", "load_aot", "holds_fp8_as_float", "fp8_as_float", "sliding_window",
                             "window_tables"}}


def test_a_kernel_choice_outside_the_table_is_found(tmp_path):
    files = _tree(tmp_path, {
        "plugins/registry.py": ("C = 'plugins.cpu'\nT = {('rope', 'triton'): Impl('plugins.rope:apply_rope'),\n"
                                "     ('gemm', 'cpu'): Impl(f'{C}.gemm:gemm')}\n"),
        "backend/ops/linear.py": ("from plugins.rope import apply_rope\n"
                                  "from plugins.rope import ROPE_BLOCK\n"        # not a kernel of the table
                                  "from plugins.cpu import gemm as g\n"
                                  "y = g.gemm(x)\nok = g.available()\n"
                                  "f = torch.ops.quantized.linear_dynamic_fp16.default\n"),
        "backend/model/llama.py": "fused = self.attention.name == 'triton'\nk = registry.load('rope', 'triton')\n",
    })
    targets = table_targets(tmp_path)
    assert targets == {"plugins.rope:apply_rope", "plugins.cpu.gemm:gemm"}
    bad = kernel_choices([f for f in files if "plugins" not in f.parts], tmp_path, targets)
    assert [b.split(": ", 1)[0] for b in bad] == [
        "backend/model/llama.py:1", "backend/ops/linear.py:1", "backend/ops/linear.py:4",
        "backend/ops/linear.py:6"]
