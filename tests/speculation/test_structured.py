"""Structured outputs through the engine, on a tiny random model with
SmolLM2's tokenizer: whatever the model prefers, every output matches its
constraint; greedy outputs are the same with and without speculation (the
grammar's forced tokens and model-free proposals cut by the grammar); and
sampling under a mask keeps the masked target's distribution."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpage.core.grammar import Constraint, json_schema
from specpage.core.request import SamplingParams, ValidationError
from specpage.engine import Engine, EngineConfig
from specpage.llm import LLM
from specpage.models.loader import load_model
from specpage.speculation.sampling_rows import grammar_bias, mask_rows_
from tests.speculation.test_sampling import ALPHA, RUNS, VOCAB, chi_square_p, peaked_model
from tests.support.checkpoints import tokenizer_pair
from tests.support.head import tiny_head

PROMPT_TEXT = "Write the record as JSON."
MAX_TOKENS = 400  # more than any schema below can take: every output completes


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("structured")
    tokenizer_pair(root)
    return root


@pytest.fixture(scope="module")
def engines(folder: Path) -> dict[str, LLM]:
    """Speculation off; model-free and the grammar's forced tokens; and
    with the draft model configured beside them."""
    base = dict(num_blocks=1024, block_size=16, max_num_seqs=16, adaptive_k=False)
    return {
        "off": LLM(folder / "target", config=EngineConfig(spec_k=0, **base)),
        "model_free": LLM(folder / "target", config=EngineConfig(spec_k=4, **base)),
        "draft": LLM(folder / "target", draft=folder / "draft",
                     config=EngineConfig(spec_k=4, **base)),
    }


# ------------------------------------------------------------------ schemas

KEYS = st.from_regex(r"[a-z]{1,6}", fullmatch=True)
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-50, 50), st.integers(0, 500)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda values: {"enum": values},
              st.lists(st.text(alphabet="abxyz -", min_size=1, max_size=6), min_size=1,
                       max_size=4, unique=True)),
    st.just({"type": "string", "pattern": "^[a-z]{1,5}$"}),
    st.just({"type": "null"}),
)


@st.composite
def objects(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    properties = draw(st.dictionaries(KEYS, children, min_size=1, max_size=3))
    required = [key for key in properties if draw(st.booleans())]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def arrays(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda items, most: {"type": "array", "items": items, "maxItems": most},
                     children, st.integers(0, 3))


NESTED = st.recursive(LEAVES, lambda children: st.one_of(objects(children), arrays(children)),
                      max_leaves=6)
SCHEMAS = objects(NESTED)


def generated(llm: LLM, params: SamplingParams, constraint: Constraint) -> list[Any]:
    completion = llm.generate([PROMPT_TEXT], params, chat=True, constraint=constraint)[0]
    return completion.samples


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMAS)
def test_every_output_parses_and_validates_and_greedy_ones_agree(engines, schema):
    constraint = json_schema(schema, "response_format")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=2)
    texts = {}
    for name, llm in engines.items():
        samples = generated(llm, greedy, constraint) + generated(llm, sampled, constraint)
        for sample in samples:
            assert sample.finish_reason == "stop", (name, sample.text)
            jsonschema.validate(json.loads(sample.text), schema)
        texts[name] = samples[0].token_ids
    assert texts["model_free"] == texts["off"]
    assert texts["draft"] == texts["off"]


def test_greedy_constrained_tokens_are_the_argmax_of_the_fully_masked_logits(folder, engines):
    """The reference: transformers' logits at each position, every token the
    grammar forbids masked, argmax, the grammar advanced by it. The engines
    mask a greedy row only where its argmax is forbidden."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder / "target").eval()
    llm = engines["model_free"]
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["x", "y z"]}, "maxItems": 3},
        "n": {"type": "integer", "minimum": -20, "maximum": 2000}},
        "required": ["name", "n"], "additionalProperties": False}
    constraint = json_schema(schema, "guided_json")
    prompt = llm.engine.make_request("ref", PROMPT_TEXT, SamplingParams()).prompt_token_ids
    sequence = llm.engine.intake.grammars.compile(constraint).start()
    tokens: list[int] = []
    with torch.no_grad():
        while not sequence.stopped:
            logits = model(torch.tensor([list(prompt) + tokens])).logits[0, -1]
            bias = grammar_bias(sequence.masks([]), 1, logits.shape[-1])[0]
            tokens.append(int((logits + bias).argmax()))
            assert sequence.take(tokens[-1]) is None
    for name in ("off", "model_free"):
        completion = engines[name].generate([PROMPT_TEXT], SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0), constraint=constraint)[0]
        assert completion.samples[0].token_ids == tokens, name


