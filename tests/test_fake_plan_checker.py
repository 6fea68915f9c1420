"""The wire fake executor's plan checks (tests/fake_plan_checker.py) on hand-made plans: a
request new to the executor may start past position 0 only at a cached prefix (a whole
number of blocks) or, for a later sample, where sample 0 has computed (the router forks it
again after a recompute and sends it as a new request with its own outputs)."""

from __future__ import annotations

import argparse

import numpy as np
from fake_plan_checker import PlanChecker
from pagedserve.protos.wire import NewRequest, SamplingParams, StepPlan

BS = 4


def _checker() -> PlanChecker:
    args = argparse.Namespace(block_size=BS, executor_id="f0", num_gpu_blocks=32,
                              num_cpu_blocks=8, verbose=False, eos_at=None, vocab_size=64)
    return PlanChecker(args, eos_token_id=None)


def _plan(step: int, rows: list[tuple[str, int, int, list[int], int]], new=()) -> StepPlan:
    """rows: (request id, tokens computed before, tokens now, whole table, samples)."""
    tokens, positions, slots = [], [], []
    for _, start, k, table, _ in rows:
        tokens += [5] * k
        positions += list(range(start, start + k))
        slots += [table[p // BS] * BS + p % BS for p in range(start, start + k)]
    return StepPlan(
        step_id=step, new_requests=list(new), request_ids=[r[0] for r in rows],
        num_computed_tokens=np.array([r[1] for r in rows], np.int32),
        num_new_tokens=np.array([r[2] for r in rows], np.int32),
        do_sample=np.array([r[4] for r in rows], np.uint8),
        token_ids=np.array(tokens, np.int32), positions=np.array(positions, np.int32),
        slot_mapping=np.array(slots, np.int64),
        block_table_starts=np.zeros(len(rows), np.int32),
        block_table_lens=np.array([len(r[3]) for r in rows], np.int32),
        block_table_ids=np.array([b for r in rows for b in r[3]], np.int32))


def _new(rid: str, prompt: int, outputs: int = 0) -> NewRequest:
    return NewRequest(request_id=rid, prompt_token_ids=np.full(prompt, 5, np.int32),
                      output_token_ids=np.full(outputs, 5, np.int32),
                      sampling=SamplingParams(temperature=0.0, ignore_eos=True))


def test_a_later_sample_new_here_may_start_where_sample_0_has_computed():
    c = _checker()
    c.execute(_plan(1, [("r#0", 0, 6, [0, 1], 0)], [_new("r#0", 7)]))  # 6 of 7 prompt tokens
    assert c.violations == []
    # r#1 (forked again after a recompute, sent with its own 2 outputs) starts at 6
    c.execute(_plan(2, [("r#0", 6, 1, [0, 1], 1), ("r#1", 6, 3, [0, 2, 3], 1)],
                    [_new("r#1", 7, outputs=2)]))
    assert c.violations == []


def test_a_new_request_starting_mid_block_on_its_own_is_a_violation():
    c = _checker()
    c.execute(_plan(1, [("q#0", 6, 1, [0, 1], 1)], [_new("q#0", 7)]))
    assert len(c.violations) == 1 and "num_computed 6, executor has 0" in c.violations[0]
    c = _checker()  # a later sample whose sample 0 has not computed that far
    c.execute(_plan(1, [("s#0", 0, 2, [0], 0)], [_new("s#0", 7)]))
    c.execute(_plan(2, [("s#1", 6, 1, [0, 1], 1)], [_new("s#1", 7)]))
    assert len(c.violations) == 1 and "num_computed 6" in c.violations[0]
