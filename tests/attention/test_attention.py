"""The attention backends' metadata: each backend builds exactly what its
own attend reads, and the model runner runs on the metadata of the backend
it holds."""

import random
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import triton

from specpage.attention.backend import AttentionMetadata
from specpage.attention.reference import TorchAttention
from specpage.attention.selection import select_backend
from specpage.attention.triton import TritonAttention, TritonMetadata
from specpage.core.span import Span
from specpage.executor.model_runner import ModelRunner
from specpage.models.loader import load_model
from tests.support.checkpoints import tiny_checkpoint

CPU = torch.device("cpu")
# Block size 4, two query heads per KV head: a decode token at position 5,
# a 10-token prefill chunk (longer than a short span), a 3-token verification.
SPANS = [Span([1], 5, [7, 2]), Span([1] * 10, 0, [3, 9, 5]), Span([1] * 3, 1, [4])]
SLOTS = [9, 12, 13, 14, 15, 36, 37, 38, 39, 20, 21, 17, 18, 19]


def field_names(meta: AttentionMetadata) -> set[str]:
    return {f.name for f in fields(meta)}


def test_triton_metadata_is_what_the_kernels_read() -> None:
    meta = TritonAttention().build_metadata(SPANS, 4, 2, CPU)
    assert field_names(meta) == {
        "slot_mapping", "block_tables", "context_lens", "query_start", "max_query", "max_context"
    }
    assert meta.slot_mapping.tolist() == SLOTS
    assert meta.block_tables.tolist() == [[7, 2, 0], [3, 9, 5], [4, 0, 0]]
    assert meta.context_lens.tolist() == [6, 10, 4]
    assert meta.query_start.tolist() == [0, 1, 11, 14]
    assert (meta.max_query, meta.max_context) == (10, 10)


def test_torch_metadata_is_the_padded_groups() -> None:
    meta = TorchAttention().build_metadata(SPANS, 4, 2, CPU)
    assert field_names(meta) == {"slot_mapping", "padded"}
    assert meta.slot_mapping.tolist() == SLOTS
    short, chunk = meta.padded
    # The decode token and the verification span, padded to 3 tokens each.
    assert (short.num_seqs, short.max_query, short.max_context) == (2, 3, 6)
    assert short.gather_blocks.tolist() == [7, 2, 4, 0]
    assert short.token_rows is not None and short.token_rows.tolist() == [0, 11, 12, 13]
    assert short.query_index is not None and short.query_index.tolist() == [0, 3, 4, 5]
    assert short.mask is not None and short.mask.shape == (2, 1, 2 * 3, 6)
    t, f = True, False
    decode_rows = [[t] * 6, [t, f, f, f, f, f], [t, f, f, f, f, f]]  # padding sees position 0
    verify_rows = [[t, t, f, f, f, f], [t, t, t, f, f, f], [t, t, t, t, f, f]]
    assert short.mask[:, 0].tolist() == [decode_rows * 2, verify_rows * 2]
    # The prefill chunk alone: no padding, a causal mask.
    assert (chunk.num_seqs, chunk.max_query, chunk.max_context) == (1, 10, 10)
    assert chunk.gather_blocks.tolist() == [3, 9, 5]
    assert chunk.token_rows is not None and chunk.token_rows.tolist() == list(range(1, 11))
    assert chunk.query_index is None
    assert chunk.mask is not None
    assert torch.equal(chunk.mask[0, 0], torch.ones(10, 10, dtype=torch.bool).tril().repeat(2, 1))


def test_select_backend_by_device() -> None:
    assert type(select_backend(CPU)) is TorchAttention
    assert type(select_backend(torch.device("meta"))) is TorchAttention
    # Built, not run: no GPU is touched.
    assert type(select_backend(torch.device("cuda"))) is TritonAttention


class RecordingTriton(TritonAttention):
    def __init__(self) -> None:
        self.seen: list[AttentionMetadata] = []

    def attend(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        self.seen.append(meta)
        return super().attend(q, cache, meta, scale, window)


@pytest.mark.skipif(
    not triton.knobs.runtime.interpret, reason="runs the kernels on CPU tensors: TRITON_INTERPRET=1"
)
def test_runner_attends_with_its_backends_own_metadata(tmp_path: Path) -> None:
    """A runner on the Triton backend (interpreted on CPU) gives the logits
    of one on the reference backend, and its layers see only Triton metadata.
    Each forward brings more than FEW_ROWS tokens: the CPU's few-rows matmul
    leaves K and V column-major, which the kernels refuse."""
    tiny_checkpoint(tmp_path)
    loaded = load_model(tmp_path)
    triton_backend = RecordingTriton()
    runners = [ModelRunner(loaded, 32, 4, backend=triton_backend), ModelRunner(loaded, 32, 4)]
    assert type(runners[1].kv.backend) is TorchAttention
    rng = random.Random(3)
    tokens = [rng.randrange(211) for _ in range(20 + 1 + 15 + 33)]
    tables = [[5, 1, 8, 30, 11, 0], list(range(12, 24))]
    prefill = [Span(tokens[:20], 0, tables[0], 20), Span(tokens[21:36], 0, tables[1], 15)]
    # A decode token beside the next chunk of the other sequence's prompt.
    mixed = [Span(tokens[20:21], 20, tables[0], 1), Span(tokens[36:], 15, tables[1], 33)]
    for spans in (prefill, mixed):
        ours, ref = (runner.forward(spans) for runner in runners)
        assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-4
    assert len(triton_backend.seen) == 2 * 2  # two forwards, two layers
    assert all(type(meta) is TritonMetadata for meta in triton_backend.seen)
