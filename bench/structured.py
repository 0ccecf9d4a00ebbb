"""Structured outputs: what a JSON schema costs and what the grammar's forced
tokens win, on the daemon as `make serve` starts it.

    python bench/structured.py [--quick] [--rounds N]

The requests: JSON extraction (a short text, a schema of the fields to take
from it; EXTRACTIONS below), through the model's chat template, greedy, sent
as token ids over gRPC with `constraint={"json_schema": ...}`. Three parts:

- compile: each schema compiled with nothing cached (a first request with a
  new schema), in process, over SmolLM2's tokenizer; p50 and p99 over the
  set and its repeats; the tokenizer's own preparation, once per process,
  apart;
- single stream (the daemon): each request alone in four modes, constrained
  or not, spec AUTO or OFF, the order rotated by request and round; decode
  speed from the client's clock (tokens after the first over the time from
  the first chunk to the last) per mode over the set. Ratios per round:
  constrained AUTO over constrained OFF (the forced tokens and model-free
  proposals cut by the grammar, against none), over unconstrained AUTO and
  over unconstrained OFF. Every constrained output that ends (its grammar
  complete, not cut by max_tokens) must parse and match its schema, and
  greedy AUTO must equal greedy OFF;
- mask cost (in process, the q4 target, spec OFF): 32 constrained requests
  at once, greedy and then sampled (temperature 0.8, seeded); the seconds
  the steps spend on the grammar (taking tokens, forced tokens, admitted
  proposals, masks, and laying the masks on the logits: a greedy row only
  where its argmax is forbidden, a sampled row always) as a share of the
  steps' seconds.

Medians over the rounds with min-max spreads (bench/common.py).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DRAFT, Spread, finish, machine, parse_args, rounds  # noqa: E402
from bench.model_free import Outcome, daemon  # noqa: E402
from bench.serving import MODEL, Running  # noqa: E402
from specpage.client import Chunk, Client  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

STREAMS = 32
MAX_TOKENS = 160
MODES = ("constrained/auto", "constrained/off", "free/auto", "free/off")


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


STRING, INTEGER, NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
# (text, schema): what applications extract with a schema
EXTRACTIONS: list[tuple[str, dict[str, Any]]] = [
    ("Ada Lovelace, born in London in 1815, was a mathematician.",
     _object({"name": STRING, "birth_year": INTEGER, "city": STRING, "occupation": STRING})),
    ("Order 4471: two blue mugs at $8.50 each, shipped to Denver, Colorado.",
     _object({"order_id": INTEGER, "item": STRING, "quantity": INTEGER,
              "unit_price": NUMBER, "city": STRING, "state": STRING})),
    ("The meeting with Dr. Patel is on Tuesday, March 4 at 3 pm in room 204.",
     _object({"person": STRING, "day": STRING, "date": STRING, "time": STRING,
              "room": STRING})),
    ("I loved the camera but the battery died after two hours. 3 out of 5.",
     _object({"sentiment": {"enum": ["positive", "negative", "mixed"]},
              "rating": {"type": "integer", "minimum": 1, "maximum": 5},
              "pros": {"type": "array", "items": STRING},
              "cons": {"type": "array", "items": STRING}})),
    ("Flight BA 287 from London Heathrow to San Francisco departs at 11:40 and "
     "arrives at 14:55 local time.",
     _object({"flight": STRING, "origin": STRING, "destination": STRING,
              "departure": STRING, "arrival": STRING})),
    ("Acme Corp reported revenue of 12.4 billion dollars in 2023, up 8 percent; "
     "its CEO is Jane Ruiz.",
     _object({"company": STRING, "revenue_billion_usd": NUMBER, "year": INTEGER,
              "growth_percent": NUMBER, "ceo": STRING})),
    ("Contact: Tom Becker, tom.becker@example.com, +1 555 0142, Berlin office.",
     _object({"name": STRING, "email": STRING, "phone": STRING, "office": STRING})),
    ("The recipe needs 2 cups of flour, 1 egg and 200 ml of milk; bake for 25 minutes.",
     _object({"ingredients": {"type": "array", "items": _object(
         {"name": STRING, "amount": STRING})}, "bake_minutes": INTEGER})),
]


def rendered(cap: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_model(MODEL))
    out = []
    for text, schema in EXTRACTIONS:
        messages = [{"role": "user", "content": "Extract the fields of this text as JSON, "
                     f"with the keys {', '.join(schema['properties'])}:\n{text}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        out.append({"ids": ids, "schema": schema, "max_tokens": cap})
    return out


# ------------------------------------------------------------------ compile

def compile_times(repeats: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from specpage.core.grammar import Grammars, json_schema

    tokenizer = AutoTokenizer.from_pretrained(ensure_model(MODEL))
    grammars = Grammars(tokenizer, 49152, (2,))
    start = time.perf_counter()
    grammars._llg_tokenizer()
    prepare = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        for _, schema in EXTRACTIONS:
            grammars._compiled.clear()  # a first request with this schema
            start = time.perf_counter()
            grammars.compile(json_schema(schema, "bench"))
            times.append(time.perf_counter() - start)
    times.sort()
    return {"tokenizer_prepare_ms": prepare * 1e3,
            "p50_ms": statistics.median(times) * 1e3,
            "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3,
            "max_ms": times[-1] * 1e3, "compiles": len(times)}


# ------------------------------------------------------------------ single stream

class Extracted(Outcome):
    """A request's run with its text; drafted and accepted: the grammar's."""

    text = ""
    finish_reason = ""


async def run_one(client: Client, request: dict[str, Any], mode: str, salt: str) -> Extracted:
    constrained, spec = mode.split("/")
    options: dict[str, Any] = {}
    if constrained == "constrained":
        options["constraint"] = {"json_schema": request["schema"]}
    out = Extracted()
    text = []
    async for event in client.generate(request["ids"], spec=spec, cache_salt=salt,
                                       max_tokens=request["max_tokens"], temperature=0.0,
                                       **options):
        now = time.perf_counter()
        if isinstance(event, Chunk):
            out.first = out.first or now
            out.last = now
            out.tokens += event.token_ids
            text.append(event.text)
            out.finish_reason = event.finish_reason or out.finish_reason
        else:
            counts = event.usage.by_method.get("grammar", [0, 0])
            out.drafted, out.accepted = counts
    out.text = "".join(text)
    return out


def speed(outcomes: list[Outcome]) -> float:
    seconds = sum(o.decode_seconds for o in outcomes)
    return sum(max(len(o.tokens) - 1, 0) for o in outcomes) / max(seconds, 1e-9)


async def single_stream(port: int, requests: list[dict[str, Any]], count: int
                        ) -> dict[str, Any]:
    import jsonschema

    per_round: dict[str, list[float]] = {mode: [] for mode in MODES}
    same = valid = constrained_total = cut = forced_drafted = forced_accepted = 0
    async with Client(f"127.0.0.1:{port}") as client:
        for mode in MODES:  # warm-up: every step shape, untimed
            await run_one(client, {**requests[0], "max_tokens": 24}, mode, f"w-{mode}")
        for r in range(count):
            outcomes: dict[str, list[Extracted]] = {mode: [] for mode in MODES}
            for i in [*range(r, len(requests)), *range(r)]:
                shift = (i + r) % len(MODES)
                by_mode = {}
                for mode in MODES[shift:] + MODES[:shift]:
                    by_mode[mode] = await run_one(client, requests[i], mode, f"s{r}-{mode}")
                    outcomes[mode].append(by_mode[mode])
                auto, off = by_mode["constrained/auto"], by_mode["constrained/off"]
                same += auto.tokens == off.tokens
                forced_drafted += auto.drafted
                forced_accepted += auto.accepted
                for outcome in (auto, off):
                    if outcome.finish_reason != "stop":  # cut by max_tokens: JSON unfinished
                        cut += 1
                        continue
                    constrained_total += 1
                    try:
                        jsonschema.validate(json.loads(outcome.text), requests[i]["schema"])
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
            for mode in MODES:
                per_round[mode].append(speed(outcomes[mode]))
            print(f"round {r}: " + ", ".join(f"{m} {per_round[m][-1]:.1f} tok/s"
                                            for m in MODES), file=sys.stderr, flush=True)
    tok_s = {mode: Spread.of(v) for mode, v in per_round.items()}

    def ratio(a: str, b: str) -> Spread:
        return Spread.of([x / y for x, y in zip(per_round[a], per_round[b], strict=True)])

    return {
        "tok_s": {mode: s.as_json() for mode, s in tok_s.items()},
        "ratios": {
            "constrained_auto_vs_constrained_off": ratio("constrained/auto",
                                                         "constrained/off").as_json(),
            "constrained_auto_vs_free_auto": ratio("constrained/auto", "free/auto").as_json(),
            "constrained_auto_vs_free_off": ratio("constrained/auto", "free/off").as_json(),
            "constrained_off_vs_free_off": ratio("constrained/off", "free/off").as_json(),
        },
        "greedy_auto_equals_off": f"{same}/{len(requests) * count}",
        # constrained outputs that ended (the grammar complete): parse and match
        "valid_outputs": f"{valid}/{constrained_total}",
        "cut_by_max_tokens": cut,
        "grammar_drafted": forced_drafted, "grammar_accepted": forced_accepted,
    }


# ------------------------------------------------------------------ mask cost

def mask_cost(requests: list[dict[str, Any]], count: int) -> dict[str, Any]:
    """The grammar's share of the steps' seconds, 32 constrained streams."""
    import torch

    from specpage.core import grammar as grammar_module
    from specpage.core.grammar import json_schema
    from specpage.core.request import SamplingParams
    from specpage.engine import EngineConfig
    from specpage.llm import LLM
    from specpage.speculation import verifier

    spent = [0.0]

    def timed(fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return run

    sequence = grammar_module.SequenceGrammar
    for name in ("take", "forced", "admitted", "masks"):
        setattr(sequence, name, timed(getattr(sequence, name)))
    verifier._with_grammar = timed(verifier._with_grammar)
    torch.set_num_threads(2)
    llm = LLM(ensure_model(MODEL), config=EngineConfig(spec_k=0), quantization="auto")
    result: dict[str, Any] = {"streams": STREAMS}
    for name, temperature in (("greedy", 0.0), ("sampled", 0.8)):
        shares, steps_s = [], []
        for r in range(count):
            engine = llm.engine
            for i in range(STREAMS):
                request = requests[i % len(requests)]
                engine.add_request(f"{name}{r}-{i}", request["ids"], SamplingParams(
                    max_tokens=request["max_tokens"], temperature=temperature, seed=i),
                    constraint=json_schema(request["schema"], "bench"))
            spent[0] = 0.0
            total = 0.0
            steps = 0
            while engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                total += time.perf_counter() - start
                steps += 1
            shares.append(spent[0] / total)
            steps_s.append(total / steps)
            print(f"mask cost, {name}: {shares[-1]:.3%} of {steps} steps "
                  f"({total / steps * 1e3:.1f} ms each)", file=sys.stderr, flush=True)
        result[name] = {"share_of_step": Spread.of(shares).as_json(),
                        "step_ms": Spread.of([s * 1e3 for s in steps_s]).as_json()}
    return result


def main() -> None:
    args = parse_args(__doc__, extra=lambda p: p.add_argument("--rounds", type=int, default=3))
    count = rounds(args.quick, args.rounds)
    cap = 64 if args.quick else MAX_TOKENS
    requests = rendered(cap)
    if args.quick:
        requests = requests[:3]
    result: dict[str, Any] = {"machine": machine(), "rounds": count,
                              "requests": len(requests), "max_tokens": cap}
    result["compile"] = compile_times(2 if args.quick else 10)
    spec, port = daemon("specpage", ["--draft", str(DRAFT)], args.threads)
    server = Running(spec, Path(tempfile.gettempdir()) / "structured.log")
    try:
        result["single"] = asyncio.run(single_stream(port, requests, count))
    finally:
        server.stop()
    result["mask_cost"] = mask_cost(requests, 1 if args.quick else count)
    result["headline"] = {
        "compile_p50_ms": result["compile"]["p50_ms"],
        "compile_p99_ms": result["compile"]["p99_ms"],
        **{k: v["median"] for k, v in result["single"]["ratios"].items()},
        "mask_share_of_step_32_greedy": result["mask_cost"]["greedy"]["share_of_step"]["median"],
        "mask_share_of_step_32_sampled":
            result["mask_cost"]["sampled"]["share_of_step"]["median"],
    }
    finish("structured", result)


if __name__ == "__main__":
    main()
