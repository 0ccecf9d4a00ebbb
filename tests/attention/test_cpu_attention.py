"""The native CPU paged-attention kernel against its pure-torch reference,
the CPU backend against the gathering reference backend on mixed spans, and
the fallback when the kernel is switched off."""

import random

import pytest
import torch

from specpage.attention import native
from specpage.attention.cpu import NATIVE_SPAN, CpuAttention
from specpage.attention.native import native_kernels, paged_attention_ref
from specpage.attention.reference import TorchAttention
from specpage.attention.selection import select_backend
from specpage.core.span import Span

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # fp32 sums in another order

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native kernel not built")


def random_spans(rng: random.Random, count: int, block_size: int, num_blocks: int,
                 longest: int, furthest: int = 40) -> list[tuple[int, int, list[int]]]:
    free = rng.sample(range(num_blocks), num_blocks)
    spans = []
    for _ in range(count):
        num_new, start = rng.randint(1, longest), rng.randint(0, furthest)
        blocks = -(-(start + num_new) // block_size)
        spans.append((start, num_new, [free.pop() for _ in range(blocks)]))
    return spans


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "furthest", "count"),
                         [(9, 3, 64, 16, 40, 6), (4, 4, 32, 16, 40, 6), (8, 1, 128, 16, 40, 6),
                          (6, 2, 96, 16, 40, 6), (10, 2, 80, 16, 40, 6),
                          (8, 4, 256, 16, 40, 6), (4, 1, 256, 16, 200, 1),  # Gemma 3's
                          (9, 3, 64, 5, 300, 6),  # long contexts, blocks across score groups
                          (9, 3, 64, 16, 300, 1),  # one sequence: its rows split over threads
                          (7, 1, 32, 16, 200, 4)])  # spans up to NATIVE_SPAN (a draft catching up)
