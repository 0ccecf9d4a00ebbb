"""Qwen3 and Gemma 3 text checkpoints made with transformers: specpage's
logits equal transformers' in fp32 through whole and chunked prefill and
decode on every CPU attention backend, prompts longer than Gemma's sliding
window; greedy generation through the Engine (no speculation, a draft of
the same family, model-free proposals) equals transformers' generate; and
what the config reads or refuses."""

from __future__ import annotations

import random

import pytest
import torch

from specpage.attention.cpu import CpuAttention
from specpage.attention.native import native_kernels
from specpage.attention.reference import TorchAttention
from specpage.core.block_pool import HOLE, BlockPool
from specpage.core.layer_groups import GroupedPool, layer_groups
from specpage.core.request import SamplingParams
from specpage.core.span import Span
from specpage.engine import Engine, EngineConfig
from specpage.executor.model_runner import ModelRunner
from specpage.models.config import FULL, SLIDING, ModelConfig, ModelLoadError
from specpage.models.loader import load_model
from tests.support.checkpoints import family_checkpoint

VOCAB, WINDOW = 300, 8
BLOCK_SIZE = 4
TOLERANCE = 1e-4  # fp32 logits; products and sums in another order


# name -> family and what its checkpoints set: Qwen3 with its window on the
# layers from max_window_layers, as no released Qwen3 has it, tests the window
# with Llama's norms and a single rotary.
VARIANTS = {"qwen3": ("qwen3", {}), "gemma3": ("gemma3", {}),
            "qwen3-sliding": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW,
                                        "max_window_layers": 3}),
            "gemma3-head256": ("gemma3", {"head_dim": 256})}  # Gemma 3's own head size


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoints(request, tmp_path_factory):
    """(variant, HF target, folder of the target, folder of a one-layer draft)."""
    family, overrides = VARIANTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    shape = dict(vocab_size=VOCAB, **overrides)
    if family == "gemma3":
        shape.update(sliding_window=WINDOW)
    hf = family_checkpoint(root / "target", family, **shape)
    family_checkpoint(root / "draft", family, seed=1, num_hidden_layers=1, **shape)
    return request.param, hf, root / "target", root / "draft"


def test_configs_read_the_families(checkpoints):
    variant, _, folder, _ = checkpoints
    config = load_model(folder).config
    assert config.family == VARIANTS[variant][0] and config.qk_norm
    if variant == "qwen3":
        assert not config.windowed and config.attention_scale == 32**-0.5
        return
    if variant == "qwen3-sliding":
        assert [config.window_of(i) for i in range(7)] == [None] * 3 + [WINDOW] * 4
        assert config.local_rope is None
        return
    assert config.layer_types == (SLIDING,) * 5 + (FULL, SLIDING)
    assert [config.window_of(i) for i in range(7)] == [WINDOW] * 5 + [None, WINDOW]
    assert config.attention_scale == 24**-0.5 and config.hidden_act == "gelu_pytorch_tanh"
    assert config.rope.theta == 100_000.0 and config.rope.factor == 2.0
    assert config.local_rope is not None and config.local_rope.theta == 10_000.0


def backends():
    made = {"reference": TorchAttention}
    if native_kernels() is not None:
        made["cpu"] = CpuAttention
        made["cpu-every-span"] = lambda: CpuAttention(every_span=True)
    return made


def run_logits(runner, tokens, pieces):
    """Logits of every position of tokens, fed in pieces of these lengths
    (prefill chunks, then decode tokens or verify spans), through one pool."""
    pool = BlockPool(64, BLOCK_SIZE)
    pool.allocate_prompt(0, tokens)
    rows, start = [], 0
    for n in pieces:
        piece = tokens[start:start + n]
        rows.append(runner.forward([Span(piece, start, list(pool.block_table(0)), n)]))
        pool.commit(0, piece)
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("backend", list(backends()))
@pytest.mark.parametrize("pieces", [[40], [7, 7, 7, 7, 7, 5], [30, 1, 1, 1, 1, 6]],
                         ids=["whole", "chunked", "decode-verify"])
def test_logits_equal_transformers(checkpoints, backend, pieces):
    _, hf, folder, _ = checkpoints
    tokens = random.Random(3).choices(range(VOCAB), k=40)  # five windows long
    runner = ModelRunner(load_model(folder), 64, BLOCK_SIZE, backend=backends()[backend]())
    ours = run_logits(runner, tokens, pieces)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert float((ours - ref).abs().max()) < TOLERANCE


