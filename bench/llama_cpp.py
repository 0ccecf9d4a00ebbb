"""llama.cpp as a peer: its own OpenAI server, `llama-server`, built for this
CPU from the llama.cpp sources that PyPI's llama-cpp-python 0.3.36 vendors,
into the git-ignored .llama-cpp/ (bench/build_llama_server.sh). It serves the
very GGUF specpage's q4 reads its 4-bit blocks from.

    make llama-server                  # build it once (about 5 min on 2 cores)
    python bench/llama_cpp.py [--quick]  # llama-bench: flash attention off and on

Facts of this peer, and what the benchmarks do about them:
- Parallel slots (-np) decode together in one batch, so 32 streams run on
  32 slots; they share one unified KV cache (--kv-unified) of CONTEXT
  positions, so a slot takes what its request needs.
- Prompt caching is off (--no-cache-prompt, --cache-ram 0): the benchmarks
  send every server a fresh cache_salt per run, so that none finds a
  previous run's prompt cached, and llama-server has no salt.
- It honours vLLM's ``ignore_eos``, answers GET /health once the model is
  loaded, and reports usage in the last streamed chunk (with
  stream_options.include_usage), so it needs no wrapper.
- Flash attention: FLASH_ATTENTION, whichever this script measured faster
  with llama-bench.
- On a CPU with AMX, a build with -march=native repacks the Q4_1 weights for
  llama.cpp's AMX kernels, and llama-cpp-python's build of it died on its
  first request there; the build script names that CPU's instruction sets
  without AMX instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUILD = Path(__file__).with_name("build_llama_server.sh")
SERVER = ROOT / ".llama-cpp" / "bin" / "llama-server"
BENCH = ROOT / ".llama-cpp" / "bin" / "llama-bench"
SOURCE = "llama.cpp as vendored by llama-cpp-python==0.3.36 (PyPI sdist)"
HEALTH_PATH = "/health"
# KV positions all slots share: 32 slots of a grounded request (up to 460
# prompt tokens and 256 output tokens, bench/workloads) fit in 32 x 1024.
CONTEXT = 32768
# Measured with llama-bench -fa 0,1 and 1,0 (this script writes the figures
# to bench/results/llama_cpp.json): on an AVX2 EPYC without AVX-512 flash
# attention on prefilled faster in every run and decoded faster in most; on
# an Intel Xeon with AMX (built without it, see above), two runs of 5: on
# decoded 95.0 and 95.2 tok/s against 91.5 and 88.8 off, and prefilled 307
# and 310 against 278 and 276.
FLASH_ATTENTION = "on"


def ready() -> bool:
    """Whether llama-server is built."""
    return os.access(SERVER, os.X_OK)


def setup() -> str | None:
    """Build llama-server if it is not built yet. Returns None or why it failed."""
    if ready():
        return None
    done = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True)
    if done.returncode != 0 or not ready():
        return f"{BUILD.name} failed: {(done.stdout + done.stderr)[-600:]}"
    return None


def gguf() -> Path:
    """The GGUF file specpage's q4 reads (fetched and converted by specpage)."""
    from specpage.models.fetch import SMOLLM2_GGUF_NAME, cache_dir

    return cache_dir() / "gguf" / SMOLLM2_GGUF_NAME


def server_argv(alias: str, port: int, threads: int, slots: int,
                extra: Sequence[str] = ()) -> list[str]:
    """llama-server on 127.0.0.1:port with `slots` parallel slots; `extra`
    adds options (its draft-free speculation, for one)."""
    return [str(SERVER), "-m", str(gguf()), "--alias", alias, "--host", "127.0.0.1",
            "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(CONTEXT), "--kv-unified", "-fa", FLASH_ATTENTION, "--no-cache-prompt",
            "--cache-ram", "0", "--no-webui", *extra]


def server_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def bench(threads: int, repetitions: int) -> list[dict[str, Any]]:
    """llama-bench on the GGUF: prefill of 512 tokens and 128 decoded, with
    flash attention off and on. Its JSON rows, one per test."""
    argv = [str(BENCH), "-m", str(gguf()), "-t", str(threads), "-p", "512", "-n", "128",
            "-fa", "0,1", "-r", str(repetitions), "-o", "json"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True,
                          env=server_env(threads))
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.common import finish, machine, parse_args

    args = parse_args(__doc__)
    error = setup()
    if error:
        finish("llama_cpp", {"error": error})
        return
    rows = bench(args.threads, 2 if args.quick else 5)
    figures: dict[str, dict[str, Any]] = {}
    for row in rows:
        test = "decode_tg128" if row["n_gen"] else "prefill_pp512"
        flash = {0: "off", 1: "on"}[row["flash_attn"]]
        figures.setdefault(f"flash_attention_{flash}", {})[test] = {
            "tok_s": row["avg_ts"], "stddev": row["stddev_ts"]}
    fastest = max(figures, key=lambda k: figures[k]["decode_tg128"]["tok_s"])
    finish("llama_cpp", {"source": SOURCE, "build": rows[0].get("cpu_info", ""),
                         "gguf": gguf().name, "threads": args.threads, "llama_bench": figures,
                         "fastest_decode": fastest, "flash_attention_used": FLASH_ATTENTION,
                         "machine": machine()})


if __name__ == "__main__":
    main()
