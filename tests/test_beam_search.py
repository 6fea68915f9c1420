"""Beam search in the router (router/beam_search.py) against transformers' own
`generate(num_beams=...)`, on a model whose logits are a function of the context
(tests/beam_rig.py), through the router's real engine, scheduler and KV manager with an
in-process executor: every output token for token, every block back, every beam the
executor was given dropped again."""

from __future__ import annotations

import asyncio

import pytest
from beam_rig import ContextExecutor, hf_beams
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedserve.router.scheduler import PreemptionMode
from pagedserve.router.types import BeamSpec, RequestSpec, SamplingSpec
from pipeline_rig import EOS, Collector, make_engine, run


async def _search(prompt, width, max_tokens, *, eos_boost=2.0, depth=2, blocks=64,
                  mode=PreemptionMode.AUTO, others=(), **sampling):
    """Run one beam search (after `others`: plain greedy requests beside it) to the end;
    returns (beam collector, other collectors, executor, engine); the collector's `group`
    is the search's request."""
    engine, _ = make_engine(depth=depth, num_gpu_blocks=blocks, mode=mode)
    ex = ContextExecutor(engine, eos_boost=eos_boost)
    plain = [Collector(await engine.submit(RequestSpec(
        f"plain{i}", tuple(p), SamplingSpec(max_tokens=max_tokens, temperature=0.0))))
        for i, p in enumerate(others)]
    beam = BeamSpec(sampling.pop("length_penalty", 1.0), sampling.pop("early_stopping", False))
    spec = RequestSpec("beam", tuple(prompt), SamplingSpec(
        max_tokens=max_tokens, temperature=0.0, n=width, beam=beam, **sampling))
    c = Collector(await engine.submit(spec))
    c.group = engine.live["beam"]
    await ex.run_until_done([c, *plain])
    await _drain(ex)
    return c, plain, ex, engine


async def _drain(ex) -> None:
    """Answer the plans still coming (the last drops go out with the next plan)."""
    for _ in range(5):
        await asyncio.sleep(0.01)
        while ex.unanswered():
            await ex.answer()


def _check_clean(engine, ex) -> None:
    handle = engine.executors["e0"]
    kv = handle.kv
    kv.check_invariants()
    assert kv.stats().gpu.num_free_blocks == kv.stats().gpu.num_total_blocks
    assert kv.request_ids() == []
    assert handle.scheduler.num_leaked_blocks() == (0, [])
    assert not engine.live


def _outputs(c, width):
    return [c.tokens(i) for i in range(width)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(0, 62), min_size=1, max_size=10),
       width=st.integers(2, 4), max_tokens=st.integers(1, 14),
       eos_boost=st.sampled_from([0.0, 3.0, 5.0, 8.0]),
       length_penalty=st.sampled_from([-1.0, 0.0, 1.0, 2.0]),
       early_stopping=st.sampled_from([False, True, "never"]),
       min_tokens=st.integers(0, 3))
def test_beams_equal_transformers(prompt, width, max_tokens, eos_boost, length_penalty,
                                  early_stopping, min_tokens):
    min_tokens = min(min_tokens, max_tokens)
    c, _, ex, engine = run(_search(prompt, width, max_tokens, eos_boost=eos_boost,
                                   length_penalty=length_penalty,
                                   early_stopping=early_stopping, min_tokens=min_tokens))
    assert c.error is None
    want = hf_beams(prompt, width, max_tokens, length_penalty=length_penalty,
                    early_stopping=early_stopping, min_tokens=min_tokens,
                    eos_boost=eos_boost)
    assert _outputs(c, width) == want
    for i, tokens in enumerate(want):
        fin = c.finish(i)
        if tokens[-1] == EOS and len(tokens) > min_tokens:
            assert (fin.finish_reason, fin.stop_token_id) == ("stop", EOS)
        else:
            assert (fin.finish_reason, len(tokens)) == ("length", max_tokens)
    assert c.usage.completion_tokens == sum(map(len, want))
    _check_clean(engine, ex)
    assert sorted(ex.dropped) == sorted([r.request_id for r in ex.new_requests] + ex.forked)


