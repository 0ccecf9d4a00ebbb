"""Decode forwards replayed from CUDA graphs (executor/cuda_graphs.py) give
the tokens that eager forwards give.

Decoding, a draft's proposal steps and verification (a draft's k + 1
tokens, the model-free proposals of varying lengths) each go through
buckets of sequences and span lengths, padded. On CUDA the graphs
themselves are captured and replayed. On CPU, with the Triton kernels in
the interpreter, each replay runs the recorded forward again on its
bucket's buffers: the buckets, the padding, the fills and the split-K launch
at the engine's longest context are those of the device.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import triton

import specpage.executor.kv_cache as kv_cache
from specpage.attention.triton import TritonAttention
from specpage.core.request import SamplingParams
from specpage.engine import EngineConfig
from specpage.executor.cuda_graphs import DecodeGraphs
from specpage.llm import LLM
from tests.support.checkpoints import tiny_checkpoint

# 5 and then 3 sequences decoding (the 2nd and 4th stop first): buckets 8 and
# 4, rows of padding in each
PROMPTS = [[(7 * i + j) % 211 for j in range(5 + 9 * i)] for i in range(5)]
PARAMS = [SamplingParams(max_tokens=22 - 10 * (i % 2), temperature=0, ignore_eos=True)
          for i in range(5)]
MAX_SEQS = 8


def _checkpoints(folder: Path) -> tuple[Path, Path]:
    tiny_checkpoint(folder / "target")
    tiny_checkpoint(folder / "draft", seed=1, num_hidden_layers=1)
    return folder / "target", folder / "draft"


def _generate(target: Path, draft: Path | None, device: str, graphs: bool,
              attach: Callable[[LLM], None] | None = None,
              methods: str = "") -> tuple[LLM, list[list[int]]]:
    """methods: the proposers that need no model (their proposals' lengths vary
    from sequence to sequence and step to step)."""
    llm = LLM(target, draft=draft, device=device, dtype="fp32",
              config=EngineConfig(cuda_graphs=graphs, max_num_seqs=MAX_SEQS, spec_k=4,
                                  adaptive_k=False, spec_methods=methods))
    if attach is not None:
        attach(llm)
    done = llm.generate(PROMPTS, PARAMS)
    llm.engine.pool.check_integrity()
    return llm, [list(c.samples[0].token_ids) for c in done]


class _Rerun(DecodeGraphs):
    """Replays that run the recorded forward again, on the bucket's buffers."""

    def _record(self, forward: Callable[[], torch.Tensor]
                ) -> tuple[Callable[[], None], torch.Tensor]:
        logits = forward()

        def replay() -> None:
            logits.copy_(forward())

        return replay, logits


@pytest.mark.skipif(not triton.knobs.runtime.interpret,
                    reason="runs the Triton kernels on CPU tensors: TRITON_INTERPRET=1")
def test_buckets_give_the_eager_tokens_in_the_interpreter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = _checkpoints(tmp_path)
    monkeypatch.setattr(kv_cache, "select_backend", lambda *_, **__: TritonAttention())

    def attach(llm: LLM) -> None:
        for runner in llm.engine.executor.runners:
            runner.graphs = _Rerun(runner.model, runner.kv, runner.block_size, MAX_SEQS,
                                   runner.model.config.max_position)

    _, reference = _generate(target, None, "cpu", graphs=False)
    for proposer, methods in ((None, ""), (draft, ""), (None, "ngram,suffix")):
        llm, tokens = _generate(target, proposer, "cpu", graphs=False, attach=attach,
                                methods=methods)
        assert tokens == reference
        graphs = [runner.graphs for runner in llm.engine.executor.runners]
        assert all(g is not None and g.off is None and g.replays > 0 for g in graphs)
        spans = {q for g in graphs for _, q in g.captured}
        buckets = {bucket for g in graphs for bucket, _ in g.captured}
        assert {4, 8} <= buckets  # 5 sequences, then 3: padding sequences in each
        if proposer is not None:  # verification: k + 1 = 5 tokens, padded to 6
            assert 6 in spans
        if methods:  # proposals of several lengths, each padded to its bucket
            assert len(spans) >= 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs CUDA and compiled kernels")
def test_graph_replays_give_the_eager_tokens(tmp_path: Path) -> None:
    target, draft = _checkpoints(tmp_path)
    outputs = {}
    for graphs in (True, False):
        for proposer, methods in ((None, ""), (draft, ""), (None, "ngram,suffix")):
            llm, outputs[graphs, proposer, methods] = _generate(target, proposer, "cuda",
                                                                graphs, methods=methods)
            runners = llm.engine.executor.runners
            if graphs:
                for runner in runners:
                    assert runner.graphs is not None and runner.graphs.off is None
                assert sum(r.graphs.replays for r in runners) > 0
    reference = outputs[False, None, ""]
    assert all(tokens == reference for tokens in outputs.values())