def test_forced_tokens_are_proposed_and_accepted_without_a_model(engines):
    schema = {"type": "object", "properties": {
        "first_name": {"type": "string", "maxLength": 6},
        "last_name": {"type": "string", "maxLength": 6},
        "favourite_colour": {"enum": ["red", "green", "blue"]}},
        "required": ["first_name", "last_name", "favourite_colour"],
        "additionalProperties": False}
    llm = engines["model_free"]
    before = llm.engine.stats().by_method.get("grammar")
    samples = generated(llm, SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                        json_schema(schema, "guided_json"))
    after = llm.engine.stats().by_method["grammar"]
    drafted = after.drafted - (before.drafted if before else 0)
    accepted = after.accepted - (before.accepted if before else 0)
    assert drafted >= 6  # the keys and punctuation, at least
    assert accepted >= drafted // 2
    assert json.loads(samples[0].text).keys() == schema["properties"].keys()
    plain = generated(engines["off"], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                      json_schema(schema, "guided_json"))
    assert plain[0].token_ids == samples[0].token_ids
    assert "grammar" not in engines["off"].engine.stats().by_method  # off proposes nothing


@pytest.mark.parametrize("name", ["off", "model_free"])
def test_choices_regexes_and_grammars_hold_for_every_sample(engines, name):
    llm = engines[name]
    sampled = SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=4, logprobs=True)
    cases = [
        (Constraint("choice", choices=("yes", "no", "not sure")),
         lambda text: text in ("yes", "no", "not sure")),
        (Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"),
         lambda text: len(text) >= 6 and text[:3].isdigit() and text[3] == "-"),
        (Constraint("grammar", 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]'),
         lambda text: text[0] == "(" and text[-1] == ")" and set(text[1:-1]) <= set("abc,")),
    ]
    for constraint, holds in cases:
        for sample in generated(llm, sampled, constraint):
            assert sample.finish_reason == "stop" and holds(sample.text), sample.text
            # the target's own log-probabilities, one per token
            assert len(sample.logprobs) == len(sample.token_ids)
            assert all(lp <= 0 for lp in sample.logprobs)


def test_a_bad_constraint_is_refused_and_the_engine_serves_on(engines):
    llm = engines["off"]
    with pytest.raises(ValidationError) as caught:
        generated(llm, SamplingParams(max_tokens=4), Constraint("regex", "(", field="r"))
    assert caught.value.field == "r"
    assert not llm.engine.has_unfinished()
    samples = generated(llm, SamplingParams(max_tokens=8, temperature=0),
                        Constraint("choice", choices=("ok",)))
    assert samples[0].text == "ok"
    llm.engine.pool.check_integrity()


# ------------------------------------------------------------------ distribution

@pytest.fixture(scope="module")
def head_llm(folder: Path) -> LLM:
    """The target with a random EAGLE-3 head as its draft."""
    from transformers import AutoConfig

    tiny_head(folder / "head", AutoConfig.from_pretrained(folder / "target"),
              eagle_aux_hidden_state_layer_ids=[0, 1, 1])
    return LLM(folder / "target", draft=folder / "head", config=EngineConfig(
        spec_k=4, num_blocks=1024, block_size=16, max_num_seqs=16, adaptive_k=False))


