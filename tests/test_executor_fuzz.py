"""Wire-valid but wild StepPlans straight into a ModelRunner (no router): whatever a plan
holds (unknown requests, marked decodes with nothing to feed, slots, positions, token and
block ids just outside their ranges, rows with no tokens, forks of unknown parents, block
moves out of range, requests finished twice), `execute` returns a StepResult and never
raises, answers every row that samples once (a token or an error), and the runner keeps
serving: a clean request afterwards samples what it samples on a fresh runner. The same
with steps left in flight (`submit`/`collect`). And one row of a correct step broken one
way: that request alone is named, with that check's message, and the others' tokens are
exactly those they sample alone, one step at a time and as a GPU runs (steps in flight,
pipelined decodes in any row order as fed decode graphs: ids from the stage, from the
graphs' last tokens and copied in all occur).

Sampling parameters stay within what the router validates (the executor takes them as
validated: protos/wire.py SamplingParams)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import (
    Fork,
    NewRequest,
    SamplingParams,
    StepPlan,
    int32,
    int64_pairs,
)
from pagedserve.router.structured import build_grammar
from test_executor_support import Driver

from pagedserve.tinymodels import build_model

BS, NUM_GPU, NUM_CPU, MAX_LEN = 8, 24, 8, 96
POOL = ["a", "b", "c", "d"]  # the wild plans' request ids
CLEAN = [0, 17, 250, 33, 9, 480, 77, 5, 61, 300]  # the clean request's prompt afterwards
CLEAN_BLOCKS = [20, 21, 22, 23]  # its blocks (the wild plans may write anywhere)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("fuzz") / "llama", "llama")


def _runner(model_dir):
    return build_runner(str(model_dir), num_gpu_blocks=NUM_GPU, num_cpu_blocks=NUM_CPU,
                        block_size=BS, max_model_len=MAX_LEN, progress=False)


def _clean_tokens(runner, step_id: int) -> list[int]:
    """A greedy request ("z") prefilled then decoded twice: its three tokens."""
    greedy = SamplingParams(temperature=0.0)
    n = len(CLEAN)
    plan = StepPlan(
        step_id=step_id, request_ids=["z"],
        new_requests=[NewRequest(request_id="z", prompt_token_ids=int32(CLEAN),
                                 output_token_ids=int32([]), sampling=greedy)],
        num_computed_tokens=int32([0]), num_new_tokens=int32([n]),
        do_sample=np.ones(1, np.uint8), token_ids=int32(CLEAN), positions=int32(range(n)),
        slot_mapping=np.array([CLEAN_BLOCKS[p // BS] * BS + p % BS for p in range(n)],
                              np.int64),
        block_table_starts=int32([0]), block_table_lens=int32([2]),
        block_table_ids=int32(CLEAN_BLOCKS[:2]))
    out = []
    for k in range(3):
        result = runner.execute(plan)
        assert not result.errors and result.request_ids == ["z"], result.errors
        token = int(result.token_ids[0])
        out.append(token)
        pos = n + k
        plan = StepPlan(
            step_id=step_id + k + 1, request_ids=["z"], num_computed_tokens=int32([pos]),
            num_new_tokens=int32([1]), do_sample=np.ones(1, np.uint8),
            token_ids=int32([token]), positions=int32([pos]),
            slot_mapping=np.array([CLEAN_BLOCKS[pos // BS] * BS + pos % BS], np.int64),
            block_table_starts=int32([2]), block_table_lens=int32([0]), block_table_ids=None,
            finished_ids=["z"] if k == 2 else [])
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    return _clean_tokens(_runner(model_dir), 1)


@pytest.fixture(scope="module")
def runner(model_dir):
    return _runner(model_dir)


GRAMMARS = {"choice": build_grammar("choice", ["ab", "b"]),
            "regex": build_grammar("regex", "[a-c]+")}
SAMPLING = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0]), top_p=st.sampled_from([1.0, 0.9]),
    top_k=st.sampled_from([0, 5]), seed=st.integers(0, 3),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    presence_penalty=st.sampled_from([0.0, 0.5]), min_tokens=st.integers(0, 2),
    logprobs=st.sampled_from([None, 0, 2]), stop_token_ids=st.sampled_from([(), (3,)]),
    eos_token_ids=st.sampled_from([(), (1,)]), ignore_eos=st.booleans(),
    logit_bias_ids=st.sampled_from([(), (7,)]).map(tuple),
    prompt_logprobs=st.sampled_from([None, None, 1]),
    # Structured output: most free, some a format (the router's compiled grammars), one
    # this executor cannot use (the request is then condemned).
    grammar=st.sampled_from(["", "", "", "choice", "regex", "not a grammar"]).map(
        lambda g: GRAMMARS.get(g, g)),
).map(lambda p: SamplingParams(**{**{f: getattr(p, f) for f in p.__struct_fields__},
                                  "logit_bias_values": (2.0,) * len(p.logit_bias_ids)}))


@st.composite
def wild_plan(draw, step_id: int, vocab: int):
    ids = draw(st.lists(st.sampled_from(POOL), unique=True, max_size=4))
    s = len(ids)
    # Half the plans are "coherent": every row one the executor can run as far as the plan
    # alone tells (its request sent along, a table from 0 that holds its tokens, in-range
    # values, no fork, move or finish), so that whole steps run, steps stay in flight and
    # decodes run as fed graphs among the wild plans; the other half are wild throughout.
    coherent = draw(st.booleans())
    num_new = [draw(st.sampled_from([1, 1, 1, 2, 4] if coherent else [0, 1, 1, 2, 4]))
               for _ in range(s)]
    t = sum(num_new)
    ints = lambda lo, hi, n: draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))  # noqa: E731
    if coherent:
        computed = [draw(st.integers(0, MAX_LEN - 4 - n)) for n in num_new]
        starts = [0] * s
        lens = [-(-(c + n) // BS) for c, n in zip(computed, num_new, strict=True)]
        in_range = dict(tokens=(0, vocab - 1), positions=(0, MAX_LEN - 1),
                        slots=(-1, NUM_GPU * BS - 1), blocks=(0, NUM_GPU - 1))
        sent = [rid for rid in ids if draw(st.integers(0, 3))]  # most rows' requests sent
    else:
        lens = [draw(st.integers(0, 2)) for _ in range(s)]
        starts = [draw(st.sampled_from([0, 0, 1, 2, 4])) for _ in range(s)]
        computed = [draw(st.integers(0, MAX_LEN)) for _ in range(s)]
        in_range = dict(tokens=(-2, vocab), positions=(-1, MAX_LEN),
                        slots=(-2, NUM_GPU * BS), blocks=(-1, NUM_GPU))
        sent = draw(st.lists(st.sampled_from(POOL), unique=True, max_size=2))
    new = [NewRequest(request_id=rid,
                      prompt_token_ids=int32(ints(0, vocab - 1, draw(st.integers(1, 12)))),
                      output_token_ids=int32(ints(0, vocab - 1, draw(st.integers(0, 2)))),
                      sampling=draw(SAMPLING), sample_index=draw(st.integers(0, 1)))
           for rid in sent]

    def pairs(lo_limit, hi_limit):
        if coherent or not draw(st.booleans()):
            return None
        return int64_pairs([(draw(st.integers(-1, lo_limit)), draw(st.integers(-1, hi_limit)))])

    copy = pairs(NUM_GPU, NUM_GPU)
    if copy is not None and copy[0, 0] == copy[0, 1]:
        copy = None  # a block both source and target: the wire rejects it
    forks = [] if coherent else [
        Fork(parent_id=draw(st.sampled_from(POOL)), child_id=child,
             sample_index=draw(st.integers(0, 2)))
        for child in draw(st.lists(st.sampled_from(POOL), unique=True, max_size=1))]
    n_ids = sum(lens)
    plan = StepPlan(
        step_id=step_id, request_ids=ids, new_requests=new, forks=forks,
        num_computed_tokens=int32(computed), num_new_tokens=int32(num_new),
        do_sample=np.array([draw(st.sampled_from([0, 1, 1, 1])) for _ in range(s)], np.uint8),
        feed_sampled=np.array(ints(0, 1, s), np.uint8) if draw(st.booleans()) else None,
        token_ids=int32(ints(*in_range["tokens"], t)),
        positions=int32(ints(*in_range["positions"], t)),
        slot_mapping=np.array(ints(*in_range["slots"], t), np.int64),
        block_table_starts=int32(starts), block_table_lens=int32(lens),
        block_table_ids=int32(ints(*in_range["blocks"], n_ids))
        if n_ids or draw(st.booleans()) else None,
        swap_out=pairs(NUM_GPU, NUM_CPU), swap_in=pairs(NUM_CPU, NUM_GPU), copy=copy,
        finished_ids=[] if coherent else draw(st.lists(st.sampled_from(POOL), unique=True,
                                                       max_size=2)))
    plan.validate()
    return plan


STEP = [1000]  # step ids keep growing across examples (the runner is the module's)


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_wild_plans_never_raise_and_every_sampling_row_is_answered(runner, data):
    vocab = runner.vocab_size
    runner.reset()  # each example from an empty state (as after registering), replayable
    for _ in range(data.draw(st.integers(1, 4))):
        STEP[0] += 1
        plan = data.draw(wild_plan(STEP[0], vocab))
        result = runner.execute(plan)
        assert result.step_id == plan.step_id
        _check_result(plan, result, vocab)
        _check_held(runner)


@pytest.fixture(scope="module")
def overlapped(model_dir):
    """A GPU's loop on the CPU: a sampling step stays in flight until the next, and decode
    steps of up to 3 rows run as fed decode graphs (their CPU twin; 4 rows: eager)."""
    r = _runner(model_dir)
    r.overlap_steps = True
    graphs = DecodeGraphs(r.model, r.cache.kv_cache, BS, MAX_LEN, 3)
    graphs.capture()
    r.graphs = graphs
    return r


def _check_result(plan: StepPlan, result, vocab: int) -> None:
    errors = {e.request_id for e in result.errors}
    assert len(errors) == len(result.errors), result.errors  # one error a request
    assert set(result.request_ids) <= set(plan.request_ids)
    assert not set(result.request_ids) & errors, result.errors
    if result.request_ids:
        assert result.token_ids.shape == (len(result.request_ids),)
        assert ((result.token_ids >= 0) & (result.token_ids < vocab)).all()
    if "" not in errors:  # not a step that failed as a whole
        sampling = {rid for rid, d in zip(plan.request_ids, plan.do_sample, strict=True) if d}
        assert sampling <= set(result.request_ids) | errors, (sampling, result)


def _check_held(runner) -> None:
    """The runner's count of requests that are not plain greedy (runner_requests.py) is
    the count of those it holds."""
    assert runner._not_plain == sum(not r._sampling.plain for r in runner.requests.values())


@pytest.fixture(scope="module")
def cuda_runner(tmp_path_factory):
    """On a GPU as `serve` runs it: steps left in flight, decode steps of up to 3 rows as
    fed CUDA graphs (float32; head dim 64)."""
    model = build_model(tmp_path_factory.mktemp("fuzz-cuda") / "llama", "llama",
                        hidden_size=256, num_heads=4, num_kv_heads=2)
    return build_runner(str(model), device="cuda", dtype="float32", num_gpu_blocks=NUM_GPU,
                        num_cpu_blocks=NUM_CPU, block_size=BS, max_model_len=MAX_LEN,
                        max_num_seqs=3, progress=False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_wild_plans_with_steps_left_in_flight(device, request, data):
    """The same through `submit` and `collect` with steps left in flight (a marked decode
    then fed from the step in flight): every plan answered once, in order; on the CPU
    through the graphs' twin, on a GPU through real CUDA graphs."""
    overlapped = request.getfixturevalue("overlapped" if device == "cpu" else "cuda_runner")
    assert overlapped.overlap_steps and overlapped.graphs is not None
    vocab = overlapped.vocab_size
    overlapped.reset()
    plans, results = [], []
    for _ in range(data.draw(st.integers(1, 5))):
        STEP[0] += 1
        plans.append(data.draw(wild_plan(STEP[0], vocab)))
        results += overlapped.submit(plans[-1])
        if data.draw(st.booleans()):
            last = overlapped.collect()  # no plan waiting: the step in flight read back
            results += [last] if last is not None else []
    last = overlapped.collect()
    results += [last] if last is not None else []
    assert [r.step_id for r in results] == [p.step_id for p in plans]
    for plan, result in zip(plans, results, strict=True):
        _check_result(plan, result, vocab)
    _check_held(overlapped)


