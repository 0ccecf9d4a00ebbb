"""Quality and speed of weight-only int4 (specpage/models/quant*.py) on
SmolLM2-135M-Instruct, one run:

- quality over a held-out text (not a chat prompt): max and mean |logit
  difference| against the fp32 model (the GGUF's blocks dequantized, the
  exact path) and perplexity for fp32, q4 from the GGUF's own Q4_1 blocks
  (bf16 activations, the default, and fp32 activations with each product's
  input cast to bf16) and q4 re-quantized round-to-nearest from the fp32
  weights; greedy agreement with fp32 over chat prompts (prompts whose whole
  answer is the same, and tokens before the first difference); and how far
  torch's int4 kernel's weights are from the GGUF's: its scale and zero are
  bf16, so GGML's float16 d and m are rounded to 8 significant bits (the
  native kernel, where it runs, keeps them exact);
- speed: batch-1 decode step, q4 vs fp32 vs bf16 weights, and batch 32 q4 vs
  fp32, rotated rounds (bench/common.py); the q4 step's bandwidth floor from
  the bytes it reads (packed weights, scales and zeros, the embedding/LM head
  as stored) over the read bandwidth of a large copy, that rate measured in
  the same rotated rounds as the steps and the ratio taken round by round
  (the machine's memory rate moves within minutes); and the vocabulary
  projection alone, dense fp32 / bf16 against int8 (torch's
  _weight_int8pack_mm) and Q8Head (the head's own Q8_0 blocks on the int4
  kernel), the measurement behind a q4 GGUF model's head: Q8Head up to 8
  rows, dense bf16 past them.

    python bench/quantization.py [--quick]
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    Spread,
    finish,
    machine,
    median_seconds,
    memory_rates,
    over_floor,
    parse_args,
    rotated,
    rounds,
)
from bench.prompts import chat_prompts  # noqa: E402
from specpage.core.request import SamplingParams  # noqa: E402
from specpage.core.span import Span  # noqa: E402
from specpage.engine import EngineConfig  # noqa: E402
from specpage.executor.model_runner import ModelRunner  # noqa: E402
from specpage.layers import quant  # noqa: E402
from specpage.layers.products import PackedWeight, cpu_linear  # noqa: E402
from specpage.layers.quant import (  # noqa: E402
    Q8_GROUP,
    Int4Linear,
    Q8Head,
)
from specpage.llm import LLM  # noqa: E402
from specpage.models.loader import LoadedModel  # noqa: E402

BLOCK_SIZE = 16
CONTEXT = 128  # tokens already in the KV cache of each decode step
CALLS = 3  # calls per round; a round's figure is their median
# Held out: written for this benchmark, in no prompt list and no draft's data.
HELD_OUT = (
    "The lighthouse keeper climbed the spiral stairs every evening before sunset. "
    "He polished the great lens, trimmed the wick and wrote the weather in a leather "
    "book: wind from the north-west, a long swell, two fishing boats returning late. "
    "In winter the storms came in from the open sea and the whole tower shook, but the "
    "light never went out. Ships passing at night saw it flash three times every twenty "
    "seconds, and the captains knew exactly where they were. When the keeper retired, "
    "the light was automated, and a small electric lamp now turns where the old flame "
    "burned. Visitors climb the same stairs in summer and read his notes behind glass. "
    "Most of them are surprised by how ordinary the entries are: bread delivered, a "
    "window repaired, a seal asleep on the rocks below, the first swallows of spring."
)


def load(quantization: str, dtype: str | None = None, spec_k: int = 0,
         int8x: bool = True) -> LLM:
    """SmolLM2-135M-Instruct; int8x False: its int4 products on bf16 x
    (quant.INT8X_PRODUCTS), where by default they take x to int8."""
    config = EngineConfig(spec_k=spec_k, adaptive_k=False, num_blocks=1024)
    kept, quant.INT8X_PRODUCTS = quant.INT8X_PRODUCTS, int8x
    try:
        return LLM("smollm2-135m", None, config, dtype=dtype, quantization=quantization)
    finally:
        quant.INT8X_PRODUCTS = kept


SPAN = 8  # tokens per forward over the held-out text: a verify step's few rows


def logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """fp32 logits [len(tokens), vocab] over the text in forwards of SPAN
    tokens, so that the products run as a decode or verify step runs them
    (a long prefill may take other kernels: quant.DENSE_FROM_ROWS)."""
    runner = ModelRunner(loaded, -(-len(tokens) // BLOCK_SIZE), BLOCK_SIZE)
    table = list(range(-(-len(tokens) // BLOCK_SIZE)))
    parts = [runner.forward([Span(tokens[at : at + SPAN], at, table,
                                     len(tokens[at : at + SPAN]))])
             for at in range(0, len(tokens), SPAN)]
    return torch.cat(parts).float()


def quality(systems: dict[str, LLM], prompts: int, max_tokens: int) -> dict[str, Any]:
    reference = systems["fp32"]
    tokens = reference.tokenizer(HELD_OUT)["input_ids"]
    ref_logits = logits(reference.target, tokens)
    out: dict[str, Any] = {"held_out_tokens": len(tokens), "chat_prompts": prompts,
                           "max_tokens": max_tokens}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    texts = chat_prompts(prompts)
    answers = {name: [c.token_ids for c in llm.generate(texts, params, chat=True)]
               for name, llm in systems.items()}
    for name, llm in systems.items():
        values = logits(llm.target, tokens)
        nll = torch.nn.functional.cross_entropy(values[:-1], torch.tensor(tokens[1:]))
        diff = (values - ref_logits).abs()
        out[name] = {
            "perplexity": math.exp(float(nll)),
            "max_logit_diff": float(diff.max()), "mean_logit_diff": float(diff.mean()),
            **agreement(answers[name], answers["fp32"]),
            "quantization": llm.target.quantization,
        }
    fp32 = out["fp32"]["perplexity"]
    for name in systems:
        out[name]["perplexity_vs_fp32"] = out[name]["perplexity"] / fp32 - 1
    # The q4 model's greedy answers with its vocabulary projection dense bf16
    # (Q8Head set aside; the held-out text's many rows take the dense head
    # either way, so only the answers can differ).
    q4 = systems["q4_gguf"]
    model = q4.target.model
    if model.q8_head is not None:
        kept, model.q8_head = model.q8_head, None
        try:
            dense = [c.token_ids for c in q4.generate(texts, params, chat=True)]
        finally:
            model.q8_head = kept
        out["q4_gguf_dense_head"] = {**agreement(dense, answers["fp32"]),
                                     "answers_as_q4": agreement(dense, answers["q4_gguf"])}
    return out


def agreement(answers: list[list[int]], reference: list[list[int]]) -> dict[str, int]:
    """Greedy answers against a reference's: how many are the same, and the
    tokens before each one's first difference, summed."""
    same_prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b),
                        min(len(x), len(y)))
                   for x, y in zip(answers, reference, strict=True)]
    return {"greedy_same_answers": sum(a == b for a, b in zip(answers, reference, strict=True)),
            "greedy_tokens_before_first_difference": sum(same_prefix),
            "greedy_tokens": sum(len(a) for a in reference)}


