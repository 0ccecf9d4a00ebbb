"""llama.cpp as a peer: llama-cpp-python's OpenAI server (llama.cpp compiled
from PyPI's source package for this CPU) in its own git-ignored virtual
environment, .venv-llama, never in specpage's; it serves the very GGUF
specpage reads its 4-bit blocks from.

    make llama-venv                   # build it once (3-4 min on 2 cores)
    python bench/llama_cpp.py --quick # a smoke run: one request, its ms/token

Facts of this peer, and what the benchmarks do about them:
- Its server has no /health; GET /v1/models answers once the model is loaded.
- It serves one request at a time (one slot, requests queue on a lock);
  llama-cpp-python has no parallel-slot setting, so 32 streams run through
  that one slot: its best, and only, configuration. By default a new request
  interrupts the one streaming (interrupt_requests); 32 concurrent streams
  would then each get a token or two, so that is turned off.
- On a CPU with AMX, llama.cpp built with -march=native (its default) repacks
  the Q4_1 weights for its AMX kernels, and its server died (SIGSEGV) on its
  first request (0.3.36, an Intel Xeon with AMX). There it is built for the
  same CPU's AVX-512 (with VNNI and BF16, as llama.cpp uses them for Q4_1
  blocks) without AMX (build_flags): its best configuration that runs.
- It ignores vLLM's ``ignore_eos`` extension, which the benchmarks' client
  sends so that every request streams exactly max_tokens. The server is
  started through ``llama_cpp_server.py``, which gives the end-of-sequence
  token a logit bias of -inf for every request (the same effect), so the
  figures count the same tokens as every other system's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-llama"
PYTHON = VENV / "bin" / "python"
PACKAGE = "llama-cpp-python[server]==0.3.36"
WRAPPER = Path(__file__).with_name("llama_cpp_server.py")
HEALTH_PATH = "/v1/models"
BUILD_JOBS = "2"  # compile jobs: the machine's cores
N_CTX = 4096  # 32 streams share one slot, so one context is enough


def ready() -> bool:
    """Whether .venv-llama exists and imports llama_cpp's server."""
    if not PYTHON.exists():
        return False
    probe = subprocess.run([str(PYTHON), "-c", "import llama_cpp.server"], capture_output=True)
    return probe.returncode == 0


def setup() -> str | None:
    """Build .venv-llama if it is not usable yet. Returns None or why it failed."""
    if ready():
        return None
    steps = [[sys.executable, "-m", "venv", str(VENV)],
             [str(PYTHON), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
             # built here, never a wheel cached from a build with other flags
             [str(PYTHON), "-m", "pip", "install", "--quiet", "--no-cache-dir", PACKAGE]]
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": BUILD_JOBS}
    if build_flags():
        env["CMAKE_ARGS"] = build_flags()
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            return f"{' '.join(step[-2:])} failed: {(done.stdout + done.stderr)[-600:]}"
    return None if ready() else "llama_cpp.server does not import after the install"


def build_flags() -> str:
    """llama.cpp's CMake options for this CPU: none (-march=native) unless it
    has AMX, where the same instruction sets are named without AMX."""
    from specpage.kernels.cpu.features import cpu_flags

    flags = cpu_flags()
    if "amx_int8" not in flags:
        return ""
    wanted = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c",
              "GGML_BMI2": "bmi2", "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512_vbmi",
              "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}
    return " ".join(["-DGGML_NATIVE=OFF"] + [f"-D{option}={'ON' if flag in flags else 'OFF'}"
                                             for option, flag in wanted.items()])


def server_argv(gguf: Path, alias: str, port: int, threads: int) -> list[str]:
    # -P: not bench/ first on sys.path, where this module would shadow llama_cpp
    return [str(PYTHON), "-P", str(WRAPPER), "--model", str(gguf), "--model_alias", alias,
            "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--n_ctx", str(N_CTX), "--verbose", "False",
            "--interrupt_requests", "False"]


def server_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.common import MODEL, finish, free_port
    from specpage.models.fetch import SMOLLM2_GGUF_NAME, cache_dir, ensure_model

    error = setup()
    if error:
        finish("llama_cpp", {"error": error})
        return
    ensure_model(MODEL)
    port = free_port()
    gguf = cache_dir() / "gguf" / SMOLLM2_GGUF_NAME
    process = subprocess.Popen(server_argv(gguf, MODEL, port, args.threads),
                               env=server_env(args.threads), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + HEALTH_PATH, timeout=5):
                    break
            except OSError:
                time.sleep(0.5)
        tokens = 32 if args.quick else 128
        body = json.dumps({"model": MODEL, "max_tokens": tokens, "temperature": 0.0,
                           "messages": [{"role": "user", "content": "Explain tides."}]}).encode()
        request = urllib.request.Request(url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as reply:
            answer = json.loads(reply.read())
        seconds = time.perf_counter() - start
        produced = answer["usage"]["completion_tokens"]
        finish("llama_cpp", {"package": PACKAGE, "completion_tokens": produced,
                             "ms_per_token_incl_prefill": seconds / produced * 1e3,
                             "text": answer["choices"][0]["message"]["content"][:120]})
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
