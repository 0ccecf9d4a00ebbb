"""EAGLE-3 heads as the draft: the llama_eagle3 checkpoint layout, proposals
that match a reference computed from transformers' hidden states, and
greedy output identical to the target's across every scheduling path."""

import json
import random
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from specpage.attention.cpu import CpuAttention
from specpage.core.model_free import Speculation
from specpage.core.request import SamplingParams
from specpage.engine import Engine, EngineConfig
from specpage.kernels.cpu.native import native_kernels
from specpage.layers import quant
from specpage.layers.quant import Int4Linear
from specpage.models.eagle3 import LoadedHead
from specpage.models.loader import ModelLoadError, draft_dtype, load_model
from specpage.models.quant_names import QuantizationError
from tests.engine.test_engine import drain, hf_greedy, prompts, sampled
from tests.support.checkpoints import tiny_checkpoint
from tests.support.head import HEAD_FILE, reference_proposals, tiny_head

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TAPS = [0, 1, 2]  # the tiny target's three layers; vLLM's default needs eight or more
NUM_DRAFT_TOKENS = 4  # a head that proposes among the target's favourite tokens accepts some


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A 3-layer target; a head over its whole vocabulary; and a head whose
    draft vocabulary is the tokens the target outputs most (so proposals
    are accepted often enough to test every commit path)."""
    root = tmp_path_factory.mktemp("heads")
    hf = tiny_checkpoint(root / "target", num_hidden_layers=3)
    counts = Counter(t for p in prompts(12, seed=1) for t in hf_greedy(hf, p, 16))
    favourites = [t for t, _ in counts.most_common(NUM_DRAFT_TOKENS)]
    tiny_head(root / "head", hf.config, eagle_aux_hidden_state_layer_ids=TAPS)
    tiny_head(root / "small", hf.config, seed=2, draft_vocab=favourites,
              eagle_aux_hidden_state_layer_ids=TAPS)
    # head_dim 32: the native CPU attention kernel's size (16 is the reference's)
    tiny_head(root / "wide", hf.config, seed=3, num_attention_heads=2, num_key_value_heads=1,
              eagle_aux_hidden_state_layer_ids=TAPS)
    # shapes int4 takes (inputs in groups of 32, outputs in sixteens)
    tiny_head(root / "even", hf.config, seed=4, intermediate_size=96,
              draft_vocab=[t for t, _ in counts.most_common(16)],
              eagle_aux_hidden_state_layer_ids=TAPS)
    return hf, root, favourites


def engine(models, head="small", **config):
    _, root, _ = models
    options = dict(block_size=4, num_blocks=512, spec_k=3, adaptive_k=False)
    options.update(config)
    return Engine(load_model(root / "target"), load_model(root / head), None,
                  EngineConfig(**options))


def record_proposals(eng):
    """Every (batch, proposal) the head makes, as the engine runs."""
    seen = []
    proposer = eng.executor.proposer
    propose = proposer.propose
    proposer.propose = (lambda batch, guides: seen.append((batch, propose(batch, guides)))
                        or seen[-1][1])
    return seen


def test_a_head_in_the_llama_eagle3_layout_loads_with_its_d2t(models):
    _, root, favourites = models
    tensors = load_file(root / "small" / HEAD_FILE)
    hidden = 64
    assert tuple(tensors["fc.weight"].shape) == (hidden, 3 * hidden)
    assert tuple(tensors["midlayer.self_attn.q_proj.weight"].shape) == (hidden, 2 * hidden)
    assert tuple(tensors["lm_head.weight"].shape) == (NUM_DRAFT_TOKENS, hidden)
    assert "embed_tokens.weight" not in tensors
    assert {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight",
            "d2t", "t2d"} <= set(tensors)
    head = load_model(root / "small")
    assert isinstance(head, LoadedHead)
    assert head.config.draft_vocab_size == NUM_DRAFT_TOKENS
    assert head.config.layers_of(3) == (0, 1, 2)
    ids = sorted(favourites)
    assert head.model.draft_to_target.tolist() == ids  # i + d2t[i]
    assert (tensors["d2t"] + torch.arange(NUM_DRAFT_TOKENS)).tolist() == ids
    assert torch.nonzero(tensors["t2d"]).flatten().tolist() == ids
    logits = head.model.logits(torch.randn(2, hidden))
    assert logits.shape == (2, 211)
    assert torch.isfinite(logits).nonzero()[:, 1].unique().tolist() == ids


def test_vllm_default_taps_are_layers_2_half_and_minus_3(tmp_path):
    hf = tiny_checkpoint(tmp_path / "target", num_hidden_layers=3)
    tiny_head(tmp_path / "head", hf.config)
    assert load_model(tmp_path / "head").config.layers_of(32) == (2, 16, 29)


@pytest.mark.parametrize("head,k", [("head", 1), ("head", 3), ("wide", 3)])
def test_first_proposals_equal_a_reference_from_transformers_hidden_states(models, head, k):
    """The head's first proposal in each step is its output at the position
    before the newest token, which it absorbed from the target's features:
    each equals the head computed in plain torch, from the checkpoint's
    tensors, over transformers' hidden states of the final sequence. The
    wide head's attention runs on the native kernel where it builds."""
    hf, root, _ = models
    eng = engine(models, head=head, spec_k=k)
    if head == "wide" and native_kernels() is not None:
        assert isinstance(eng.executor.draft.kv.backend, CpuAttention)
    seen = record_proposals(eng)
    prompt = prompts(1, seed=4, lengths=(9,))[0]
    tokens = drain(eng, {0: [("a", prompt, GREEDY)]})[("a", 0)][0]
    reference = reference_proposals(root / head, hf, prompt + tokens)
    firsts = [(w.end, p[0]) for batch, proposal in seen
              for w, p in zip(batch, proposal.tokens, strict=True) if p]
    assert len(firsts) >= 16 // (k + 1)
    assert [p for _, p in firsts] == [reference[end - 2] for end, _ in firsts]


