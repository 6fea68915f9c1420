"""What a plan alone determines (executor/plan_inputs.py `precompute`), against a row-by-row
oracle written from the wire contract (protos/wire.py StepPlan), for random plans: the
rows each check condemns and its message, the marked rows that cannot be fed, where each
token goes. The vectorised code has a path for steps of one token a row (every decode)
beside the general one; both must say what the oracle says."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.executor.plan_inputs import PlanLimits, precompute
from pagedserve.protos.wire import StepPlan, int32

BS, NUM_BLOCKS, MAX_LEN, VOCAB = 4, 8, 40, 10
LIMITS = PlanLimits(BS, NUM_BLOCKS, 0, MAX_LEN, VOCAB, torch.device("cpu"))


@st.composite
def plans(draw, one_token_rows: bool):
    """A plan that passes `StepPlan.validate`, some of whose rows the executor must
    condemn: values just inside and just outside every range."""
    s = draw(st.integers(1, 6))
    rows = []
    for _ in range(s):
        rows.append(dict(
            num_new=1 if one_token_rows else draw(st.integers(0, 3)),
            computed=draw(st.integers(0, MAX_LEN)),
            start=draw(st.integers(0, 3)), lens=draw(st.integers(0, 2)),
            marked=draw(st.booleans()), sample=draw(st.booleans()) or one_token_rows,
        ))
    t = sum(r["num_new"] for r in rows)
    n_ids = sum(r["lens"] for r in rows)
    ints = lambda lo, hi, n: draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))  # noqa: E731
    feed = draw(st.booleans())
    plan = StepPlan(
        step_id=draw(st.integers(1, 100)), request_ids=[f"r{i}" for i in range(s)],
        num_computed_tokens=int32([r["computed"] for r in rows]),
        num_new_tokens=int32([r["num_new"] for r in rows]),
        do_sample=np.array([r["sample"] for r in rows], np.uint8),
        feed_sampled=np.array([r["marked"] for r in rows], np.uint8) if feed else None,
        token_ids=int32(ints(-2, VOCAB, t)), positions=int32(ints(-1, MAX_LEN, t)),
        slot_mapping=np.array(ints(-2, NUM_BLOCKS * BS, t), np.int64),
        block_table_starts=int32([r["start"] for r in rows]),
        block_table_lens=int32([r["lens"] for r in rows]),
        block_table_ids=(int32(ints(-1, NUM_BLOCKS, n_ids))
                         if n_ids or draw(st.booleans()) else None))
    plan.validate()
    return plan


def oracle(plan: StepPlan) -> dict:
    """Row by row, from the contract."""
    s = plan.num_seqs
    num_new = plan.num_new_tokens.tolist()
    marked = [bool(plan.feed_sampled[i]) if plan.feed_sampled is not None else False
              for i in range(s)]
    first = [sum(num_new[:i]) for i in range(s)]
    lens = plan.block_table_lens.tolist()
    ids = [] if plan.block_table_ids is None else plan.block_table_ids.tolist()
    id_first = [sum(lens[:i]) for i in range(s)]
    unfed = {i: (f"marked to be fed its sample of step {plan.step_id - 1} but scheduled with "
                 f"{num_new[i]} tokens (a marked row is a decode of one token)")
             for i in range(s) if marked[i] and num_new[i] != 1}
    bad = {}
    for i in range(s):
        tokens = range(first[i], first[i] + num_new[i])
        new_len = int(plan.block_table_starts[i]) + lens[i]
        seq_len = int(plan.num_computed_tokens[i]) + num_new[i]
        if any(not -1 <= plan.slot_mapping[j] < NUM_BLOCKS * BS
               or not 0 <= plan.positions[j] < MAX_LEN
               or (not marked[i] and not 0 <= plan.token_ids[j] < VOCAB) for j in tokens):
            bad[i] = "a slot, position or token id out of range"
        elif any(not 0 <= b < NUM_BLOCKS for b in ids[id_first[i]:id_first[i] + lens[i]]):
            bad[i] = f"block id out of range (have {NUM_BLOCKS})"
        elif seq_len > min(MAX_LEN, new_len * BS):
            bad[i] = "its tokens do not fit its blocks or max_model_len"
        elif num_new[i] == 0:
            bad[i] = "scheduled with no new tokens"
    fed = [i for i in range(s) if marked[i] and i not in unfed]
    return {
        "unfed": unfed, "bad": bad,
        "row_of_token": [i for i in range(s) for _ in range(num_new[i])],
        "marked": fed, "feed_at": [first[i] for i in fed], "all_marked": len(fed) == s,
        "id_cols": [int(plan.block_table_starts[i]) + k for i in range(s) for k in range(lens[i])],
        "sample_ids": [plan.request_ids[i] for i in range(s) if plan.do_sample[i]],
        "max_query_len": max(num_new),
    }


def _check(plan: StepPlan) -> None:
    want = oracle(plan)
    got = precompute(plan, LIMITS)
    assert got.unfed == want["unfed"] and got.bad == want["bad"]
    assert got.row_of_token.tolist() == want["row_of_token"]
    assert got.marked.tolist() == want["marked"] and got.feed_at.tolist() == want["feed_at"]
    assert got.all_marked == want["all_marked"]
    assert got.id_cols.tolist() == want["id_cols"]
    assert got.token_ids.tolist() == plan.token_ids.tolist()
    assert got.token_ids is not plan.token_ids  # a copy: fed tokens are written into it
    if not want["bad"] and not want["unfed"]:
        assert got.sample_ids == want["sample_ids"]
        assert got.max_query_len == want["max_query_len"]
        assert got.feedable == (want["max_query_len"] == 1 and all(plan.do_sample))


@settings(max_examples=300, deadline=None)
@given(plans(one_token_rows=False))
def test_precompute_matches_the_row_by_row_oracle(plan):
    _check(plan)


@settings(max_examples=300, deadline=None)
@given(plans(one_token_rows=True))
def test_precompute_of_one_token_rows_matches_the_oracle(plan):
    """Decode steps: the path that skips the per-token bookkeeping."""
    _check(plan)


def test_a_plan_without_block_ids_is_prepared():
    """`block_table_ids` may be absent when no table changes (the contract): such a plan
    is prepared like one with an empty array (it raised TypeError before)."""
    plan = StepPlan(step_id=3, request_ids=["a", "b"], num_computed_tokens=int32([4, 7]),
                    num_new_tokens=int32([1, 1]), do_sample=np.ones(2, np.uint8),
                    token_ids=int32([5, 6]), positions=int32([4, 7]),
                    slot_mapping=np.array([4, 11], np.int64),
                    block_table_starts=int32([2, 2]), block_table_lens=int32([0, 0]))
    plan.validate()
    got = precompute(plan, LIMITS)
    assert got.bad == {} and got.unfed == {} and got.ids.shape == (0,)
    assert got.id_cols.shape == (0,) and got.longest == 2 and got.feedable
