"""Speculation through the running daemon, by kind of request: spec AUTO
against spec OFF on the same daemon, as `make serve` starts it.

    python bench/model_free.py [--quick] [--systems A,B,...] [--rounds N]
                               [--temperature T] [--sets grounded,chat] [--no-streams]
                               [--no-single] [--streams N] [--control] [--out NAME]

The requests: bench/workloads/grounded.jsonl (input-grounded: summaries of
a given paragraph, rewrites, extraction into JSON, tables, code edits, answers
from a given context, multi-turn edits) and bench/workloads/chat.jsonl (open
chat), written for this bench; no draft was trained on them. Each is
rendered with the model's chat template and sent as token ids over gRPC,
greedy (or sampled at --temperature, unseeded), with its own max_tokens (EOS
ends it, as for a user).

The systems are daemons (one up at a time, each started as `make serve`
does, q4 by default): `specpage` (draft model and the proposers that need
no model), `model_free` (no draft: `make serve`'s default), `no_corpus` (no
draft, prompt lookup and the suffix cache without the corpus table), `draft_only`
(spec_methods ""), `head` (the EAGLE-3 head models/smollm2-head in the
draft's place, beside the proposers that need no model). Against each, the
same daemon with spec OFF per request.

- single stream: each request alone, AUTO and OFF one after the other (the
  order alternating by request and round), decode speed from the client's
  clock (tokens after the first over the time from the first chunk to the
  last), by kind;
- 32 streams (--streams N: N): that many of the set's requests at once,
  taken in order and repeated as needed (the grounded set, then chat), in
  AUTO and in OFF, each twice a round in the order AUTO OFF OFF AUTO (OFF
  AUTO AUTO OFF in odd rounds), tokens per second of wall time. A run takes
  seconds, and this machine's speed drifts by 5-10% over such spans; with
  --control, OFF is also measured against OFF in the same order, so that
  the spread that noise alone gives stands beside AUTO's.

Every (round, mode) pair of single-stream runs, and every 32-stream run,
sends its own cache_salt, so neither the prefix cache nor the suffix cache
ever holds a previous run of the same request: AUTO's suffix cache holds
only the other requests of its own round (of its own run, at 32 streams). The
greedy answers of AUTO and OFF are compared request by request, at 32 streams
too (`streams_same`; sampled ones differ by chance). Medians over the
rounds of per-round ratios, with min-max spreads (bench/common.py).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections import defaultdict
from itertools import cycle, islice, zip_longest
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DRAFT, Spread, finish, machine, parse_args, rounds  # noqa: E402
from bench.serving import MODEL, SPECPAGE, Running, ServerSpec, free_port  # noqa: E402
from specpage.client import Chunk, Client  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

WORKLOADS = Path(__file__).resolve().parent / "workloads"
HEAD = DRAFT.parent / "smollm2-head"  # the EAGLE-3 head (not the default)
STREAMS = 32
QUICK_REQUESTS = 6  # per set, single stream, with --quick
QUICK_TOKENS = 64  # max_tokens cap with --quick
SYSTEMS = {
    "specpage": ["--draft", str(DRAFT)],
    "model_free": ["--draft", ""],
    "no_corpus": ["--draft", "", "--spec-methods", "ngram,suffix"],
    "draft_only": ["--draft", str(DRAFT), "--spec-methods", ""],
    "head": ["--draft", str(HEAD)],
}


def load(name: str) -> list[dict[str, Any]]:
    lines = (WORKLOADS / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def render(requests: list[dict[str, Any]], cap: int | None) -> list[dict[str, Any]]:
    """Each request's prompt as token ids through the model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_model(MODEL))
    rendered = []
    for r in requests:
        ids = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)
        if not isinstance(ids, list):  # a BatchEncoding in newer transformers
            ids = ids["input_ids"]
        tokens = min(r["max_tokens"], cap) if cap else r["max_tokens"]
        rendered.append({"kind": r["kind"], "ids": list(ids), "max_tokens": tokens})
    return rendered


def daemon(name: str, flags: list[str], threads: int) -> ServerSpec:
    http, grpc_port = free_port(), free_port()
    argv = [str(SPECPAGE), "serve", "--target", MODEL, *flags, "--port", str(grpc_port),
            "--http-port", str(http), "--set", "server.log_level=warning"]
    import os

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    return ServerSpec(name, argv, env, http), grpc_port