def test_kernel_equals_its_reference(dtype, heads, kv_heads, head_dim, block_size, furthest,
                                     count):
    torch.manual_seed(heads + head_dim)
    rng = random.Random(head_dim + furthest)
    num_blocks = 6 * (-(-(furthest + 8) // block_size))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    if count == 1:  # a verify span of 8 after a long context
        spans = [(furthest, 8, rng.sample(range(num_blocks), -(-(furthest + 8) // block_size)))]
    else:
        longest = NATIVE_SPAN if count == 4 else 8
        spans = random_spans(rng, count, block_size, num_blocks, longest=longest,
                             furthest=furthest)
    q = torch.randn(sum(n for _, n, _ in spans), heads, head_dim).to(dtype)
    width = max(len(t) for _, _, t in spans)
    tables = torch.tensor([t + [0] * (width - len(t)) for _, _, t in spans])
    query_start = torch.tensor([0] + [n for _, n, _ in spans]).cumsum(0)
    context_lens = torch.tensor([s + n for s, n, _ in spans])
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # fewer items than twice the threads: bf16 rows split among them
    try:
        ours = native_kernels().paged_attention(q, cache, tables, query_start, context_lens, 0.1)
    finally:
        torch.set_num_threads(threads)
    ref = paged_attention_ref(q, cache, tables, query_start, context_lens, 0.1)
    assert ours.shape == (q.shape[0], heads * head_dim) and ours.dtype == dtype
    assert float((ours.float() - ref.float()).abs().max()) < TOLERANCE[dtype]


@pytest.mark.parametrize("spans", [[(300, 5)], [(40, 3), (290, 5)], [(7, 1)]])
@pytest.mark.parametrize("heads, kv_heads, head_dim, window",
                         [(9, 3, 64, 0), (4, 1, 256, 0), (4, 1, 256, 100)])
def test_where_the_rows_are_cut_between_threads_changes_no_bit(spans, heads, kv_heads,
                                                               head_dim, window):
    """With fewer items than twice the threads, every item's rows laid end to
    end are cut into one share per thread, so an item's rows may be computed
    by two threads; with fewer items than threads, its positions are cut for
    the scores instead (Gemma 3's one KV head): each row's output is the same
    bits at 1 to 5 threads, with a window too."""
    torch.manual_seed(11)
    block_size = 16
    tables = [list(range(i * 20, i * 20 + -(-(c + n) // block_size))) for i, (c, n) in
              enumerate(spans)]
    cache = torch.randn(2, 20 * len(spans), block_size, kv_heads, head_dim).bfloat16()
    q = torch.randn(sum(n for _, n in spans), heads, head_dim).bfloat16()
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query_start = torch.tensor([0] + [n for _, n in spans]).cumsum(0)
    context_lens = torch.tensor([c + n for c, n in spans])
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in range(1, 6):
            torch.set_num_threads(count)
            outputs.append(native_kernels().paged_attention(q, cache, table, query_start,
                                                            context_lens, 0.125, window))
    finally:
        torch.set_num_threads(threads)
    for out in outputs[1:]:
        assert torch.equal(out.view(torch.int16), outputs[0].view(torch.int16))


def test_kernel_rejects_a_context_its_table_cannot_hold():
    cache = torch.zeros(2, 4, 4, 1, 32)
    q = torch.zeros(1, 1, 32)
    with pytest.raises(RuntimeError, match="does not fit"):
        native_kernels().paged_attention(q, cache, torch.tensor([[0]]), torch.tensor([0, 1]),
                                         torch.tensor([5]), 1.0)


# decode only, verify spans, short prefill, prefill longer than NATIVE_SPAN beside them
@pytest.mark.parametrize("longest", [1, 8, 40, 100])
def test_cpu_backend_equals_the_reference_backend(longest):
    torch.manual_seed(longest)
    rng = random.Random(longest)
    block_size, num_blocks, heads, kv_heads, head_dim = 4, 128, 6, 2, 64
    spans = random_spans(rng, 7, block_size, num_blocks, longest)
    spans[0] = (spans[0][0], 1, spans[0][2][: -(-(spans[0][0] + 1) // block_size)])
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    tokens = sum(n for _, n, _ in spans)
    q = torch.randn(tokens, heads, head_dim)
    k, v = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    outputs = []
    for backend in (CpuAttention(), TorchAttention()):
        layer = cache.clone()
        meta = backend.build_metadata([Span([1] * n, start, table) for start, n, table in spans],
                                      block_size, heads // kv_heads, CPU)
        backend.write_kv(layer, k, v, meta)
        outputs.append(backend.attend(q, layer, meta, head_dim**-0.5))
    assert float((outputs[0] - outputs[1]).abs().max()) < 1e-5


def test_switched_off_the_cpu_takes_the_reference(monkeypatch):
    assert type(select_backend(CPU, head_dim=64)) is CpuAttention
    assert type(select_backend(CPU, head_dim=48)) is TorchAttention  # not instantiated
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native_kernels() is None
    assert type(select_backend(CPU, head_dim=64)) is TorchAttention


def kernel_operands(spans: list[tuple[int, int, list[int]]]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_tables, query_start and context_lens of (start, new tokens, table) spans."""
    width = max(len(t) for _, _, t in spans)
    tables = torch.tensor([t + [0] * (width - len(t)) for _, _, t in spans])
    query_start = torch.tensor([0] + [n for _, n, _ in spans]).cumsum(0)
    context_lens = torch.tensor([s + n for s, n, _ in spans])
    return tables, query_start, context_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("window", [1, 5, 16, 37, 500])
def test_kernel_with_a_window_equals_its_reference(dtype, head_dim, window):
    """Decode tokens, verify spans and a span of NATIVE_SPAN, contexts past
    the window, blocks of 5 so windows start inside blocks and tiles."""
    torch.manual_seed(window)
    rng = random.Random(window)
    heads, kv_heads, block_size, num_blocks = 8, 2, 5, 400
    spans = random_spans(rng, 5, block_size, num_blocks, longest=8, furthest=150)
    spans.append((90, NATIVE_SPAN, rng.sample(range(num_blocks), -(-(90 + NATIVE_SPAN) // 5))))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    q = torch.randn(sum(n for _, n, _ in spans), heads, head_dim).to(dtype)
    operands = kernel_operands(spans)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # fewer items than twice the threads: bf16 rows split among them
    try:
        ours = native_kernels().paged_attention(q, cache, *operands, 0.1, window)
    finally:
        torch.set_num_threads(threads)
    ref = paged_attention_ref(q, cache, *operands, 0.1, window)
    assert float((ours.float() - ref.float()).abs().max()) < TOLERANCE[dtype]
    unwindowed = paged_attention_ref(q, cache, *operands, 0.1)
    assert (window >= 150 + NATIVE_SPAN) == torch.equal(ref, unwindowed)


def test_a_window_leaves_a_row_the_window_s_last_positions():
    """Position p sees p - window + 1 .. p, transformers' sliding window:
    with V one-hot by position, the output of a row is spread over exactly
    those positions."""
    block_size, window, context = 4, 3, 10
    cache = torch.zeros(2, 3, block_size, 1, 32)
    cache[1].view(-1, 32)[torch.arange(context), torch.arange(context)] = 1.0
    q = torch.zeros(context, 1, 32)  # equal scores: equal weights over what a row sees
    out = native_kernels().paged_attention(q, cache, torch.tensor([[0, 1, 2]]),
                                           torch.tensor([0, context]), torch.tensor([context]),
                                           1.0, window)
    for p in range(context):
        seen = [i for i in range(context) if out[p, i] > 0]
        assert seen == list(range(max(0, p - window + 1), p + 1))


@pytest.mark.parametrize("window", [3, 9, 64])
@pytest.mark.parametrize("longest", [1, 8, 100])
def test_backends_with_a_window_equal_the_kernel_reference(longest, window):
    torch.manual_seed(longest + window)
    rng = random.Random(longest * window)
    block_size, num_blocks, heads, kv_heads, head_dim = 4, 400, 6, 2, 32
    spans = random_spans(rng, 6, block_size, num_blocks, longest, furthest=120)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    tokens = sum(n for _, n, _ in spans)
    q = torch.randn(tokens, heads, head_dim)
    k, v = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    for backend in (CpuAttention(), CpuAttention(every_span=True), TorchAttention()):
        layer = cache.clone()
        meta = backend.build_metadata([Span([1] * n, start, table) for start, n, table in spans],
                                      block_size, heads // kv_heads, CPU)
        backend.write_kv(layer, k, v, meta)
        ref = paged_attention_ref(q, layer, *kernel_operands(spans), 0.2, window)
        for _ in range(2):  # a second layer reads the window's mask the first one made
            ours = backend.attend(q, layer, meta, 0.2, window)
            assert float((ours - ref).abs().max()) < 1e-5, type(backend).__name__
        full = paged_attention_ref(q, layer, *kernel_operands(spans), 0.2)
        assert float((backend.attend(q, layer, meta, 0.2) - full).abs().max()) < 1e-5


@pytest.mark.parametrize("heads, kv_heads, head_dim, window",
                         [(9, 3, 64, 0), (16, 8, 64, 0), (4, 1, 256, 0), (9, 3, 64, 40)])
def test_a_sequence_s_rows_are_the_same_bits_alone_and_in_a_batch(heads, kv_heads, head_dim,
                                                                  window):
    """A batch's sequences are read a sequence (or a share of its KV heads) at
    a time, all its heads' rows of a position together; one sequence alone
    is cut by rows or positions among the threads. Each sequence's output
    is the same bits either way, at 1 to 4 threads."""
    torch.manual_seed(5)
    block_size = 16
    spans = [(120, 1), (300, 1), (17, 1), (64, 2), (200, 1), (5, 5), (0, 3), (90, 1)]
    rng = random.Random(3)
    free = rng.sample(range(200), 200)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in spans]
    cache = torch.randn(2, 200, block_size, kv_heads, head_dim).bfloat16()
    q = torch.randn(sum(n for _, n in spans), heads, head_dim).bfloat16()
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query_start = torch.tensor([0] + [n for _, n in spans]).cumsum(0)
    context_lens = torch.tensor([c + n for c, n in spans])
    kernel = native_kernels().paged_attention
    threads = torch.get_num_threads()
    try:
        for count in range(1, 5):
            torch.set_num_threads(count)
            batch = kernel(q, cache, table, query_start, context_lens, 0.125, window)
            for s, (first, end) in enumerate(zip(query_start[:-1], query_start[1:], strict=True)):
                alone = kernel(q[first:end], cache, table[s:s + 1],
                               torch.tensor([0, int(end - first)]), context_lens[s:s + 1],
                               0.125, window)
                assert torch.equal(alone.view(torch.int16), batch[first:end].view(torch.int16))
    finally:
        torch.set_num_threads(threads)
    ref = paged_attention_ref(q, cache, table, query_start, context_lens, 0.125, window)
    assert float((batch.float() - ref.float()).abs().max()) < TOLERANCE[torch.bfloat16]
