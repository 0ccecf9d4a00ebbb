"""The head's training-time test (draft/train_head.ttt_forward) computes what
the head computes when it drafts: each depth of each anchor equals the
head's own runner writing and reading the pool's K/V one proposal at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from draft.train_head import depth_loss, export, head_config, target_labels, ttt_forward
from specpage.core.span import Span
from specpage.executor.head_runner import HeadRunner
from specpage.models.eagle3 import Eagle3Config
from specpage.models.loader import load_model
from tests.support.head import tiny_head

BLOCK = 4


@pytest.mark.parametrize("depth", [1, 3])
def test_every_depth_of_every_anchor_equals_drafting_through_the_runner(tmp_path, depth):
    target = LlamaConfig(hidden_size=32, vocab_size=50, max_position_embeddings=64)
    tiny_head(tmp_path, target, seed=3)
    loaded = load_model(tmp_path, dtype=torch.float32)
    head = loaded.model
    embedding = torch.nn.Embedding(50, 32)
    torch.manual_seed(0)
    n = 11
    tokens = torch.randint(0, 50, (n + depth + 1,)).tolist()
    hidden = torch.randn(n, 32)
    with torch.no_grad():
        outs = ttt_forward(head, embedding.weight[torch.tensor(tokens[1 : n + 1])], hidden, depth)
    assert [o.shape[0] for o in outs] == [n - j for j in range(depth)]
    runner = HeadRunner(loaded, embedding, num_blocks=8, block_size=BLOCK)
    table = list(range(8))
    for p in range(n):
        # the committed positions 0 .. n - 1, from the target's features
        state = runner.run([Span(tokens[1 : n + 1], 0, table)], hidden,
                           every_output=True)[p]
        # as the last of a span, alone: the same output, its K/V the same
        last = runner.run([Span(tokens[1 : p + 2], 0, table)], hidden[: p + 1])
        torch.testing.assert_close(last[0], state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[0][p], state, atol=1e-5, rtol=1e-5)
        for j in range(1, depth):
            if p + j >= n:
                break
            # drafting: position p + j, fed the head's own output
            state = runner.run([Span([tokens[p + j + 1]], p + j, table)], state[None])[0]
            torch.testing.assert_close(outs[j][p], state, atol=1e-5, rtol=1e-5)


def test_an_exported_head_loads_through_the_loader_in_bf16(tmp_path):
    target = LlamaConfig(hidden_size=32, vocab_size=50, max_position_embeddings=64)
    tiny_head(tmp_path / "trained", target, seed=1, draft_vocab=list(range(0, 50, 2)))
    export(tmp_path / "trained", tmp_path / "shipped")
    trained = load_model(tmp_path / "trained", dtype=torch.float32).model
    shipped = load_model(tmp_path / "shipped", dtype=torch.float32).model
    assert torch.equal(shipped.draft_to_target, trained.draft_to_target)
    for (name, a), (_, b) in zip(trained.state_dict().items(), shipped.state_dict().items(),
                                 strict=True):
        rounded = a.to(torch.bfloat16).to(a.dtype) if a.is_floating_point() else a
        assert torch.equal(b, rounded), name


def test_soft_labels_are_the_targets_distribution_over_the_draft_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[0, 7] = 20.0  # a greedy token outside the draft vocabulary
    logits[1, 8] = 20.0
    vocab = torch.arange(0, 50, 2)
    to_draft = torch.full((50,), -1)
    to_draft[vocab] = torch.arange(25)
    greedy, probs = target_labels(logits, vocab, to_draft)
    assert greedy[0] == -1 and greedy[1] == 4
    assert torch.equal(greedy[2:], to_draft[logits[2:].argmax(-1)])
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    ratio = probs / logits[:, vocab].exp()  # the same factor across a row
    torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))


def test_the_soft_loss_against_a_one_hot_distribution_is_the_hard_loss():
    torch.manual_seed(1)
    logits = torch.randn(7, 25)
    labels = torch.tensor([3, -1, 0, 24, -1, 9, 9])
    one_hot = F.one_hot(labels.clamp(min=0), 25).float()
    torch.testing.assert_close(depth_loss(logits, labels, one_hot),
                               depth_loss(logits, labels, None))
    torch.testing.assert_close(depth_loss(logits, labels, None),
                               F.cross_entropy(logits[labels >= 0], labels[labels >= 0]))


def test_a_head_reads_the_target_layers_it_is_given():
    """--taps: the config names the layers, as vLLM's and SGLang's loaders
    read them; by default EAGLE-3's low, middle and high."""
    target = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "vocab_size": 128, "intermediate_size": 96,
              "max_position_embeddings": 256}
    default = Eagle3Config.from_dict(head_config(target, 32, 30), "head")
    assert default.layers_of(30) == (2, 15, 27)
    raw = head_config(target, 32, 30, (2, 15, 29))
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 15, 29]
    assert Eagle3Config.from_dict(raw, "head").layers_of(30) == (2, 15, 29)
