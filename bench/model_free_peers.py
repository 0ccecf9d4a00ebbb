"""The peers' draft-free speculation on bench/model_free.py's requests, each
peer against itself without speculation: llama.cpp's `llama-server` (its
n-gram speculation, --spec-type) and vLLM's CPU server (`ngram`, prompt
lookup, and `suffix`, suffix decoding, where arctic-inference installs).

    python bench/model_free_peers.py [--quick] [--peers A,B] [--rounds N]
                                     [--no-streams] [--sweep]

The requests: bench/workloads/grounded.jsonl and chat.jsonl, rendered with
the model's chat template exactly as bench/model_free.py renders them
(its `load` and `render`), and sent as those token ids to each server's
OpenAI /v1/completions (both take a prompt of token ids), so every system
gets the same prompt; greedy, the request's max_tokens, EOS ends a request.

A peer's speculation is a start-up option, so each mode is a server of its
own, all of a peer's modes up at once: "off" (no speculation) and its
speculating modes. Measured as bench/model_free.py measures specpage:

- single stream: each request alone on every mode of the peer, one after
  the other (the order of the modes rotating by request and round); decode
  speed from the client's clock (tokens after the first over the time from
  the first chunk to the last), by kind and by set, as a ratio to "off";
- 32 streams: every request of a set at once (the chat set's 16 twice, as
  bench/model_free.py sends them), on each mode in turn (rotating by
  round), tokens per second of wall time, as a ratio to "off";
- the greedy text of each speculating mode against "off", request by
  request (single stream).

The peers' speculation keeps state across requests (vLLM's suffix tree,
llama.cpp's ngram-mod table), which would hold the same request's answer
from an earlier run; so the servers start afresh for each round's single-
stream runs and again for its 32 streams, and a speculating mode's memory
holds only the other requests before it in the same run (bench/model_free.py
salts specpage's suffix cache per round and mode to the same end). Every
server gets the same untimed warm-up first. vLLM's worker spins on a core
for a second after each job, so every request to it is followed by that
pause, untimed (bench/vllm_cpu.py).

Both peers run with --threads threads (2 by default). Where other jobs
keep the machine's two cores busy, a 2-thread llama.cpp waits at every
operation's barrier for its descheduled thread (a single stream decoded at
3 tok/s with 2 threads and 33 tok/s with 1, 2026-12-03); measure with
--threads 1 then, and say so.

--sweep runs llama.cpp's candidate settings (LLAMA_SWEEP) instead, single
stream on the grounded set, and writes model_free_peers_sweep.json; the
best by grounded decode speed among those that drafted is LLAMA_SPEC.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import llama_cpp  # noqa: E402
from bench.common import (  # noqa: E402
    MODEL,
    RESULTS,
    Spread,
    finish,
    free_port,
    machine,
    parse_args,
)
from bench.model_free import QUICK_REQUESTS, QUICK_TOKENS, STREAMS, load, render  # noqa: E402
from bench.serving import Running, ServerSpec, vllm_server  # noqa: E402
from bench.vllm_cpu import PACKAGE as VLLM_PACKAGE  # noqa: E402
from bench.vllm_cpu import PYTHON as VLLM_PYTHON  # noqa: E402
from bench.vllm_cpu import SPIN_AFTER_JOB_S, cpu_has_bf16  # noqa: E402
from bench.vllm_cpu import setup as vllm_setup  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

NAME = "model_free_peers"
WARMUP_TOKENS = 16  # as bench/model_free.py's warm-up
REQUEST_TIMEOUT_S = 600.0
# llama.cpp's draft-free settings tried by --sweep (its defaults, n 12 and
# m 48, are sized for long repeats in code; these requests repeat shorter
# spans). The best on the grounded set is LLAMA_SPEC.
LLAMA_SWEEP: dict[str, list[str]] = {
    "ngram-simple n3 m8": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                           "--spec-ngram-simple-size-m", "8"],
    "ngram-map-k n3 m8": ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                          "--spec-ngram-map-k-size-m", "8"],
    "ngram-map-k n12 m48": ["--spec-type", "ngram-map-k"],
    "ngram-mod match8 min2 max16": ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "8",
                                    "--spec-ngram-mod-n-min", "2",
                                    "--spec-ngram-mod-n-max", "16"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
}
SWEEP_REQUESTS = 14  # of the grounded set (kinds interleaved): every kind twice
SWEEP_TOKENS = 128  # max_tokens cap in the sweep
# The sweep's best here among the settings that drafted at all
# (model_free_peers_sweep.json): ngram-map-k's defaults drafted nothing on
# these requests, so their ratio to "off" is the noise between two servers.
LLAMA_SPEC = "ngram-mod match8 min2 max16"
VLLM_SPEC: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2},
    "suffix": {"method": "suffix"},  # needs arctic-inference in .venv-vllm
}

Starter = Callable[[], ServerSpec]


@dataclass(frozen=True)
class Peer:
    """A peer's servers by mode ("off" first), and the untimed pause each
    request to it is followed by."""

    modes: Mapping[str, Starter]
    settle_s: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)


def llama_server(mode: str, flags: list[str], threads: int) -> ServerSpec:
    port = free_port()
    argv = llama_cpp.server_argv(MODEL, port, threads, STREAMS, flags)
    return ServerSpec(f"llama_cpp_{mode}", argv, llama_cpp.server_env(threads), port,
                      llama_cpp.HEALTH_PATH)


def vllm_spec_server(mode: str, method: dict[str, Any] | None, threads: int,
                     eager: bool) -> ServerSpec:
    """vLLM's OpenAI server as bench/serving.py starts it, with `method` as
    its speculative config."""
    dtype = "bfloat16" if cpu_has_bf16() else "float32"
    base = vllm_server(f"vllm_{mode}", {"dtype": dtype, "eager": eager},
                       ensure_model(MODEL), threads)
    extra = ["--speculative-config", json.dumps(method)] if method else []
    return ServerSpec(base.name, [*base.argv, *extra], base.env, base.port)


def has_arctic_inference() -> bool:
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import arctic_inference"],
                           capture_output=True)
    return probe.returncode == 0


def llama_peer(threads: int, settings: dict[str, list[str]]) -> Peer:
    modes = {"off": partial(llama_server, "off", [], threads)}
    modes.update({name: partial(llama_server, name.replace(" ", "_"), flags, threads)
                  for name, flags in settings.items()})
    return Peer(modes, config={"source": llama_cpp.SOURCE, "slots": STREAMS,
                               "flash_attention": llama_cpp.FLASH_ATTENTION,
                               "settings": settings})


def vllm_peer(threads: int, eager: bool) -> Peer:
    methods = {name: m for name, m in VLLM_SPEC.items()
               if name != "suffix" or has_arctic_inference()}
    modes = {"off": partial(vllm_spec_server, "off", None, threads, eager)}
    modes.update({name: partial(vllm_spec_server, name, m, threads, eager)
                  for name, m in methods.items()})
    dtype = "bfloat16" if cpu_has_bf16() else "float32"
    left_out = {name: "arctic-inference is not installed in .venv-vllm"
                for name in VLLM_SPEC if name not in methods}
    return Peer(modes, SPIN_AFTER_JOB_S, {"package": VLLM_PACKAGE, "dtype": dtype,
                                          "compiled": not eager, "speculative_config": methods,
                                          "left_out": left_out})


class Outcome:
    """One request's run: its text, tokens, decode time and speculation counts."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens = 0
        self.first = self.last = 0.0
        self.drafted = self.accepted = 0

    @property
    def decode_seconds(self) -> float:
        return self.last - self.first


