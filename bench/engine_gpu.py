"""The engine on CUDA: SmolLM2-135M's shape in bf16, greedy, EOS ignored,
at 1, 32 and 256 concurrent requests, with speculation off, with the
proposers that need no model (ngram and suffix), and with the shipped draft
model beside them (what `make serve` runs); and the step's time split.

The target has SmolLM2-135M-Instruct's exact configuration (30 layers,
hidden 576, 9 query and 3 KV heads of 64, vocabulary 49,152, tied
embeddings) with random bf16 weights, since the real weights cannot travel
to a GPU machine that has no network. Speed does not depend on the weights'
values, so the plain decoding figures hold for the real model. Speculation's
do not: a random target's greedy text is not what the draft was distilled
from (the draft's acceptance is near zero, so its rows show what drafting
costs when it does not pay, and whether the policy then stops) and it falls
into loops that prompt lookup matches (the model-free rows' acceptance is
reported beside them). Acceptance on real text is measured on the CPU
(bench/model_free.py); this bench gives the GPU's side: what a verify step
and a draft forward cost there.

Time split of the steps where every running request decodes: the target's
forward (synchronized: ModelRunner waits for the device), the draft's
forwards, the proposers that need no model (their lookups, and indexing
each step's new tokens), sampling and acceptance, and the rest (scheduling,
the pool, outputs: Python). Each runs twice: eagerly (the default) and with the
forwards of short spans (plain decoding, the draft's proposal steps,
verification) replayed from CUDA graphs (engine.cuda_graphs).

Writes results/engine_gpu.json (a dry run: engine_gpu_cpu_dry_run.json,
which git ignores); the last line printed is the same JSON object. Without
CUDA (and without --device cpu, a dry run) it prints a `skipped` line and
exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import decoding_steps, finish, time_part  # noqa: E402

DRAFT = ROOT / "models" / "smollm2-draft"
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
MODES = {
    "off": {"spec_k": 0},
    "off_graphs": {"spec_k": 0, "cuda_graphs": True},
    "model_free": {"spec_methods": "ngram,suffix"},
    "model_free_graphs": {"spec_methods": "ngram,suffix", "cuda_graphs": True},
    "draft_and_model_free": {"spec_methods": "ngram,suffix"},
    "draft_and_model_free_graphs": {"spec_methods": "ngram,suffix", "cuda_graphs": True},
}


def random_target(folder: Path) -> Path:
    """SmolLM2-135M's configuration with random bf16 weights, and the
    SmolLM2 tokenizer (the draft's folder holds the same one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(torch.bfloat16)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DRAFT / name).is_file():
            shutil.copy(DRAFT / name, folder / name)
    return folder


def instrument(engine: Any, spent: dict[str, float]) -> None:
    """Wrap the step's parts so that each adds its seconds to spent[part]."""

    def timed(owner: Any, name: str, part: str) -> None:
        time_part(owner, name, part, spent)

    executor = engine.executor
    timed(executor.verifier, "verify", "verify")  # the target's forward + acceptance
    timed(executor.verifier.runner, "forward", "target_forward")
    if executor.proposer is not None:
        timed(executor.proposer, "propose", "proposals")
    for name in ("propose", "index", "observe"):  # the proposers that need no model
        timed(engine.core.model_free, name, "model_free")


def run(llm: Any, prompts: list[list[int]], tokens: int,
        outputs: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Every prompt at once, to `tokens` each; tok/s over the whole run and
    the split of the steps where all of them decode. outputs: each
    request's tokens, by request id."""
    from specpage.core.request import SamplingParams

    engine = llm.engine
    spent: dict[str, float] = defaultdict(float)
    instrument(engine, spent)
    before = engine.stats()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt,
                           SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    parts: dict[str, list[float]] = defaultdict(list)
    start = time.perf_counter()
    for step in decoding_steps(engine, len(prompts), spent, outputs):
        forward = spent["target_forward"]
        parts["step_ms"].append(step * 1e3)
        parts["target_forward_ms"].append(forward * 1e3)
        parts["proposals_ms"].append(spent["proposals"] * 1e3)
        parts["model_free_ms"].append(spent["model_free"] * 1e3)
        parts["sampling_ms"].append((spent["verify"] - forward) * 1e3)
        parts["python_ms"].append(
            (step - spent["verify"] - spent["proposals"] - spent["model_free"]) * 1e3)
    seconds = time.perf_counter() - start
    engine.pool.check_integrity()
    after = engine.stats()
    drafted = after.drafted_tokens - before.drafted_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    total = tokens * len(prompts)
    return {
        "tok_s": round(total / seconds, 1),
        "decode_steps": len(parts["step_ms"]),
        **{name: round(statistics.median(v), 3) for name, v in parts.items() if v},
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(accepted / drafted, 3) if drafted else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer tokens per request")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the bench itself")
    parser.add_argument("--streams", default="1,32,256")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--modes", default=",".join(MODES), help="runs, comma-separated")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"bench": "engine_gpu", "skipped": "no CUDA device"}))
        return
    from bench.prompts import chat_prompts
    from specpage.engine import EngineConfig
    from specpage.llm import LLM, chat_prompt

    tokens = min(args.tokens, 48) if args.quick else args.tokens
    streams = [int(s) for s in args.streams.split(",")]
    most = max(streams)
    work = Path(tempfile.mkdtemp(prefix="engine-gpu-"))
    target = random_target(work / "smollm2-135m-random")
    result: dict[str, Any] = {
        "bench": "engine_gpu",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "quick": args.quick,
        "model": "SmolLM2-135M configuration, random bf16 weights",
        "tokens_each": tokens,
        "runs": {},
        "graphs": {},  # per mode, per runner (target, draft): CUDA graph replays
    }
    answers: dict[str, dict[str, list[int]]] = {}  # run -> request id -> tokens
    common = {"num_blocks": most * (-(-(160 + tokens + 16) // 16)) + 256,
              "max_num_seqs": most, "max_step_tokens": max(4096, most * 9)}
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; known: {', '.join(MODES)}")
    for mode in modes:
        settings = MODES[mode]
        draft = DRAFT if mode.startswith("draft") else None
        llm = LLM(target, draft=draft, dtype="bf16", device=args.device,
                  config=EngineConfig(**common, **settings))
        prompts = [chat_prompt(llm.tokenizer, t) for t in chat_prompts(most)]
        run(llm, prompts[:2], 8)  # compiles the kernels
        # as the daemon does once started (serve/daemon.py): what lives as
        # long as the engine leaves the cyclic collector's reach, so that the
        # collections a step's short-lived objects trigger stop walking it (at
        # 256 streams of a tiny model on CPU, 0.76-0.85 s a run -> 0.62 s)
        gc.collect()
        gc.freeze()
        for count in streams:
            key = f"{mode}@{count}"
            result["runs"][key] = run(llm, prompts[:count], tokens, answers.setdefault(key, {}))
            print(key, json.dumps(result["runs"][key]), flush=True)
        result["graphs"][mode] = [
            {"replays": r.graphs.replays, "buckets": sorted(r.graphs.captured), "off": r.graphs.off}
            if r.graphs is not None else None for r in llm.engine.executor.runners]
        del llm
        gc.unfreeze()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    runs = result["runs"]
    # bf16: a graph's split of the context (fixed at the longest) rounds
    # otherwise than an eager launch's, so a near tie may part the greedy text
    result["graphs_same_tokens_as_eager"] = {
        key: round(sum(answers[key][r] == answers[key.replace("_graphs@", "@")][r]
                       for r in answers[key]) / len(answers[key]), 3)
        for key in answers if "_graphs@" in key and key.replace("_graphs@", "@") in answers}
    result["speedup_vs_off"] = {
        key: round(value["tok_s"] / runs[f"off@{key.split('@')[1]}"]["tok_s"], 3)
        for key, value in runs.items() if not key.startswith("off@") and "off" in modes
    }  # off_graphs's: what the graphs give
    shutil.rmtree(work, ignore_errors=True)
    # a dry run's figures never stand in for the device's
    finish("engine_gpu" if args.device == "cuda" else f"engine_gpu_{args.device}_dry_run", result)


if __name__ == "__main__":
    main()
