"""Held-out acceptance of a draft: the target's greedy answers to the
benchmark chat prompts (bench/prompts.py: the topic prompts, whose topics no
training prompt uses, and the mixed requests, which no training generator
makes), drafted at a fixed k by specpage's engine. Per-token acceptance is accepted
/ tested draft tokens (a proposal is tested when every proposal before it was
accepted): the a for which a step yields (1 - a^(k+1)) / (1 - a) tokens on
average. Accepted / drafted is reported too.

    python -m draft.evaluate --draft models/smollm2-draft --k 1 2 3 4 5 6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.prompts import chat_prompts, mixed_prompts
from specpage.core.request import SamplingParams
from specpage.core.span import Span
from specpage.engine import EngineConfig
from specpage.executor.model_runner import ModelRunner
from specpage.llm import LLM, chat_prompt
from specpage.models.decoder import LayerTap
from specpage.models.loader import load_model

PROMPT_SETS = {"topics": chat_prompts, "mixed": mixed_prompts}


def held_out_acceptance(draft: Path, k: int = 4, prompts: int = 32, max_tokens: int = 128,
                        batch: int = 32, prompt_set: str = "topics") -> dict[str, float]:
    llm = LLM("smollm2-135m", draft=draft,
              config=EngineConfig(num_blocks=4096, max_num_seqs=batch, spec_k=k,
                                  adaptive_k=False))
    texts = PROMPT_SETS[prompt_set](prompts)
    chats = [chat_prompt(llm.tokenizer, text) for text in texts]
    outputs = llm.generate(chats, SamplingParams(max_tokens=max_tokens, temperature=0))
    stats = llm.engine.stats()
    by_position = [n / max(1, stats.drafted_tokens // k) for n in stats.accepted_by_position]
    return {"k": k, "prompts": prompts, "prompt_set": prompt_set,
            "output_tokens": sum(len(o.samples[0].token_ids) for o in outputs),
            "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
            "per_token_acceptance": stats.per_token_acceptance,
            "accepted_over_drafted": stats.acceptance,
            "accepted_by_position": [round(p, 3) for p in by_position]}


def replay_steps(right: list[list[bool]], first: int, end: int) -> tuple[int, int]:
    """(tested, accepted) proposals of steps of len(right) proposals each,
    the first step's from anchor `first`, until an anchor reaches `end`:
    right[j][p] says whether proposal j + 1 from anchor p is the target's
    token. A step's proposals are tested until the first wrong one; the next
    step's anchor follows the target's token after the last one kept."""
    tested = accepted = 0
    anchor, k = first, len(right)
    while anchor < end:
        kept = 0
        while kept < k and right[kept][anchor]:
            kept += 1
        tested += kept + (kept < k)
        accepted += kept
        anchor += kept + 1
    return tested, accepted


def replayed_acceptance(head: Path, k: int = 4, prompts: int = 32, max_tokens: int = 128,
                        prompt_set: str = "mixed") -> dict[str, object]:
    """An EAGLE-3 head's held-out acceptance without drafting: the target's
    greedy answers as held_out_acceptance makes them, then the head unrolled
    k proposals deep over every answer position at once as it trains
    (draft/train_head.ttt_forward, which equals drafting through its runner),
    and the engine's steps replayed over them: a step's proposals start
    after the token the last step ended on, and are tested until the first
    that is not the target's. Seconds where the engine takes minutes; the
    same per-token acceptance up to ties the two computations break apart
    (0.435 against the engine's 0.436 for models/smollm2-head at k = 4 on the
    mixed requests). Also each depth's top-1 over every answer position."""
    from draft.train_head import head_logits, ttt_forward  # the trainer's, torch-heavy

    llm = LLM("smollm2-135m", config=EngineConfig(num_blocks=4096, max_num_seqs=32))
    chats = [chat_prompt(llm.tokenizer, text) for text in PROMPT_SETS[prompt_set](prompts)]
    outputs = llm.generate(chats, SamplingParams(max_tokens=max_tokens, temperature=0))
    blocks = (max(map(len, chats)) + max_tokens) // 16 + 1
    runner = ModelRunner(llm.target, blocks, 16)
    loaded = load_model(head, dtype=torch.float32)
    model = loaded.model
    layers = loaded.config.layers_of(llm.target.config.num_layers)
    embed = llm.target.model.embed_tokens.weight.detach().float()
    hits, rows, tested, accepted = [0] * k, [0] * k, 0, 0
    for chat, output in zip(chats, outputs, strict=True):
        ids = chat + list(output.samples[0].token_ids)
        tap = LayerTap(layers)
        with torch.inference_mode():
            logits = runner.forward([Span(ids, 0, list(range(blocks)),
                                             num_logits=len(ids))], tap)
            features = torch.cat(tap.states, -1)[:-2].float()  # anchors p: token p + 2 next
            n = features.shape[0]
            outs = ttt_forward(model, embed[torch.tensor(ids[1 : n + 1])],
                               model.fc(features), min(k, n))
        greedy = logits.argmax(-1)  # row r: the target's token r + 1
        right = []
        for depth, out in enumerate(outs):
            drafted = model.draft_to_target[head_logits(model, out).argmax(-1)]
            right.append(drafted == greedy[depth + 1 : depth + 1 + out.shape[0]])
            answer = right[-1][max(0, len(chat) - 2 - depth):]
            hits[depth] += int(answer.sum())
            rows[depth] += answer.numel()
        # the prefill's token is the first proposal's input
        steps = replay_steps([r.tolist() for r in right], len(chat) - 1, n - k)
        tested += steps[0]
        accepted += steps[1]
    return {"k": k, "prompts": prompts, "prompt_set": prompt_set, "replayed": True,
            "per_token_acceptance": round(accepted / max(tested, 1), 4),
            "top1_by_depth": [round(h / max(r, 1), 4) for h, r in zip(hits, rows, strict=True)]}