def test_the_runner_still_serves_after_the_wild_plans(runner, reference):
    """Runs after the fuzz (same module runner): a clean request samples what a fresh
    runner samples."""
    STEP[0] += 10
    assert _clean_tokens(runner, STEP[0]) == reference


def test_a_failed_fork_condemns_a_request_already_under_the_childs_id(runner):
    """Found by the fuzz: a fork of an unknown parent whose child id names a request the
    executor holds, scheduled in the same plan, used to run that old request and report
    both its token and the fork's error. Now the old state is dropped with the fork's error
    alone (one error a request), and the id is unknown here afterwards."""
    runner.reset()
    greedy = SamplingParams(temperature=0.0)
    STEP[0] += 1
    prefill = StepPlan(
        step_id=STEP[0], request_ids=["a"],
        new_requests=[NewRequest(request_id="a", prompt_token_ids=int32([3, 4, 5]),
                                 output_token_ids=int32([]), sampling=greedy)],
        num_computed_tokens=int32([0]), num_new_tokens=int32([3]),
        do_sample=np.ones(1, np.uint8), token_ids=int32([3, 4, 5]), positions=int32([0, 1, 2]),
        slot_mapping=np.array([0, 1, 2], np.int64), block_table_starts=int32([0]),
        block_table_lens=int32([1]), block_table_ids=int32([0]))
    first = runner.execute(prefill)
    assert first.request_ids == ["a"] and not first.errors
    STEP[0] += 1
    decode = StepPlan(
        step_id=STEP[0], request_ids=["a"], forks=[Fork(parent_id="ghost", child_id="a", sample_index=0)],
        num_computed_tokens=int32([3]), num_new_tokens=int32([1]),
        do_sample=np.ones(1, np.uint8), token_ids=int32([int(first.token_ids[0])]),
        positions=int32([3]), slot_mapping=np.array([3], np.int64),
        block_table_starts=int32([1]), block_table_lens=int32([0]))
    result = runner.execute(decode)
    assert result.request_ids == []
    assert [(e.request_id, e.message) for e in result.errors] == [("a", "fork of unknown 'ghost'")]
    assert "a" not in runner.requests