def test_forks_share_blocks_and_copy_the_parents_state():
    """Width 4 from one prompt of 8 tokens (2 blocks of 4): after the first step the four
    beams are one kept sample and three forks of it (the plan's forks: the executor copies
    the parent's state), starting where the parent's computed tokens end, sharing its
    blocks."""
    prompt = list(range(10, 18))
    c, _, ex, engine = run(_search(prompt, 4, 6, eos_boost=0.0))
    assert _outputs(c, 4) == hf_beams(prompt, 4, 6, eos_boost=0.0)
    (first,) = ex.new_requests  # every other beam is a fork
    assert first.request_id == "beam#0" and first.output_token_ids.tolist() == []
    assert first.sampling.logprobs == 8  # K = max(2, 1 + 1 stop id) x 4 beams
    assert [(f.parent_id, f.child_id, f.sample_index) for f in ex.plans[1].forks] == [
        ("beam#0", "beam#1.1", 1), ("beam#0", "beam#2.2", 2), ("beam#0", "beam#3.3", 3)]
    # The prompt: blocks 0, 1. The step after: beam 0 adds block 2, each fork has the
    # prompt's two blocks (shared) and a fresh one (copy-on-write of a full block: none).
    plan = ex.plans[1]
    assert plan.request_ids == ["beam#0", "beam#1.1", "beam#2.2", "beam#3.3"]
    assert plan.num_computed_tokens.tolist() == [8] * 4
    assert plan.block_table_starts.tolist() == [2, 0, 0, 0]
    assert plan.block_table_ids.tolist() == [2, 0, 1, 3, 0, 1, 4, 0, 1, 5]
    assert plan.slot_mapping.tolist() == [8, 12, 16, 20]
    # Next: two beams fork from beam 0 again; block 2 (their shared, partly written last
    # block) is copied for each before its first write there, the beams they replace are
    # dropped.
    plan = ex.plans[2]
    assert sorted(plan.finished_ids) == ["beam#2.2", "beam#3.3"]
    assert {src for src, _ in plan.copy.tolist()} == {2} and len(plan.copy) == 2
    _check_clean(engine, ex)


def test_beam_steps_beside_pipelined_requests():
    """A beam never decodes a token in flight; plain requests beside it still do (marked
    decodes), and their greedy tokens are the model's."""
    prompt = [5, 6, 7]
    others = [[1, 2], [3, 4, 5, 6]]
    c, plain, ex, engine = run(_search(prompt, 3, 8, eos_boost=0.0, others=others))
    assert _outputs(c, 3) == hf_beams(prompt, 3, 8, eos_boost=0.0)
    for p, col in zip(others, plain, strict=True):
        assert col.tokens() == hf_beams(p, 1, 8, stop_ids=(), eos_boost=0.0)[0][:8] or \
            col.tokens()[-1] == EOS
    marked = {rid for plan in ex.plans if plan.feed_sampled is not None
              for rid, f in zip(plan.request_ids, plan.feed_sampled, strict=True) if f}
    assert marked and all(rid.startswith("plain") for rid in marked)
    _check_clean(engine, ex)


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_preempted_beams_finish_the_same(mode):
    """Too few blocks for the beams and a plain request: preemption (recompute or swap)
    of either; the beams still equal transformers'."""
    prompt = list(range(20, 29))
    others = [list(range(1, 24)), list(range(2, 25))]
    c, plain, ex, engine = run(_search(prompt, 4, 10, eos_boost=0.0, blocks=20, mode=mode,
                                       others=others))
    assert c.error is None and not any(p.error for p in plain)
    assert _outputs(c, 4) == hf_beams(prompt, 4, 10, eos_boost=0.0)
    assert c.group.num_preemptions >= 1  # (the latest arrival is the victim)
    assert engine.executors["e0"].scheduler.num_preemptions[mode] >= 1
    _check_clean(engine, ex)


def test_logprobs_of_beams():
    """logprobs=2: each returned token's logprob and its beam's top 2 at that position."""
    import torch
    from beam_rig import context_logits
    prompt = [9, 8, 7]
    c, _, ex, engine = run(_search(prompt, 2, 5, logprobs=2))
    for i in range(2):
        tokens = c.tokens(i)
        lps = [lp for o in c.outputs for d in o.deltas if d.index == i for lp in d.logprobs]
        assert [lp.token_id for lp in lps] == tokens
        for j, lp in enumerate(lps):
            ref = torch.log_softmax(context_logits(prompt + tokens[:j]), -1)
            assert lp.logprob == pytest.approx(float(ref[tokens[j]]), abs=1e-6)
            top = ref.topk(2)
            assert [t for t, _ in lp.top] == top.indices.tolist()
    _check_clean(engine, ex)


def test_abort_mid_search_frees_everything():
    async def go():
        engine, _ = make_engine()
        ex = ContextExecutor(engine, eos_boost=0.0)
        spec = RequestSpec("beam", (1, 2, 3), SamplingSpec(
            max_tokens=20, temperature=0.0, n=3, beam=BeamSpec()))
        c = Collector(await engine.submit(spec))
        for _ in range(6):
            await ex.answer()
        assert engine.abort("beam")
        await _drain(ex)
        return c, ex, engine
    c, ex, engine = run(go())
    assert c.done and c.error is None
    assert {c.finish(i).finish_reason for i in range(3)} == {"abort"}
    _check_clean(engine, ex)
    assert sorted(ex.dropped) == sorted([r.request_id for r in ex.new_requests] + ex.forked)


