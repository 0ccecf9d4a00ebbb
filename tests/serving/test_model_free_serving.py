"""Model-free speculation through the gRPC servicer on 127.0.0.1: usage and
server info count drafted and accepted tokens by method, a cache salt's
requests are never proposed another salt's text (by the counts, not by
timing), and a request can keep its text out of the suffix cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpage.client import Client
from specpage.engine import Engine, EngineConfig
from specpage.models.loader import load_model
from tests.support.checkpoints import tiny_checkpoint
from tests.support.inprocess import serving_engine

PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
# what the suffix cache keeps of each: its output after the prompt's last n_max tokens
KEPT = min(len(PROMPT), EngineConfig().spec_ngram_max) + GREEDY["max_tokens"]


def suffix_engine(folder: Path) -> Engine:
    """Proposals from earlier requests only, always verified (no costs)."""
    tiny_checkpoint(folder)
    return Engine(load_model(folder), None, None, EngineConfig(
        block_size=4, num_blocks=256, max_num_seqs=4, adaptive_k=False,
        spec_methods="suffix"))


@pytest.mark.asyncio
async def test_suffix_proposals_stay_within_their_salt(tmp_path: Path):
    engine = suffix_engine(tmp_path)
    async with serving_engine(engine) as served, Client(served.address, max_retries=0) as client:
        first = await client.complete(PROMPT, cache_salt="a", **GREEDY)
        assert first.usage.drafted_tokens == 0  # nothing earlier to propose from
        for salt in ("b", ""):  # another tenant, and the requests without a salt
            other = await client.complete(PROMPT, cache_salt=salt, **GREEDY)
            assert other.usage.drafted_tokens == 0, salt
            assert other.samples[0].token_ids == first.samples[0].token_ids
        again = await client.complete(PROMPT, cache_salt="a", **GREEDY)
        assert again.samples[0].token_ids == first.samples[0].token_ids
        assert again.usage.by_method["suffix"][0] == again.usage.drafted_tokens > 0
        assert again.usage.by_method["suffix"][1] == again.usage.accepted_tokens > 0
        info = await client.server_info()
    counts = {m.method: m for m in info.by_method}
    assert set(counts) == {"suffix"}
    assert counts["suffix"].drafted_tokens == again.usage.drafted_tokens
    assert sum(counts["suffix"].accepted_by_position) == again.usage.accepted_tokens
    assert info.suffix_cache_tokens == 4 * KEPT


@pytest.mark.asyncio
async def test_a_request_kept_out_of_the_suffix_cache_leaves_no_text(tmp_path: Path):
    engine = suffix_engine(tmp_path)
    async with serving_engine(engine) as served, Client(served.address, max_retries=0) as client:
        message = await client.complete(PROMPT, no_suffix_cache=True, **GREEDY)
        later = await client.complete(PROMPT, **GREEDY)
        info = await client.server_info()
    assert later.usage.drafted_tokens == 0
    assert later.samples[0].token_ids == message.samples[0].token_ids
    assert info.suffix_cache_tokens == KEPT  # the later one's
