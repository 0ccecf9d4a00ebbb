"""How specpage's decode cost grows with the model, against llama.cpp's own
server on the same GGUF files.

    python bench/scaling.py [--quick] [--sizes 0.5b,1b,3b] [--no-gemma]

The models are Llama-shaped, of about 0.5B, 1B and 3B parameters, with
RANDOM weights, written as Q4_K_M GGUF files by bench/random_gguf.py (which
says how): a decode step reads every weight whatever its value, so the
speed of a random model is the speed of a trained one of its shape and
format; nothing here says anything about quality, and the greedy answers
are noise. They share SmolLM2's tokenizer and chat template, so both
servers tokenize and template the prompts the same way.

A fourth row, with real weights, is Gemma 3 270M's Q4_K_M GGUF (`specpage
models fetch gemma3-270m`): specpage serves it by that name where it knows
it, else the file; where specpage cannot serve it, the row says why not.
That file carries no chat template, so both servers take its prompts as
raw completions (/v1/completions), the same text for both.

Each model is served in turn by specpage (`specpage serve --model FILE`,
speculation off: no draft and no model-free proposers, so both servers run
one forward per token) and by llama.cpp's `llama-server` in its best
configuration here (bench/llama_cpp.py: 2 threads, flash attention on, one
slot per stream). One server is up at a time, in an order rotated over the
rounds; each gets the same untimed warm-up, then loadgen's OpenAI backend
drives both workloads of bench/serving.py (greedy, fixed max_tokens with
ignore_eos): a single stream (its decode time per output token, TPOT p50)
and 32 streams (output tok/s).

The floor of a single-stream decode step is the bytes it must read, every
linear weight of the layers and the output projection as the file stores
them, over the machine's read bandwidth (bench/common.py's read_bandwidth: the
better of torch's sum and the native read_through over a buffer of 512 MiB
or four times the last-level cache, whichever is larger, so that the cache
keeps none of it between reads). The rate is read just before and just after each
server's single stream, and a server's ms/token is reported as a multiple of
the floor at the better of those two, round by round (over_floor): the
machine's rate moves by 10-20% within minutes, and the steps are bounded by
the rate they had. It is also read at the start and end of every round, the
better of the two taken, and each ms/token reported over that round's floor
too (over_round_floor). Also, per model:
specpage's time to serving (process start to /health answering 200), and
whether it wrote a dense copy of the file (a converted folder in specpage's
cache naming the file) and how much the cache grew. Dense copies of the
random files are removed before and after a run, so that the first round's
start-up is a first start on the file (any conversion included) and the
later rounds' are starts on what that one left.

specpage runs under an address-space data limit of half the memory free at
the start (SPECPAGE_MEMORY_SHARE), so that a model it cannot hold fails as a
row of its own instead of pressing on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import llama_cpp  # noqa: E402
from bench.common import (  # noqa: E402
    MODEL,
    Spread,
    compare,
    finish,
    free_port,
    machine,
    over_floor,
    parse_args,
    read_bandwidth,
)
from bench.prompts import chat_prompts  # noqa: E402
from bench.random_gguf import SHAPES, ensure_file  # noqa: E402
from bench.serving import (  # noqa: E402
    SPECPAGE,
    STREAMS,
    BenchError,
    Running,
    ServerSpec,
    Workload,
    drive,
    greedy_answers,
)
from specpage.models import fetch  # noqa: E402
from specpage.models.fetch import SOURCE_FILE, cache_dir  # noqa: E402

ROUNDS = {False: 3, True: 1}  # by --quick
OUTPUT_TOKENS = {False: 128, True: 32}
SINGLE_REQUESTS = {False: 4, True: 2}
WARMUP_TOKENS = 16  # as bench/serving.py: every step shape runs once
WARMUP_SINGLE = 2
SINGLE = "single"  # the single-stream workload, whose steps the floor bounds
COMPARED_PROMPTS = 2  # greedy answers fetched in the first round, to see both run the model
SPECPAGE_MEMORY_SHARE = 0.5  # of MemAvailable at the start: specpage's data limit
GEMMA = "gemma3-270m"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def decode_bytes(path: Path) -> dict[str, int]:
    """What one single-stream decode step must read, from the file's tensor
    sizes: every linear weight of the layers and the output projection (the
    embedding where the file ties it); and the file's size."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    linears = sum(n for name, n in tensors.items()
                  if name.startswith("blk.") and name.split(".")[2] in LINEARS)
    output = tensors.get("output.weight", tensors["token_embd.weight"])
    return {"linear_bytes": linears, "output_bytes": output, "step_bytes": linears + output,
            "file_bytes": path.stat().st_size}


