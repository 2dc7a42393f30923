"""Every folder's README map lists its files, and names none that is gone.

Each tracked ``.py`` file under the product folders (``__init__.py`` aside) must be named in the
README.md of its own folder, or of the nearest folder above it that has one: by its path from that
README's folder (``stages/verify.py``) or, where no other file under that README shares it, by its
file name alone (``verify.py``), always in backticks. A sub-package with a README.md of its own is
mapped there, not in its parent's.

A ``.py`` name a README gives in backticks must be a file: one under the README's folder (by that
relative path, or as the end of one), or a path from the repository root. Fenced code blocks are
commands, not maps, and are not read.

Pure: git lists the files (a directory walk where there is no git), nothing is imported.
"""
from __future__ import annotations

import posixpath
import re
import subprocess
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("backend", "builder", "harness", "plugins", "quant")

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_TICKED = re.compile(r"`([^`\n]+)`")
_PY_NAME = re.compile(r"[\w./-]*\w\.py\b")


def repo_files(root: Path = ROOT) -> list[str]:
    """Every tracked file of the repository, as a path from its root."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True,
                             check=True).stdout
        # a file deleted but not yet staged is still listed: it is not there to be named
        return sorted(p for p in out.split("\0") if p and (root / p).is_file())
    except (OSError, subprocess.CalledProcessError):  # a copy without git: every file but caches
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts and ".git" not in p.parts)


def named_py(readme_text: str) -> set[str]:
    """The ``.py`` paths a README gives in backticks, outside fenced code blocks."""
    text = _FENCE.sub("", readme_text)
    return {name for span in _TICKED.findall(text) for name in _PY_NAME.findall(span)}


def _readme_dirs(files: list[str]) -> set[PurePosixPath]:
    return {PurePosixPath(f).parent for f in files
            if PurePosixPath(f).name == "README.md" and PurePosixPath(f).parts[0] in TOPS}


def _owner(path: PurePosixPath, readme_dirs: set[PurePosixPath]) -> PurePosixPath | None:
    """The folder of the README that maps ``path``: its own folder's, or the nearest above it."""
    for folder in path.parents:
        if folder in readme_dirs:
            return folder
    return None


def _matches(name: str, rels: list[str]) -> list[str]:
    """The files (paths from a README's folder) a name in that README points at."""
    return [r for r in rels if r == name or r.endswith("/" + name)]


def unnamed(files: list[str], root: Path = ROOT) -> dict[str, list[str]]:
    """README.md -> the files it maps but does not name (paths from its folder); a file under no
    README is listed under the top folder's README.md, where its row would go."""
    dirs = _readme_dirs(files)
    mapped: dict[PurePosixPath, list[str]] = {}
    for f in files:
        p = PurePosixPath(f)
        if p.suffix != ".py" or p.name == "__init__.py" or p.parts[0] not in TOPS:
            continue
        folder = _owner(p, dirs) or PurePosixPath(p.parts[0])
        mapped.setdefault(folder, []).append(p.relative_to(folder).as_posix())
    missing = {}
    for folder, rels in sorted(mapped.items()):
        readme = root / folder / "README.md"
        names = named_py(readme.read_text(encoding="utf-8")) if readme.is_file() else set()
        covered = set()
        for name in names:
            hits = _matches(name, rels)
            # an exact path always counts; a bare or partial one only when it points at one file
            covered |= {name} if name in rels else set(hits) if len(hits) == 1 else set()
        left = [r for r in rels if r not in covered]
        if left:
            missing[f"{folder}/README.md"] = left
    return missing


def stale(files: list[str], root: Path = ROOT) -> list[str]:
    """"README: `name`" for each ``.py`` name a README gives that no file answers to."""
    every = set(files)
    bad = []
    for folder in sorted(_readme_dirs(files)):
        below = [f[len(folder.as_posix()) + 1:] for f in files if f.startswith(folder.as_posix() + "/")]
        for name in sorted(named_py((root / folder / "README.md").read_text(encoding="utf-8"))):
            from_folder = posixpath.normpath(f"{folder}/{name}")  # `../x.py` climbs out of the folder
            if not (_matches(name, below) or from_folder in every or name in every):
                bad.append(f"{folder}/README.md: `{name}`")
    return bad


def test_every_product_file_is_named_in_its_readme():
    missing = unnamed(repo_files())
    assert not missing, ("each file below needs a row (its name in backticks, or its path from the "
                         "README's folder where another file shares the name) in the README.md named:\n"
                         + "\n".join(f"{readme}: {', '.join(rels)}" for readme, rels in missing.items()))


def test_no_readme_names_a_file_that_is_gone():
    bad = stale(repo_files())
    assert not bad, ("these README rows name a .py file that does not exist (renamed or removed? fix "
                     "or drop the row):\n" + "\n".join(bad))


def _tree(root: Path, files: dict[str, str]) -> list[str]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return sorted(files)


def test_the_check_finds_unnamed_shared_and_stale_names(tmp_path):
    files = _tree(tmp_path, {
        "backend/README.md": ("| `a.py` | mapped |\n| `ops.py` | shared by two files: names neither |\n"
                              "| `sub/c.py` | by its path |\n| `gone.py` | removed |\n"
                              "```\npython b.py  # a command, not a row\n```\n"),
        "backend/a.py": "", "backend/b.py": "", "backend/__init__.py": "",
        "backend/sub/c.py": "", "backend/sub/d.py": "", "backend/sub/__init__.py": "",
        "backend/x/ops.py": "", "backend/y/ops.py": "",
        # a sub-package with its own README is mapped there, even if the parent names its files
        "backend/own/README.md": "`e.py`, `../a.py`, `backend/sub/d.py`, `tests/t.py`\n",
        "backend/own/e.py": "", "backend/own/f.py": "",
        "quant/q.py": "",  # a top folder without a README: every file is unnamed
        "tests/t.py": "",
    })
    assert unnamed(files, tmp_path) == {
        "backend/README.md": ["b.py", "sub/d.py", "x/ops.py", "y/ops.py"],
        "backend/own/README.md": ["f.py"],
        "quant/README.md": ["q.py"],
    }
    assert stale(files, tmp_path) == ["backend/README.md: `gone.py`"]


def test_the_check_passes_a_complete_map(tmp_path):
    files = _tree(tmp_path, {"plugins/README.md": "`k.py` and `cpu/ops.py`, `reference/ops.py`\n",
                             "plugins/k.py": "", "plugins/cpu/ops.py": "", "plugins/reference/ops.py": ""})
    assert unnamed(files, tmp_path) == {} and stale(files, tmp_path) == []
