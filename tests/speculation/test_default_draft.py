"""The committed default draft (models/smollm2-draft): a standard HF
checkpoint of at most 32 MB with its README and license, the target's
tokenizer, and exact greedy outputs when it speculates for SmolLM2."""

from pathlib import Path

import pytest
import torch

from specpage.models.fetch import ensure_model
from specpage.models.loader import check_draft_compatible, draft_vocabulary, load_model

pytestmark = pytest.mark.slow

DRAFT = Path(__file__).resolve().parents[2] / "models" / "smollm2-draft"


@pytest.fixture(scope="module")
def smollm2():
    return ensure_model("smollm2-135m")


def test_the_checkpoint_is_small_documented_and_loads_in_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = {p.name: p.stat().st_size for p in DRAFT.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md",
            "LICENSE", "draft_vocab.json"} <= set(files)
    assert sum(files.values()) <= 32_000_000, files
    model = AutoModelForCausalLM.from_pretrained(DRAFT)
    assert model.config.vocab_size == 49152
    tokenizer = AutoTokenizer.from_pretrained(DRAFT)
    assert tokenizer.decode(tokenizer.encode("Hello, world")) == "Hello, world"


def test_it_shares_the_targets_tokenizer_and_vocabulary(smollm2):
    assert (DRAFT / "tokenizer.json").read_bytes() == (smollm2 / "tokenizer.json").read_bytes()
    check_draft_compatible(load_model(smollm2), load_model(DRAFT))


def test_its_vocabulary_covers_the_answers_it_learned_from_and_the_end():
    draft = load_model(DRAFT)
    vocabulary = draft_vocabulary(draft)
    assert vocabulary is not None
    assert 10_000 < len(vocabulary) < draft.config.vocab_size
    assert 2 in vocabulary  # <|im_end|>, SmolLM2-Instruct's end of turn


def test_greedy_outputs_with_the_draft_equal_the_target_alone(smollm2):
    from specpage.core.request import SamplingParams
    from specpage.engine import EngineConfig
    from specpage.llm import LLM, chat_prompt

    torch.manual_seed(0)
    alone = LLM(smollm2, config=EngineConfig(num_blocks=128, spec_k=0))
    pair = LLM(smollm2, draft=DRAFT, config=EngineConfig(num_blocks=128, spec_k=4,
                                                         adaptive_k=False))
    prompts = [chat_prompt(alone.tokenizer, text) for text in
               ("Give three facts about honey bees.", "What is the capital of France?")]
    params = SamplingParams(max_tokens=32, temperature=0)
    expected = [c.samples[0].token_ids for c in alone.generate(prompts, params)]
    got = [c.samples[0].token_ids for c in pair.generate(prompts, params)]
    assert got == expected
    stats = pair.engine.stats()
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0
