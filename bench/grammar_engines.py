"""Grammar engines for structured outputs, measured here before one is chosen:
xgrammar, llguidance and outlines-core, on SmolLM2-135M's tokenizer (49,152
tokens), over a set of JSON schemas of the kinds applications send.

    pip install --no-deps xgrammar apache-tvm-ffi llguidance outlines-core
    python bench/grammar_engines.py [--quick]

(xgrammar's own requirements add triton, which its CPU path does not use.)

For each engine and schema:
- compile: from the schema's text to what a request's matcher is made from,
  with nothing cached (a first request with a new schema); the tokenizer's
  own preparation, once per process, is reported apart;
- mask: the time to compute the next token's mask, walking a valid instance
  of the schema token by token (each step: the mask, then the token
  accepted), per token; one stream, and 32 streams' masks of one step
  computed one after another (what a step with constraints on every request
  pays on one core);
- apply: the masks of 32 rows laid on 32 x 49,152 fp32 logits.
Each engine's matcher must accept every token of the instance, and at every
step its mask must allow the token taken next (checked as it walks).

Rounds rotate the engines' order; medians with min-max spreads
(bench/common.py).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Spread, finish, machine, parse_args, rounds  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

STREAMS = 32

# (name, schema, a valid instance)
SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    ("person", {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"]},
     {"name": "Ada Lovelace", "age": 36}),
    ("address_nested", {"type": "object", "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"]}},
        "required": ["name", "address"]},
     {"name": "Grace", "address": {"street": "1 Main St", "city": "Arlington",
                                   "zip": "22201"}}),
    ("enum_array", {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"},
            "status": {"enum": ["in_stock", "backorder", "discontinued"]},
            "qty": {"type": "integer", "minimum": 0, "maximum": 1000}},
            "required": ["sku", "status", "qty"]}, "minItems": 1}},
        "required": ["items"]},
     {"items": [{"sku": "A-100", "status": "in_stock", "qty": 12},
                {"sku": "B-7", "status": "backorder", "qty": 0}]}),
    ("optional_keys", {"type": "object", "properties": {
        "title": {"type": "string"}, "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "rating": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["title"]},
     {"title": "Dune", "tags": ["sci-fi", "classic"], "rating": 8.5}),
    ("tool_call", {"type": "object", "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["location", "unit"], "additionalProperties": False},
     {"location": "Paris, France", "unit": "celsius", "days": 3}),
    ("extraction", {"type": "object", "properties": {
        "invoice_number": {"type": "string"},
        "date": {"type": "string", "format": "date"},
        "vendor": {"type": "string"},
        "total": {"type": "number"},
        "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
        "lines": {"type": "array", "items": {"type": "object", "properties": {
            "description": {"type": "string"}, "amount": {"type": "number"}},
            "required": ["description", "amount"]}}},
        "required": ["invoice_number", "date", "vendor", "total", "currency", "lines"]},
     {"invoice_number": "INV-2041", "date": "2026-11-30", "vendor": "Acme Ltd",
      "total": 1250.5, "currency": "EUR",
      "lines": [{"description": "Consulting", "amount": 1000},
                {"description": "Travel", "amount": 250.5}]}),
]


def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_model("smollm2-135m"))


def instance_tokens(tokenizer: Any, instance: Any) -> list[int]:
    ids: list[int] = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
    return ids


class Engine:
    """One grammar engine: prepare (once), compile(schema) -> compiled,
    matcher(compiled) -> m, fill(m, bitmask, row), accept(m, token) -> bool,
    allowed(bitmask, row, token) -> bool, apply(logits, bitmask)."""

    name = ""

    def allocate(self, rows: int) -> torch.Tensor:
        raise NotImplementedError

    def allowed(self, bitmask: torch.Tensor, row: int, token: int) -> bool:
        word = int(bitmask[row, token // 32])
        return bool((word >> (token % 32)) & 1)


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.prepare_s = time.perf_counter() - start
        self.vocab = self.info.vocab_size

    def compile(self, schema: str) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(schema)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.llt = llguidance, llguidance.torch
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.prepare_s = time.perf_counter() - start
        self.vocab = self.tokenizer.vocab_size

    def compile(self, schema: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # compiles here
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def allocate(self, rows: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llt.apply_token_bitmask_inplace(logits, bitmask)


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE: the printable character standing for each byte."""
    kept = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(kept, chars, strict=True)}


