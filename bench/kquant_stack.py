"""K-quant models' decode and verify forwards through the native layer
stack (layers/native_stack.py: the layers in one native call) against the
module path, on the same runner and cache.

    python bench/kquant_stack.py [--quick] [--sizes 0.5b,1b]

The models are bench/scaling.py's random Llama-shaped Q4_K_M GGUF files
(bench/random_gguf.py; speed does not depend on the weights' values),
loaded as `specpage serve` loads them (`--quantization auto`: the file's
K-quant blocks, bf16 activations). After a 200-token prompt, a forward of 1
position (a decode step) and of 5 (a verify step of 4 proposals) is timed
both ways: the mean of 5 forwards a round, rounds rotated (bench/common.py),
medians with min-max spreads. The logits of the two ways are compared (the
native call makes the modules' kernel calls, so they must be equal).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import compare, finish, machine, parse_args, rotated, rounds  # noqa: E402
from bench.random_gguf import SHAPES, ensure_file  # noqa: E402
from specpage.core.span import Span  # noqa: E402
from specpage.executor.model_runner import ModelRunner  # noqa: E402
from specpage.layers import native_stack  # noqa: E402
from specpage.models.loader import load_model  # noqa: E402

PROMPT = 200
TABLE = list(range(16))  # blocks of 16: the prompt and what follows
FORWARDS = 5  # timed per round


def our_options(parser: Any) -> None:
    parser.add_argument("--sizes", default=None,
                        help=f"random models, comma-separated ({', '.join(SHAPES)}; "
                             "default 0.5b,1b, or 0.5b with --quick)")


def timed(runner: ModelRunner, spans: list[Span], enabled: bool) -> float:
    native_stack.ENABLED = enabled
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(FORWARDS):
            runner.forward(spans)
        return (time.perf_counter() - start) / FORWARDS * 1e3


def one_model(name: str, count: int) -> dict[str, Any]:
    loaded = load_model(ensure_file(name, SHAPES[name]), quantization="auto")
    runner = ModelRunner(loaded, 32, 16)
    with torch.inference_mode():
        runner.forward([Span(list(range(5, 5 + PROMPT)), 0, TABLE, 1)])
    row: dict[str, Any] = {"quantization": loaded.quantization}
    for label, tokens in (("decode", [7]), ("verify 5", [9, 8, 7, 6, 5])):
        spans = [Span(tokens, PROMPT, TABLE, len(tokens))]
        assert loaded.model.stack_plan(len(tokens)) is not None, "the native call declines"
        outputs = []
        for enabled in (True, False):
            native_stack.ENABLED = enabled
            with torch.inference_mode():
                outputs.append(runner.forward(spans))
        spread = rotated({"native stack": lambda job: timed(runner, job, True),
                          "modules": lambda job: timed(runner, job, False)}, spans, spans, count)
        row[label] = {"native_stack_ms": spread["native stack"].as_json(),
                      "modules_ms": spread["modules"].as_json(),
                      "native_over_modules": compare(spread["native stack"], spread["modules"],
                                                     higher_is_better=False),
                      "logits_equal": bool(torch.equal(outputs[0], outputs[1]))}
    native_stack.ENABLED = True
    return row


def main() -> None:
    args = parse_args(__doc__, extra=our_options)
    default = "0.5b" if args.quick else "0.5b,1b"
    sizes = [s for s in (args.sizes if args.sizes is not None else default).split(",") if s]
    count = rounds(args.quick)
    models = {name: one_model(name, count) for name in sizes}
    headline = {f"{name}/{label}": models[name][label]["native_over_modules"]["ratio"]
                for name in models for label in ("decode", "verify 5")}
    finish("kquant_stack", {"bench": "kquant_stack", "models": models, "rounds": count,
                            "machine": machine(), "headline": headline})


if __name__ == "__main__":
    main()
