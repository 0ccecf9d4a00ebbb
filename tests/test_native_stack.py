"""The decoder's layers as one loop of direct kernel calls
(specpage/models/native_stack.py) give exactly what the module path gives:
the same logits, the same K/V in the cache and the same tapped hidden
states, for decode and verify steps in bf16 and q4 (on the native products
and on oneDNN's); and forwards it does not
take (a prefill chunk, fp32) run the module path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpage.model_runner import ModelRunner, SeqSpan
from specpage.models import native_stack
from specpage.models.decoder import LayerTap, bf16_kernels
from specpage.models.loader import load_model
from specpage.models.quant import DENSE_FROM_ROWS
from tests.models_util import tiny_checkpoint

pytestmark = pytest.mark.skipif(bf16_kernels() is None,
                                reason="no AVX-512 BF16 kernel in this build")

BLOCK = 16
# Widths the kernels take: hidden and intermediate whole vectors, products
# whole blocks of 16 outputs by 64 inputs, head_dim 64.
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("stack")
    tiny_checkpoint(folder, seed=3, **SHAPE)
    return folder


def prefilled(checkpoint: Path, quantization: str | None, prompts: int) -> ModelRunner:
    runner = ModelRunner(load_model(checkpoint, "bf16", quantization=quantization),
                         4 * prompts + 4, BLOCK)
    with torch.inference_mode():
        runner.forward([SeqSpan([(11 * s + 3 * j) % 500 + 1 for j in range(40)], 0,
                                table(s), 1) for s in range(prompts)])
    return runner


def table(seq: int) -> list[int]:
    return list(range(4 * seq, 4 * seq + 4))


def both_ways(runner: ModelRunner, spans: list[SeqSpan], monkeypatch: pytest.MonkeyPatch,
              layers: tuple[int, ...] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(logits, the cache after, tapped states) by the direct loop and by the modules,
    each from the same cache."""
    before = runner.kv_cache.clone()
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(native_stack, "ENABLED", enabled)
        runner.kv_cache.copy_(before)
        tap = LayerTap(layers)
        logits = runner.forward(spans, tap)
        results.append((logits, runner.kv_cache.clone(), torch.stack(tap.states)
                        if tap.states else torch.empty(0)))
    direct, modules = results
    return list(direct), list(modules)


@pytest.mark.parametrize("quantization", [None, "q4"])
@pytest.mark.parametrize("shape", ["decode 1", "decode 3", "verify 5", "verify 2 + decode 2",
                                   "decode 20"])
def test_the_direct_loop_gives_the_modules_logits_and_kv(
        checkpoint: Path, quantization: str | None, shape: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = prefilled(checkpoint, quantization, 20 if shape == "decode 20" else 3)
    spans = {
        "decode 1": [SeqSpan([7], 40, table(0))],
        "decode 3": [SeqSpan([7 + s], 40, table(s)) for s in range(3)],
        "verify 5": [SeqSpan([9, 8, 7, 6, 5], 40, table(1), 5)],
        "verify 2 + decode 2": [SeqSpan([9, 8], 40, table(0), 2), SeqSpan([5], 40, table(1)),
                                SeqSpan([4], 40, table(2))],
        "decode 20": [SeqSpan([7 + s], 40, table(s)) for s in range(20)],  # past the native
    }[shape]                                                               # products: oneDNN
    rows = sum(len(s.token_ids) for s in spans)
    assert runner.model.direct_calls(rows) is not None  # the loop applies to these rows
    (logits, cache, _), (ref_logits, ref_cache, _) = both_ways(runner, spans, monkeypatch)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(cache, ref_cache)
    assert not torch.equal(cache, runner.kv_cache.new_zeros(()).expand_as(cache))


def test_q4_rows_take_the_int4_kernel_below_the_dense_copy(checkpoint: Path) -> None:
    """The direct loop chooses each product's kernel as Int4Linear.forward does."""
    model = load_model(checkpoint, "bf16", quantization="q4").model
    kernels = bf16_kernels()
    few = model.direct_calls(DENSE_FROM_ROWS - 1)
    many = model.direct_calls(DENSE_FROM_ROWS)
    assert few is not None and many is not None
    assert few[0][1][0] == kernels.int4_gemv.default  # qkv of layer 0
    assert many[0][1][0] == kernels.bf16_gemv.default


def test_the_tap_sees_the_same_states(checkpoint: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    runner = prefilled(checkpoint, None, 1)
    spans = [SeqSpan([9, 8, 7], 40, table(0), 3)]
    (_, _, states), (_, _, ref_states) = both_ways(runner, spans, monkeypatch, (0, 2, 2))
    assert states.shape == (3, 3, SHAPE["hidden_size"])
    assert torch.equal(states, ref_states)


def test_forwards_the_loop_does_not_take_run_the_modules(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk (a long span) and an fp32 model leave the loop
    before it does anything."""
    taken = []
    run_layers = native_stack.run_layers
    monkeypatch.setattr(native_stack, "run_layers",
                        lambda *a: taken.append(result := run_layers(*a)) or result)
    runner = prefilled(checkpoint, None, 2)
    assert taken == [None]  # the prefill
    runner.forward([SeqSpan([5], 40, table(0))])
    assert taken[-1] is not None
    fp32 = ModelRunner(load_model(checkpoint, "fp32"), 32, BLOCK)
    fp32.forward([SeqSpan([5], 0, table(0))])
    assert taken[-1] is None