def decode_step(llm: LLM, batch: int) -> Callable[[None], float]:
    """A system for rotated(): the median seconds of CALLS decode steps of
    `batch` sequences with CONTEXT tokens each."""
    blocks = -(-(CONTEXT + 1) // BLOCK_SIZE)
    runner = ModelRunner(llm.target, blocks * batch, BLOCK_SIZE)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    prompts = [[(7 * i + j) % 40000 + 100 for j in range(CONTEXT)] for i in range(batch)]
    runner.forward([Span(p, 0, t, 1) for p, t in zip(prompts, tables, strict=True)])
    spans = [Span([5], CONTEXT, t, 1) for t in tables]
    return lambda _: median_seconds(lambda: runner.forward(spans), repeats=CALLS, warmup=0)


def without_q8_head(step: Callable[[None], float], llm: LLM) -> Callable[[None], float]:
    """A step of this model with its Q8Head set aside: the dense bf16 head."""
    model = llm.target.model

    def run(arg: None) -> float:
        kept, model.q8_head = model.q8_head, None
        try:
            return step(arg)
        finally:
            model.q8_head = kept

    return run


def step_bytes(loaded: LoadedModel) -> int:
    """Bytes a batch-1 decode step reads: every linear as stored (packed
    int4 with its scales, or dense), the norms, and the vocabulary projection
    (Q8Head's tiles where the model has one, else the tied embedding, as
    stored; the lookup reads one row, not counted)."""
    total = 0
    q8_head = loaded.model.q8_head
    for module in loaded.model.modules():
        if isinstance(module, Int4Linear):
            total += module.nbytes
        elif isinstance(module, Q8Head):
            total += module.tiles.nbytes
        elif isinstance(module, torch.nn.Embedding) and q8_head is not None:
            continue
        elif isinstance(module, torch.nn.Linear | torch.nn.Embedding) or hasattr(module, "eps"):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


def head_alone(quick: bool) -> dict[str, Any]:
    """The vocabulary projection on 1, 8 and 32 rows: dense fp32 (x @ W.T
    held transposed, the decoder's one-row path), dense bf16 both ways and
    on the decoder's own product (cpu_linear: the native kernels where the
    CPU has AVX-512 BF16), int8 per row (torch's only CPU int8 weight-only
    kernel), and Q8Head on the weight's Q8_0 blocks (a q4 GGUF model's head
    up to Q8_HEAD_MAX_ROWS rows) with x to int8 where the CPU can, and on
    the bf16 int4 kernel."""
    vocab, hidden = 49152, 576
    groups = (torch.randn(vocab, hidden) * 0.05).view(vocab, hidden // Q8_GROUP, Q8_GROUP)
    d = (groups.abs().amax(-1, keepdim=True) / 127).half().float()  # GGML stores d in fp16
    q = (groups / d).round()
    weight = (d * q).view(vocab, hidden)  # Q8_0 blocks, as a GGUF's head
    q8_heads = {}
    if Q8Head.usable(vocab, hidden):
        for name, int8x in (("q8_head", True), ("q8_head_bf16_products", False)):
            q8_heads[name] = Q8Head(q.to(torch.int8).view(vocab, hidden), d[..., 0], int8x)
    packed = PackedWeight()
    transposed = weight.T.contiguous()
    bf16, bf16_t = weight.bfloat16(), transposed.bfloat16()
    scales = weight.abs().amax(1) / 127
    int8 = (weight / scales[:, None]).round().to(torch.int8)
    scales_bf16 = scales.bfloat16()
    out: dict[str, Any] = {}
    for rows in (1, 8, 32):
        x = torch.randn(rows, hidden)
        xb = x.bfloat16()
        systems: dict[str, Callable[[None], float]] = {
            "fp32_xWt": lambda _, x=x: median_seconds(lambda: x @ transposed, CALLS, 0),
            "fp32_Wx": lambda _, x=x: median_seconds(lambda: weight @ x.T, CALLS, 0),
            "bf16_xWt": lambda _, xb=xb: median_seconds(lambda: xb @ bf16_t, CALLS, 0),
            "bf16_Wx": lambda _, xb=xb: median_seconds(lambda: bf16 @ xb.T, CALLS, 0),
            "int8": lambda _, xb=xb: median_seconds(
                lambda: torch.ops.aten._weight_int8pack_mm(xb, int8, scales_bf16), CALLS, 0),
            "bf16_decoder": lambda _, xb=xb: median_seconds(
                lambda: cpu_linear(xb, bf16, None, packed), CALLS, 0),
        }
        for name, head in q8_heads.items():
            systems[name] = lambda _, xb=xb, head=head: median_seconds(lambda: head(xb), CALLS, 0)
        spreads = rotated(systems, None, None, rounds(quick))
        out[f"rows_{rows}_ms"] = {k: v.median * 1e3 for k, v in spreads.items()}
    return out


# SmolLM2-135M's four projections per layer: (out_features, in_features)
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS_TIMED = 30  # each with weights of its own, so they stream from memory as in a step


def linears_alone(quick: bool) -> dict[str, Any]:
    """All 30 layers' projections (weights of their own, as in a decode
    step) on 1 to 128 rows: fp32 dense (the decoder's few-rows path), q8
    (torch's _weight_int8pack_mm, per-row int8, bf16 input), q4 (the int4
    kernel, group 32: x to int8 where the CPU can), q4 on bf16 x and, where
    that keeps one, its dense bf16 copy on oneDNN: the measurements behind
    refusing q8, behind quant.DENSE_FROM_ROWS and behind int8x layers
    keeping no dense copy."""
    from specpage.models.quant_load import quantize_rtn

    layers = []
    for _ in range(LAYERS_TIMED):
        layer = []
        for rows, cols in LAYER_SHAPES:
            weight = torch.randn(rows, cols) * 0.05
            scales = weight.abs().amax(1) / 127
            blocks = quantize_rtn(weight, 32)
            layer.append((weight, (weight / scales[:, None]).round().to(torch.int8),
                          scales.bfloat16(), Int4Linear(blocks),
                          Int4Linear(blocks, int8x=False)))
        layers.append(layer)
    out: dict[str, Any] = {}
    for rows in (1, 4, 8, 32) if quick else (1, 2, 4, 6, 8, 12, 16, 32, 64, 128):
        inputs = {cols: torch.randn(rows, cols) for _, cols in LAYER_SHAPES}
        spreads = rotated(_linear_systems(layers, inputs), None, None, rounds(quick))
        out[f"rows_{rows}_ms"] = {k: v.median * 1e3 for k, v in spreads.items()}
    return out


def _linear_systems(layers: list[list[tuple[Any, ...]]], inputs: dict[int, torch.Tensor]
                    ) -> dict[str, Callable[[None], float]]:
    from specpage.layers.products import few_rows_linear

    def fp32() -> None:
        for layer in layers:
            for w, *_ in layer:
                few_rows_linear(inputs[w.shape[1]], w)

    def q8() -> None:
        for layer in layers:
            for w, w8, s8, *_ in layer:
                torch.ops.aten._weight_int8pack_mm(inputs[w.shape[1]].bfloat16(), w8, s8)

    def q4() -> None:
        for layer in layers:
            for w, _, _, module, _ in layer:
                module.int4_product(inputs[w.shape[1]].bfloat16())

    def q4_bf16_products() -> None:
        for layer in layers:
            for w, *_, module in layer:
                module.int4_product(inputs[w.shape[1]].bfloat16())

    def q4_dense_copy() -> None:
        for layer in layers:
            for w, *_, module in layer:
                module.dense_product(inputs[w.shape[1]].bfloat16())

    ways = [("fp32", fp32), ("q8", q8), ("q4", q4), ("q4_bf16_products", q4_bf16_products)]
    if layers[0][0][-1].dense is not None:  # the bf16 products' layers keep one here
        ways.append(("q4_dense_copy", q4_dense_copy))
    return {name: (lambda _, fn=fn: median_seconds(fn, CALLS, 0)) for name, fn in ways}


def main() -> None:
    args = parse_args(__doc__)
    prompts, max_tokens = (2, 16) if args.quick else (32, 128)
    systems = {"fp32": load("none"), "q4_gguf": load("q4"),
               "q4_gguf_bf16_products": load("q4", int8x=False),
               "q4_gguf_fp32_activations": load("q4", "fp32"), "q4_rtn": None}
    # Round-to-nearest from the fp32 weights: a float checkpoint, quantized at load.
    rtn_folder = systems["fp32"].target.folder
    systems["q4_rtn"] = LLM(_float_copy(rtn_folder), None,
                            EngineConfig(spec_k=0, adaptive_k=False, num_blocks=1024),
                            quantization="q4")
    quality_figures = quality({k: v for k, v in systems.items() if v is not None},
                              prompts, max_tokens)
    quality_figures["kernel_weights_vs_gguf"] = scale_rounding(systems["fp32"].target)
    speed: dict[str, Any] = {}
    bf16 = None if args.quick else load("none", "bf16")  # a seventh model: full runs only
    for batch in (1, 32):
        runners = {"fp32": decode_step(systems["fp32"], batch),
                   "q4": decode_step(systems["q4_gguf"], batch),
                   "q4_bf16_products": decode_step(systems["q4_gguf_bf16_products"], batch),
                   "q4_fp32_activations": decode_step(systems["q4_gguf_fp32_activations"],
                                                      batch)}
        if batch == 1 and bf16 is not None:
            runners["bf16"] = decode_step(bf16, batch)
        if batch == 1:  # the same q4 model with its vocabulary projection dense bf16
            runners["q4_dense_head"] = without_q8_head(decode_step(systems["q4_gguf"], batch),
                                                       systems["q4_gguf"])
        if batch == 1:  # the floors' memory rates, in the same rounds as the steps
            runners |= memory_rates()
        spreads = rotated(runners, None, None, rounds(args.quick, full=5))
        if batch == 1:
            rates = {name: spreads.pop(name) for name in memory_rates()}
            steps = spreads
        speed[f"batch_{batch}_ms"] = {k: v.as_json() | {"median_ms": v.median * 1e3}
                                      for k, v in spreads.items()}
    floors = {}
    for name, step in (("fp32", "fp32"), ("q4_gguf", "q4"),
                       ("q4_gguf_bf16_products", "q4_bf16_products"),
                       ("q4_gguf_fp32_activations", "q4_fp32_activations")):
        nbytes = step_bytes(systems[name].target)  # type: ignore[union-attr]
        floor = over_floor(steps[step], nbytes, rates["copy_traffic_gb_s"])
        read = over_floor(steps[step], nbytes, rates["read_alone_gb_s"])
        floors[name] = {"bytes": nbytes, "floor_ms": floor["floor_ms"],
                        "over_floor": floor["ratio"], "read_alone_ms": read["floor_ms"],
                        "over_read_alone": read["ratio"]}
    speed["floor"] = floors
    speed["q4_dense_head_vs_q4"] = Spread.of(
        [a / b for a, b in zip(steps["q4_dense_head"].runs, steps["q4"].runs, strict=True)]
    ).as_json()
    speed["q4_bf16_products_vs_q4"] = Spread.of(
        [a / b for a, b in zip(steps["q4_bf16_products"].runs, steps["q4"].runs, strict=True)]
    ).as_json()
    speed["q4_vs_floor"] = floors["q4_gguf"]["over_floor"]["median"]
    speed["q4_vs_read_alone"] = floors["q4_gguf"]["over_read_alone"]["median"]
    speed["q4_fp32_activations_vs_floor"] = (
        floors["q4_gguf_fp32_activations"]["over_floor"]["median"])
    speed["head_alone"] = head_alone(args.quick)
    speed["linears_alone"] = linears_alone(args.quick)
    finish("quantization", {"machine": machine(), "quality": quality_figures, "speed": speed,
                            "read_bandwidth_gb_s": rates["copy_traffic_gb_s"].median,
                            "read_alone_bandwidth_gb_s": rates["read_alone_gb_s"].median})


def scale_rounding(fp32: LoadedModel) -> dict[str, float]:
    """The kernel's weights, (q − 8)·bf16(d) + bf16(m + 8d), against the
    GGUF's d·q + m (which the fp32 path loads bit for bit): max and mean
    |difference|, and the max relative to each weight's group's largest."""
    from specpage.layers.quant import KERNEL_DTYPE, Q_OFFSET
    from specpage.models.gguf_blocks import GGUFWeights
    from specpage.models.quant_load import PROJECTIONS, gguf_source

    gguf = gguf_source(fp32.folder, fp32.folder)
    assert gguf is not None
    weights = GGUFWeights(gguf, fp32.config)
    worst, total, count, worst_relative = 0.0, 0.0, 0, 0.0
    for i in range(fp32.config.num_layers):
        for name in PROJECTIONS:
            b = weights.blocks(i, name)
            exact = b.dequantize()
            rows, cols = b.q.shape
            scale = b.scale.to(KERNEL_DTYPE).float()
            zero = (b.offset + Q_OFFSET * b.scale).to(KERNEL_DTYPE).float()
            q = b.q.view(rows, -1, b.group).float() - Q_OFFSET
            kernel = (q * scale[..., None] + zero[..., None]).view(rows, cols)
            diff = (kernel - exact).abs()
            size = exact.abs().view(rows, -1, b.group).amax(-1, keepdim=True)
            relative = diff.view(rows, -1, b.group) / size.clamp(min=1e-12)
            worst, worst_relative = max(worst, float(diff.max())), max(worst_relative,
                                                                       float(relative.max()))
            total, count = total + float(diff.sum()), count + diff.numel()
    return {"max_abs": worst, "mean_abs": total / count, "max_relative_to_group": worst_relative}


def _float_copy(folder: Path) -> Path:
    """The converted fp32 folder under another name: a float checkpoint with
    no GGUF behind it, so q4 quantizes it round-to-nearest (once: cached)."""
    import shutil
    import tempfile

    copy = Path(tempfile.gettempdir()) / "specpage-bench-fp32-smollm2"
    if not copy.exists():
        shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("specpage-source.json"))
    return copy


if __name__ == "__main__":
    main()
