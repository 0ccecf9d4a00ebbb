"""Layers talk to the layer below only: no module of specpage outside the
engine package reaches through an engine into its parts.

An engine is any value whose name ends in `engine` (`engine`, `async_engine`,
`self.frontend.engine`, `llm.engine`). Read from outside the engine package,
it offers its public methods and properties only: never the Engine inside an
AsyncEngine (`engine.engine`), never a private member (`engine._stats`), and
never one of the parts below (`engine.streams`, `engine.scheduler`, ...). The
engine's own modules (the scheduler, the block pool, the speculation layer)
keep their `self.pool` and the like: those are not read through an engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import specpage

PACKAGE = Path(specpage.__file__).parent
ENGINE_PACKAGE = PACKAGE / "engine"
# What the engines hold and nothing outside them may read: AsyncEngine's
# streams, and Engine's parts.
PARTS = frozenset({"streams", "scheduler", "pool", "policy", "runners", "requests",
                   "verifier", "proposer", "core", "executor", "intake"})


def names_an_engine(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else (
        node.attr if isinstance(node, ast.Attribute) else "")
    return name.lower().endswith("engine")


def reaches_through(node: ast.Attribute) -> bool:
    return names_an_engine(node.value) and (
        node.attr == "engine" or node.attr.startswith("_") or node.attr in PARTS)


def reach_throughs(source: str, where: str) -> list[str]:
    """`where:line: code` for each reach-through in source, in line order."""
    found = [node for node in ast.walk(ast.parse(source, where))
             if isinstance(node, ast.Attribute) and reaches_through(node)]
    return [f"{where}:{node.lineno}: {ast.unparse(node)}"
            for node in sorted(found, key=lambda node: (node.lineno, node.col_offset))]


def test_no_module_outside_the_engine_package_reaches_into_an_engine():
    modules = [path for path in sorted(PACKAGE.rglob("*.py"))
               if not path.is_relative_to(ENGINE_PACKAGE)]
    assert len(modules) > 20  # the package was found
    found = [line for path in modules
             for line in reach_throughs(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, "reached into an engine:\n" + "\n".join(found)


def test_the_rule_finds_each_kind_of_reach_through_and_nothing_else():
    """A part read through any engine, the Engine inside an AsyncEngine, a
    private member; not the public API, a config section named engine, nor
    a module's own pool."""
    source = "\n".join([
        "engine.engine.config",
        "self.frontend.engine.streams",
        "async_engine._stats",
        "llm.engine.scheduler.pool",
        "self.engine.abort_stream(stream)",
        "config.engine.block_size",
        "self.pool.allocate(1)",
        "llm.engine.add_request(r, p, s)",
    ])
    assert reach_throughs(source, "front.py") == [
        "front.py:1: engine.engine",
        "front.py:2: self.frontend.engine.streams",
        "front.py:3: async_engine._stats",
        "front.py:4: llm.engine.scheduler",
    ]