def chat_template(path: Path) -> bool:
    """Whether the GGUF carries a chat template (Gemma 3 270M's base file
    does not: it is served raw completions, both servers alike)."""
    import gguf

    return "tokenizer.chat_template" in gguf.GGUFReader(path).fields


def dense_copies(path: Path) -> list[str]:
    """specpage's converted (dense) folders made from `path`, by the source
    record each holds."""
    found = []
    for record in (cache_dir() / "gguf" / "converted").glob(f"*/{SOURCE_FILE}"):
        try:
            if json.loads(record.read_text()).get("gguf_file") == path.name:
                found.append(record.parent.name)
        except (OSError, ValueError):
            continue
    return sorted(found)


def drop_dense_copies(path: Path) -> None:
    """Remove specpage's dense copies of one of this bench's own files: each
    run then shows whether specpage makes one, and the cache does not keep
    gigabytes of a random model."""
    for name in dense_copies(path):
        shutil.rmtree(cache_dir() / "gguf" / "converted" / name)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def memory_limit() -> int:
    """specpage's data limit: a share of the memory free now (/proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(int(line.split()[1]) * 1024 * SPECPAGE_MEMORY_SHARE)
    raise BenchError("no MemAvailable in /proc/meminfo")


def specpage_server(model: Path | str, threads: int, limit: int) -> ServerSpec:
    """specpage's daemon and HTTP front on `model` (a GGUF file or a known
    name), speculation off, under a data limit of `limit` bytes."""
    port = free_port()
    argv = ["prlimit", f"--data={limit}", "--", str(SPECPAGE), "serve", "--model", str(model),
            "--served-model-name", MODEL, "--draft", "", "--spec-methods", "",
            "--port", "0", "--http-port", str(port), "--set", "server.log_level=warning"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    return ServerSpec("specpage", argv, env, port)


def llama_cpp_server(model: Path, threads: int) -> ServerSpec:
    """bench/llama_cpp.py's server, on `model` instead of SmolLM2's file."""
    port = free_port()
    argv = llama_cpp.server_argv(MODEL, port, threads, STREAMS)
    argv[argv.index("-m") + 1] = str(model)
    return ServerSpec("llama_cpp", argv, llama_cpp.server_env(threads), port,
                      llama_cpp.HEALTH_PATH)


Figures = dict[str, Any]


def one_round(spec: ServerSpec, jobs: list[Workload], warmups: list[Workload],
              compared: list[str]) -> Figures:
    """Start the server, warm it up, run every job, fetch `compared`'s
    greedy answers, stop it."""
    with tempfile.TemporaryDirectory(prefix=f"scaling_{spec.name}_") as name:
        folder = Path(name)
        server = Running(spec, folder / "server.log")
        try:
            try:
                for warmup in warmups:
                    drive(spec.url, warmup, folder)
            except BenchError as error:  # loadgen gives a status; the server says why
                says = refusal(spec.url, jobs[0].chat)
                raise BenchError(f"{error}; {spec.name} says: {says}") from error
            figures: Figures = {}
            for job in jobs:
                # the floor's rate read beside the single stream's steps too,
                # just before and after them, the server idle
                before = read_rate_gb_s() if job.name == SINGLE else None
                figures[job.name] = drive(spec.url, job, folder, server)
                if before is not None:
                    figures[job.name]["read_gb_s"] = [before, read_rate_gb_s()]
            figures["outputs"] = greedy_answers(spec.url, compared, jobs[0].chat)
        finally:
            server.stop()
    figures["startup_s"] = server.startup_s
    return figures


def refusal(url: str, chat: bool = True) -> str:
    """The error message a server answers one chat (or raw completion)
    request with ("" if none)."""
    message = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}
    body = json.dumps({"model": MODEL, **message, "max_tokens": 1}).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    request = urllib.request.Request(f"{url}{path}", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60):
            return ""
    except urllib.error.HTTPError as error:
        text = error.read().decode(errors="replace")
    except OSError as error:
        return str(error)
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:300]


def read_rate_gb_s() -> float:
    """The read bandwidth now: the median of three of bench/common.py's measures."""
    return statistics.median(read_bandwidth() / 1e9 for _ in range(3))


class Rounds(NamedTuple):
    figures: dict[str, list[Figures]]  # system -> its figures, one per round
    rates: list[float]  # read bandwidth (GB/s) of each round, the better of its start and end
    errors: dict[str, str]  # system -> why it was left out