async def run_one(client: httpx.AsyncClient, url: str, request: dict[str, Any]) -> Outcome:
    """One streamed completion of the request's token ids, greedy."""
    body = {"model": MODEL, "prompt": request["ids"], "max_tokens": request["max_tokens"],
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    out = Outcome()
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk.get("choices") or ():
                out.first = out.first or now
                out.last = now
                out.text += choice.get("text") or ""
                chunks += bool(choice.get("text"))
            if chunk.get("usage"):
                out.tokens = chunk["usage"]["completion_tokens"]
            timings = chunk.get("timings") or {}  # llama-server's, with its draft counts
            out.drafted = timings.get("draft_n", out.drafted)
            out.accepted = timings.get("draft_n_accepted", out.accepted)
    out.tokens = out.tokens or chunks  # a server that sends no usage: a token per chunk
    return out


def speed(outcomes: list[Outcome]) -> float:
    """Decode tokens per second over the requests together."""
    seconds = sum(o.decode_seconds for o in outcomes)
    return sum(max(o.tokens - 1, 0) for o in outcomes) / max(seconds, 1e-9)


class Session:
    """A peer's servers for one run, all modes up; stops them on exit."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self._stack = ExitStack()
        self.urls: dict[str, str] = {}

    def __enter__(self) -> Session:
        folder = Path(tempfile.gettempdir())
        try:
            for mode, start in self.peer.modes.items():  # one at a time: vLLM compiles
                spec = start()
                server = Running(spec, folder / f"{NAME}_{spec.name}.log")
                self._stack.callback(server.stop)
                self.urls[mode] = spec.url
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    async def warm_up(self, client: httpx.AsyncClient,
                      sets: dict[str, list[dict[str, Any]]]) -> None:
        for requests in sets.values():
            for url in self.urls.values():
                await run_one(client, url, {**requests[0], "max_tokens": WARMUP_TOKENS})
                await asyncio.sleep(self.peer.settle_s)

    async def single(self, client: httpx.AsyncClient, requests: list[dict[str, Any]],
                     r: int) -> dict[str, list[Outcome]]:
        """Every request alone on every mode: {mode: [outcome by request]}."""
        modes = list(self.urls)
        runs: dict[str, list[Outcome | None]] = {m: [None] * len(requests) for m in modes}
        order = list(range(len(requests)))
        order = order[r % len(order):] + order[: r % len(order)]
        for i in order:
            shift = (i + r) % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                runs[mode][i] = await run_one(client, self.urls[mode], requests[i])
                await asyncio.sleep(self.peer.settle_s)
        return {m: [o for o in outcomes if o is not None] for m, outcomes in runs.items()}

    async def streams(self, client: httpx.AsyncClient, requests: list[dict[str, Any]],
                      r: int) -> dict[str, float]:
        """The set's requests all at once on each mode: {mode: tok/s of wall time}."""
        modes = list(self.urls)
        shift = r % len(modes)
        rate = {}
        for mode in modes[shift:] + modes[:shift]:
            start = time.perf_counter()
            outcomes = await asyncio.gather(*(run_one(client, self.urls[mode], q)
                                              for q in (requests * 2)[:STREAMS]))
            rate[mode] = sum(o.tokens for o in outcomes) / (time.perf_counter() - start)
            await asyncio.sleep(self.peer.settle_s)
        return rate


class Tally:
    """A peer's figures over the rounds."""

    def __init__(self) -> None:
        self.ratios: dict[str, list[float]] = defaultdict(list)  # "mode/single/kind"
        self.tok_s: dict[str, list[float]] = defaultdict(list)  # "mode/single/set"
        self.same: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # "mode/set"
        self.drafts: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # "mode/kind"
        self.detail: list[dict[str, Any]] = []

    def add_single(self, name: str, requests: list[dict[str, Any]],
                   runs: dict[str, list[Outcome]], r: int) -> None:
        kinds: dict[str, list[int]] = defaultdict(list)
        for i, q in enumerate(requests):
            kinds[q["kind"]].append(i)
            kinds[name].append(i)
        off = runs["off"]
        for mode, outcomes in runs.items():
            self.tok_s[f"{mode}/single/{name}"].append(speed(outcomes))
            if mode == "off":
                continue
            for kind, ids in kinds.items():
                self.ratios[f"{mode}/single/{kind}"].append(
                    speed([outcomes[i] for i in ids]) / speed([off[i] for i in ids]))
            for i, (q, spec, alone) in enumerate(zip(requests, outcomes, off, strict=True)):
                self.same[f"{mode}/{name}"][0] += spec.text == alone.text
                self.same[f"{mode}/{name}"][1] += 1
                self.drafts[f"{mode}/{q['kind']}"][0] += spec.drafted
                self.drafts[f"{mode}/{q['kind']}"][1] += spec.accepted
                self.detail.append({"round": r, "set": name, "index": i, "kind": q["kind"],
                                    "mode": mode, "tokens": [spec.tokens, alone.tokens],
                                    "decode_s": [spec.decode_seconds, alone.decode_seconds],
                                    "drafted": spec.drafted, "accepted": spec.accepted,
                                    "same_text": spec.text == alone.text})

    def add_streams(self, name: str, rate: dict[str, float]) -> None:
        for mode, value in rate.items():
            self.tok_s[f"{mode}/streams/{name}"].append(value)
            if mode != "off":
                self.ratios[f"{mode}/streams/{name}"].append(value / rate["off"])

    def as_json(self) -> dict[str, Any]:
        return {"spec_vs_off": {k: Spread.of(v).as_json() for k, v in sorted(self.ratios.items())},
                "tok_s": {k: Spread.of(v).as_json() for k, v in sorted(self.tok_s.items())},
                "greedy_same_as_off": {k: f"{s}/{n}" for k, (s, n) in sorted(self.same.items())},
                "drafted_accepted_by_kind": {
                    k: {"drafted": d, "accepted": a, "acceptance": a / max(d, 1)}
                    for k, (d, a) in sorted(self.drafts.items()) if d},
                "requests": self.detail}


async def measure(peer: Peer, sets: dict[str, list[dict[str, Any]]], count: int,
                  streams: bool) -> dict[str, Any]:
    tally = Tally()
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    # a connection per request: llama-server closes idle ones after 5 s, and
    # a pooled one it closed fails the next request sent on it
    limits = httpx.Limits(max_connections=2 * STREAMS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for r in range(count):
            with Session(peer) as session:
                await session.warm_up(client, sets)
                for name, requests in sets.items():
                    runs = await session.single(client, requests, r)
                    tally.add_single(name, requests, runs, r)
                    report(r, name, "single", tally)
            if not streams:
                continue
            with Session(peer) as session:
                await session.warm_up(client, sets)
                for name, requests in sets.items():
                    tally.add_streams(name, await session.streams(client, requests, r))
                    report(r, name, "streams", tally)
    return tally.as_json()


def report(r: int, name: str, load: str, tally: Tally) -> None:
    figures = [f"{k} {v[-1]:.2f}" for k, v in tally.ratios.items()
               if k.endswith(f"/{load}/{name}")]
    print(f"round {r} {name} {load}: " + ", ".join(figures), file=sys.stderr, flush=True)


def options(parser: Any) -> None:
    parser.add_argument("--peers", default="llama_cpp,vllm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-streams", action="store_true", help="single stream only")
    parser.add_argument("--sweep", action="store_true",
                        help="llama.cpp's candidate settings on the grounded set")
    parser.add_argument("--eager", action="store_true",
                        help="vLLM eager (the default with --quick), not compiled")


def sweep(threads: int, quick: bool) -> None:
    cap = QUICK_TOKENS if quick else SWEEP_TOKENS
    requests = render(load("grounded"), cap)[: QUICK_REQUESTS if quick else SWEEP_REQUESTS]
    error = llama_cpp.setup()
    if error:
        finish(f"{NAME}_sweep", {"error": error})
        return
    result = asyncio.run(measure(llama_peer(threads, LLAMA_SWEEP), {"grounded": requests}, 1,
                                 streams=False))
    by_setting = {mode: result["spec_vs_off"][f"{mode}/single/grounded"]["median"]
                  for mode in LLAMA_SWEEP}
    drafting = [mode for mode in LLAMA_SWEEP
                if any(k.startswith(f"{mode}/") for k in result["drafted_accepted_by_kind"])]
    finish(f"{NAME}_sweep", {"machine": machine(), "requests": len(requests), "rounds": 1,
                             "settings": LLAMA_SWEEP, "grounded_spec_vs_off": by_setting,
                             "drafting": drafting,
                             "best": max(drafting, key=lambda k: by_setting[k], default=None),
                             "result": result})


def main() -> None:
    args = parse_args(__doc__, extra=options)
    # a TERM stops the servers too (the with-blocks' exits run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.sweep:
        sweep(args.threads, args.quick)
        return
    cap = QUICK_TOKENS if args.quick else None
    sets = {name: render(load(name), cap) for name in ("grounded", "chat")}
    if args.quick:
        sets = {name: requests[:QUICK_REQUESTS] for name, requests in sets.items()}
    count = 1 if args.quick else args.rounds
    streams = not (args.quick or args.no_streams)
    peers: dict[str, Callable[[], Peer | str]] = {
        "llama_cpp": lambda: llama_cpp.setup() or llama_peer(
            args.threads, {LLAMA_SPEC: LLAMA_SWEEP[LLAMA_SPEC]}),
        "vllm": lambda: vllm_setup() or vllm_peer(args.threads, args.eager or args.quick),
    }
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    wanted = args.peers.split(",")
    for done, name in enumerate(wanted, 1):
        peer = peers[name]()
        if isinstance(peer, str):
            errors[name] = peer
            continue
        try:
            results[name] = {"config": peer.config,
                             **asyncio.run(measure(peer, sets, count, streams))}
        except Exception as error:  # a peer that fails is reported, not fatal
            errors[name] = f"{type(error).__name__}: {error}"[-600:]
            print(f"{name} failed: {errors[name]}", file=sys.stderr, flush=True)
            continue
        print(json.dumps({name: results[name]["spec_vs_off"]}), file=sys.stderr, flush=True)
        if done < len(wanted):  # each peer's figures are kept as soon as they are in
            partial = summary(results, errors, count, streams)
            (RESULTS / f"{NAME}.json").write_text(json.dumps(
                {**partial, "not_yet_run": wanted[done:]}, indent=2) + "\n")
    finish(NAME, summary(results, errors, count, streams))


def summary(results: dict[str, Any], errors: dict[str, str], count: int,
            streams: bool) -> dict[str, Any]:
    headline = {f"{name}/{k}": v["median"] for name, r in results.items()
                for k, v in r["spec_vs_off"].items()}
    headline.update({f"{name}/{k}/greedy_same": v for name, r in results.items()
                     for k, v in r["greedy_same_as_off"].items()})
    return {"machine": machine(), "rounds": count, "streams": streams,
            "prompts": "token ids (the chat template's, as bench/model_free.py renders "
                       "them) to /v1/completions, streamed, greedy",
            "peers": results, "errors": errors, "headline_spec_vs_off": headline}

if __name__ == "__main__":
    main()
