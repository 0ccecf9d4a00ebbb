"""A decode or verify forward from its spans to its logits on the native
kernels (specpage/models/native_step.py) gives what the module path with
the native layer loop gives: the same logits, KV and tapped states; and
leaves what it does not take to the modules."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from specpage.attention.cpu import NATIVE_SPAN
from specpage.core.span import Span
from specpage.executor.model_runner import ModelRunner
from specpage.layers import quant
from specpage.layers.products import bf16_kernels
from specpage.models.decoder import DecoderModel, LayerTap
from specpage.models.loader import load_model
from specpage.models.native_step import NativeStep
from tests.layers.test_native_stack import BLOCK, QUANTIZATIONS, SHAPE, prefilled, table
from tests.support.checkpoints import tiny_checkpoint

pytestmark = pytest.mark.skipif(bf16_kernels() is None,
                                reason="no AVX-512 BF16 kernel in this build")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("step")
    tiny_checkpoint(folder, seed=3, **SHAPE)
    return folder


def step_and_loop(runner: ModelRunner, spans: list[Span], layers: tuple[int, ...] = ()
                  ) -> list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]:
    """(logits, the cache after, tapped states) by NativeStep and by the
    module path with the native layer loop, each from the same cache."""
    assert runner.native_step is not None
    step, before = runner.native_step, runner.kv.tensor.clone()
    results = []
    for native_step in (step, None):
        runner.native_step = native_step
        runner.kv.tensor.copy_(before)
        tap = LayerTap(layers)
        logits = runner.forward(spans, tap)
        results.append((logits, runner.kv.tensor.clone(), tap.states))
    runner.native_step = step
    return results


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("shape", ["decode 1", "decode 3", "verify 5", "verify 3, 1 logit",
                                   "verify 2 + decode 2, some logits", "decode 20",
                                   "catch-up 30 + decode 1"])
def test_the_step_from_spans_gives_the_layer_loops_logits_kv_and_taps(
        checkpoint: Path, quantization: str | None, shape: str) -> None:
    runner = prefilled(checkpoint, quantization, 20)
    spans = {
        "decode 1": [Span([7], 40, table(0))],
        "decode 3": [Span([7 + s], 40 + s, table(s)) for s in range(3)],
        "verify 5": [Span([9, 8, 7, 6, 5], 40, table(1), 5)],
        "verify 3, 1 logit": [Span([9, 8, 7], 40, table(2), 1)],
        "verify 2 + decode 2, some logits": [
            Span([9, 8], 40, table(0), 1), Span([5], 40, table(1)),
            Span([4, 3, 2], 40, table(2), 2)],
        "decode 20": [Span([7 + s], 40, table(s)) for s in range(20)],
        "catch-up 30 + decode 1": [Span(list(range(3, 33)), 40, table(0)),
                                   Span([5], 40, table(1))],
    }[shape]
    step, loop = step_and_loop(runner, spans, (0, 2, 2))
    assert torch.equal(step[0], loop[0])
    assert step[0].shape == (sum(s.num_logits for s in spans), SHAPE["vocab_size"])
    assert torch.equal(step[1], loop[1])
    assert len(step[2]) == len(loop[2]) == 3
    assert all(torch.equal(a, b) for a, b in zip(step[2], loop[2], strict=True))


def test_the_step_leaves_forwards_it_does_not_take_to_the_modules(
        checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A prefill chunk longer than the attention kernel's spans: NativeStep
    does nothing and the module path computes it. An fp32 model gets no
    NativeStep at all, decided when its runner is built, with the reason
    logged once."""
    runner = prefilled(checkpoint, None, 1)
    assert runner.native_step is not None
    longer = list(range(1, NATIVE_SPAN + 2))  # than the attention kernel's spans
    assert runner.native_step([Span(longer, 40, table(0))], None) is None
    assert NativeStep.unusable(runner.model, runner.kv.backend) is None
    with caplog.at_level(logging.INFO, logger="specpage.engine"):
        fp32 = ModelRunner(load_model(checkpoint, "fp32"), 32, BLOCK)
    assert fp32.native_step is None
    assert NativeStep.unusable(fp32.model, fp32.kv.backend) == "torch.float32 weights, not bfloat16"
    said = [r.getMessage() for r in caplog.records if "native step" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("torch.float32 weights, not bfloat16")
    assert fp32.forward([Span([5], 0, table(0))]).shape == (1, SHAPE["vocab_size"])


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_a_draft_vocabulary_is_projected_as_the_modules_do(checkpoint: Path,
                                                           quantization: str | None) -> None:
    """A draft scoring only its vocabulary's rows (-inf elsewhere): the
    step's logits are the module path's, catching up and proposing."""
    runner = prefilled(checkpoint, quantization, 2)
    runner.model.restrict_output_vocab(torch.arange(0, SHAPE["vocab_size"], 2))
    for spans in ([Span([5], 40, table(0))],
                  [Span(list(range(3, 20)), 40, table(0)), Span([5], 40, table(1))]):
        with torch.inference_mode():
            assert runner.native_step is not None and runner.native_step(spans, None) is not None
        step, loop = step_and_loop(runner, spans)
        assert torch.equal(step[0], loop[0]) and torch.equal(step[1], loop[1])
        assert bool(torch.isinf(step[0][:, 1::2]).all()) and bool(step[0][:, ::2].isfinite().all())


@pytest.mark.skipif(not quant.int8x_kernels(), reason="no AVX-512 VNNI on this CPU")
def test_the_step_projects_on_a_q8_head_as_the_modules_do(checkpoint: Path) -> None:
    """With the vocabulary projection on Q8_0 blocks (as a q4 load of
    SmolLM2's GGUF has it), the step from spans gives the module path's
    logits bit for bit, up to Q8_HEAD_MAX_ROWS rows and past them."""
    runner = prefilled(checkpoint, "q4", 10)
    groups = runner.model.embed_tokens.weight.detach().float().view(SHAPE["vocab_size"], -1, 32)
    d = (groups.abs().amax(-1) / 127).half()
    q = torch.round(groups / d.float()[..., None]).clamp(-127, 127).to(torch.int8)
    runner.model.q8_head = quant.Q8Head(q.view(SHAPE["vocab_size"], -1), d)
    for spans in ([Span([7], 40, table(0))], [Span([9, 8, 7, 6, 5], 40, table(1), 5)],
                  [Span([7 + s], 40, table(s)) for s in range(10)]):
        step, loop = step_and_loop(runner, spans)
        assert torch.equal(step[0], loop[0])
        assert torch.equal(step[1], loop[1])


def test_a_model_with_a_forward_of_its_own_takes_the_module_path(checkpoint: Path) -> None:
    """A DecoderModel subclass that overrides forward (a tensor-parallel
    shard gathers its ranks' logits there) gets no NativeStep: its forward
    runs."""
    loaded = load_model(checkpoint, "bf16")
    seen = []

    class Wrapped(DecoderModel):
        def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            seen.append(True)
            return super().forward(*args, **kwargs)

    loaded.model.__class__ = Wrapped
    runner = ModelRunner(loaded, 8, BLOCK)
    assert runner.native_step is None
    runner.forward([Span([5, 6, 7], 0, table(0))])
    runner.forward([Span([8], 3, table(0))])
    assert seen == [True, True]