class Outcome:
    """One request's run: its text, tokens, decode time and speculation counts."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.first = self.last = 0.0
        self.drafted = self.accepted = 0
        # method -> [drafted, accepted, accepted at proposal 1, 2, ...]
        self.by_method: dict[str, list[int]] = {}

    @property
    def decode_seconds(self) -> float:
        return self.last - self.first


async def run_one(client: Client, request: dict[str, Any], spec: str, salt: str,
                  temperature: float = 0.0) -> Outcome:
    out = Outcome()
    async for event in client.generate(request["ids"], spec=spec, cache_salt=salt,
                                       max_tokens=request["max_tokens"],
                                       temperature=temperature):
        now = time.perf_counter()
        if isinstance(event, Chunk):
            out.first = out.first or now
            out.last = now
            out.tokens += event.token_ids
        else:
            out.drafted, out.accepted = event.usage.drafted_tokens, event.usage.accepted_tokens
    return out


async def single_stream(client: Client, requests: list[dict[str, Any]], r: int,
                        temperature: float) -> dict[str, dict[str, Outcome]]:
    """Every request alone in both modes: {mode: {index: outcome}}."""
    runs: dict[str, dict[str, Outcome]] = {"auto": {}, "off": {}}
    shift = r % max(len(requests), 1)
    order = list(range(shift, len(requests))) + list(range(shift))
    for i in order:
        modes = ("auto", "off") if (i + r) % 2 == 0 else ("off", "auto")
        for mode in modes:
            before = await method_counts(client)
            out = await run_one(client, requests[i], mode, f"s{r}-{mode}", temperature)
            after = await method_counts(client)  # alone on the daemon: this request's
            out.by_method = {m: [a - b for a, b in zip_longest(f, before.get(m, []), fillvalue=0)]
                             for m, f in after.items()}
            runs[mode][str(i)] = out
    return runs


async def method_counts(client: Client) -> dict[str, list[int]]:
    """The daemon's counts so far: method -> [drafted, accepted, accepted at
    proposal 1, 2, ...]."""
    info = await client.server_info()
    return {m.method: [m.drafted_tokens, m.accepted_tokens, *m.accepted_by_position]
            for m in info.by_method}


async def concurrent(client: Client, requests: list[dict[str, Any]], mode: str,
                     salt: str, temperature: float) -> tuple[float, list[Outcome]]:
    """Every request at once: the seconds until the last ends, and each one's outcome."""
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(run_one(client, q, mode, salt, temperature)
                                      for q in requests))
    return time.perf_counter() - start, list(outcomes)


async def paired_streams(client: Client, requests: list[dict[str, Any]], measured: str,
                         against: str, salt: str, r: int, temperature: float,
                         counts: list[int], same: list[int]) -> float:
    """Tokens per second of wall time in mode `measured` over mode `against`,
    every request at once, run twice each in the order ABBA (BAAB in odd
    rounds), so that a machine that drifts steadily through the round weighs
    on both alike. Adds the drafted and accepted counts of AUTO runs to
    counts, and to same [equal, compared] how many of the measured runs'
    answers equal the first `against` run's, request by request."""
    a, b = (measured, 0), (against, 1)  # (mode, side)
    if r % 2:
        a, b = b, a
    tokens, seconds = [0, 0], [0.0, 0.0]  # by side
    answers: list[list[list[int]]] = [[], []]  # by side, each run's answers
    for i, (mode, side) in enumerate((a, b, b, a)):
        # a salt of its own for every run: no run finds another's prompts cached
        spent, outs = await concurrent(client, requests, mode,
                                       f"{salt}-{measured}-{against}-{i}", temperature)
        seconds[side] += spent
        tokens[side] += sum(len(o.tokens) for o in outs)
        answers[side].append([o.tokens for o in outs])
        if mode == "auto":
            counts[0] += sum(o.drafted for o in outs)
            counts[1] += sum(o.accepted for o in outs)
    for run in answers[0]:  # (sampled answers differ by chance)
        same[0] += sum(x == y for x, y in zip(run, answers[1][0], strict=True))
        same[1] += len(run)
    return (tokens[0] / seconds[0]) / (tokens[1] / seconds[1])


def speed(outcomes: list[Outcome]) -> float:
    """Decode tokens per second over the requests together."""
    seconds = sum(o.decode_seconds for o in outcomes)
    return sum(max(len(o.tokens) - 1, 0) for o in outcomes) / max(seconds, 1e-9)


