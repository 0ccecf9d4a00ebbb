"""The layers sit below the models: no module in specpage/layers imports
specpage.models, directly or through what it imports, so models import
layers and never the other way round."""

from __future__ import annotations

import subprocess
import sys
from collections import deque

from tests.test_import_graph import ROOT, import_graph


def test_no_layer_reaches_the_models() -> None:
    graph = import_graph(ROOT, "specpage")
    layers = sorted(m for m in graph if m.startswith("specpage.layers"))
    assert "specpage.layers.products" in layers and "specpage.layers.quant" in layers
    reached: dict[str, list[str]] = {}
    for start in layers:
        seen, queue = {start}, deque([start])
        while queue:
            for target in graph[queue.popleft()]:
                if target not in seen:
                    seen.add(target)
                    queue.append(target)
        models = sorted(m for m in seen if m.startswith("specpage.models"))
        if models:
            reached[start] = models
    assert not reached


def test_the_model_config_with_its_rope_settings_imports_no_torch() -> None:
    """specpage.models.config holds a layers.rope_config.RopeConfig and
    stays torch-free: specpage.config, the settings the CLI checks, reads it."""
    code = ("import sys, specpage.config, specpage.models.config\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
