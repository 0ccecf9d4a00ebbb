"""The scheduler alone (pure Python): spans, budget and progress."""

from specpage.core.block_pool import BlockPool
from specpage.core.engine_config import EngineConfig
from specpage.core.model_free import Speculation
from specpage.core.proposer_rules import DRAFT_MODEL
from specpage.core.request import Request, SamplingParams, Sequence
from specpage.core.scheduler import Scheduler


def run_until_logits(scheduler, pool, seq, steps=10):
    spans = []
    for _ in range(steps):
        plan = scheduler.schedule(now=0.0)
        for entry in plan.scheduled:
            start, done = entry.seq.num_computed, entry.wants_logits
            spans.append((entry.num_new, entry.k))
            pool.commit(entry.seq.seq_id, entry.seq.token_ids[start : start + entry.num_new])
            entry.seq.num_computed += entry.num_new
            if done:
                return spans
    raise AssertionError(f"no progress: {spans}")


def test_a_last_chunk_that_cannot_hold_its_proposals_stops_one_short():
    """A re-prefilled sequence (it has output) whose last chunk plus k
    overflows the budget must not wait forever."""
    pool = BlockPool(64, 4)
    config = EngineConfig(max_step_tokens=8, spec_k=4)
    scheduler = Scheduler(config, 2048, pool, lambda seq, batch: Speculation(4), DRAFT_MODEL)
    request = Request("r", tuple(range(1, 11)), SamplingParams(max_tokens=50))
    seq = Sequence(0, request, 0, list(range(1, 11)) + [7, 7, 7, 7, 7])  # 5 outputs so far
    request.sequences.append(seq)
    scheduler.add(seq)
    # 15 uncomputed: 8 now; then 7 + k = 11 would overflow, so 6; then 1 + k = 5
    assert run_until_logits(scheduler, pool, seq) == [(8, 0), (6, 0), (1, 4)]
