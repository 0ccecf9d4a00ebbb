"""Shared helpers for the benchmark scripts: timing, machine facts, results."""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from specpage.kernels.cpu import hugepages
from specpage.kernels.cpu.native import native_kernels

RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-135m"  # the served model's name, the same on every system
DRAFT = Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"  # the default draft


def parse_args(doc: str | None, vllm: bool = False,
               extra: Callable[[argparse.ArgumentParser], object] | None = None
               ) -> argparse.Namespace:
    """The arguments the model benchmarks share, and a bench's own (`extra`
    adds them); sets torch's thread count."""
    parser = argparse.ArgumentParser(description=doc)
    if extra is not None:
        extra(parser)
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    parser.add_argument("--draft", type=Path, default=DRAFT)
    parser.add_argument("--threads", type=int, default=2)
    if vllm:
        parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM rows")
        parser.add_argument("--vllm-modes", default=None,
                            help="only these vLLM configurations, e.g. "
                                 "vllm_eager_bf16,vllm_compiled_bf16 (each keeps a process "
                                 "with its own KV space for the whole run)")
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


# Rounds of a comparison: one slow spell of a shared 2-core machine can move a
# single run by ±10%, so every system runs several times in rotated order.
ROUNDS_FULL = 3
ROUNDS_QUICK = 2

Job = TypeVar("Job")


def rounds(quick: bool, full: int = ROUNDS_FULL) -> int:
    return ROUNDS_QUICK if quick else max(ROUNDS_FULL, full)


@dataclass(frozen=True)
class Spread:
    """One system's figures over the rounds of a comparison."""

    median: float
    low: float
    high: float
    runs: tuple[float, ...]

    @classmethod
    def of(cls, runs: list[float]) -> Spread:
        return cls(statistics.median(runs), min(runs), max(runs), tuple(runs))

    def as_json(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.low, "max": self.high, "runs": list(self.runs)}


def rotated(systems: Mapping[str, Callable[[Job], float]], job: Job, warmup: Job,
            count: int) -> dict[str, Spread]:
    """Each system's figure for `job` over `count` rounds. Every system first runs
    the same `warmup` job untimed; round r then starts at the r-th system, so
    that no system always runs first (after a pause) or last (after the others
    warmed the caches)."""
    for run in systems.values():
        run(warmup)
    names = list(systems)
    figures: dict[str, list[float]] = {name: [] for name in names}
    for r in range(count):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            figures[name].append(systems[name](job))
            print(f"round {r}: {name} {figures[name][-1]:.2f}", file=sys.stderr, flush=True)
    return {name: Spread.of(values) for name, values in figures.items()}


def compare(ours: Spread, theirs: Spread, higher_is_better: bool = True) -> dict[str, Any]:
    """ours against theirs: the ratio of medians (above 1 means ours is better)
    and a verdict. When the two min–max spreads overlap the rounds cannot tell
    the systems apart, and the verdict is "level" whatever the ratio."""
    ratio = ours.median / theirs.median if higher_is_better else theirs.median / ours.median
    if ours.low <= theirs.high and theirs.low <= ours.high:
        verdict = "level"
    else:
        verdict = "better" if ratio > 1 else "worse"
    return {"ratio": ratio, "verdict": verdict}


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes copied per second by a large tensor copy (each byte read once and
    written once, so memory traffic is twice this). Its buffers are on huge
    pages where the weights are (specpage/kernels/cpu/hugepages.py): on 4 KB pages
    the same copy is slower, and the floor would flatter the step. Under a
    last-level cache near the buffers' size part of them stays cached: under
    a 300 MiB L3 (an Intel Xeon) 256 MiB copied a median 1.24x as fast as
    1 GiB (0.71-1.76, 6 alternations; 1.2 GiB level with 1 and 2 GiB). The
    floors at this rate (bench/model_runner.py, quantization.py) are then
    stricter than memory's rate for a step whose weights stream from memory,
    and close to what a small model whose weights stay in that cache meets;
    read_bandwidth reads past the cache."""
    src = hugepages.empty((megabytes * 2**20 // 4,), torch.float32).fill_(1.0)
    dst = hugepages.empty(tuple(src.shape), torch.float32)
    seconds = median_seconds(lambda: dst.copy_(src), repeats)
    return src.numel() * 4 / seconds


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs, cpu0's caches); 0 where
    it cannot be read."""
    sizes = [0]
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes)