def test_a_head_left_behind_catches_up_to_the_reference(models):
    """Steps without speculation leave positions unabsorbed (no head forward
    runs at all in most of them) within the block being filled; the step
    that speculates next absorbs them first, and its proposal is still the
    reference's, computed from transformers' hidden states."""
    hf, root, _ = models
    eng = engine(models, head="head", spec_k=2, block_size=8)
    eng.scheduler.speculate = lambda seq, batch: Speculation(2 if seq.num_tokens % 7 == 0 else 0)
    seen = record_proposals(eng)
    steps_with_a_head_forward = set()  # the step's number: proposals recorded so far
    run = eng.executor.draft.run
    eng.executor.draft.run = (lambda spans, hidden: steps_with_a_head_forward.add(len(seen))
                              or run(spans, hidden))
    prompt = prompts(1, seed=5, lengths=(9,))[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    tokens = drain(eng, {0: [("a", prompt, params)]})[("a", 0)][0]
    assert tokens == hf_greedy(hf, prompt, 40)
    reference = reference_proposals(root / "head", hf, prompt + tokens)
    firsts = [(w, p[0]) for batch, proposal in seen
              for w, p in zip(batch, proposal.tokens, strict=True) if p]
    behind = [(w, p) for w, p in firsts if w.draft_tokens]
    assert behind, "no proposal followed positions left unabsorbed"
    assert [p for _, p in firsts] == [reference[w.end - 2] for w, _ in firsts]
    assert len(steps_with_a_head_forward) <= len(seen) // 2, (steps_with_a_head_forward, len(seen))


@pytest.mark.parametrize("head,quantization", [("small", None), ("even", "q4")])
def test_a_q4_target_runs_its_head_in_its_own_dtype(models, head, quantization):
    """A q4 target computes in bf16 unless a dtype is chosen; the head, which
    reads its hidden states and embedding, loads in bf16 with it (draft_dtype),
    as it is or itself in int4, and the output stays the q4 target's own."""
    _, root, _ = models
    options = dict(block_size=4, num_blocks=512, adaptive_k=False)
    target = load_model(root / "target", quantization="q4")
    assert target.model.embed_tokens.weight.dtype == torch.bfloat16
    head = load_model(root / head, draft_dtype(None, target), quantization=quantization)
    if quantization:
        assert head.quantization == ("q4 g32 round-to-nearest, bf16 activations"
                                     + (", int8 product inputs" if quant.int8x_kernels() else ""))
        assert all(isinstance(getattr(head.model, name), Int4Linear)
                   for name in ("fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                "lm_head"))
    eng = Engine(target, head, None, EngineConfig(spec_k=3, **options))
    assert eng.executor.draft.dtype == torch.bfloat16
    assert eng.executor.draft.model.inv_freq.dtype == torch.float32
    alone = Engine(load_model(root / "target", quantization="q4"), None, None,
                   EngineConfig(spec_k=0, **options))
    arrivals = {0: [(str(i), p, GREEDY) for i, p in enumerate(prompts(4, seed=6))]}
    assert drain(eng, arrivals) == drain(alone, arrivals)
    assert eng.stats().drafted_tokens > 0  # it proposed (the favourites are fp32's: rejected)


def test_q4_on_a_head_it_cannot_take_names_the_layer(models):
    _, root, _ = models
    with pytest.raises(QuantizationError, match="down_proj: q4 needs in_features a multiple "
                                                "of the group size 32; this weight has 80"):
        load_model(root / "small", quantization="q4")
    with pytest.raises(QuantizationError, match="lm_head: q4 needs out_features a multiple "
                                                "of 16; this weight has 4 outputs"):
        tiny = root / "narrow"
        tiny_head(tiny, models[0].config, intermediate_size=96, draft_vocab=models[2],
                  eagle_aux_hidden_state_layer_ids=TAPS)
        load_model(tiny, quantization="q4")


def test_greedy_with_a_head_equals_transformers_across_mixed_batches(models):
    """Arrivals over several steps, chunked prefill (a 12-token step
    budget), k changing from step to step (0 too): the target's output,
    token for token, with proposals accepted and rejected."""
    hf = models[0]
    eng = engine(models, max_step_tokens=12)
    rng = random.Random(3)
    eng.scheduler.speculate = lambda seq, batch: Speculation(rng.choice([0, 1, 2, 3, 3]))
    batch = prompts(8, seed=1)
    arrivals = {i // 2 * 3: [] for i in range(8)}
    for i, p in enumerate(batch):
        arrivals[i // 2 * 3].append((str(i), p, GREEDY))
    results = drain(eng, arrivals)
    for i, p in enumerate(batch):
        assert results[(str(i), 0)][0] == hf_greedy(hf, p, 16), i
    stats = eng.stats()
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    assert any(n > 1 for n in stats.accepted_by_position[1:])  # deeper proposals accepted too


def test_a_reduced_draft_vocabulary_proposes_inside_it_and_the_rest_comes_from_the_target(
        models):
    hf, _, favourites = models
    eng = engine(models)
    seen = record_proposals(eng)
    batch = prompts(6, seed=1)
    results = drain(eng, {0: [(str(i), p, GREEDY) for i, p in enumerate(batch)]})
    proposed = {t for _, proposal in seen for p in proposal.tokens for t in p}
    assert proposed and proposed <= set(favourites)
    outputs = [results[(str(i), 0)][0] for i in range(len(batch))]
    assert outputs == [hf_greedy(hf, p, 16) for p in batch]
    assert {t for out in outputs for t in out} - set(favourites)  # outside: the target's


def test_prefix_cache_hits_keep_the_output_and_share_the_heads_kv(models):
    hf = models[0]
    eng = engine(models)
    shared = prompts(1, lengths=(33,))[0]
    first = drain(eng, {0: [("a", shared + [7, 8], GREEDY)]})
    second = drain(eng, {0: [("b", shared + [9], GREEDY)]})
    assert eng.stats().prefix_cached_tokens >= 32
    assert first[("a", 0)][0] == hf_greedy(hf, shared + [7, 8], 16)
    assert second[("b", 0)][0] == hf_greedy(hf, shared + [9], 16)


def test_a_cache_hit_never_serves_a_pool_without_the_head(models):
    """The pool's cache key names the head: blocks that an engine without
    it (or with another head) cached are not the head engine's."""
    _, root, _ = models
    small, other = load_model(root / "small"), load_model(root / "head")
    assert small.identity != other.identity
    keys = {Engine(load_model(root / "target"), d, None,
                   EngineConfig(block_size=4, num_blocks=64, adaptive_k=False)
                   ).pool.model_identity for d in (small, other, None)}
    assert len(keys) == 3


@pytest.mark.parametrize("params", [GREEDY, sampled(11)])
def test_preemption_recomputes_the_head_and_keeps_outputs(models, params):
    batch = prompts(8, lengths=(9, 14, 6))
    arrivals = {0: [(str(i), p, params) for i, p in enumerate(batch)]}
    roomy = drain(engine(models), arrivals)
    tiny = engine(models, num_blocks=24)
    assert drain(tiny, arrivals) == roomy
    assert tiny.stats().preemptions > 0
    if params is GREEDY:
        hf = models[0]
        assert [roomy[(str(i), 0)][0] for i in range(8)] == [hf_greedy(hf, p, 16) for p in batch]


def test_n_samples_fork_with_the_head(models):
    """Forks share the prompt's blocks and the head's state; greedy samples
    all give the target's output, and the first of sampled ones what its
    seed gives alone. (A fork's head state and KV at the last prompt
    position read the parent's first token, not its own: see
    core/proposer_rules.py; that changes its proposals, so its seeded draws, but
    not its distribution.)"""
    hf = models[0]
    prompt = prompts(1, lengths=(30,))[0]
    eng = engine(models)
    eng.add_request("n", prompt, sampled(40, n=3))
    first = {o.index: o.token_ids for o in eng.step()}
    assert sorted(first) == [0, 1, 2]
    states = {s.draft_state for s in eng.requests["n"].sequences}
    assert len(states) == 1 and len(next(iter(states))) == 64 * 4  # shared, fp32
    results = drain(eng)
    alone = drain(engine(models), {0: [("x", prompt, sampled(40))]})
    assert first[0] + results[("n", 0)][0] == alone[("x", 0)][0]
    greedy = drain(engine(models), {0: [("g", prompt, SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, n=3))]})
    assert [greedy[("g", i)][0] for i in range(3)] == [hf_greedy(hf, prompt, 16)] * 3


def test_pool_invariants_hold_every_step_and_aborts_leak_nothing(models):
    rng = random.Random(8)
    eng = engine(models, num_blocks=32, max_num_seqs=16, max_step_tokens=24)
    eng.scheduler.speculate = lambda seq, batch: Speculation(rng.choice([0, 2, 3]))
    steps, submitted = 0, 0
    while submitted < 120 or eng.has_unfinished():
        if submitted < 120 and rng.random() < 0.7:
            params = GREEDY if submitted % 2 else sampled(submitted, n=rng.choice([1, 2]))
            eng.add_request(str(submitted), prompts(1, seed=submitted)[0], params)
            submitted += 1
        if eng.requests and rng.random() < 0.2:
            eng.abort(rng.choice(sorted(eng.requests)))
        if eng.has_unfinished():
            eng.step()
        eng.pool.check_integrity()
        for seq in eng.scheduler.running:  # the head lags only within the block being filled
            assert (seq.num_draft_computed == seq.num_computed
                    or seq.num_draft_computed // 4 == seq.num_computed // 4), seq
        steps += 1
        assert steps < 5000
    stats = eng.stats()
    assert stats.aborts > 0 and stats.preemptions > 0 and stats.accepted_tokens > 0
    assert not eng.requests
    assert stats.free_blocks + stats.cached_blocks == stats.total_blocks


def test_a_sequence_the_head_is_left_off_gives_the_targets_output(models):
    """The policy may leave the head off a new sequence (a head costs every
    step even while it does not propose): that sequence makes no proposals
    even when asked for some, and the target's output comes out beside
    sequences with the head, through shared prefixes, preemption and forks.
    Its blocks are cached under a key of their own: a sequence with the head
    is never served blocks that hold no head KV (tests/core/test_core_head.py
    checks the head's KV itself)."""
    hf = models[0]
    eng = engine(models, num_blocks=40, max_num_seqs=8, max_step_tokens=16)
    flags = iter([False, True] * 20)
    eng.core.policy.admits_draft = lambda request, batch: next(flags)
    eng.scheduler.speculate = lambda seq, batch: Speculation(3)
    seen = record_proposals(eng)
    tapped, verify = [], eng.executor.verifier.verify
    eng.executor.verifier.verify = lambda batch_, proposal: (
        tapped.append((any(w.draft_on for w in batch_), verify(batch_, proposal)))
        or tapped[-1][1])
    shared = prompts(1, lengths=(33,))[0]
    batch = [shared + [i + 1] for i in range(4)] + prompts(4, lengths=(9, 14), seed=5)
    arrivals = {0: [(str(i), p, GREEDY) for i, p in enumerate(batch[:5])],
                6: [(str(i), p, GREEDY) for i, p in enumerate(batch[5:], start=5)]}
    arrivals[9] = [("n", shared + [9], SamplingParams(max_tokens=16, temperature=0.0,
                                                       ignore_eos=True, n=2))]
    results = drain(eng, arrivals)
    for i, p in enumerate(batch):
        assert results[(str(i), 0)][0] == hf_greedy(hf, p, 16), i
    assert results[("n", 0)][0] == results[("n", 1)][0] == hf_greedy(hf, shared + [9], 16)
    works = [w for batch_, _ in seen for w in batch_]
    assert any(not w.draft_on for w in works) and any(w.k for w in works)
    assert all(w.k == 0 for w in works if not w.draft_on)  # asked for 3, it proposes none
    # a step with no sequence the head keeps anything for taps no features
    assert {(head, verdict.features is not None) for head, verdict in tapped} == {
        (True, True), (False, False)}
    stats = eng.stats()
    assert stats.preemptions > 0 and stats.prefix_cached_tokens > 0
    assert stats.drafted_tokens > 0


def test_a_head_is_not_a_target_and_must_fit_its_target(models, tmp_path):
    hf, root, _ = models
    head = load_model(root / "head")
    with pytest.raises(ModelLoadError, match="a draft, not a target"):
        Engine(head, None, None, EngineConfig(block_size=4, num_blocks=64))
    wide = tiny_checkpoint(tmp_path / "wide", hidden_size=32, num_hidden_layers=3)
    del wide
    with pytest.raises(ModelLoadError, match="hidden states of size 64"):
        Engine(load_model(tmp_path / "wide"), head, None, EngineConfig(block_size=4,
                                                                      num_blocks=64))
    tiny_head(tmp_path / "deep", hf.config, eagle_aux_hidden_state_layer_ids=[0, 1, 5])
    with pytest.raises(ModelLoadError, match=r"target layers \[0, 1, 5\]"):
        Engine(load_model(root / "target"), load_model(tmp_path / "deep"), None,
               EngineConfig(block_size=4, num_blocks=64))


@pytest.mark.parametrize("damage", ["drop fc", "d2t out of range", "d2t missing"])
def test_a_damaged_head_checkpoint_names_the_problem(models, tmp_path, damage):
    _, root, _ = models
    folder = tmp_path / "bad"
    folder.mkdir()
    tensors = load_file(root / "small" / HEAD_FILE)
    if damage == "drop fc":
        del tensors["fc.weight"]
        expected = "lack tensor 'fc.weight'"
    elif damage == "d2t out of range":
        tensors["d2t"] = tensors["d2t"] + 1000
        expected = "d2t must map"
    else:
        del tensors["d2t"]
        expected = "needs d2t"
    save_file(tensors, folder / HEAD_FILE)
    (folder / "config.json").write_text(json.dumps(json.loads(
        (root / "small" / "config.json").read_text())))
    with pytest.raises(ModelLoadError, match=expected):
        load_model(folder)