def run_rounds(specs: dict[str, Callable[[], ServerSpec]], jobs: list[Workload],
               warmups: list[Workload], count: int, raw: frozenset[str] = frozenset()
               ) -> Rounds:
    """Every system once per round, one server at a time, the order rotated;
    the read bandwidth of each round. A system that fails once
    is left out from then on, with the reason. Systems named in `raw` (a
    model without a chat template) take the same prompts as raw completions."""
    names = list(specs)
    figures: dict[str, list[Figures]] = {name: [] for name in names}
    rates: list[float] = []
    errors: dict[str, str] = {}
    prompts = jobs[0].prompts[:COMPARED_PROMPTS]
    for r in range(count):
        start_rate = read_rate_gb_s()
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if name in errors:
                continue
            chat = name not in raw
            try:
                got = one_round(specs[name](), [replace(j, chat=chat) for j in jobs],
                                [replace(w, chat=chat) for w in warmups],
                                prompts if r == 0 else [])
            except (BenchError, OSError, subprocess.TimeoutExpired) as error:
                errors[name] = str(error)
                print(f"round {r}: {name} failed: {error}", file=sys.stderr, flush=True)
                continue
            figures[name].append(got)
            read = got[SINGLE]["read_gb_s"]
            print(f"round {r}: {name}: single {got[SINGLE]['tpot_p50_s'] * 1e3:.1f} ms/token "
                  f"(read {read[0]:.1f} GB/s before, {read[1]:.1f} after), "
                  f"32 streams {got['streams32']['tok_s']:.1f} tok/s, "
                  f"start-up {got['startup_s']:.1f} s", file=sys.stderr, flush=True)
        # Others' work on a shared machine can halve the rate for a minute:
        # the floor takes the better of the round's two measures.
        end_rate = read_rate_gb_s()
        rates.append(max(start_rate, end_rate))
        print(f"round {r}: read bandwidth {start_rate:.1f} GB/s before, {end_rate:.1f} after",
              file=sys.stderr, flush=True)
    return Rounds({n: f for n, f in figures.items() if n not in errors}, rates, errors)


def summary(model: str, rounds: Rounds, nbytes: dict[str, int]) -> dict[str, Any]:
    """One model's headline: the floor, both servers' ms/token and its
    multiple of the floor, 32-stream tok/s, specpage over llama.cpp."""
    rate = Spread.of(rounds.rates)
    row: dict[str, Any] = {"floor_ms": nbytes["step_bytes"] / (rate.median * 1e9) * 1e3}
    got: dict[str, dict[str, Spread]] = {}
    for system in ("specpage", "llama_cpp"):
        figures = rounds.figures.get(f"{model}/{system}")
        if not figures:
            continue
        tpot = Spread.of([f[SINGLE]["tpot_p50_s"] for f in figures])
        got[system] = {"tpot": tpot, "tok_s": Spread.of([f["streams32"]["tok_s"]
                                                          for f in figures])}
        row[f"{system}_ms_per_token"] = tpot.median * 1e3
        # the floor at the rate read beside this server's own steps (the
        # better of just before and just after), and at the round's rate
        beside = Spread.of([max(f[SINGLE]["read_gb_s"]) for f in figures])
        row[f"{system}_over_floor"] = over_floor(tpot, nbytes["step_bytes"], beside)["ratio"]
        row[f"{system}_over_round_floor"] = over_floor(tpot, nbytes["step_bytes"], rate)["ratio"]
        row[f"{system}_read_gb_s"] = beside.as_json()
        row[f"{system}_streams32_tok_s"] = got[system]["tok_s"].median
        # the first start of a file may convert it; the rounds show each start
        row[f"{system}_startup_s"] = Spread.of([f["startup_s"] for f in figures]).as_json()
    if len(got) == 2:
        row["specpage_vs_llama_cpp"] = {
            "single_tpot": compare(got["specpage"]["tpot"], got["llama_cpp"]["tpot"], False),
            "streams32_tok_s": compare(got["specpage"]["tok_s"], got["llama_cpp"]["tok_s"])}
    return row


def our_options(parser: Any) -> None:
    parser.add_argument("--sizes", default=None,
                        help=f"only these random models, comma-separated ({', '.join(SHAPES)}; "
                             "default: all, or 0.5b with --quick; empty: none)")
    parser.add_argument("--no-gemma", action="store_true", help=f"leave out {GEMMA}")


