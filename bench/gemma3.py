"""Gemma 3 270M (Q4_K_M GGUF, `specpage models fetch gemma3-270m`) in
specpage against llama.cpp on the same file: greedy tokens and perplexity.

    python bench/gemma3.py [--quick]

- Greedy agreement: each prompt's greedy continuation from specpage (the
  file read directly, computing in fp32 on the dequantized weights: the
  exact path) and from llama.cpp's own `llama-server` (`/completion`,
  temperature 0, its token ids and the two likeliest tokens' probabilities
  at each step). Where the two part, the margin between the likeliest two
  tokens at that position on both sides: a small margin is a near-tie that
  rounding (llama.cpp's int8 activations, its summation order) decides.
- Perplexity on held-out text (docs/DESIGN.md of this repository, which
  no model was trained on), computed as `llama-perplexity` computes it:
  chunks of n_ctx tokens, each starting with BOS, the second half of each
  chunk scored; specpage's from its own logits over the same tokens.

llama.cpp's binaries are built by `make llama-server` (.llama-cpp/bin).
Prints one JSON object last and writes bench/results/gemma3.json.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish, free_port, machine, parse_args  # noqa: E402
from specpage.core.request import SamplingParams  # noqa: E402
from specpage.core.span import Span  # noqa: E402
from specpage.executor.model_runner import ModelRunner  # noqa: E402
from specpage.llm import LLM  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402
from specpage.models.loader import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".llama-cpp" / "bin"
PROMPTS = [
    "The capital of France is",
    "Photosynthesis is the process by which",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "In 1969, the Apollo 11 mission",
    "A good way to learn a new language is",
    "The boiling point of water at sea level is",
]
N_CTX = 512


def llama_server(path: Path, port: int) -> subprocess.Popen[bytes]:
    server = subprocess.Popen(
        [str(BIN / "llama-server"), "-m", str(path), "-t", "2", "--host", "127.0.0.1",
         "--port", str(port), "-c", "4096", "-np", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(240):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError("llama-server did not start")


def llama_greedy(port: int, prompt: str, n: int) -> tuple[list[int], list[float]]:
    """llama.cpp's greedy token ids and the margin (log p1 - log p2) at each."""
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "n_probs": 2,
                       "return_tokens": True, "cache_prompt": False}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        answer = json.load(r)
    margins = []
    for step in answer["completion_probabilities"]:
        top = step["top_logprobs"]
        margins.append(top[0]["logprob"] - top[1]["logprob"])
    return list(answer["tokens"]), margins


def ours_greedy(llm: LLM, prompt: str, n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return list(llm.generate([prompt], params, chat=False)[0].samples[0].token_ids)


def margin(runner: ModelRunner, tokens: list[int]) -> float:
    """log p1 - log p2 of the likeliest two tokens after these tokens."""
    blocks = list(range(len(tokens) // 16 + 1))
    top = runner.forward([Span(tokens, 0, blocks)])[-1].double().log_softmax(-1).topk(2).values
    return float(top[0] - top[1])


def ours_perplexity(runner: ModelRunner, tokens: list[int], bos: int, chunks: int) -> float:
    """llama-perplexity's measure: per chunk of N_CTX tokens (BOS first),
    the mean negative log-likelihood of the second half's tokens."""
    total, count = 0.0, 0
    for c in range(chunks):
        chunk = [bos] + tokens[c * N_CTX + 1 : (c + 1) * N_CTX]
        logits = runner.forward([Span(chunk, 0, list(range(N_CTX // 16 + 1)),
                                      num_logits=len(chunk))])
        logp = torch.log_softmax(logits.double(), -1)
        for i in range(N_CTX // 2, N_CTX - 1):
            total -= float(logp[i, chunk[i + 1]])
            count += 1
    return math.exp(total / count)


def llama_perplexity(path: Path, text: Path, chunks: int) -> float:
    out = subprocess.run([str(BIN / "llama-perplexity"), "-m", str(path), "-f", str(text),
                          "-c", str(N_CTX), "-t", "2", "--chunks", str(chunks)],
                         capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    assert found, out.stderr[-2000:]
    return float(found.group(1))


def main() -> None:
    args = parse_args(__doc__)
    n = 16 if args.quick else 48
    prompts = PROMPTS[:3] if args.quick else PROMPTS
    path = ensure_model("gemma3-270m")
    llm = LLM(path)
    # the exact model's logits, for margins and perplexity
    runner = ModelRunner(load_model(path), num_blocks=N_CTX // 16 + 1, block_size=16)
    port = free_port()
    server = llama_server(path, port)
    agreement = []
    try:
        for prompt in prompts:
            ours = ours_greedy(llm, prompt, n)
            theirs, their_margins = llama_greedy(port, prompt, n)
            same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False))
                         if a != b), min(len(ours), len(theirs)))
            row = {"prompt": prompt, "tokens": n, "agree": same,
                   "ours_text": llm.engine.tokenizer.decode(ours)}
            if same < n:
                prompt_ids = llm.engine.tokenizer.encode(prompt, add_special_tokens=True)
                row["margin_ours"] = round(margin(runner, prompt_ids + ours[:same]), 4)
                row["margin_llama"] = round(their_margins[same], 4)
            agreement.append(row)
            print(json.dumps(row))
    finally:
        server.terminate()
        server.wait()
    text = ROOT / "docs" / "DESIGN.md"
    tokenizer = llm.engine.tokenizer
    tokens = tokenizer.encode(text.read_text(), add_special_tokens=True)
    chunks = min(2 if args.quick else 8, len(tokens) // N_CTX)
    ppl_ours = ours_perplexity(runner, tokens, tokenizer.bos_token_id, chunks)
    ppl_llama = llama_perplexity(path, text, chunks)
    print(f"perplexity over {chunks} chunks of {N_CTX}: specpage {ppl_ours:.4f}, "
          f"llama.cpp {ppl_llama:.4f}")
    finish("gemma3", {
        "machine": machine(), "model": str(path.name),
        "agreement": agreement,
        "full_agreement": sum(r["agree"] == n for r in agreement),
        "prompts": len(agreement),
        "perplexity": {"chunks": chunks, "n_ctx": N_CTX, "specpage": ppl_ours,
                       "llama_cpp": ppl_llama, "ratio": ppl_ours / ppl_llama},
        "headline": {"greedy_identical": f"{sum(r['agree'] == n for r in agreement)}"
                                         f"/{len(agreement)}",
                     "perplexity_ratio": ppl_ours / ppl_llama},
    })


if __name__ == "__main__":
    main()
