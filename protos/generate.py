"""Generate the gRPC stubs into specpage/serve/grpc_stubs.

protoc names a stub's module by the .proto file's path (specpage/v1/...),
which is also the wire package, `specpage.v1`. The stubs live in the serving
package under a name that says what they are, so the import protoc writes is
pointed there; the wire names stay as they are.

    python protos/generate.py [OUT_DIR]     (default: the package's folder)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "specpage/v1/generation.proto"
STUBS = ROOT / "specpage" / "serve" / "grpc_stubs"
# protoc's module names for the stubs, and where they are (the descriptor's
# file name, specpage/v1/generation.proto, and the wire package stay).
MODULE_NAMES = (("from specpage.v1 import", "from specpage.serve.grpc_stubs import"),
                ("specpage.v1.generation_pb2", "specpage.serve.grpc_stubs.generation_pb2"),
                ("specpage/v1/generation_pb2", "specpage/serve/grpc_stubs/generation_pb2"))
GENERATED = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}",
             f"--python_out={scratch}", f"--pyi_out={scratch}",
             f"--grpc_python_out={scratch}", str(ROOT / "protos" / PROTO)],
            check=True,
        )
        for name in GENERATED:
            text = (Path(scratch) / "specpage" / "v1" / name).read_text()
            for wire, package in MODULE_NAMES:
                text = text.replace(wire, package)
            (out / name).write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else STUBS)
