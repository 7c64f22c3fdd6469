"""No import cycles inside a package, between its modules or between its sub-packages.

Read from the source with ``ast``, so nothing is imported and a cycle through an import inside a function
counts too: a lazy import hides a cycle from Python, not from a reader, who still cannot understand one
module without the other. ``TYPE_CHECKING`` imports count for the same reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.paths import SRC

# The whole package, and bench/ on its own (its sub-packages are benchmark families).
PACKAGES = ["hydragen", "hydragen.bench"]


def package_modules(package: str, src: Path = SRC) -> dict[str, Path]:
    """Every module of ``package`` (a package is its ``__init__``) by dotted name."""
    root = src.joinpath(*package.split("."))
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(module: str, path: Path) -> list[str]:
    """The dotted names a module imports, anywhere in its file, relative imports made absolute."""
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here[: len(here) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from package import name` imports the module package.name when there is one
            names += [f"{base}.{alias.name}" for alias in node.names] + [base]
    return names


def import_graph(package: str, src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = package_modules(package, src)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in _imported_names(module, path):
            while name and name not in modules:  # an attribute of a module: that module
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def by_subpackage(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The graph one level below ``package``: each module folded into its sub-package (or itself)."""
    depth = package.count(".") + 2

    def top(module: str) -> str:
        return ".".join(module.split(".")[:depth])

    folded: dict[str, set[str]] = {}
    for module, targets in graph.items():
        folded.setdefault(top(module), set()).update(top(t) for t in targets if top(t) != top(module))
    return folded


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(found: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for component in found:
        members = set(component)
        lines += [f"{m} imports {', '.join(sorted(graph[m] & members))}" for m in component] + [""]
    return "\n".join(lines)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_between_modules(package):
    graph = import_graph(package)
    found = cycles(graph)
    assert not found, f"import cycles in {package}:\n{_describe(found, graph)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_between_subpackages(package):
    graph = by_subpackage(import_graph(package), package)
    found = cycles(graph)
    assert not found, f"import cycles between the sub-packages of {package}:\n{_describe(found, graph)}"


def test_the_check_finds_a_cycle_through_a_lazy_import(tmp_path):
    """A circle a -> b -> c -> a, closed by an import inside a function and a relative import, is found;
    a module importing a sibling package's module folds into a cycle between the two sub-packages."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from toy import b\n")
    (pkg / "b.py").write_text("from .c import thing\n")
    (pkg / "c.py").write_text("thing = 1\n\ndef later():\n    from toy.sub import d\n")
    (pkg / "sub" / "d.py").write_text("def later():\n    import toy.a\n")
    graph = import_graph("toy", tmp_path)
    assert graph["toy.a"] == {"toy", "toy.b"} and graph["toy.b"] == {"toy.c"}  # toy: its __init__ runs
    assert cycles(graph) == [["toy.a", "toy.b", "toy.c", "toy.sub.d"]]
    (pkg / "sub" / "d.py").write_text("")
    assert cycles(import_graph("toy", tmp_path)) == []
    (pkg / "a.py").write_text("from toy.sub import d\n")
    (pkg / "sub" / "e.py").write_text("import toy.c\n")
    (pkg / "c.py").write_text("from toy import a\n")
    assert cycles(import_graph("toy", tmp_path)) == []
    assert cycles(by_subpackage(import_graph("toy", tmp_path), "toy")) == [["toy.a", "toy.c", "toy.sub"]]
