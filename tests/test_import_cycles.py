"""The project's modules import each other in layers: no import cycle among the modules of
toolkit/, jobs/, actors/ and sampler/, counting the imports inside functions (a lazy import
that closes a circle is a circle) and relative imports. Imports under ``if TYPE_CHECKING:``
are left out: they never run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("toolkit", "jobs", "actors", "sampler")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the four packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node of a module, at any depth, outside TYPE_CHECKING
    blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _targets(node, module: str, is_package: bool, modules: dict) -> set[str]:
    """The project modules an import statement loads (the most specific module named)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return {_known(name, modules) for name in names} - {None}
    if node.level:  # relative: resolved against the importing module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        base_parts = package[:len(package) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    out = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.add(sub if sub in modules else _known(base, modules))
    return out - {None}


def _known(name: str, modules: dict) -> str | None:
    """``name`` or its closest enclosing project module (None outside the project)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (self-imports left out)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in _imports(tree):
            edges |= _targets(node, module, is_package, modules)
        graph[module] = edges - {module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``a -> b -> ... -> a``) per strongly connected component of more than one
    module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    comps.append(set(comp))
    return [_cycle_in(comp, graph) for comp in comps]


def _cycle_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    first = min(comp)
    parent = {first: None}
    queue = [first]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & comp):
            if child == first:
                path = [node]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return path[::-1] + [first]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle in component {sorted(comp)}")


def test_cycle_finder_reports_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_graph_counts_function_level_and_relative_imports():
    tree = ast.parse("def f():\n    from .x import y\n    import sampler.kernels\n"
                     "if TYPE_CHECKING:\n    import jobs\n")
    modules = {"sampler": None, "sampler.kernels": None, "sampler.kernels.x": None,
               "sampler.kernels.x.y": None, "jobs": None}
    found = set()
    for node in _imports(tree):
        found |= _targets(node, "sampler.kernels.z", False, modules)
    assert found == {"sampler.kernels.x.y", "sampler.kernels"}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    graph = import_graph()
    assert any(m == package or m.startswith(package + ".") for m in graph)
    cycles = [c for c in find_cycles(graph)
              if any(m == package or m.startswith(package + ".") for m in c)]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
