"""A soak: thousands of requests of mixed kinds against one daemon, its
resident memory and KV pool read every so many, to show that nothing grows
without bound.

    python bench/soak.py [--quick] [--requests N] [--every K] [--concurrency C]

One daemon as `make serve` starts it (the q4 target, the default draft,
adaptive k, the proposers that need no model), gRPC and HTTP on 127.0.0.1.
The requests, drawn in a seeded order from the benchmarks' chat prompts,
some with a shared system prefix, are of these kinds:

- plain: greedy, streamed to its end;
- sampled: temperature 0.8, seeded, n = 2;
- cancelled: the client leaves after its first chunks (the call is
  cancelled, the daemon aborts the request);
- deadline: `timeout_s` shorter than the request takes, so it ends
  DEADLINE_EXCEEDED part-way;
- forced: speculation ON with k 4, and OFF, by turns;
- logprobs: greedy with the 5 likeliest alternatives of each token;
- http: the same as plain through the OpenAI API, streamed.

Every `--every` finished requests it records the daemon's resident set
(VmRSS, from /proc) and the pool's blocks by state, the running and
waiting counts and the suffix cache's tokens (from the metrics endpoint).
Headline: the resident set's growth over the second half of the run
against the first, and whether the pool came back whole (no block in use,
none tentative) once all had ended. The suffix cache and the prefix
cache's blocks fill towards their bounds (engine.spec_suffix_cache_tokens,
the pool) while the run goes on: the resident set levels off once both
are full.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.common import DRAFT, MODEL, finish, free_port, machine  # noqa: E402
from bench.prompts import chat_prompts  # noqa: E402
from specpage.client import Client  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SPECPAGE = ROOT / ".venv" / "bin" / "specpage"
KINDS = ("plain", "sampled", "cancelled", "deadline", "forced", "logprobs", "http")
PREFIX = ("You are a careful assistant. Answer briefly and plainly, in full sentences, "
          "and say so when you do not know.\n\n")
STARTUP_TIMEOUT_S = 900.0
BLOCKS = re.compile(r'^specpage_kv_blocks\{state="(\w+)"\} (\S+)$', re.M)
GAUGE = re.compile(r"^specpage_requests_(running|waiting) (\S+)$", re.M)
SUFFIX = re.compile(r"^specpage_(suffix_cache_tokens) (\S+)$", re.M)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def scrape(metrics: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{metrics}/metrics", timeout=30) as response:
        text = response.read().decode()
    found = {f"blocks_{state}": float(value) for state, value in BLOCKS.findall(text)}
    found.update({name: float(value) for name, value in GAUGE.findall(text) + SUFFIX.findall(text)})
    return found


class Soak:
    def __init__(self, grpc_target: str, http: str, metrics: str, pid: int, every: int,
                 max_tokens: int) -> None:
        self.grpc_target, self.http, self.metrics = grpc_target, http, metrics
        self.pid, self.every, self.max_tokens = pid, every, max_tokens
        self.outcomes: Counter[str] = Counter()
        self.finished = 0
        self.samples: list[dict[str, Any]] = []
        self.tokens = 0

    def record(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.finished += 1
        if self.finished % self.every == 0:
            self.samples.append({"requests": self.finished, "rss_mb": round(rss_mb(self.pid), 1),
                                 "t_s": round(time.perf_counter() - self.started, 1),
                                 **scrape(self.metrics)})
            print(f"{self.finished} requests: {self.samples[-1]}", file=sys.stderr, flush=True)

    async def one(self, client: Client, index: int, kind: str, prompt: str) -> None:
        options: dict[str, Any] = {"max_tokens": self.max_tokens, "chat": True,
                                   "request_id": f"soak-{index}"}
        if kind == "sampled":
            options.update(temperature=0.8, seed=index, n=2)
        elif kind == "deadline":
            options.update(max_tokens=400, ignore_eos=True, timeout_s=0.3)
        elif kind == "forced":
            options.update(spec="on" if index % 2 else "off")
        elif kind == "logprobs":
            options.update(logprobs=True, top_logprobs=5)
        if kind == "http":
            await asyncio.to_thread(self.http_chat, prompt)
            self.record("http completed")
            return
        try:
            chunks = 0
            async for event in client.generate(prompt, **options):
                chunks += 1
                self.tokens += len(getattr(event, "token_ids", ()) or ())
                if kind == "cancelled" and chunks >= 3:
                    break  # leaving cancels the call; the daemon aborts it
            self.record(f"{kind} {'cancelled' if kind == 'cancelled' else 'completed'}")
        except grpc.aio.AioRpcError as error:
            self.record(f"{kind} {error.code().name}")

    def http_chat(self, prompt: str) -> None:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": self.max_tokens, "stream": True}).encode()
        request = urllib.request.Request(f"{self.http}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            for _ in response:
                pass

    async def run(self, requests: int, concurrency: int, seed: int) -> None:
        rng = random.Random(seed)
        prompts = chat_prompts(64)
        plan = [(i, rng.choice(KINDS), (PREFIX if rng.random() < 0.5 else "")
                 + rng.choice(prompts)) for i in range(requests)]
        queue: asyncio.Queue[tuple[int, str, str]] = asyncio.Queue()
        for item in plan:
            queue.put_nowait(item)
        self.started = time.perf_counter()
        async with Client(self.grpc_target) as client:
            async def worker() -> None:
                while not queue.empty():
                    await self.one(client, *queue.get_nowait())

            await asyncio.gather(*(worker() for _ in range(concurrency)))


def start_daemon(folder: Path) -> tuple[subprocess.Popen[bytes], str, str, str]:
    """The daemon, its gRPC target, its HTTP API's and its metrics' URLs."""
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    argv = [str(SPECPAGE), "serve", "--target", MODEL, "--draft", str(DRAFT),
            "--quantization", "auto", "--port", str(grpc_port), "--http-port", str(http_port),
            "--set", "server.log_level=warning", "--set", f"server.metrics_port={metrics_port}"]
    log = (folder / "daemon.log").open("wb")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"})
    http = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the daemon exited {process.returncode}: "
                               f"{(folder / 'daemon.log').read_text()[-800:]}")
        try:
            with urllib.request.urlopen(f"{http}/health", timeout=5) as response:
                if response.status == 200:
                    return (process, f"127.0.0.1:{grpc_port}", http,
                            f"http://127.0.0.1:{metrics_port}")
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the daemon did not become healthy")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    parser.add_argument("--requests", type=int, default=None, help="default 2000 (quick: 120)")
    parser.add_argument("--every", type=int, default=None, help="default 200 (quick: 20)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    requests = args.requests or (48 if args.quick else 2000)
    every = args.every or (8 if args.quick else 200)
    max_tokens = 16 if args.quick else 32
    with tempfile.TemporaryDirectory(prefix="soak_") as name:
        process, grpc_target, http, metrics = start_daemon(Path(name))
        try:
            idle_before = rss_mb(process.pid)
            soak = Soak(grpc_target, http, metrics, process.pid, every, max_tokens)
            asyncio.run(soak.run(requests, args.concurrency, args.seed))
            time.sleep(1.0)  # the last aborts reach the engine
            after = {"rss_mb": round(rss_mb(process.pid), 1), **scrape(metrics)}
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
    samples = soak.samples
    half = len(samples) // 2
    first_half = samples[half - 1]["rss_mb"] - samples[0]["rss_mb"] if half >= 2 else None
    second_half = samples[-1]["rss_mb"] - samples[half - 1]["rss_mb"] if half >= 1 else None
    result = {
        "bench": "soak", "requests": requests, "every": every, "concurrency": args.concurrency,
        "max_tokens": max_tokens,
        "server": "q4 target, default draft, adaptive k, ngram,suffix (as make serve)",
        "kinds": KINDS, "outcomes": dict(soak.outcomes), "rss_idle_before_mb": idle_before,
        "samples": samples, "after": after,
        "rss_growth_first_half_mb": first_half, "rss_growth_second_half_mb": second_half,
        "pool_whole_after": after.get("blocks_in_use") == 0
        and after.get("blocks_tentative") == 0,
        "machine": machine()}
    finish("soak", result)


if __name__ == "__main__":
    main()