@pytest.mark.parametrize("name", ["draft", "head"])
def test_the_draft_and_the_head_propose_under_the_grammar(engines, head_llm, name):
    """Where the grammar leaves a choice, the draft model (or the head)
    proposes, masked by the grammar: greedy output as without speculation,
    every sample valid."""
    llm = head_llm if name == "head" else engines[name]
    schema = {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 12},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                 "maxItems": 3}},
        "required": ["title", "year", "tags"], "additionalProperties": False}
    constraint = json_schema(schema, "guided_json")
    before = llm.engine.stats().by_method.get("draft")
    greedy = generated(llm, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), constraint)
    sampled = generated(llm, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                                            n=3), constraint)
    after = llm.engine.stats().by_method["draft"]
    assert after.drafted - (before.drafted if before else 0) > 0
    for sample in greedy + sampled:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), schema)
    plain = generated(engines["off"], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                      constraint)
    assert greedy[0].token_ids == plain[0].token_ids


# On an 8-token vocabulary whose tokens are the letters a..g (0 is the end),
# a regex allows different letters at each position.
LETTERS = "abcdefg"
PATTERN = "[a-e][a-c][b-g][a-g]"
ALLOWED = [set(range(1, 6)), {1, 2, 3}, set(range(2, 8))]  # positions 1..3, by token id
LETTER_PROMPT = [1, 2, 3] * 3 + [1]  # "abcabcabca": prompt lookup finds continuations


class LetterTokenizer:
    """llguidance's view of the 8-token vocabulary: token i > 0 is a letter."""

    eos_token_id = 0
    bos_token_id = None
    tokens = [b"<end>"] + [c.encode() for c in LETTERS]
    special_token_ids = [0]

    def __call__(self, text: bytes) -> list[int]:
        return [LETTERS.index(chr(b)) + 1 for b in text]


def masked_joint(model, params: SamplingParams) -> torch.Tensor:
    """P(x2, x3) of the 2nd and 3rd tokens, each drawn from the target's
    distribution with the tokens its position forbids masked out."""
    from specpage.speculation.sampler import probabilities

    def dist(prefix: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([LETTER_PROMPT + list(prefix)])).logits[0, -1:].clone()
        forbidden = [t for t in range(VOCAB) if t not in ALLOWED[len(prefix)]]
        logits[0, forbidden] = float("-inf")
        return probabilities(logits, torch.tensor([params.temperature]),
                             torch.tensor([params.top_k]), torch.tensor([params.top_p]))[0]
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = dist(())
    for x1 in range(VOCAB):
        if p1[x1] == 0:
            continue
        p2 = dist((x1,))
        for x2 in range(VOCAB):
            if p2[x2] > 0:
                joint[x2] += p1[x1] * p2[x2] * dist((x1, x2)).double()
    return joint.flatten()


def masked_counts(target, params: SamplingParams, methods: str, draft=None,
                  proposed: list[int] | None = None) -> tuple[torch.Tensor, Engine]:
    """proposed: gets each sampled sequence's proposal length, step by step."""
    import llguidance

    engine = Engine(target, draft, None, EngineConfig(
        block_size=4, num_blocks=2048, max_num_seqs=256, max_step_tokens=2048,
        spec_k=2 if methods or draft else 0, adaptive_k=False, spec_methods=methods))
    if proposed is not None:
        execute = engine.executor.execute

        def counted(*args, **kwargs):
            result = execute(*args, **kwargs)
            proposed.extend(done.num_proposed for done in result.seqs if done.tokens)
            return result
        engine.executor.execute = counted
    grammars = engine.intake.grammars
    grammars._tokenizer = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(LetterTokenizer()), n_vocab=VOCAB, eos_token=0)
    for seed in range(RUNS):
        engine.add_request(str(seed), LETTER_PROMPT, SamplingParams(
            max_tokens=8, temperature=params.temperature, top_k=params.top_k,
            top_p=params.top_p, seed=seed, ignore_eos=True),  # the model's EOS is a letter
            constraint=Constraint("regex", PATTERN))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    for tokens in outputs.values():
        assert len(tokens) == 4 and all(t in ALLOWED[i] for i, t in enumerate(tokens[:3]))
    counts = Counter(tokens[1] * VOCAB + tokens[2] for tokens in outputs.values())
    return torch.tensor([counts[i] for i in range(VOCAB * VOCAB)], dtype=torch.float64), engine


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_k=3, top_p=0.9)],
                         ids=["plain", "top-k-top-p"])