def draft_costs(draft: Path, dtype: str = "auto") -> dict[str, object]:
    """The draft's forward as a fraction of the target's, at 1 and 32
    positions, from the costs the engine measures for its policy when it
    starts (speculation/calibrate.py), in the dtype the daemon runs."""
    llm = LLM("smollm2-135m", draft=draft, dtype=dtype,
              config=EngineConfig(num_blocks=4096, max_num_seqs=32, spec_k=4))
    policy = llm.engine.core.policy
    target, proposer = policy.target_cost, policy.draft_cost
    return {"dtype": dtype, **{f"draft_over_target_at_{n}": round(proposer(n) / target(n), 4)
                               for n in (1, 4, 32)},
            "target_ms_at_1": round(1e3 * target(1), 3),
            "draft_ms_at_1": round(1e3 * proposer(1), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draft", type=Path, default=Path("models/smollm2-draft"))
    parser.add_argument("--k", type=int, nargs="+", default=[4], help="one run per k")
    parser.add_argument("--prompt-set", choices=[*PROMPT_SETS, "both"], default="both",
                        help="the benchmark's topic prompts, the mixed requests, or both")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--costs", action="store_true",
                        help="also the draft's forward cost as a fraction of the target's")
    parser.add_argument("--replay", action="store_true",
                        help="an EAGLE-3 head's acceptance replayed over the target's answers "
                             "(seconds) instead of drafted by the engine (minutes)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.costs:
        print(json.dumps(draft_costs(args.draft)), flush=True)
    sets = list(PROMPT_SETS) if args.prompt_set == "both" else [args.prompt_set]
    for prompt_set in sets:
        for k in args.k:
            measure = replayed_acceptance if args.replay else held_out_acceptance
            print(json.dumps(measure(args.draft, k, args.prompts, args.max_tokens,
                                     prompt_set=prompt_set)), flush=True)


if __name__ == "__main__":
    main()