# ------------------------------------------------------------------ the request fields

def _spec(**fields):
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
    from pagedserve.router.validation import Limits, sampling_from_pb
    beam = fields.pop("beam_search", {})
    params = pb.SamplingParams(**fields)
    if beam is not None:
        params.beam_search.SetInParent()
        for k, v in beam.items():
            setattr(params.beam_search, k, v)
    return sampling_from_pb(params, Limits(vocab_size=64, max_model_len=128))


def test_beam_fields_from_grpc():
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
    from pagedserve.router.errors import InvalidRequest
    assert _spec(n=3).beam == BeamSpec(1.0, False)
    assert _spec(n=2, beam_search={"length_penalty": -0.5,
                                   "early_stopping": pb.EARLY_STOPPING_NEVER}).beam == \
        BeamSpec(-0.5, "never")
    assert _spec(n=2, beam_search={"early_stopping": pb.EARLY_STOPPING_WHEN_FULL}).beam == \
        BeamSpec(1.0, True)
    assert _spec(n=2, beam_search=None).beam is None
    one = _spec(n=1, temperature=0.9)  # one beam is greedy decoding, as in transformers
    assert one.beam is None and one.temperature == 0.0
    ok = _spec(n=2, temperature=0.9, seed=3, min_tokens=2, ignore_eos=True, logprobs=3,
               stop_token_ids=[5])  # temperature and seed: no effect, accepted
    assert ok.beam is not None and ok.min_tokens == 2
    for field, value in [("top_p", 0.9), ("top_k", 5), ("min_p", 0.1),
                         ("repetition_penalty", 1.2), ("presence_penalty", 0.5),
                         ("frequency_penalty", -0.5), ("logit_bias", {3: 1.0}),
                         ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
                         ("stop", ["."]),
                         ("structured_output", pb.StructuredOutput(regex="a+"))]:
        with pytest.raises(InvalidRequest, match=f"^{field}: cannot be combined with beam"):
            _spec(n=2, **{field: value})
    with pytest.raises(InvalidRequest, match="^length_penalty: must be a number"):
        _spec(n=2, beam_search={"length_penalty": float("nan")})
    with pytest.raises(InvalidRequest, match=r"^length_penalty: must be in \[-10, 10\]"):
        _spec(n=2, beam_search={"length_penalty": 10.5})
    with pytest.raises(InvalidRequest, match="^stop_token_ids: at most 16 with beam search"):
        _spec(n=2, stop_token_ids=list(range(17)))
    assert _spec(n=2, stop_token_ids=list(range(16)) * 2).beam is not None
    with pytest.raises(InvalidRequest, match="^early_stopping: unknown value 7"):
        _spec(n=2, beam_search={"early_stopping": 7})


def test_beam_fields_from_openai_bodies():
    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
    from pagedserve.router.openai_formats import beam_search
    params = pb.SamplingParams()
    beam_search({"use_beam_search": True, "length_penalty": 0.5, "early_stopping": "never"},
                params)
    assert params.HasField("beam_search")
    assert (params.beam_search.length_penalty, params.beam_search.early_stopping) == \
        (0.5, pb.EARLY_STOPPING_NEVER)
    for body, early in (({"use_beam_search": True, "early_stopping": True},
                         pb.EARLY_STOPPING_WHEN_FULL),
                        ({"use_beam_search": True}, pb.EARLY_STOPPING_HEURISTIC)):
        params = pb.SamplingParams()
        beam_search(body, params)
        assert params.beam_search.early_stopping == early
        assert not params.beam_search.HasField("length_penalty")
    params = pb.SamplingParams()  # defaults without beam search: nothing asked
    beam_search({"use_beam_search": False, "length_penalty": 1.0, "early_stopping": False},
                params)
    assert not params.HasField("beam_search")


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_preempted_while_its_rows_are_out(mode):
    """The search's group preempted (as the scheduler does for another group) while the
    step after the first fork is out: the answers still step the search; after a
    recompute the new beams have no blocks and reach the executor as new requests with
    their outputs (the group forks again), after a swap they are forked on the executor
    and swapped in with their parents' blocks. The beams equal transformers'."""
    from pagedserve.router.plan_builder import PlanRows
    from pagedserve.router.scheduler import SchedulerOutput

    async def go():
        engine, _ = make_engine(mode=mode)
        ex = ContextExecutor(engine, eos_boost=0.0)
        spec = RequestSpec("beam", tuple(range(10, 19)), SamplingSpec(
            max_tokens=8, temperature=0.0, n=3, beam=BeamSpec()))
        c = Collector(await engine.submit(spec))
        await ex.answer()  # the prompt: beam 0 forks twice
        while not ex.unanswered():
            await asyncio.sleep(0.001)
        sched, group = engine.executors["e0"].scheduler, engine.live["beam"]
        out = SchedulerOutput(PlanRows(sched.kv))
        sched._preempt(group, out)  # (the beams' rows are out)
        sched._pending_drops.extend(out.dropped_seq_ids)
        await ex.run_until_done([c])
        await _drain(ex)
        return c, ex, engine, group
    c, ex, engine, group = run(go())
    assert c.error is None and group.num_preemptions == 1
    assert _outputs(c, 3) == hf_beams(list(range(10, 19)), 3, 8, eos_boost=0.0)
    recomputed = [r for r in ex.new_requests if len(r.output_token_ids)]
    if mode is PreemptionMode.RECOMPUTE:  # the three beams, 2 tokens out, computed again
        assert sorted(len(r.output_token_ids) for r in recomputed) == [2, 2, 2]
    else:
        # the next plan swaps the beams out (their blocks were written by the plan that
        # was out), forks the new beam from its swapped parent, and swaps all back in
        plan = ex.plans[2]
        assert not recomputed and plan.swap_out.shape[0] and plan.swap_in.shape[0]
        assert [(f.parent_id, f.child_id) for f in plan.forks] == [("beam#0", "beam#2.3")]
    _check_clean(engine, ex)
    assert sorted(ex.dropped) == sorted([r.request_id for r in ex.new_requests] + ex.forked)


