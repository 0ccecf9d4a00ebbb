"""Row-invariant products and forwards (engine.deterministic), checked on
whatever CPU runs the suite: under layers/products.py's row_invariant, each
row of every product way comes out bit for bit as that row alone; and a
deterministic ModelRunner's logits for a position are the same whether its
prompt is prefilled whole, in chunks of any size, or beside another sequence.
Without the mode the same checks find differences (the last test), so they
can tell."""

from __future__ import annotations

import random

import pytest
import torch

from specpage.attention.selection import NoInvariantAttention, select_backend
from specpage.core.span import Span
from specpage.executor.model_runner import ModelRunner
from specpage.layers.linear import Linear
from specpage.layers.products import row_invariant
from specpage.layers.quant import Int4Blocks, Int4Linear, Q8Head
from specpage.models.loader import load_model
from tests.support.checkpoints import tiny_checkpoint

ROWS = (1, 2, 3, 5, 8, 9, 16, 17, 24, 33, 65, 130)
# (in, out): SmolLM2's projections, a vocabulary projection's tall shape, a tiny one
SHAPES = ((576, 1536), (1536, 576), (576, 8192), (128, 256), (64, 211))


def each_row_alone(product, x: torch.Tensor) -> None:
    alone = torch.cat([product(x[r : r + 1]) for r in range(max(ROWS))])
    for rows in ROWS:
        y = product(x[:rows])
        differ = [r for r in range(rows) if not torch.equal(y[r], alone[r])]
        assert not differ, f"{rows} rows: rows {differ[:5]} differ from each alone"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_dense_products_compute_each_row_as_if_alone(dtype, shape):
    torch.manual_seed(0)
    layer = Linear(*shape, bias=True).to(dtype)
    x = torch.randn(max(ROWS), shape[0]).to(dtype)
    with torch.inference_mode(), row_invariant(True):
        each_row_alone(layer, x)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % 16 == 0])  # int4's outputs
def test_int4_products_compute_each_row_as_if_alone(shape):
    torch.manual_seed(0)
    n_in, n_out = shape
    scale = torch.rand(n_out, n_in // 32) / 10
    blocks = Int4Blocks(q=torch.randint(0, 16, (n_out, n_in), dtype=torch.uint8),
                        scale=scale, offset=-8 * scale, group=32)
    layer = Int4Linear(blocks)
    x = torch.randn(max(ROWS), n_in).bfloat16()
    with torch.inference_mode(), row_invariant(True):
        each_row_alone(layer, x)


def test_the_q8_head_computes_each_row_as_if_alone():
    if not Q8Head.usable(256, 128):
        pytest.skip("the Q8_0 head runs on the native int4 kernels, which need AVX-512 BF16")
    torch.manual_seed(0)
    head = Q8Head(torch.randint(-127, 128, (256, 128), dtype=torch.int8),
                  (torch.rand(256, 4) / 100).half().float())  # float16 values, as Q8_0 holds
    x = torch.randn(max(ROWS), 128).bfloat16()
    with torch.inference_mode(), row_invariant(True):
        assert head.takes(x)  # every row count: the dense head never takes some
        each_row_alone(head, x)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    tiny_checkpoint(root / "target", num_hidden_layers=2, vocab_size=256, hidden_size=128,
                    intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)
    return root / "target"


BLOCK = 4
_rng = random.Random(0)
PROMPT = [_rng.randrange(1, 256) for _ in range(150)]
OTHER = [_rng.randrange(1, 256) for _ in range(90)]


def table(first: int, positions: int) -> list[int]:
    return list(range(first, first + -(-positions // BLOCK)))


def whole_and_chunked(model, deterministic: bool) -> list[tuple[str, torch.Tensor]]:
    """The prompt's logits at every position: prefilled whole, in chunks of
    several sizes, and whole beside another sequence."""
    def runner() -> ModelRunner:
        return ModelRunner(model, num_blocks=128, block_size=BLOCK, deterministic=deterministic)

    n = len(PROMPT)
    found = [("whole", runner().forward([Span(PROMPT, 0, table(0, n), num_logits=n)]))]
    for size in (1, 3, 16, 64, 100):
        r, parts = runner(), []
        for start in range(0, n, size):
            chunk = PROMPT[start : start + size]
            parts.append(r.forward([Span(chunk, start, table(0, n), num_logits=len(chunk))]))
        found.append((f"chunks of {size}", torch.cat(parts)))
    beside = runner().forward([Span(OTHER, 0, table(64, len(OTHER))),
                               Span(PROMPT, 0, table(0, n), num_logits=n)])
    found.append(("beside another", beside[1:]))
    return found


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "q4"])
def test_a_deterministic_runner_gives_each_position_one_result(target, dtype):
    model = load_model(target, "bf16" if dtype == "bf16" else None,
                       quantization="q4" if dtype == "q4" else None)
    (_, whole), *others = whole_and_chunked(model, deterministic=True)
    for name, logits in others:
        assert torch.equal(logits, whole), name


def test_without_the_mode_chunks_change_the_logits(target):
    """What the mode is for: the default ways differ by chunk (the reference
    attention takes long spans, the native kernel short ones)."""
    model = load_model(target, "bf16")
    (_, whole), *others = whole_and_chunked(model, deterministic=False)
    assert any(not torch.equal(logits, whole) for _, logits in others)


def test_a_head_size_without_the_native_kernel_is_refused():
    with pytest.raises(NoInvariantAttention, match="engine.deterministic needs the native"):
        select_backend(torch.device("cpu"), 48, row_invariant=True)
