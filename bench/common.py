"""Shared helpers for the benchmark scripts: timing, machine facts, results."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
DRAFT = Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"  # the default draft


def parse_args(doc: str | None, vllm: bool = False) -> argparse.Namespace:
    """The arguments the model benchmarks share; sets torch's thread count."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    parser.add_argument("--draft", type=Path, default=DRAFT)
    parser.add_argument("--threads", type=int, default=2)
    if vllm:
        parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes copied per second by a large tensor copy (each byte read once and
    written once, so memory traffic is twice this)."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats)
    return src.numel() * 4 / seconds


def machine() -> dict[str, Any]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }


def finish(name: str, result: dict[str, Any]) -> None:
    """Write results/<name>.json and print the headline JSON as the last line."""
    result = {**result, "quick": "--quick" in sys.argv}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.flush()
    print(json.dumps(result))