def model_files(args: Any) -> tuple[dict[str, Path], dict[str, str]]:
    """The GGUF of each model to serve (the random ones written if need be),
    and the models left out with the reason."""
    sizes = ([s for s in args.sizes.split(",") if s] if args.sizes is not None
             else ["0.5b"] if args.quick else list(SHAPES))
    if set(sizes) - set(SHAPES):
        raise SystemExit(f"--sizes: no model {', '.join(sorted(set(sizes) - set(SHAPES)))} "
                         f"(these are: {', '.join(SHAPES)})")
    files = {name: ensure_file(name, SHAPES[name]) for name in sizes}
    gemma = cache_dir() / "gguf" / GEMMA_FILE
    if args.quick or args.no_gemma:
        return files, {}
    if not gemma.is_file():
        return files, {GEMMA: f"{gemma} is not there: specpage models fetch {GEMMA}"}
    return {**files, GEMMA: gemma}, {}


def server_specs(files: dict[str, Path], threads: int, limit: int
                 ) -> dict[str, Callable[[], ServerSpec]]:
    """Both servers' starts for every model; specpage's under `limit` bytes of data."""
    specs: dict[str, Callable[[], ServerSpec]] = {}
    for name, path in files.items():
        # A known name brings what the fetch step records with the file (its
        # chat template, for one); specpage's own list says which it knows.
        target = name if name in fetch.MODELS else path
        specs[f"{name}/specpage"] = partial(specpage_server, target, threads, limit)
        specs[f"{name}/llama_cpp"] = partial(llama_cpp_server, path, threads)
    return specs


def model_result(name: str, path: Path, rounds: Rounds, copies_before: list[str]
                 ) -> dict[str, Any]:
    """One model's row: its headline, shape, bytes, dense copies, failures
    and first-round greedy answers."""
    systems = {system: f"{name}/{system}" for system in ("specpage", "llama_cpp")}
    nbytes = decode_bytes(path)
    copies = dense_copies(path)
    return {
        **summary(name, rounds, nbytes),
        "shape": asdict(SHAPES[name]) if name in SHAPES else None,
        "parameters": SHAPES[name].parameters() if name in SHAPES else None,
        **nbytes,
        "dense_copy": {"folders": copies, "new": sorted(set(copies) - set(copies_before)),
                       "bytes": sum(folder_bytes(cache_dir() / "gguf" / "converted" / c)
                                    for c in copies)},
        "errors": {system: rounds.errors[key] for system, key in systems.items()
                   if key in rounds.errors},
        "outputs": {system: rounds.figures[key][0]["outputs"] for system, key in systems.items()
                    if key in rounds.figures},
    }


def main() -> None:
    args = parse_args(__doc__, extra=our_options)
    started = time.perf_counter()
    if not llama_cpp.ready():
        raise SystemExit("llama-server is not built: make llama-server")
    files, skipped = model_files(args)
    random_files = [path for name, path in files.items() if name in SHAPES]
    for path in random_files:
        drop_dense_copies(path)
    cache_before = folder_bytes(cache_dir())
    copies_before = {name: dense_copies(path) for name, path in files.items()}
    prompts = chat_prompts(STREAMS)
    tokens = OUTPUT_TOKENS[args.quick]
    jobs = [Workload("streams32", prompts, tokens, STREAMS),
            Workload(SINGLE, prompts[:SINGLE_REQUESTS[args.quick]], tokens, 1)]
    warmups = [Workload("warmup32", prompts, WARMUP_TOKENS, STREAMS),
               Workload("warmup1", prompts[:WARMUP_SINGLE], WARMUP_TOKENS, 1)]
    limit = memory_limit()
    specs = server_specs(files, args.threads, limit)
    raw = frozenset(spec for spec in specs if not chat_template(files[spec.split("/")[0]]))
    rounds = run_rounds(specs, jobs, warmups, ROUNDS[args.quick], raw)
    models = {name: model_result(name, path, rounds, copies_before[name])
              for name, path in files.items()}
    cache_after = folder_bytes(cache_dir())
    for path in random_files:
        drop_dense_copies(path)
    finish("scaling", {
        "bench": "scaling", "client": "specpage-loadgen run --api openai (chat, streamed)",
        "weights": "random (speed only), Q4_K_M as llama.cpp lays it out; gemma3-270m real",
        "output_tokens": tokens, "rounds": ROUNDS[args.quick],
        "workloads": {job.name: {"requests": len(job.prompts), "concurrency": job.concurrency}
                      for job in jobs},
        "read_gb_s": Spread.of(rounds.rates).as_json(),
        "specpage_data_limit_bytes": limit,
        "llama_cpp": {"source": llama_cpp.SOURCE, "slots": STREAMS, "threads": args.threads,
                      "flash_attention": llama_cpp.FLASH_ATTENTION},
        "models": models, "skipped": skipped,
        "cache_bytes": {"before": cache_before, "after": cache_after},
        "machine": machine(), "wall_s": time.perf_counter() - started,
    })


if __name__ == "__main__":
    main()
