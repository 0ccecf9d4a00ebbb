"""specpage's modules import one another without a cycle, and so do its
packages: each module collapsed to its first-level package under specpage
(specpage.core.ledger -> core; a top-level module such as specpage/llm.py
is a node of its own), no package imports, through any of its modules, a
package that imports it back.

Every `import` and `from ... import` in a module counts, wherever it stands:
at the top, inside a function, or under `if TYPE_CHECKING:`. A cycle hidden
in a function or behind TYPE_CHECKING still ties the modules together; it
only moves the failure from import time to the first call, or to the day
someone lifts the import to the top.

Edges, from the importing module:
- `import specpage.a.b` and `from specpage.a.b import name`: to specpage.a.b;
- `from specpage.a import b` where b is a submodule: to specpage.a.b, and to
  specpage.a too when another name in the list is not a submodule (it is read
  from specpage/a/__init__.py);
- importing specpage.a.b also runs specpage/a/__init__.py (and
  specpage/__init__.py) first, so an edge goes to each package above the
  target, except the importer's own packages: those have already started
  running by the time the importer does, so the import does not run them.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "specpage"

Graph = Mapping[str, set[str]]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file; a package is named by its __init__.py."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a `from` import names, relative levels resolved."""
    if node.level == 0:
        assert node.module is not None
        return node.module
    # Level 1 is the importer's own package: the module itself for an __init__.
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(
    tree: ast.Module, module: str, is_package: bool, modules: Collection[str]
) -> Iterator[tuple[str, bool]]:
    """(target, explicit) for each module the file imports, anywhere in it.
    explicit is False for the package in `from package import submodule`:
    only its __init__ running counts there, not a name read from it."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, True
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, is_package)
            yield source, False
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield (submodule, True) if submodule in modules else (source, True)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules its import statements run."""
    modules = module_files(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for target, explicit in _imports(tree, module, path.name == "__init__.py", modules):
            if target not in modules:
                continue
            if explicit:
                graph[module].add(target)
                target = target.rpartition(".")[0]
            graph[module] |= _packages_run(target, module) & modules.keys()
        graph[module].discard(module)
    return graph


def _packages_run(package: str, importer: str) -> set[str]:
    """package and those above it: the __init__ files an import of anything
    in package runs, less the importer's own packages (already running)."""
    parts = package.split(".")
    chain = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {p for p in chain if p != importer and not importer.startswith(f"{p}.")}


def find_cycles(graph: Graph) -> list[list[str]]:
    """One shortest cycle through each module that lies on a cycle, each
    as a closed chain [a, b, ..., a], without repeats up to rotation."""
    cycles: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        cycle = _shortest_cycle(graph, start)
        if cycle is None:
            continue
        ring = cycle[:-1]
        first = ring.index(min(ring))
        key = tuple(ring[first:] + ring[:first])
        if key not in seen:
            seen.add(key)
            cycles.append([*key, key[0]])
    return cycles


def _shortest_cycle(graph: Graph, start: str) -> list[str] | None:
    """Breadth-first from start's successors back to start."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for successor in sorted(graph.get(node, ())):
            if successor == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(parent[chain[-1]])
                return [*reversed(chain), start]
            if successor not in parent:
                parent[successor] = node
                queue.append(successor)
    return None


def package_of(module: str) -> str:
    """The first-level package under the root a module lies in (a top-level
    module is its own; the root package's __init__ is the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: Graph) -> dict[str, set[str]]:
    """The module graph with each module collapsed to package_of it; an
    import within one package is no edge."""
    packages: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for module, targets in graph.items():
        source = package_of(module)
        packages[source] |= {package_of(t) for t in targets} - {source}
    return packages


def witness(graph: Graph, source: str, target: str) -> str:
    """One module import that makes the package edge source -> target."""
    return next(f"{m} -> {t}" for m in sorted(graph) if package_of(m) == source
                for t in sorted(graph[m]) if package_of(t) == target)


def readable(cycle: list[str], modules: Mapping[str, Path]) -> str:
    """The cycle as a chain of files."""
    return " -> ".join(str(modules[name].relative_to(ROOT)) for name in cycle)


def test_specpage_has_no_import_cycle() -> None:
    modules = module_files(ROOT, PACKAGE)
    cycles = find_cycles(import_graph(ROOT, PACKAGE))
    assert not cycles, "import cycles:\n" + "\n".join(readable(c, modules) for c in cycles)


def test_specpage_packages_import_one_another_without_a_cycle() -> None:
    graph = import_graph(ROOT, PACKAGE)
    cycles = find_cycles(package_graph(graph))
    assert not cycles, "package import cycles:\n" + "\n".join(
        " -> ".join(cycle) + "\n" + "".join(
            f"    {witness(graph, a, b)}\n" for a, b in zip(cycle, cycle[1:], strict=False))
        for cycle in cycles)


def test_package_graph_on_a_made_up_graph() -> None:
    """Two packages that import each other through different modules are a
    cycle, though no module lies on one; imports within a package, and a
    top-level module that only imports, are none."""
    graph = {
        "pkg": set(),
        "pkg.core": set(),
        "pkg.core.pool": set(),
        "pkg.core.ledger": {"pkg.core.pool", "pkg.core"},  # within core
        "pkg.spec": set(),
        "pkg.spec.verifier": {"pkg.run.runner", "pkg.run", "pkg.core.pool"},
        "pkg.run": set(),
        "pkg.run.runner": {"pkg.core.ledger"},
        "pkg.run.executor": {"pkg.spec.verifier", "pkg.spec"},
        "pkg.llm": {"pkg.run.executor", "pkg.run"},
    }
    assert find_cycles(graph) == []
    assert package_graph(graph) == {
        "pkg": set(),
        "core": set(),
        "spec": {"run", "core"},
        "run": {"core", "spec"},
        "llm": {"run"},
    }
    assert find_cycles(package_graph(graph)) == [["run", "spec", "run"]]
    assert witness(graph, "run", "spec") == "pkg.run.executor -> pkg.spec"
    assert witness(graph, "spec", "run") == "pkg.spec.verifier -> pkg.run"


def test_find_cycles_on_a_made_up_graph() -> None:
    graph = {
        "a": {"b"},
        "b": {"c", "d"},
        "c": {"a"},  # a -> b -> c -> a
        "d": {"e"},
        "e": {"b"},  # b -> d -> e -> b, sharing b with the first
        "f": {"a", "g"},  # reaches a cycle, is on none
        "g": set(),
    }
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["b", "d", "e", "b"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_import_graph_sees_hidden_imports_and_the_packages_they_run(tmp_path: Path) -> None:
    """Imports under TYPE_CHECKING, inside a function and relative ones all
    count; importing pkg.sub.leaf runs pkg/sub/__init__.py."""
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from pkg.sub.leaf import Leaf\n"
        ),
        "pkg/b.py": "def f():\n    from . import a\n    import os.path\n",
        "pkg/c.py": "from pkg.sub import leaf, NAME\n",
        "pkg/sub/__init__.py": "from pkg.sub.leaf import Leaf\nNAME = 1\n",
        "pkg/sub/leaf.py": "from .other import x\nclass Leaf: ...\n",
        "pkg/sub/other.py": "from ..b import f\n",
    })
    assert import_graph(tmp_path, "pkg") == {
        "pkg": set(),
        "pkg.a": {"pkg.sub", "pkg.sub.leaf"},
        "pkg.b": {"pkg.a"},
        "pkg.c": {"pkg.sub", "pkg.sub.leaf"},
        # The package's own submodules do not run its __init__ again.
        "pkg.sub": {"pkg.sub.leaf"},
        "pkg.sub.leaf": {"pkg.sub.other"},
        "pkg.sub.other": {"pkg.b"},
    }
    assert find_cycles(import_graph(tmp_path, "pkg")) == [
        ["pkg.a", "pkg.sub.leaf", "pkg.sub.other", "pkg.b", "pkg.a"],
        ["pkg.a", "pkg.sub", "pkg.sub.leaf", "pkg.sub.other", "pkg.b", "pkg.a"],
    ]
