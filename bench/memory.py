"""KV memory of real runs of the default pair (SmolLM2-135M-Instruct fp32 and
its draft, one shared pool), block size 16.

(a) A realistic length mix: the held-out chat prompts (bench/prompts.py),
    all submitted at once and answered greedily to their natural end (at most
    256 tokens), speculation on. Prefix caching is kept out of it (a cache
    salt per request) so that this is paging alone. Around every step it
    records positions holding valid KV (committed, both models), blocks in
    use, tentative blocks (speculation's slots, mid-step) and the block-table
    bytes. Position utilization is valid positions / allocated slots, averaged
    over steps. The same requests under two reservation schemes, computed from
    the run's own lengths: each running request reserving its maximum length
    (prompt + max_tokens) contiguously, and a static left-padded batch as HF
    `generate` keeps it (every row as long as the longest prompt plus the
    longest answer).
(b) Sharing: one request with n = 4 samples over a 512-token prompt against
    four independent requests with that prompt (prefix caching kept out by
    distinct salts), 32 sampled tokens each: the most blocks held at once.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish, machine, parse_args  # noqa: E402
from bench.prompts import chat_prompts  # noqa: E402
from specpage.core.kv_layout import KvShape  # noqa: E402
from specpage.core.request import SamplingParams  # noqa: E402
from specpage.engine import Engine, EngineConfig  # noqa: E402
from specpage.llm import LLM, chat_prompt  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

BLOCK = 16


def submit(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    request = engine.make_request(request_id, prompt, params)
    request.cache_salt = request_id.encode()  # no prefix sharing between requests
    engine.submit(request)


def length_mix(llm: LLM, prompts: list[list[int]], max_tokens: int,
               bytes_per_slot: int) -> dict[str, Any]:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        submit(engine, f"mix{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    schedule, tentative_peaks = engine.scheduler.schedule, []

    def schedule_and_record(now: float):
        plan = schedule(now)
        tentative_peaks.append(engine.pool.stats().tentative)
        return plan

    engine.scheduler.schedule = schedule_and_record  # type: ignore[method-assign]
    samples, finished = [], {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.usage
        running = engine.scheduler.running
        if not running:
            continue
        valid = sum(seq.num_computed for seq in running)
        in_use = engine.pool.stats().in_use
        table_entries = sum(len(engine.pool.block_table(seq.seq_id)) for seq in running)
        samples.append((valid, in_use, table_entries, len(running)))
    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    # Per-step reservations under the two contiguous schemes, same running sets.
    lengths = [(u.prompt_tokens, u.completion_tokens) for u in finished.values()]
    longest = max(p for p, _ in lengths) + max(c for _, c in lengths)
    reserve_each = statistics.mean(p for p, _ in lengths) + max_tokens
    utilization = [valid / (in_use * BLOCK) for valid, in_use, _, _ in samples]
    peak = max(samples, key=lambda s: s[1])
    return {
        "requests": len(prompts), "max_tokens": max_tokens,
        "prompt_tokens_mean": statistics.mean(p for p, _ in lengths),
        "completion_tokens_mean": statistics.mean(c for _, c in lengths),
        "completion_tokens_range": [min(c for _, c in lengths), max(c for _, c in lengths)],
        "steps": len(samples),
        "position_utilization_mean": statistics.mean(utilization),
        "position_utilization_at_peak": peak[0] / (peak[1] * BLOCK),
        "peak_blocks": peak[1],
        "peak_kv_bytes": peak[1] * BLOCK * bytes_per_slot,
        "tentative_blocks_peak": max(tentative_peaks),
        "block_table_bytes_peak": max(s[2] for s in samples) * 4,  # int32 entries
        "bytes_per_position": bytes_per_slot,
        # at the peak step, the same running requests under contiguous schemes
        "reserve_max_length_kv_bytes": peak[3] * reserve_each * bytes_per_slot,
        "static_batch_kv_bytes": peak[3] * longest * bytes_per_slot,
        "paged_vs_reserve_max_length": peak[3] * reserve_each / (peak[1] * BLOCK),
        "paged_vs_static_batch": peak[3] * longest / (peak[1] * BLOCK),
        # averaged over the run's steps: what each scheme holds while requests grow
        "paged_vs_reserve_max_length_mean": statistics.mean(
            running * reserve_each / (in_use * BLOCK) for _, in_use, _, running in samples),
        "paged_vs_static_batch_mean": statistics.mean(
            running * longest / (in_use * BLOCK) for _, in_use, _, running in samples),
    }


def sharing(llm: LLM, prompt: list[int], tokens: int) -> dict[str, Any]:
    engine = llm.engine

    def blocks_held(submit_all) -> tuple[int, int]:
        submit_all()
        held = 0
        while engine.has_unfinished():
            engine.step()
            held = max(held, engine.pool.stats().in_use)
        return held, len(prompt) + tokens

    params = dict(max_tokens=tokens, temperature=1.0, seed=1, ignore_eos=True)
    forked, _ = blocks_held(lambda: submit(engine, "n4", prompt, SamplingParams(n=4, **params)))
    independent, length = blocks_held(lambda: [
        submit(engine, f"solo{i}", prompt, SamplingParams(**{**params, "seed": i}))
        for i in range(4)])
    return {"prompt_tokens": len(prompt), "tokens_each": tokens,
            "blocks_n4_forked": forked, "blocks_4_independent": independent,
            "blocks_per_sequence_alone": -(-length // BLOCK),
            "saving": 1 - forked / independent}


def main() -> None:
    args = parse_args(__doc__)
    target = ensure_model("smollm2-135m")
    draft = args.draft if (args.draft / "config.json").is_file() else None
    count, max_tokens, tokens = (8, 48, 8) if args.quick else (32, 256, 32)
    llm = LLM(target, draft=draft, config=EngineConfig(block_size=BLOCK, num_blocks=2048,
                                                       max_num_seqs=64))
    bytes_per_slot = KvShape.from_hf_config(target).bytes_per_token + (
        KvShape.from_hf_config(draft, "float32").bytes_per_token if draft else 0)
    prompts = [chat_prompt(llm.tokenizer, text) for text in chat_prompts(count)]
    mix = length_mix(llm, prompts, max_tokens, bytes_per_slot)
    long_prompt = (chat_prompt(llm.tokenizer, " ".join(chat_prompts(64))) * 8)[:512]
    shared = sharing(llm, long_prompt, tokens)
    llm.engine.pool.check_integrity()
    finish("memory", {"bench": "memory", "block_size": BLOCK,
                      "models": "SmolLM2-135M-Instruct fp32"
                      + (f" + draft {draft} fp32" if draft else ""),
                      "length_mix": mix, "n4_sharing": shared, "machine": machine()})


if __name__ == "__main__":
    main()
