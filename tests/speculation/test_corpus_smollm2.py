"""The corpus table that ships for SmolLM2, through an engine as `make
serve` configures it (spec_corpus "auto"): it is found by the target's
vocabulary, proposes, is accepted, and greedy output stays the target's
alone, token for token (fp32)."""

import pytest

from specpage.core.request import SamplingParams
from specpage.engine import EngineConfig
from specpage.llm import LLM, chat_prompt
from specpage.models.fetch import ensure_model

pytestmark = pytest.mark.slow

QUESTIONS = ["Write a short paragraph about lighthouses.",
             "Explain how a bicycle gear works, step by step.",
             "Rewrite this sentence in the past tense: The cat sleeps on the warm windowsill."]


def test_the_shipped_corpus_proposes_and_keeps_greedy_output_exact():
    smollm2 = ensure_model("smollm2-135m")
    alone = LLM(smollm2, config=EngineConfig(spec_methods=""))
    # a fixed policy proposes every continuation found, whatever forwards cost
    served = LLM(smollm2, config=EngineConfig(spec_methods="corpus", adaptive_k=False))
    assert served.engine.core.model_free.corpus is not None
    params = SamplingParams(max_tokens=48, temperature=0.0)
    prompts = [chat_prompt(served.tokenizer, q) for q in QUESTIONS]
    assert ([c.token_ids for c in served.generate(prompts, params)]
            == [c.token_ids for c in alone.generate(prompts, params)])
    corpus = served.engine.stats().by_method["corpus"]
    assert corpus.drafted > 0 and corpus.accepted > 0
