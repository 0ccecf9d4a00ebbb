"""The core is the torch-free layer: every module in specpage/core imports
neither torch nor any specpage package outside the core, directly or
through what it imports, so it runs (and is tested) without the models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import specpage.core
from tests.test_import_graph import ROOT, import_graph

CORE = Path(specpage.core.__file__).parent


def core_modules() -> list[str]:
    return sorted(f"specpage.core.{path.stem}" for path in CORE.glob("*.py")
                  if path.stem != "__init__")


def test_no_core_module_imports_torch_even_indirectly() -> None:
    modules = core_modules()
    assert "specpage.core.engine_core" in modules and len(modules) > 20
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_the_core_imports_only_the_core() -> None:
    graph = import_graph(ROOT, "specpage")
    outside = {module: sorted(target for target in targets
                              if target != "specpage" and not target.startswith("specpage.core"))
               for module, targets in graph.items() if module.startswith("specpage.core")}
    assert not {m: t for m, t in outside.items() if t}
