"""torch.compile against the runner's eager path on the work of a decoder
step that is not attention: for each of SmolLM2-135M's 30 layers the norms
and residual adds, the q/k/v, o, gate/up and down products, the rotary
embedding and SiLU-and-mul, at the row counts of a one-stream and a
32-stream decode step, in the dtype this CPU runs fastest.

Ways, one run, rotated rounds (bench/common.py):
- eager_fused: what the model runner runs: oneDNN products on weights
  reordered once (models/decoder.cpu_linear) and the native fused kernels
  (layers/fused.py);
- eager_torch: the same products with torch's own ops for the rest (the
  fused kernels' references);
- inductor: torch.compile (inductor, default mode, shapes static per row
  count) of eager_torch's function with F.linear products;
- inductor_frozen: the same with inductor's freezing, which folds the
  weights in as constants and prepacks the products for oneDNN.

Compile time is reported beside each compiled way (first call, including
dynamo's tracing; inductor's on-disk cache may shorten a rerun), and each
way's output is compared with eager_torch's (max absolute difference over
the output's largest value; the stack has no attention to tame its growth,
so bf16 rounding differences compound over the 30 layers).

    python bench/compile.py [--quick]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import compare, finish, machine, median_seconds, parse_args, rotated, rounds  # noqa: E402
from bench.vllm_cpu import cpu_has_bf16  # noqa: E402
from specpage.layers import fused  # noqa: E402
from specpage.layers.products import cpu_linear  # noqa: E402
from specpage.layers.rope import apply_rope, cos_sin  # noqa: E402
from specpage.models.decoder import DecoderModel  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402
from specpage.models.loader import load_model  # noqa: E402

CALLS = 5  # calls per round; a round's figure is their median


class Stack(nn.Module):
    """The model's layers without attention: attention's output is taken to
    be q itself (same shape), so every other op of the step runs."""

    def __init__(self, model: DecoderModel, use_fused: bool, onednn: bool) -> None:
        super().__init__()
        self.model, self.use_fused, self.onednn = model, use_fused, onednn
        c = model.config
        self.heads, self.kv_heads, self.eps = c.num_heads, c.num_kv_heads, c.rms_norm_eps

    def linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        if self.onednn:
            return cpu_linear(x, layer.weight, layer.bias, layer.packed)
        return F.linear(x, layer.weight, layer.bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        branch = None
        n = x.shape[0]
        for layer in self.model.layers:
            w_in, w_post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            if self.use_fused:
                x, normed = ((x, fused.rms_norm(x, w_in, self.eps)) if branch is None
                             else fused.add_rms_norm(branch, x, w_in, self.eps))
                q, _, _ = fused.rope_qk(self.linear(normed, layer.qkv_proj), cos, sin,
                                        self.heads, self.kv_heads)
                x, normed = fused.add_rms_norm(self.linear(q.view(n, -1), layer.o_proj), x,
                                               w_post, self.eps)
                branch = self.linear(fused.silu_and_mul(self.linear(normed, layer.gate_up_proj)),
                                     layer.down_proj)
                continue
            if branch is not None:
                x = x + branch
            qkv = self.linear(fused.rms_norm_ref(x, w_in, self.eps), layer.qkv_proj)
            d = cos.shape[-1]
            q = apply_rope(qkv[:, :self.heads * d].view(n, self.heads, d), cos, sin)
            apply_rope(qkv[:, self.heads * d:(self.heads + self.kv_heads) * d]
                       .view(n, self.kv_heads, d), cos, sin)
            x = x + self.linear(q.reshape(n, -1), layer.o_proj)
            gate, up = self.linear(fused.rms_norm_ref(x, w_post, self.eps),
                                   layer.gate_up_proj).chunk(2, dim=-1)
            branch = self.linear(F.silu(gate) * up, layer.down_proj)
        assert branch is not None
        return x + branch


def ways(model: DecoderModel, rows: int, dtype: torch.dtype, compile_s: dict[str, float]
         ) -> dict[str, Callable[[], object]]:
    torch.manual_seed(rows)
    x = torch.randn(rows, model.config.hidden_size, dtype=dtype)
    cos, sin = cos_sin(model.inv_freq, torch.arange(100, 100 + rows), dtype)
    made: dict[str, Callable[[], object]] = {
        "eager_fused": lambda: Stack(model, True, True)(x, cos, sin),
        "eager_torch": lambda: Stack(model, False, True)(x, cos, sin),
    }
    import torch._inductor.config as inductor_config

    for name, freezing in (("inductor", False), ("inductor_frozen", True)):
        torch._dynamo.reset()
        inductor_config.freezing = freezing
        compiled = torch.compile(Stack(model, False, False), dynamic=False)
        start = time.perf_counter()
        compiled(x, cos, sin)
        compile_s[name] = time.perf_counter() - start
        made[name] = lambda compiled=compiled: compiled(x, cos, sin)
    inductor_config.freezing = False
    return made


def main() -> None:
    args = parse_args(__doc__)
    dtype = torch.bfloat16 if cpu_has_bf16() else torch.float32
    dtypes = [dtype] if args.quick else sorted({dtype, torch.float32}, key=str)
    cases = []
    for dt in dtypes:
        model = load_model(ensure_model("smollm2-135m"), str(dt).removeprefix("torch.")).model
        for rows in (1, 32):
            compile_s: dict[str, float] = {}
            with torch.inference_mode(False), torch.no_grad():
                made = ways(model, rows, dt, compile_s)
                spreads = rotated({k: lambda _, f=f: median_seconds(f, CALLS, warmup=1)
                                   for k, f in made.items()}, None, None, rounds(args.quick))
            with torch.no_grad():
                reference = made["eager_torch"]().float()
                scale = float(reference.abs().max())
                differences = {k: float((f().float() - reference).abs().max()) / scale
                               for k, f in made.items() if k != "eager_torch"}
            ours = spreads["eager_fused"]
            case: dict[str, Any] = {
                "dtype": str(dt), "rows": rows, "compile_s": compile_s,
                "max_diff_vs_eager_torch_relative": differences,
                "ms": {k: {"median": v.median * 1e3, "min": v.low * 1e3, "max": v.high * 1e3}
                       for k, v in spreads.items()},
                "eager_fused_vs": {k: compare(ours, v, higher_is_better=False)
                                   for k, v in spreads.items() if k != "eager_fused"}}
            cases.append(case)
            print(f"{dt} rows {rows}: " + ", ".join(
                f"{k} {v['median']:.2f} ms" for k, v in case["ms"].items())
                + f"; compile {', '.join(f'{k} {s:.0f} s' for k, s in compile_s.items())}",
                file=sys.stderr, flush=True)
    finish("compile", {"machine": machine(), "cases": cases})


if __name__ == "__main__":
    main()
