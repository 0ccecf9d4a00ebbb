"""The paged model runner against HF transformers: logits at every position,
and greedy generation with chunked prefill and decode through the pool."""

import logging
import random

import pytest
import torch

from specpage.core.block_pool import BlockPool
from specpage.core.span import Span
from specpage.executor.kv_cache import KvCache, KvShape
from specpage.executor.model_runner import ModelRunner
from specpage.layers.products import few_rows_linear, padded_rows
from specpage.models.loader import load_model
from specpage.models.native_step import NativeStep
from tests.support.checkpoints import greedy_through_pool, tiny_checkpoint

RTOL = 1e-4


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def scattered_table(rng: random.Random, num_blocks: int, count: int) -> list[int]:
    return rng.sample(range(num_blocks), count)


CASES = [
    pytest.param("llama", {"num_key_value_heads": 4}, 4, id="llama-mha-b4"),
    pytest.param("llama", {}, 16, id="llama-gqa-b16"),
    pytest.param("llama", {"tie_word_embeddings": True}, 4, id="llama-tied-b4"),
    pytest.param(
        "llama",
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
         "rope_theta": 500000.0},
        16,
        id="llama3-rope-b16",
    ),
    pytest.param("llama", {"attention_bias": True, "mlp_bias": True}, 4, id="llama-bias-b4"),
    pytest.param("qwen2", {"num_key_value_heads": 1}, 4, id="qwen2-mqa-b4"),
    pytest.param("qwen2", {"tie_word_embeddings": True}, 16, id="qwen2-tied-b16"),
    pytest.param("mistral", {"sliding_window": None, "head_dim": 32}, 16, id="mistral-b16"),
]


@pytest.mark.parametrize(("family", "overrides", "block_size"), CASES)
def test_logits_match_transformers_at_every_position(tmp_path, family, overrides, block_size):
    hf = tiny_checkpoint(tmp_path, family, **overrides)
    runner = ModelRunner(load_model(tmp_path), num_blocks=64, block_size=block_size)
    rng = random.Random(1)
    # lengths that cross block boundaries, in one batch, non-contiguous blocks
    lengths = [1, block_size - 1, block_size + 1, 3 * block_size + 2]
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in lengths]
    free = rng.sample(range(64), 64)
    spans = []
    for prompt in prompts:
        table = [free.pop() for _ in range(-(-len(prompt) // block_size))]
        spans.append(Span(prompt, 0, table, num_logits=len(prompt)))
    logits = runner.forward(spans).split(lengths)
    for prompt, ours in zip(prompts, logits, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert rel_error(ours, ref) < RTOL


def test_sharded_checkpoint_loads(tmp_path):
    hf = tiny_checkpoint(tmp_path, shard=True)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    runner = ModelRunner(load_model(tmp_path), num_blocks=8, block_size=4)
    prompt = list(range(10))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert rel_error(runner.forward([Span(prompt, 0, [5, 2, 7], 10)]), ref) < RTOL


def test_mixed_prefill_decode_and_verify_spans_in_one_forward(tmp_path):
    hf = tiny_checkpoint(tmp_path, "qwen2")
    runner = ModelRunner(load_model(tmp_path), num_blocks=32, block_size=4)
    rng = random.Random(2)
    seqs = [[rng.randrange(211) for _ in range(n)] for n in (13, 6, 9)]
    tables = [[0, 1, 2, 3], [4, 5], [6, 7, 8]]
    # first forward: different-length prefixes of each sequence
    done = [10, 5, 4]
    runner.forward([Span(s[:d], 0, t, 1) for s, d, t in zip(seqs, done, tables, strict=True)])
    # second: a prefill chunk (3 tokens, 1 logit), a decode token, a 5-token verify span
    spans = [Span(seqs[0][10:], 10, tables[0], 1), Span(seqs[1][5:], 5, tables[1], 1),
             Span(seqs[2][4:], 4, tables[2], 5)]
    ours = runner.forward(spans)
    assert ours.shape == (7, 211)
    with torch.no_grad():
        refs = [hf(torch.tensor([s])).logits[0] for s in seqs]
    assert rel_error(ours[0], refs[0][-1]) < RTOL
    assert rel_error(ours[1], refs[1][-1]) < RTOL
    assert rel_error(ours[2:], refs[2][4:]) < RTOL


def test_spans_of_very_different_lengths_in_one_forward(tmp_path):
    """A long prefill chunk, a medium one and a decode token: the reference
    backend pads them in separate groups and must put every row back."""
    hf = tiny_checkpoint(tmp_path, "llama")
    runner = ModelRunner(load_model(tmp_path), num_blocks=32, block_size=4)
    rng = random.Random(3)
    seqs = [[rng.randrange(211) for _ in range(n)] for n in (30, 12, 6)]
    tables = [list(range(0, 8)), [8, 9, 10], [11, 12]]
    runner.forward([Span(seqs[2][:5], 0, tables[2], 1)])
    spans = [Span(seqs[0], 0, tables[0], 3), Span(seqs[1], 0, tables[1], 1),
             Span(seqs[2][5:], 5, tables[2], 1)]
    ours = runner.forward(spans)
    assert ours.shape == (5, 211)
    with torch.no_grad():
        refs = [hf(torch.tensor([s])).logits[0] for s in seqs]
    assert rel_error(ours[:3], refs[0][-3:]) < RTOL
    assert rel_error(ours[3], refs[1][-1]) < RTOL
    assert rel_error(ours[4], refs[2][-1]) < RTOL


def test_copy_blocks_copies_every_layer_for_copy_on_write(tmp_path):
    hf = tiny_checkpoint(tmp_path)
    runner = ModelRunner(load_model(tmp_path), num_blocks=8, block_size=4)
    pool = BlockPool(8, 4)
    prompt = [5, 6, 7, 8, 9, 10]
    pool.allocate_prompt("p", prompt)
    runner.forward([Span(prompt, 0, list(pool.block_table("p")), 1)])
    pool.commit("p", prompt)
    pool.fork("p", "c")
    copies = pool.reserve("c", 1)
    assert copies == [(1, 2)]
    runner.copy_blocks(copies)
    assert torch.equal(runner.kv.tensor[:, :, 2, :2], runner.kv.tensor[:, :, 1, :2])
    # the child continues from the copy and matches HF
    logits = runner.forward([Span([42], 6, list(pool.block_table("c")), 1)])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + [42]])).logits[0, -1]
    assert rel_error(logits[0], ref) < RTOL


@pytest.mark.parametrize(("family", "block_size"), [("llama", 4), ("qwen2", 16)])
def test_greedy_generation_matches_transformers(tmp_path, family, block_size):
    hf = tiny_checkpoint(tmp_path, family)
    runner = ModelRunner(load_model(tmp_path), num_blocks=64, block_size=block_size)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 211) for _ in range(n)] for n in (3, 11, 22, 17)]
    max_new = 20
    ours = greedy_through_pool(runner, prompts, max_new, chunk=7, block_size=block_size)
    for prompt, tokens in zip(prompts, ours, strict=True):
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()
        assert tokens == ref