# ------------------------------------------------------------- one row corrupted, exactly

CORRUPTIONS = ("slot", "position", "token", "block", "start", "fit", "unknown")


def _corrupt(plan: StepPlan, row: int, kind: str, vocab: int):
    """``plan`` with row ``row`` broken in one way: (the plan, the request id the executor
    must name, its message); None when the row has no such field to break (no table
    change for "block")."""
    first = int(plan.num_new_tokens[:row].sum())  # the row's first token
    rid = plan.request_ids[row]
    arrays = {k: getattr(plan, k).copy() for k in (
        "slot_mapping", "positions", "token_ids", "block_table_ids", "block_table_starts",
        "num_computed_tokens")}
    fields: dict = {}
    message = "a slot, position or token id out of range"
    if kind == "slot":
        arrays["slot_mapping"][first] = NUM_GPU * BS
    elif kind == "position":
        arrays["positions"][first] = MAX_LEN
    elif kind == "token":
        arrays["token_ids"][first] = vocab
    elif kind == "block":
        if not plan.block_table_lens[row]:
            return None
        arrays["block_table_ids"][int(plan.block_table_lens[:row].sum())] = NUM_GPU
        message = f"block id out of range (have {NUM_GPU})"
    elif kind == "start":
        start = int(plan.block_table_starts[row])
        arrays["block_table_starts"][row] = start + 1
        message = f"block table change at {start + 1} beyond its {start}"
    elif kind == "fit":
        capacity = int(plan.block_table_starts[row] + plan.block_table_lens[row]) * BS
        arrays["num_computed_tokens"][row] = capacity
        message = "its tokens do not fit its blocks or max_model_len"
    else:  # a request this executor never heard of, in the row's place
        fields["request_ids"] = [*plan.request_ids[:row], "ghost", *plan.request_ids[row + 1:]]
        rid, message = "ghost", "unknown request (never sent as a new request)"
    bad = msgspec.structs.replace(plan, **{**arrays, **fields})
    bad.validate()
    return bad, rid, message