async def measure(port: int, sets: dict[str, list[dict[str, Any]]], count: int,
                  streams: bool, temperature: float, single: bool = True,
                  control: bool = False, width: int = STREAMS) -> dict[str, Any]:
    ratios: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_method: dict[str, dict[str, list[int]]] = defaultdict(dict)  # kind -> method -> sums
    same = total = 0
    streams_same: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # [equal, compared]
    detail: list[dict[str, Any]] = []  # every single-stream pair, for a second look
    async with Client(f"127.0.0.1:{port}") as client:
        for requests in sets.values():  # warm-up: every step shape, untimed
            for mode in ("auto", "off"):
                await run_one(client, {**requests[0], "max_tokens": 16}, mode, f"w-{mode}",
                              temperature)
        for r in range(count):
            for name, requests in sets.items():
                alone = requests if single else []
                runs = await single_stream(client, alone, r, temperature)
                kinds = defaultdict(list)
                for i, q in enumerate(alone):
                    kinds[q["kind"]].append(str(i))
                    kinds[name].append(str(i))
                    auto, off = runs["auto"][str(i)], runs["off"][str(i)]
                    detail.append({"round": r, "set": name, "index": i, "kind": q["kind"],
                                   "tokens": [len(auto.tokens), len(off.tokens)],
                                   "decode_s": [auto.decode_seconds, off.decode_seconds],
                                   "drafted": auto.drafted, "accepted": auto.accepted})
                    same += auto.tokens == off.tokens  # by chance only, when sampled
                    total += 1
                    counts[q["kind"]][0] += auto.drafted
                    counts[q["kind"]][1] += auto.accepted
                    for method, figures in auto.by_method.items():
                        sums = by_method[q["kind"]].setdefault(method, [])
                        sums += [0] * (len(figures) - len(sums))
                        for j, v in enumerate(figures):
                            sums[j] += v
                for kind, ids in kinds.items():
                    auto = speed([runs["auto"][i] for i in ids])
                    ratios[f"single/{kind}"].append(auto / speed([runs["off"][i] for i in ids]))
                if streams:
                    pairs = [("auto", "off")] + ([("off", "off")] if control else [])
                    for measured, against in pairs:
                        key = ("streams" if measured == "auto" else "control_off_vs_off")
                        ratio = await paired_streams(client, list(islice(cycle(requests), width)),
                                                     measured, against, f"c{r}", r, temperature,
                                                     counts[f"streams/{name}"],
                                                     streams_same[f"{key}/{name}"])
                        ratios[f"{key}/{name}"].append(ratio)
                print(f"round {r} {name}: " + ", ".join(
                    f"{k} {v[-1]:.2f}" for k, v in ratios.items() if k.endswith(name)),
                    file=sys.stderr, flush=True)
    return {"auto_vs_off": {k: Spread.of(v).as_json() for k, v in sorted(ratios.items())},
            "drafted_accepted_by_kind": {k: {"drafted": d, "accepted": a,
                                             "acceptance": a / max(d, 1)}
                                         for k, (d, a) in sorted(counts.items())},
            # single stream, AUTO: per kind and method, drafted, accepted, and
            # the share of proposals at position j (1, 2, ...) that were accepted
            "by_method_and_position": {
                kind: {method: {"drafted": f[0], "accepted": f[1],
                                "accepted_by_position": f[2:]}
                       for method, f in sorted(methods.items())}
                for kind, methods in sorted(by_method.items())},
            "greedy_same_as_off": f"{same}/{total}",
            # 32 streams: each measured run's answers against the first other run's
            "streams_same": {k: f"{e}/{n}" for k, (e, n) in sorted(streams_same.items())},
            "requests": detail}


def main() -> None:
    args = parse_args(__doc__, extra=lambda p: (
        p.add_argument("--systems", default="specpage,model_free,draft_only,head"),
        p.add_argument("--rounds", type=int, default=3),
        p.add_argument("--no-streams", action="store_true", help="single stream only"),
        p.add_argument("--no-single", action="store_true", help="32 streams only"),
        p.add_argument("--streams", type=int, default=STREAMS,
                       help="requests at once in the streams runs (the set's, in order, "
                            "repeated as needed)"),
        p.add_argument("--control", action="store_true",
                       help="32 streams: OFF against OFF too, in the same order (the noise)"),
        p.add_argument("--out", help="the results' name under bench/results (default "
                       "model_free, or model_free_t<T> when sampled)"),
        p.add_argument("--temperature", type=float, default=0.0,
                       help="sampled (unseeded) above 0: AUTO's and OFF's texts then differ, "
                            "and the results go to model_free_t<T>.json"),
        p.add_argument("--sets", default="grounded,chat")))
    if args.streams < 1:
        raise SystemExit(f"--streams must be at least 1, got {args.streams}")
    cap = QUICK_TOKENS if args.quick else None
    sets = {name: render(load(name), cap) for name in args.sets.split(",")}
    if args.quick:
        sets = {name: requests[:QUICK_REQUESTS] for name, requests in sets.items()}
    count = rounds(args.quick, args.rounds)
    results = {}
    for name in args.systems.split(","):
        spec, port = daemon(name, SYSTEMS[name], args.threads)
        server = Running(spec, Path(tempfile.gettempdir()) / f"model_free_{name}.log")
        try:
            results[name] = asyncio.run(measure(port, sets, count,
                                                not (args.quick or args.no_streams),
                                                args.temperature, not args.no_single,
                                                args.control, args.streams))
        finally:
            server.stop()
        print(json.dumps({name: results[name]["auto_vs_off"]}), file=sys.stderr, flush=True)
    headline = {f"{name}/{k}": v["median"] for name, r in results.items()
                for k, v in r["auto_vs_off"].items()}
    name = args.out or ("model_free" if args.temperature == 0
                        else f"model_free_t{args.temperature:g}")
    finish(name, {"machine": machine(), "rounds": count, "temperature": args.temperature,
                  "streams": args.streams, "systems": results, "headline_auto_vs_off": headline})


if __name__ == "__main__":
    main()