class OutlinesCore(Engine):
    name = "outlines_core"

    def __init__(self, tokenizer: Any) -> None:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        self.Guide, self.Index, self.regex = Guide, Index, build_regex_from_schema
        start = time.perf_counter()
        decoder = byte_decoder()
        special = set(tokenizer.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for text, i in tokenizer.get_vocab().items():
            if i not in special:
                tokens.setdefault(bytes(decoder[c] for c in text), []).append(i)
        self.vocabulary = Vocabulary(tokenizer.eos_token_id, tokens)
        self.prepare_s = time.perf_counter() - start
        self.vocab = len(tokenizer)

    def compile(self, schema: str) -> Any:
        return self.Index(self.regex(schema), self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.Guide(compiled)

    def allocate(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, (self.vocab + 31) // 32, dtype=torch.int32)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        matcher.write_mask_into(target.data_ptr(), target.numel(), target.element_size())

    def accept(self, matcher: Any, token: int) -> bool:
        matcher.advance(token)
        return True

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
        logits.masked_fill_(~allowed, float("-inf"))


def walk(engine: Engine, compiled: Any, tokens: list[int]) -> list[float]:
    """Seconds per mask along a valid instance; checks each token is allowed."""
    matcher = engine.matcher(compiled)
    bitmask = engine.allocate(1)
    times = []
    for token in tokens:
        start = time.perf_counter()
        engine.fill(matcher, bitmask, 0)
        times.append(time.perf_counter() - start)
        if not engine.allowed(bitmask, 0, token):
            raise AssertionError(f"{engine.name}: token {token} masked out")
        if not engine.accept(matcher, token):
            raise AssertionError(f"{engine.name}: token {token} refused")
    return times


def step_of_32(engine: Engine, compiled: list[Any], tokens: list[list[int]]) -> float:
    """Seconds per step for 32 streams, one schema each (cycling), their masks
    computed one after another, over the shortest instance's length."""
    picks = [i % len(compiled) for i in range(STREAMS)]
    matchers = [engine.matcher(compiled[p]) for p in picks]
    bitmask = engine.allocate(STREAMS)
    steps = min(len(t) for t in tokens)
    start = time.perf_counter()
    for s in range(steps):
        for row, (m, p) in enumerate(zip(matchers, picks, strict=True)):
            engine.fill(m, bitmask, row)
            engine.accept(m, tokens[p][s])
    return (time.perf_counter() - start) / steps


def main() -> None:
    args = parse_args(__doc__)
    torch.set_num_threads(args.threads)
    tokenizer = hf_tokenizer()
    engines: list[Engine] = []
    skipped: dict[str, str] = {}
    for kind in (XGrammar, LLGuidance, OutlinesCore):
        try:
            engines.append(kind(tokenizer))
        except ImportError as error:
            skipped[kind.name] = str(error)
    schemas = SCHEMAS[:3] if args.quick else SCHEMAS
    texts = [json.dumps(schema) for _, schema, _ in schemas]
    tokens = [instance_tokens(tokenizer, instance) for _, _, instance in schemas]
    compile_s: dict[str, dict[str, list[float]]] = {e.name: {} for e in engines}
    mask_s: dict[str, list[float]] = {e.name: [] for e in engines}
    step_s: dict[str, list[float]] = {e.name: [] for e in engines}
    apply_s: dict[str, list[float]] = {e.name: [] for e in engines}
    logits = torch.randn(STREAMS, len(tokenizer))
    count = rounds(args.quick)
    for r in range(count):
        order = engines[r % len(engines):] + engines[: r % len(engines)]
        for engine in order:
            compiled = []
            for (name, _, _), text in zip(schemas, texts, strict=True):
                start = time.perf_counter()
                compiled.append(engine.compile(text))
                compile_s[engine.name].setdefault(name, []).append(time.perf_counter() - start)
            for c, t in zip(compiled, tokens, strict=True):
                mask_s[engine.name].extend(walk(engine, c, t))
            step_s[engine.name].append(step_of_32(engine, compiled, tokens))
            bitmask = engine.allocate(STREAMS)
            for row in range(STREAMS):
                engine.fill(engine.matcher(compiled[row % len(compiled)]), bitmask, row)
            times = []
            for _ in range(5):
                masked = logits.clone()
                start = time.perf_counter()
                engine.apply(masked, bitmask)
                times.append(time.perf_counter() - start)
            apply_s[engine.name].append(statistics.median(times))
        print(f"round {r} done", file=sys.stderr, flush=True)

    def ms(values: list[float]) -> dict[str, Any]:
        return Spread.of([v * 1e3 for v in values]).as_json()

    per_engine: dict[str, Any] = {}
    for e in engines:
        all_compiles = [v for runs in compile_s[e.name].values() for v in runs]
        masks = sorted(mask_s[e.name])
        per_engine[e.name] = {
            "tokenizer_prepare_ms": e.prepare_s * 1e3,
            "compile_ms_by_schema": {k: ms(v) for k, v in compile_s[e.name].items()},
            "compile_ms_p50": statistics.median(all_compiles) * 1e3,
            "compile_ms_max": max(all_compiles) * 1e3,
            "mask_us_p50": masks[len(masks) // 2] * 1e6,
            "mask_us_p99": masks[min(len(masks) - 1, int(len(masks) * 0.99))] * 1e6,
            "step_of_32_ms": ms(step_s[e.name]),
            "apply_32_rows_ms": ms(apply_s[e.name]),
        }
        print(f"{e.name}: compile p50 {per_engine[e.name]['compile_ms_p50']:.1f} ms "
              f"(max {per_engine[e.name]['compile_ms_max']:.1f}), mask p50 "
              f"{per_engine[e.name]['mask_us_p50']:.0f} us, p99 "
              f"{per_engine[e.name]['mask_us_p99']:.0f} us, 32 streams "
              f"{statistics.median(step_s[e.name]) * 1e3:.2f} ms a step, apply "
              f"{statistics.median(apply_s[e.name]) * 1e3:.2f} ms", file=sys.stderr)
    finish("grammar_engines", {
        "tokenizer": "SmolLM2-135M-Instruct", "vocab": len(tokenizer),
        "schemas": [name for name, _, _ in schemas], "rounds": count,
        "instance_tokens": {name: len(t) for (name, _, _), t in zip(schemas, tokens, strict=True)},
        "engines": per_engine, "skipped": skipped, "machine": machine(),
        "headline": {e.name: {"compile_ms_p50": per_engine[e.name]["compile_ms_p50"],
                              "mask_us_p50": per_engine[e.name]["mask_us_p50"],
                              "step_of_32_ms": statistics.median(step_s[e.name]) * 1e3}
                     for e in engines},
        "quick": args.quick})


if __name__ == "__main__":
    main()
