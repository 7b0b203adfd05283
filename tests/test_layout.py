"""The tree shows the architecture: rooms of a readable size, every module used."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("toolkit", "jobs", "actors", "sampler")
ENTRY_POINTS = {"toolkit.cli"}  # [project.scripts]


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imported_names(path: Path, module: str) -> set[str]:
    """Every module named by an import anywhere in the file (inside functions too), and every
    ``package.name`` a ``from package import name`` may mean."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_actors_holds_at_most_14_modules_directly():
    direct = sorted(p.name for p in (ROOT / "actors").glob("*.py"))
    assert len(direct) <= 14, direct


def test_no_module_is_over_800_lines():
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > 800}
    assert not long, long


def test_every_module_is_imported_by_something_or_is_an_entry_point():
    modules = _modules()
    users = set()
    sources = list(modules.items())
    for extra in ("tests", "benchmarks", "examples"):  # entry points outside the packages
        for path in (ROOT / extra).rglob("*.py"):
            sources.append((".".join(path.relative_to(ROOT).with_suffix("").parts), path))
    for name, path in sources:
        users.update(n for n in _imported_names(path, name) if n != name)
    # a package counts as imported when one of its modules is
    for name in list(users):
        while "." in name:
            name = name.rpartition(".")[0]
            users.add(name)
    unused = sorted(m for m in modules if m not in users and m not in ENTRY_POINTS
                    and m not in PACKAGES)
    assert not unused, unused


def test_no_two_modules_share_a_name_for_different_jobs():
    """A module's base name names its job: one ``plan.py`` in the tree, not three."""
    by_name: dict[str, list[str]] = {}
    for name, path in _modules().items():
        if path.name != "__init__.py":
            by_name.setdefault(path.stem, []).append(name)
    shared = {stem: names for stem, names in by_name.items() if len(names) > 1}
    assert not shared, shared