@pytest.fixture(scope="module")
def solo(model_dir):
    return _runner(model_dir)


@pytest.mark.parametrize("loop", ["eager", "graphs"])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_one_corrupted_row_is_named_and_the_others_sample_as_alone(loop, runner, overlapped,
                                                                     solo, data):
    """A step of 2-4 greedy requests (prefill, some rows a chunk of their prompt, or
    decode), one row broken one way: the executor names that request with that check's
    message and no other, the other rows that end their prompt sample, and every
    survivor's tokens, then and 3 steps on, are those it samples alone on a fresh runner
    (eager, one step at a time). Exact token ids, not a tolerance. Run eagerly one step
    at a time, and as a GPU runs (steps left in flight, the decode steps of up to 3 rows
    as fed graphs: their CPU twin)."""
    runner = runner if loop == "eager" else overlapped
    vocab = runner.vocab_size
    runner.reset()
    d = Driver(runner)
    rids = [f"q{i}" for i in range(data.draw(st.integers(2, 4)))]
    prompts = {r: data.draw(st.lists(st.integers(0, vocab - 1), min_size=3, max_size=12))
               for r in rids}
    for r in rids:
        d.add(r, prompts[r])
    before = data.draw(st.integers(0, 2))  # outputs before the broken step (0: a prefill)
    if before:
        d.generate(rids, before)
    d.step_id = STEP[0] = STEP[0] + 10
    # A prefill step may compute only part of a prompt (a chunk: that row does not sample).
    chunks = {r: None if before or data.draw(st.booleans())
              else data.draw(st.integers(1, len(prompts[r]) - 1)) for r in rids}
    plan = d.plan(chunks)
    row, kind = data.draw(st.integers(0, len(rids) - 1)), data.draw(st.sampled_from(CORRUPTIONS))
    broken = _corrupt(plan, row, kind, vocab)
    if broken is None:
        return
    bad, named, message = broken
    result = runner.execute(bad)
    victim = rids[row]
    assert [(e.request_id, e.message) for e in result.errors] == [(named, message)]
    survivors = [r for r in rids if r != victim]
    assert result.request_ids == [r for r, sample in zip(rids, plan.do_sample, strict=True)
                                  if r != victim and sample]
    d.accept(result)
    del d.seqs[victim]
    if kind == "unknown":  # the victim's state is still here: the router would finish it
        d.step({r: None for r in survivors}, finished_ids=[victim])
    if loop == "eager":
        d.generate(survivors, before + 3)
    else:  # pipelined, as the router sends them: a decode fed the step in flight's token
        previous: set[str] = set()  # the rows of the step in flight
        for _ in range(3):  # rows in any order, one sitting a step out now and then
            order = data.draw(st.permutations(survivors))
            if len(order) > 1 and data.draw(st.booleans()):
                order = order[1:]
            plan = d.plan({r: None for r in order}, feed=[r for r in order if r in previous])
            for done in runner.submit(plan):
                d.accept(done)
            previous = set(order)
        d.accept(runner.collect())
    assert victim not in runner.requests
    for r in survivors:
        alone = Driver(solo)
        solo.reset()
        alone.add(r, prompts[r])
        alone.generate([r], len(d.seqs[r].outputs))
        assert d.seqs[r].outputs == alone.seqs[r].outputs, r