def test_beams_beside_the_decode_lane(monkeypatch):
    """Enough plain requests that their steady decodes are planned in the decode lane
    (router/decode_lane.py, from 4 running groups here): the beams stay in the loop and
    still equal transformers', the plain requests' greedy tokens are the model's."""
    from pagedserve.router.plan_builder import PlanRows
    lanes = []
    add_lane = PlanRows.add_lane

    def counted(self, lane):
        lanes.append(list(lane.ids))
        add_lane(self, lane)
    monkeypatch.setattr(PlanRows, "add_lane", counted)

    async def go():
        engine, _ = make_engine(num_gpu_blocks=128, decode_lane_min_running=4)
        ex = ContextExecutor(engine, eos_boost=0.0)
        plain = [Collector(await engine.submit(RequestSpec(
            f"p{i}", (i + 1, i + 2), SamplingSpec(max_tokens=12, temperature=0.0,
                                                  ignore_eos=True)))) for i in range(6)]
        c = Collector(await engine.submit(RequestSpec("beam", (7, 8, 9), SamplingSpec(
            max_tokens=10, temperature=0.0, n=3, beam=BeamSpec()))))
        await ex.run_until_done([c, *plain])
        await _drain(ex)
        return c, plain, ex, engine
    c, plain, ex, engine = run(go())
    assert len(lanes) >= 5 and all(rid.startswith("p") for ids in lanes for rid in ids)
    assert _outputs(c, 3) == hf_beams([7, 8, 9], 3, 10, eos_boost=0.0)
    for i, col in enumerate(plain):
        assert col.tokens() == hf_beams([i + 1, i + 2], 1, 12, stop_ids=(),
                                        eos_boost=0.0)[0]
    _check_clean(engine, ex)


def test_generate_cli_asks_for_beams():
    """`pagedserve generate --beam-search --n 3 --length-penalty 0.5 --early-stopping
    never`: the request's beam_search; the scoring flags alone are refused (exit 2)."""
    from types import SimpleNamespace

    from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb

    from pagedserve.client import build_request, main
    args = SimpleNamespace(
        prompt="x", max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, stop=None,
        n=3, ignore_eos=False, min_tokens=0, seed=None, logprobs=None, request_id=None,
        priority=0, cache_salt=None, lora_adapter=None, chat=False, beam_search=True,
        length_penalty=0.5, early_stopping="never")
    params = build_request(args).params
    assert params.n == 3 and params.HasField("beam_search")
    assert (params.beam_search.length_penalty, params.beam_search.early_stopping) == \
        (0.5, pb.EARLY_STOPPING_NEVER)
    args.beam_search = False
    assert not build_request(args).params.HasField("beam_search")
    with pytest.raises(SystemExit) as exc:
        main(["x", "--length-penalty", "2"])
    assert exc.value.code == 2


def test_router_cost_bench_quick(capsys):
    """benchmarks/beam_search_bench.py --router-cost in its smallest setting: its line."""
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "beam_search_bench.py"
    spec = importlib.util.spec_from_file_location("beam_search_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.router_cost([2], rounds=20)
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert line["case"] == "router_cost_w2" and line["advances"] > 0
    assert line["select_us"] > 0 and line["advance_us"] > 0
