"""The committed gRPC stubs are what protos/ generates today."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ["generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"]


def test_generated_stubs_are_current(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}",
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         str(ROOT / "protos/specpage/v1/generation.proto")],
        check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "specpage/v1" / name).read_text()
        committed = (ROOT / "specpage/v1" / name).read_text()
        assert fresh == committed, f"specpage/v1/{name} is stale: run `make protos`"