def test_sampling_under_a_mask_keeps_the_masked_distribution(tmp_path, params):
    target_hf = peaked_model(tmp_path / "t", seed=0, peak=4.0)
    target = load_model(tmp_path / "t")
    exact = masked_joint(target_hf, params)
    plain, _ = masked_counts(target, params, "")
    speculative, engine = masked_counts(target, params, "ngram")
    assert engine.stats().by_method["ngram"].drafted > 0
    assert chi_square_p(plain, exact) > ALPHA
    assert chi_square_p(speculative, exact) > ALPHA
    unmasked = exact.clone().fill_(1.0)  # the test has power: uniform is rejected
    assert chi_square_p(plain, unmasked) < ALPHA


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_k=3, top_p=0.9)],
                         ids=["plain", "top-k-top-p"])
@pytest.mark.parametrize("scores", [None, [4, 5, 6, 7]], ids=["whole", "narrow"])
def test_a_draft_under_a_mask_keeps_the_masked_distribution(tmp_path, params, scores):
    """The draft model proposes under the grammar: its distribution masked
    at each depth, the q verification reads. A draft that scores only d..g
    has nothing to propose where the grammar wants a..c, and stops there."""
    target_hf = peaked_model(tmp_path / "t", seed=0, peak=4.0)
    peaked_model(tmp_path / "d", seed=1, peak=2.0)
    exact = masked_joint(target_hf, params)
    draft = load_model(tmp_path / "d")
    if scores is not None:
        draft.model.restrict_output_vocab(torch.tensor(scores))
    proposed: list[int] = []
    speculative, engine = masked_counts(load_model(tmp_path / "t"), params, "", draft,
                                        proposed)
    drafted = engine.stats().by_method["draft"]
    assert drafted.drafted > 0 and drafted.accepted > 0
    if scores is not None:  # it stopped short of k = 2, after its first proposal
        assert Counter(proposed)[1] > 0
    assert chi_square_p(speculative, exact) > ALPHA
    assert chi_square_p(speculative, exact.clone().fill_(1.0)) < ALPHA


@pytest.mark.parametrize(("vocab", "width"), [(49152, 6144), (211, 28), (1000, 100),
                                              (64, 4)])
def test_the_native_mask_equals_the_added_bias(vocab, width):
    """mask_rows_ (one native pass) against the bias it replaces: every row
    given masked, others untouched, tokens past the mask's width forbidden;
    masks of every kind of byte and 64-token word."""
    generator = torch.Generator().manual_seed(vocab)
    rows = [4, 0, 2]
    packed = torch.randint(0, 256, (len(rows), width), dtype=torch.uint8, generator=generator)
    packed[0, : width // 2] = 0  # whole words forbidden
    packed[1, : width // 2] = 255  # whole words allowed
    masks = packed.numpy().tobytes()
    logits = torch.randn(6, vocab, generator=generator)
    expected = logits.clone()
    expected[rows] += grammar_bias(masks, len(rows), vocab)
    got = logits.clone()
    mask_rows_(got, rows, masks)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 3, 5]], logits[[1, 3, 5]])
