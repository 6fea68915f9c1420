"""Predicted Outputs (router/predicted_outputs.py, router/speculative.py): a prediction's
place found and followed with exact expectations, the drafter serving predictions with and
without --speculative-config, and the step loop giving the same tokens with a prediction,
right or wrong, with its usage counts and draft rows exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.router.errors import InvalidRequest
from pagedserve.router.predicted_outputs import NEAR, PredictedDrafts, PredictionCursor
from pagedserve.router.speculative import MAX_SPECULATIVE_TOKENS, Drafter, SpeculativeConfig
from pagedserve.router.types import RequestSpec, SamplingSpec
from pagedserve.router.validation import Limits, prediction_from_pb, request_from_pb
from pipeline_rig import expected, free_blocks, make_engine, run, settle, submit

# ------------------------------------------------------------------------- the cursor

PROMPT = [1, 2]


def _drafts(cursor: PredictionCursor, output: list[int], k: int) -> list[int]:
    cursor.follow(PROMPT + output, len(PROMPT))
    return cursor.drafts(k)


def test_an_output_that_follows_the_prediction_drafts_what_comes_next():
    cursor = PredictionCursor(range(10, 30))
    assert _drafts(cursor, [10], 5) == [11, 12, 13, 14, 15]
    assert _drafts(cursor, [10, 11, 12, 13], 3) == [14, 15, 16]
    assert cursor.at == 4 and cursor.followed == 4  # (the index of 14)
    assert _drafts(cursor, list(range(10, 30)), 4) == []  # at the end: nothing left


def test_a_replaced_token_then_the_prediction_again():
    cursor = PredictionCursor([10, 11, 12, 13, 14, 15, 16])
    assert _drafts(cursor, [10, 11, 99], 3) == []  # 99 occurs nowhere
    assert cursor.at == -1 and cursor.anchor == 2
    assert _drafts(cursor, [10, 11, 99, 13], 3) == [14, 15, 16]  # 13 just after the anchor


def test_inserted_tokens_then_the_prediction_at_the_anchor():
    cursor = PredictionCursor([10, 11, 12, 13])
    assert _drafts(cursor, [10, 11, 50, 51], 2) == []
    assert _drafts(cursor, [10, 11, 50, 51, 12], 2) == [13]


def test_deleted_tokens_need_two_matching_far_from_the_anchor():
    cursor = PredictionCursor(range(10, 60))
    assert _drafts(cursor, [10, 11, 40], 2) == []  # one token, 29 after the anchor: no
    assert _drafts(cursor, [10, 11, 40, 41], 2) == [42, 43]  # two: found


def test_one_matching_token_counts_near_the_anchor_only():
    near = [10, 11, 12, 9, 13, 14] + list(range(30, 60)) + [9, 70]
    cursor = PredictionCursor(near)
    assert _drafts(cursor, [10, 11, 12, 88], 2) == []
    assert _drafts(cursor, [10, 11, 12, 88, 9], 2) == [13, 14]  # the near 9, not the far one
    far = [10, 11] + list(range(30, 30 + NEAR + 14)) + [9, 70, 71, 72]
    cursor = PredictionCursor(far)
    assert _drafts(cursor, [10, 88, 9], 2) == []  # the only 9 is far: not taken ...
    assert _drafts(cursor, [10, 88, 9, 70], 2) == [71, 72]  # ... until two match


def test_text_repeated_from_before_the_anchor_needs_three_matching():
    cursor = PredictionCursor([1, 2, 3, 4, 5, 6])
    out = [1, 2, 3, 4, 5, 6]
    assert _drafts(cursor, out, 2) == []  # the prediction's end
    assert _drafts(cursor, out + [2], 2) == [] and cursor.anchor == 6
    assert _drafts(cursor, out + [2, 3], 2) == []  # two match: not enough behind
    assert _drafts(cursor, out + [2, 3, 4], 2) == [5, 6]


def test_the_longest_match_wins_then_the_nearest():
    pred = [5, 7, 8, 1, 2, 3, 1, 2, 3, 4]
    cursor = PredictionCursor(pred)
    # left at 1 (wrote 9 for 7); "2 3" ends at 5 and 8, and "1 2 3" matches at both:
    # the nearest after the anchor
    assert _drafts(cursor, [5, 9, 1, 2, 3], 1) == [1]
    assert cursor.at == 6


# ------------------------------------------------------------------------- the drafter


class _Group(SimpleNamespace):
    def __init__(self, rid: str, prediction=()) -> None:
        super().__init__(spec=RequestSpec(rid, (1,), SamplingSpec(prediction=tuple(prediction))),
                         forked=True, beam=None)


class _Seq:
    def __init__(self, group: _Group, prompt: list[int], output: list[int]) -> None:
        self.group, self.seq_id = group, f"{group.spec.request_id}#0"
        self.token_ids, self.num_prompt_tokens, self.num_pending = prompt + output, len(prompt), 0


def test_without_speculative_config_only_predictions_draft_and_count():
    drafter = Drafter(None)
    plain, predicted = _Group("a"), _Group("b", range(20, 60))
    assert not drafter.may_draft(plain) and drafter.may_draft(predicted)
    assert drafter.drafts_at(10**6)
    seq = _Seq(predicted, [7, 7], [20])
    drafts = drafter.decode(seq, 100)
    assert drafts == list(range(21, 21 + MAX_SPECULATIVE_TOKENS))  # the most a row drafts
    assert type(drafts) is PredictedDrafts  # (its result counts in the request's usage)
    drafter.confirmed(seq, len(drafts), 4)
    seq.token_ids += [21, 22, 23, 24, 99]  # 4 confirmed, then the model's own token
    assert drafter.decode(seq, 100) == []  # 99 occurs nowhere: nothing (look again later)
    beams = _Group("c", range(5))
    beams.beam = object()
    assert not drafter.may_draft(beams)


def test_a_lost_sample_looks_again_then_backs_off_and_drafts_a_full_row_once_found():
    drafter = Drafter(None)
    seq = _Seq(_Group("a", range(20, 60)), [7], [20])
    assert drafter.decode(seq, 100) == list(range(21, 36))
    drafter.confirmed(seq, 15, 0)  # all rejected: the model wrote 99 (next row: 1 draft)
    seq.token_ids.append(99)
    looked = []
    for tok in range(98, 83, -1):  # none of them in the prediction
        looked.append(drafter.wants_drafts(seq))
        assert drafter.decode(seq, 100) == []
        seq.token_ids.append(tok)
    # found nowhere: the next decode looks again, then one in 2, 4, 8
    assert [i for i, w in enumerate(looked) if w] == [0, 1, 3, 7]
    seq.token_ids += [39, 40, 41]  # three tokens match: surely found, a full row (not
    # the 1 draft the rejected row left)
    assert drafter.wants_drafts(seq) and drafter.decode(seq, 100) == list(range(42, 57))


def test_a_weak_match_drafts_what_the_rows_earned_a_sure_one_a_full_row():
    drafter = Drafter(None)
    group = _Group("a", range(20, 60))
    for rid, written, drafts in (
            ("a", [99, 40, 41], [42]),  # two tokens, 20 after the anchor: weak
            ("b", [99, 22], list(range(23, 38)))):  # one token, 2 after it: sure
        seq = _Seq(group, [7], [20])
        seq.seq_id = f"{rid}#0"
        assert len(drafter.decode(seq, 100)) == 15
        drafter.confirmed(seq, 15, 0)  # the next row: 1 draft, unless surely back
        seq.token_ids += written
        assert drafter.decode(seq, 100) == drafts


def test_a_lost_prediction_falls_back_on_the_lookup_without_a_config():
    drafter = Drafter(None)
    seq = _Seq(_Group("a", [50, 51, 52]), [5, 6, 8, 9], [50, 5])  # left it at 51
    drafts = drafter.decode(seq, 100)
    # 5 occurs nowhere in the prediction; the lookup (n 1..3): after the prompt's 5
    assert drafts == [6, 8, 9, 50, 5] and type(drafts) is list  # (not counted in usage)


def test_with_speculative_config_the_prediction_comes_first_then_the_lookup():
    drafter = Drafter(SpeculativeConfig(3, 2, 1))
    plain = _Group("a")
    assert drafter.may_draft(plain)
    predicted = _Group("b", [40, 41, 42, 43])
    seq = _Seq(predicted, [7, 8, 9, 7], [40])
    assert drafter.decode(seq, 100) == [41, 42, 43]  # the prediction, as long as it goes
    drafter.confirmed(seq, 3, 3)
    seq.token_ids += [41, 42, 43, 7]  # the prediction is done: the lookup's (what followed
    # the latest earlier 7, the prompt's), now 6 a row (all 3 were confirmed)
    lookup = drafter.decode(seq, 100)
    assert lookup == [40, 41, 42, 43, 7] and type(lookup) is list


# ------------------------------------------------------------------------- validation

LIMITS = Limits(vocab_size=64, max_model_len=32)


class _Tok:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) - 65 for c in text] + ([63] if add_special_tokens else [])


def test_prediction_from_pb_tokenizes_without_special_tokens_and_checks():
    assert prediction_from_pb(pb.Prediction(text="ABC"), _Tok(), LIMITS) == (0, 1, 2)
    ids = pb.Prediction(token_ids=pb.TokenIds(ids=[5, 6]))
    assert prediction_from_pb(ids, _Tok(), LIMITS) == (5, 6)
    for bad, message in (
            (pb.Prediction(token_ids=pb.TokenIds(ids=[5, 64])), "token id 64 ≥ vocab size 64"),
            (pb.Prediction(text="A" * 33), "33 tokens is longer than any output"),
            (pb.Prediction(text="A" * (32 * 64 + 1)), "2049 characters is longer")):
        with pytest.raises(InvalidRequest, match=message) as err:
            prediction_from_pb(bad, _Tok(), LIMITS)
        assert err.value.field == "prediction"
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1]), params=pb.SamplingParams(
        n=2, beam_search=pb.BeamSearch(), prediction=pb.Prediction(text="AB")))
    with pytest.raises(InvalidRequest, match="prediction: cannot be combined with beam search"):
        request_from_pb(req, tokenizer=_Tok(), limits=LIMITS)
    req.params.ClearField("beam_search")
    spec = request_from_pb(req, tokenizer=_Tok(), limits=LIMITS)
    assert spec.sampling.prediction == (0, 1)


# ------------------------------------------------------------------------- the step loop


def _draft_rows(ex, rid: str) -> list[int]:
    rows = []
    for plan in ex.plans:
        if plan.num_draft_tokens is not None and rid in plan.request_ids:
            rows.append(int(plan.num_draft_tokens[plan.request_ids.index(rid)]))
    return [n for n in rows if n]


@pytest.mark.parametrize("lane", [False, True])
def test_a_right_prediction_gives_the_same_tokens_in_two_decodes(lane):
    """No --speculative-config: the predicted request drafts 15 then 12 tokens, every one
    confirmed; the other request beside it pipelines without drafts (with the decode lane
    on, the loop plans every row while the prediction runs)."""
    async def main():
        engine, ex = make_engine(2, decode_lane_min_running=1 if lane else 0)
        before = free_blocks(engine)
        a = await submit(engine, "a", [3, 4, 5], max_tokens=30,
                         prediction=tuple(expected("a#0", 30)))
        b = await submit(engine, "b", [6, 7], max_tokens=30)
        await ex.run_one_in_flight([a, b])
        assert a.tokens() == expected("a#0", 30) and b.tokens() == expected("b#0", 30)
        assert _draft_rows(ex, "a#0") == [15, 12] and _draft_rows(ex, "b#0") == []
        assert (a.usage.completion_tokens, a.usage.accepted_prediction_tokens,
                a.usage.rejected_prediction_tokens) == (30, 27, 0)
        assert (b.usage.accepted_prediction_tokens, b.usage.rejected_prediction_tokens) == (0, 0)
        await settle()
        assert free_blocks(engine) == before
        sched = engine.executors["e0"].scheduler
        assert not sched._predicted and len(sched.drafter) == 0
    run(main())


def test_a_wrong_prediction_gives_the_same_tokens_and_counts_its_rejections():
    """Position 10 of the prediction is wrong: the first row confirms 9 of 15 drafts; the
    next decode finds no place (the token the model wrote occurs nowhere in the prediction)
    and drafts nothing; the one after finds it (one token matches just after the anchor)
    and drafts a full row again, every draft confirmed; one token is left to draft."""
    async def main():
        engine, ex = make_engine(2)
        pred = expected("a#0", 30)
        pred[10] = (pred[10] + 1) % 62
        a = await submit(engine, "a", [3, 4, 5], max_tokens=30, prediction=tuple(pred))
        await ex.run_one_in_flight([a])
        assert a.tokens() == expected("a#0", 30)
        assert _draft_rows(ex, "a#0") == [15, 15, 1]
        assert (a.usage.accepted_prediction_tokens, a.usage.rejected_prediction_tokens) == (25, 6)
    run(main())