def test_bad_spans_are_rejected(tmp_path):
    tiny_checkpoint(tmp_path, max_position_embeddings=16)
    runner = ModelRunner(load_model(tmp_path), num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="at least one span"):
        runner.forward([])
    with pytest.raises(ValueError, match="past the model's 16"):
        runner.forward([Span([1] * 17, 0, list(range(5)), 1)])
    with pytest.raises(ValueError, match="block table too short"):
        runner.forward([Span([1] * 5, 0, [0], 1)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.forward([Span([211], 0, [0], 1)])
    with pytest.raises(ValueError, match="num_logits 2"):
        runner.forward([Span([1], 0, [0], 2)])


@pytest.mark.parametrize("rows", [*range(1, 18), 23, 31, 32, 33])
def test_few_rows_products_match_a_plain_linear(rows):
    """Rows padded to the counts BLAS is fast at come back unpadded and equal."""
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, 48), torch.randn(200, 48), torch.randn(200)
    ours = few_rows_linear(x, weight, bias)
    assert ours.shape == (rows, 200)
    torch.testing.assert_close(ours, torch.nn.functional.linear(x, weight, bias))
    assert padded_rows(rows) >= rows


@pytest.mark.parametrize("tied", [False, True])
def test_a_restricted_output_vocabulary_scores_only_its_tokens(tmp_path, tied):
    hf = tiny_checkpoint(tmp_path, tie_word_embeddings=tied)
    runner = ModelRunner(load_model(tmp_path), num_blocks=16, block_size=4)
    prompt = list(range(5, 14))
    allowed = torch.tensor([3, 7, 8, 100, 210])
    runner.model.restrict_output_vocab([100, 3, 8, 7, 210, 3])  # any order, repeats
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    for num_logits in (1, 3, 9):  # one row, a few rows, all
        logits = runner.forward([Span(prompt, 0, [0, 1, 2], num_logits=num_logits)])
        assert rel_error(logits[:, allowed], ref[-num_logits:, allowed]) < RTOL
        outside = torch.ones(211, dtype=torch.bool)
        outside[allowed] = False
        assert torch.isneginf(logits[:, outside]).all()
    runner.model.restrict_output_vocab(None)
    full = runner.forward([Span(prompt, 0, [0, 1, 2], num_logits=9)])
    assert rel_error(full, ref) < RTOL
    for bad in ([], [211], [-1, 4]):
        with pytest.raises(ValueError, match="output vocabulary"):
            runner.model.restrict_output_vocab(bad)


def test_an_fp32_runner_decides_against_the_native_step_once(tmp_path, caplog):
    """The native step takes bf16 models only: an fp32 runner has none from
    the start, says why once when built, and says nothing per forward."""
    tiny_checkpoint(tmp_path)
    with caplog.at_level(logging.INFO, logger="specpage.engine"):
        runner = ModelRunner(load_model(tmp_path), num_blocks=8, block_size=4)
        assert runner.native_step is None
        runner.forward([Span([1, 2, 3], 0, [0], 1)])
        runner.forward([Span([4], 3, [0], 1)])
    said = [r.getMessage() for r in caplog.records if "native step" in r.getMessage()]
    assert len(said) == 1
    assert said[0].endswith(NativeStep.unusable(runner.model, runner.kv.backend) or "")


def test_the_kv_cache_copies_blocks_in_every_layer():
    kv = KvCache(KvShape(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=8),
                 torch.float32, torch.device("cpu"))
    assert kv.tensor.shape == (2, 2, 4, 2, 1, 8)
    assert [layer.data_ptr() for layer in kv.layers] == [
        kv.tensor[i].data_ptr() for i in range(2)]
    kv.tensor.copy_(torch.arange(kv.tensor.numel(), dtype=torch.float32).view_as(kv.tensor))
    before = kv.tensor.clone()
    kv.copy_blocks([(1, 3), (0, 2)])
    assert torch.equal(kv.tensor[:, :, 3], before[:, :, 1])
    assert torch.equal(kv.tensor[:, :, 2], before[:, :, 0])
    assert torch.equal(kv.tensor[:, :, :2], before[:, :, :2])
    kv.copy_blocks([])
    assert torch.equal(kv.tensor[:, :, 2], before[:, :, 0])