@pytest.mark.parametrize("backend", list(backends()))
def test_logits_through_layer_groups_equal_transformers(checkpoints, backend):
    """The target's KV in pages of a layer group each (core/layer_groups.py),
    each group through its own tables and the sliding ones giving back the
    blocks behind their window as prefill and decoding commit: transformers'
    logits on every backend, chunked and then a token at a time."""
    _, hf, folder, _ = checkpoints
    loaded = load_model(folder)
    c = loaded.config
    groups = layer_groups([c.window_of(i) or 0 for i in range(c.num_layers)])
    count = len(groups.windows)
    pool = GroupedPool(BlockPool(64 * count, BLOCK_SIZE), groups)
    runner = ModelRunner(loaded, 64 * count, BLOCK_SIZE, backend=backends()[backend](),
                         groups=groups)
    tokens = random.Random(3).choices(range(VOCAB), k=40)
    pool.allocate_prompt(0, tokens)
    rows, start = [], 0
    for n in [7, 7, 7, 7, 1, 1, 1, 1, 1, 1, 1, 5]:
        piece = tokens[start:start + n]
        first, *others = pool.block_tables(0)
        rows.append(runner.forward([Span(piece, start, first, n, others)]))
        pool.commit(0, piece)
        start += n
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert float((torch.cat(rows) - ref).abs().max()) < TOLERANCE
    # the sliding groups gave back all but the window's blocks
    held = [sum(b != HOLE for b in pool.pool.block_table((0, g))) for g in range(count)]
    assert held == [10 if w == 0 else 2 for w in groups.windows]  # positions 33..39
    pool.check_integrity()


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def prompts():
    rng = random.Random(5)
    lengths = (40, 3, 17, 25)
    batch = [rng.choices(range(VOCAB), k=n) for n in lengths]
    batch.append([7, 8, 9, 10, 11] * 6)  # repeats: model-free methods find proposals
    return batch


def hf_greedy(hf, prompt, max_new):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hf_outputs(checkpoints):
    return [hf_greedy(checkpoints[1], p, GREEDY.max_tokens) for p in prompts()]


@pytest.mark.parametrize("speculation", ["off", "draft", "model-free"])
def test_greedy_generation_equals_transformers(checkpoints, hf_outputs, speculation):
    _, _, folder, draft_folder = checkpoints
    draft = load_model(draft_folder) if speculation == "draft" else None
    methods = "ngram,suffix" if speculation == "model-free" else ""
    eng = Engine(load_model(folder), draft, None, EngineConfig(
        block_size=BLOCK_SIZE, num_blocks=256, spec_k=3, adaptive_k=False,
        spec_methods=methods, max_step_tokens=24))
    for i, prompt in enumerate(prompts()):
        eng.add_request(str(i), prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    for _ in range(500):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert [tokens[str(i)] for i in range(len(hf_outputs))] == hf_outputs
    eng.pool.check_integrity()
    drafted = eng.stats().drafted_tokens
    assert (drafted > 0) == (speculation != "off")


@pytest.mark.parametrize("speculation", ["off", "model-free"])
def test_layer_groups_change_no_token_and_hold_fewer_blocks(checkpoints, speculation):
    """EngineConfig.hybrid_kv on and off: the same greedy tokens, with a
    prompt's prefix shared from the cache, n > 1, an abort and preemption
    (a pool that cannot hold every sequence at once), and the pool whole
    after; on, a windowed model's sequences hold fewer blocks' worth of KV."""
    variant, _, folder, _ = checkpoints
    methods = "ngram,suffix" if speculation == "model-free" else ""
    runs = {}
    for hybrid in (False, True):
        eng = Engine(load_model(folder), None, None, EngineConfig(
            block_size=BLOCK_SIZE, num_blocks=40, spec_k=3, adaptive_k=False,
            spec_methods=methods, max_step_tokens=24, hybrid_kv=hybrid))
        batch = prompts()
        for i, prompt in enumerate(batch + [batch[0] + [5, 6]]):  # the last: a prefix hit
            eng.add_request(str(i), prompt, GREEDY)
        eng.add_request("n", batch[2], SamplingParams(max_tokens=20, temperature=0.0,
                                                      ignore_eos=True, n=2))
        eng.add_request("gone", batch[1], GREEDY)
        tokens: dict[tuple[str, int], list[int]] = {}
        peak = 0
        for step in range(800):
            if not eng.has_unfinished():
                break
            if step == 3:
                eng.abort("gone")
            for out in eng.step():
                tokens.setdefault((out.request_id, out.index), []).extend(out.token_ids)
            stats = eng.pool.stats()
            pool = eng.pool
            groups = len(pool.groups.windows) if isinstance(pool, GroupedPool) else 1
            peak = max(peak, stats.in_use / groups)  # in blocks of every layer
            eng.pool.check_integrity()
        assert not eng.has_unfinished()
        assert eng.pool.stats().in_use == 0
        tokens.pop(("gone", 0), None)
        runs[hybrid] = (tokens, peak, eng.stats().preemptions, eng.stats().prefix_cached_tokens)
    assert runs[True][0] == runs[False][0]
    assert runs[False][2] > 0 and runs[False][3] > 0  # preempted, and a prefix shared
    if variant != "qwen3":
        assert runs[True][1] < runs[False][1]


def gemma_raw(**changes):
    """An older Gemma 3 config.json's keys (before layer_types and rope_parameters)."""
    raw = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 13,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
           "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 512,
           "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256,
           "max_position_embeddings": 32768, "attn_logit_softcapping": None,
           "final_logit_softcapping": None}
    raw.update(changes)
    return raw


