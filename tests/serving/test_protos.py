"""The committed gRPC stubs are what protos/ generates today."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_stubs_are_current(tmp_path):
    generator = _generator()
    generator.generate(tmp_path)
    for name in generator.GENERATED:
        fresh = (tmp_path / name).read_text()
        committed = (generator.STUBS / name).read_text()
        assert fresh == committed, f"specpage/serve/grpc_stubs/{name} is stale: run `make protos`"