def read_bandwidth(megabytes: int | None = None, repeats: int = 5) -> float:
    """Bytes read per second over a large tensor: reading alone, as a decode
    step reads its weights (a copy also writes), by the better of torch's
    fp32 sum and the native kernels' read_through (every word ORed in, as
    fast as loads go: torch's sum read 15-20% slower on a Xeon than the
    products did, so a floor at its rate flattered the steps). On huge
    pages where the weights are, as copy_bandwidth. The tensor is 512 MiB
    or four times the last-level cache, whichever is larger: read again and
    again, 512 MiB under a 300 MiB L3 (an Intel Xeon) read 1.10x as fast
    (0.94-1.16, 16 alternations) as 2 GiB, where 1.2 GiB read as fast as
    2 GiB (1.00x): the cache kept part of it between reads, and a floor at
    that rate is not the rate of memory."""
    if megabytes is None:
        megabytes = max(512, 4 * last_level_cache_bytes() >> 20)
    src = hugepages.empty((megabytes * 2**20 // 4,), torch.float32).fill_(1.0)
    readers = [lambda: src.sum()]
    if native_kernels() is not None:
        readers.append(lambda: torch.ops.specpage_cpu.read_through(src))
    seconds = min(median_seconds(reader, repeats) for reader in readers)
    return src.numel() * 4 / seconds


def memory_rates() -> dict[str, Callable[[Any], float]]:
    """Systems for rotated(), beside the steps whose floor they give: the
    memory traffic of a large copy (read + written, the floor's rate) and the
    rate of reading alone, in GB/s. The machine's memory rate moves by up to
    2x over minutes, so a step and its floor are measured in the same
    rounds, and their ratio is taken round by round (over_floor)."""
    return {"copy_traffic_gb_s": lambda _: 2 * copy_bandwidth() / 1e9,
            "read_alone_gb_s": lambda _: read_bandwidth() / 1e9}


def over_floor(step: Spread, nbytes: int, rate_gb_s: Spread) -> dict[str, Any]:
    """A step (seconds) over the time to move `nbytes` at a rate (GB/s) measured
    in the same rounds: round by round, then median and min-max; and the
    floor itself (ms) at the median rate."""
    ratios = [seconds * rate * 1e9 / nbytes
              for seconds, rate in zip(step.runs, rate_gb_s.runs, strict=True)]
    return {"floor_ms": nbytes / (rate_gb_s.median * 1e9) * 1e3, "rate_gb_s": rate_gb_s.median,
            "ratio": Spread.of(ratios).as_json()}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo): the same bench moves with it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> dict[str, Any]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
    }


def time_part(owner: Any, name: str, part: str, spent: dict[str, float]) -> None:
    """Wrap owner.name so that each call adds its seconds to spent[part]."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def decoding_steps(engine: Any, batch: int, spent: dict[str, float],
                   tokens: dict[str, list[int]] | None = None) -> Iterator[float]:
    """Step `engine` until it has nothing left; each step's seconds where all
    `batch` of its sequences decode (no prompt chunk among them), with
    `spent` holding that step's parts (time_part) as it is yielded. tokens:
    each request's output tokens gathered there, by request id."""
    while engine.has_unfinished():
        decoding = (len(engine.scheduler.running) == batch
                    and all(s.num_uncomputed <= 1 for s in engine.scheduler.running))
        spent.clear()
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        if tokens is not None:
            for output in outputs:
                tokens.setdefault(output.request_id, []).extend(output.token_ids)
        if decoding:
            yield seconds


def finish(name: str, result: dict[str, Any]) -> None:
    """Write results/<name>.json and print the headline JSON as the last line."""
    result = {**result, "quick": "--quick" in sys.argv}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.flush()
    print(json.dumps(result))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
