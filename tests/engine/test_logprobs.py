"""Log-probabilities through the engine on tiny random fp32 checkpoints: the
prompt's (every position, through chunked prefill, again after a prefix-cache
hit an earlier request would have given) and the generated tokens' top
alternatives equal log_softmax of transformers' logits, with a draft
model speculating; requests that ask for none carry none."""

import msgspec
import pytest
import torch

from specpage.core.request import SamplingParams
from tests.engine.test_engine import engine
from tests.support.checkpoints import target_and_draft

TOLERANCE = 1e-4
PROMPT = [11, 5, 23, 9, 40, 7, 7, 31, 2, 99, 150, 3, 17, 3, 17, 8, 64, 12, 5, 23, 9]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True,
                        top_logprobs=5, prompt_logprobs=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return target_and_draft(tmp_path_factory.mktemp("models"))


def run(eng, requests):
    """requests: [(id, prompt, params)] all at once; {id: outputs of sample 0}."""
    for request_id, prompt, params in requests:
        eng.add_request(request_id, prompt, params)
    outputs = {}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
        steps += 1
        assert steps < 1000
    eng.pool.check_integrity()
    return outputs


def hf_log_probs(hf, tokens):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)


def check_prompt(hf, prompt, found, n):
    expected = hf_log_probs(hf, prompt)
    assert found[0] is None and len(found) == len(prompt)
    for position in range(1, len(prompt)):
        entry, row = found[position], expected[position - 1]
        token = prompt[position]
        assert abs(entry.logprob - float(row[token])) < TOLERANCE, position
        assert entry.rank == int((row > row[token]).sum()) + 1
        assert [t for t, _ in entry.top] == row.topk(n).indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(row.topk(n).values.tolist(),
                                                            abs=TOLERANCE)


@pytest.mark.parametrize("chunk", [512, 8], ids=["whole", "chunked"])
def test_prompt_and_top_logprobs_equal_transformers(models, chunk):
    hf = models[0]
    eng = engine(models, "draft", max_step_tokens=chunk)
    # the first request leaves the prompt's blocks in the prefix cache
    run(eng, [("warm", PROMPT, msgspec.structs.replace(GREEDY, prompt_logprobs=None))])
    outputs = run(eng, [("again", PROMPT, GREEDY),
                        ("other", PROMPT[:9], msgspec.structs.replace(GREEDY, n=2,
                                                                        temperature=1.0))])
    first = outputs[("again", 0)][0]
    check_prompt(hf, PROMPT, first.prompt_logprobs, 3)
    assert all(o.prompt_logprobs is None for o in outputs[("again", 0)][1:])
    tokens = [t for o in outputs[("again", 0)] for t in o.token_ids]
    top = [t for o in outputs[("again", 0)] for t in o.top_logprobs]
    expected = hf_log_probs(hf, PROMPT + tokens)[len(PROMPT) - 1 : -1]
    for j, (token, alternatives) in enumerate(zip(tokens, top, strict=True)):
        assert token == int(expected[j].argmax())  # greedy: the target's own
        assert [t for t, _ in alternatives] == expected[j].topk(5).indices.tolist()
        assert [lp for _, lp in alternatives] == pytest.approx(
            expected[j].topk(5).values.tolist(), abs=TOLERANCE)
    for index in (0, 1):  # every sample's first output carries the prompt's
        check_prompt(hf, PROMPT[:9], outputs[("other", index)][0].prompt_logprobs, 3)


def test_only_requests_that_ask_recompute_their_prompt(models):
    eng = engine(models, "draft")
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    run(eng, [("warm", PROMPT, plain)])
    eng.add_request("plain", PROMPT, plain)
    eng.add_request("asks", PROMPT, msgspec.structs.replace(plain, prompt_logprobs=0))
    requests = eng.core.requests
    batch = eng.core.schedule()
    works = {w.seq_id: w for w in batch.seqs}
    plain_work = works[requests["plain"].sequences[0].seq_id]
    asks_work = works[requests["asks"].sequences[0].seq_id]
    assert (plain_work.start, plain_work.prompt_logprobs) == (20, -1)  # 5 cached blocks
    assert (asks_work.start, asks_work.prompt_logprobs) == (0, 0)
    outputs = {out.request_id: out for out in eng.core.apply(eng.executor.execute(batch))}
    assert outputs["plain"].prompt_logprobs is None
    assert len(outputs["asks"].prompt_logprobs) == len(PROMPT)
    assert all(o.top_logprobs is None and o.logprobs is None for o in outputs.values())
    run(eng, [])