def test_an_older_gemma3_config_reads_as_transformers_does():
    config = ModelConfig.from_dict(gemma_raw())
    globals_ = [i for i, kind in enumerate(config.layer_types) if kind == FULL]
    assert globals_ == [5, 11] and config.sliding_window == 512
    assert config.max_position == 32768  # the window no longer bounds the context
    assert (config.rope.theta, config.rope.rope_type, config.rope.factor) == (
        1_000_000.0, "linear", 8.0)
    assert config.local_rope is not None
    assert (config.local_rope.theta, config.local_rope.rope_type) == (10_000.0, "default")
    assert config.rope_of(5) is config.rope and config.rope_of(4) is config.local_rope
    assert config.attention_scale == 256**-0.5


@pytest.mark.parametrize(("changes", "message"), [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ({"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
    ({"layer_types": ["full_attention"]}, "layer_types must name"),
])
def test_what_gemma3_configs_cannot_be_is_named(changes, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(gemma_raw(**changes))


def test_qwen3_slides_only_where_its_config_says():
    raw = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2,
           "head_dim": 4, "sliding_window": 16, "use_sliding_window": False,
           "max_window_layers": 2}
    assert not ModelConfig.from_dict(raw).windowed
    config = ModelConfig.from_dict({**raw, "use_sliding_window": True})
    assert [config.window_of(i) for i in range(4)] == [None, None, 16, 16]


def test_a_windowed_model_is_refused_by_a_backend_without_windows(tmp_path):
    triton_attention = pytest.importorskip("specpage.attention.triton")
    family_checkpoint(tmp_path, "gemma3", num_hidden_layers=2, sliding_window=WINDOW)
    loaded = load_model(tmp_path)
    with pytest.raises(ModelLoadError, match="sliding-window layers need an attention backend"):
        ModelRunner(loaded, 16, BLOCK_SIZE, backend=triton_attention.TritonAttention())


def test_keys_a_config_leaves_out_take_transformers_defaults():
    from transformers import Gemma3TextConfig, Qwen3Config

    shape = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 13,
             "num_attention_heads": 2}
    gemma = ModelConfig.from_dict({"architectures": ["Gemma3ForCausalLM"], **shape})
    hf = Gemma3TextConfig(**shape)
    assert (gemma.head_dim, gemma.sliding_window, gemma.max_position) == (
        hf.head_dim, hf.sliding_window, hf.max_position_embeddings)
    assert gemma.attention_scale == hf.query_pre_attn_scalar**-0.5
    assert gemma.layer_types == tuple(hf.layer_types) and gemma.tie_word_embeddings
    assert gemma.rope.theta == hf.rope_parameters[FULL]["rope_theta"]
    assert gemma.local_rope is not None
    assert gemma.local_rope.theta == hf.rope_parameters[SLIDING]["rope_theta"]
    qwen = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], **shape})
    assert qwen.head_dim == Qwen3Config(**shape).head_dim and not qwen.windowed
