"""Pipelined steps on the executor (issue 11, DESIGN §2 "Pipelining").

In process: plan N+1 built before step N's result is seen, its decodes marked
``feed_sampled`` (placeholder -1), gives exactly the tokens and logprobs of the one-plan-at-a-
time run; a marked decode whose request sampled nothing in step N is skipped with an error
while the rest of the step proceeds. Over ZeroMQ: a real executor process answers plans sent
back to back, in order, with a small ``gap_s``; and a step that overruns its ``deadline_s``
(the testing hook PAGEDSERVE_FAULT_SLEEP_IN_STEP) silences the heartbeats until it ends.
"""

from __future__ import annotations

import signal
import time

import msgspec
import numpy as np
import pytest
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import (
    Heartbeat,
    Hello,
    NewRequest,
    SamplingParams,
    Shutdown,
    StepPlan,
    StepResult,
    Welcome,
    int32,
)
from test_executor_process import FakeRouter, _start
from test_executor_support import Driver

from pagedserve.tinymodels import build_model

PROMPT = [0, 17, 250, 33, 9, 480, 77, 5, 61, 300, 12, 13, 14, 15, 16, 99, 98, 97, 96, 95]
OTHER = [0, 400, 3, 3, 3, 91, 200, 201, 202]
THIRD = [0, 7, 7, 8, 9, 10, 11, 500, 2, 3, 4]
GREEDY_PEN = SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2)
SEEDED_PEN = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.3, logprobs=3)
FEED = "feed"  # in a script: a decode of the token sampled in the previous step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("pipe") / "llama", "llama",
                       initializer_range=0.05)


def _driver(model_dir, device: str = "cpu") -> Driver:
    extra = {} if device == "cpu" else {"device": device, "dtype": "float32"}
    return Driver(build_runner(str(model_dir), num_gpu_blocks=48, num_cpu_blocks=8,
                               block_size=8, progress=False, **extra))


def _run_script(driver: Driver, script, pipelined: bool) -> list[StepResult]:
    """Run ``script`` (one {request id: tokens | None | FEED} per step). Depth 1: each plan
    is built after the previous result is accepted. Depth 2: each plan is built BEFORE the
    previous result is accepted, its FEED rows marked (placeholder -1), and its plan-only
    inputs prepared before the previous step runs (as the executor's I/O thread does)."""
    results, pending, ahead = [], None, None
    for schedule in script:
        feed = {r for r, n in schedule.items() if n == FEED} if pipelined else set()
        if pending is not None and not pipelined:
            driver.accept(pending)
        plan = driver.plan({r: None if n == FEED else n for r, n in schedule.items()},
                           feed=feed)
        if pipelined:
            ahead = driver.runner.precompute(plan)
        if pending is not None and pipelined:
            driver.accept(pending)
        pending = driver.runner.execute(plan, ahead)
        results.append(pending)
    driver.accept(pending)
    return results


def _same_results(a: StepResult, b: StepResult) -> None:
    assert (a.step_id, a.request_ids, a.errors) == (b.step_id, b.request_ids, b.errors)
    for name in ("token_ids", "logprobs", "top_counts", "top_token_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


SCRIPT = [
    {"a": None, "b": None},  # prefill both, each samples its first token
    {"a": FEED, "b": FEED},
    {"a": FEED, "b": FEED, "c": 5},  # c: a prefill chunk that does not sample
    {"a": FEED, "c": None},  # b sits out a step ...
    {"b": 1, "a": FEED, "c": FEED},  # ... so its decode is not marked (its token is known)
    {"c": FEED, "b": FEED, "a": FEED},
    {"a": FEED, "b": FEED, "c": FEED},
]


def test_marked_decodes_give_exactly_the_depth_1_tokens(model_dir):
    """Greedy and seeded sampling, with every penalty and logprobs: the fed-back tokens are
    the ones the depth-1 run reads from the plan, and penalties/logprobs see them."""
    runs = {}
    for pipelined in (False, True):
        d = _driver(model_dir)
        d.add("a", PROMPT, sampling=GREEDY_PEN)
        d.add("b", OTHER, sampling=SEEDED_PEN, sample_index=1)
        d.add("c", THIRD, sampling=SEEDED_PEN)
        runs[pipelined] = d, _run_script(d, SCRIPT, pipelined)
    (d1, depth1), (d2, depth2) = runs[False], runs[True]
    for a, b in zip(depth1, depth2, strict=True):
        _same_results(a, b)
        assert not b.errors
    assert [len(d2.seqs[r].outputs) for r in "abc"] == [7, 6, 4]
    for rid in "abc":
        assert d2.seqs[rid].outputs == d1.seqs[rid].outputs
        # The executor's own record (what the penalties count) holds the fed-back tokens.
        state = d2.runner.requests[rid].sampling
        assert state.output_token_ids.tolist() == d2.seqs[rid].outputs
    assert len(set(d2.seqs["b"].outputs)) > 1  # seeded rows really sample
    # gap_s: 0 for the first step of a runner, then the time between two steps.
    assert depth2[0].gap_s == 0.0 and all(r.gap_s > 0 for r in depth2[1:])


def test_fork_planned_while_the_parent_token_is_in_flight(model_dir):
    """n=2: the child is forked in the plan that feeds the parent's first token; both are
    fed it, and each equals the depth-1 run."""
    outs = {}
    for pipelined in (False, True):
        d = _driver(model_dir)
        d.add("p", PROMPT[:12], sampling=SEEDED_PEN)
        pending = d.runner.execute(d.plan({"p": None}))
        if not pipelined:
            d.accept(pending)
        d.fork("p", "q", sample_index=1)  # before the parent's first token is accepted
        cow = d.cow_last_block("q")
        feed = {"p", "q"} if pipelined else set()
        plan = d.plan({"p": None if not pipelined else 1, "q": None if not pipelined else 1},
                      feed=feed, copy=cow)
        if pipelined:
            d.accept(pending)
            d.seqs["q"].tokens.append(d.seqs["p"].tokens[-1])  # the child shares it
        result = d.runner.execute(plan)
        assert not result.errors
        d.accept(result)
        outs[pipelined] = (d.seqs["p"].outputs, d.seqs["q"].outputs)
    assert outs[True] == outs[False]
    assert outs[True][0][0] == outs[True][1][0] and outs[True][0] != outs[True][1]


def _replace(plan: StepPlan, **changes) -> StepPlan:
    new = msgspec.structs.replace(plan, **changes)
    new.validate()
    return new


def test_unfed_marked_decodes_are_errors_and_the_rest_proceeds(model_dir):
    """Step N fails as a whole, or one request errors in N, or was not sampled in N: its
    marked decode in N+1 is left out with an error naming why (never fed a made-up token),
    its state dropped; the other rows of N+1 run and sample what depth 1 samples."""
    d = _driver(model_dir)
    runner = d.runner
    for rid, prompt in (("a", PROMPT), ("b", OTHER), ("x", OTHER[:6]), ("c", THIRD)):
        d.add(rid, prompt, sampling=SEEDED_PEN)
    first = runner.execute(d.plan({"a": None, "b": None, "x": 3}))  # x: chunk, no sample
    assert first.request_ids == ["a", "b"]

    # Step 1 fails as a whole (the forward raises) while plan 2 is already built.
    plan1 = d.plan({"a": FEED, "b": FEED}, feed={"a", "b"})
    d.accept(first)
    plan2 = d.plan({"b": FEED, "x": 1, "c": None}, feed={"b"})
    plan2 = _replace(plan2, feed_sampled=np.array([1, 1, 0], np.uint8))  # x marked too
    original = runner.model.forward
    runner.model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    try:
        failed = runner.execute(plan1)
    finally:
        runner.model.forward = original
    assert [e.request_id for e in failed.errors] == [""] and "boom" in failed.errors[0].message
    result = runner.execute(plan2)
    errors = {e.request_id: e.message for e in result.errors}
    assert list(errors) == ["b", "x"]
    assert "sampled nothing in step 1" in errors["b"]  # step 1 failed
    assert "sampled nothing in step 1" in errors["x"]  # x never sampled (a chunk in step 0)
    assert result.request_ids == ["c"] and not {"b", "x"} & set(runner.requests)
    assert "a" in runner.requests  # a was not in plan 2: untouched

    # A request that errors in step N (a block id out of range) cannot be fed in N+1; the
    # request beside it proceeds, token for token as when it runs alone.
    ref = _driver(model_dir)
    ref.add("a", PROMPT, sampling=GREEDY_PEN)
    _run_script(ref, [{"a": None}, {"a": FEED}, {"a": FEED}], pipelined=False)
    d = _driver(model_dir)
    d.add("a", PROMPT, sampling=GREEDY_PEN)
    d.add("c", THIRD)
    first = d.runner.execute(d.plan({"a": None}))
    plan1 = d.plan({"a": FEED, "c": None}, feed={"a"})
    table_ids = plan1.block_table_ids.copy()
    table_ids[-1] = 10_000  # c's last block: out of range, so c errors in step 1
    plan1 = _replace(plan1, block_table_ids=table_ids)
    d.accept(first)
    plan2 = d.plan({"a": FEED, "c": FEED}, feed={"a", "c"})
    r1 = d.runner.execute(plan1)
    assert [e.request_id for e in r1.errors] == ["c"] and r1.request_ids == ["a"]
    r2 = d.runner.execute(plan2)
    assert [e.request_id for e in r2.errors] == ["c"] and r2.request_ids == ["a"]
    assert "unknown here" in r2.errors[0].message and "step 1" in r2.errors[0].message
    d.accept(r1)
    d.accept(r2)
    assert d.seqs["a"].outputs == ref.seqs["a"].outputs


def test_placeholder_rules(model_dir):
    """A -1 that is not marked is still an out-of-range token; a marked row must be a
    one-token decode; a marked row is fed even when its plan entry is not -1."""
    d = _driver(model_dir)
    d.add("a", PROMPT)
    d.add("b", OTHER)
    first = d.runner.execute(d.plan({"a": None, "b": None}))
    plan = d.plan({"a": FEED, "b": FEED}, feed={"a", "b"})
    d.accept(first)
    unmarked = _replace(plan, feed_sampled=np.array([1, 0], np.uint8))
    result = d.runner.execute(unmarked)
    assert [e.request_id for e in result.errors] == ["b"]
    assert "out of range" in result.errors[0].message and result.request_ids == ["a"]

    d = _driver(model_dir)
    d.add("a", PROMPT)
    first = d.runner.execute(d.plan({"a": 12}))  # no sample: a chunk
    d.accept(first)
    two = d.plan({"a": 2})
    marked_two = _replace(two, feed_sampled=np.array([1], np.uint8))
    result = d.runner.execute(marked_two)
    assert [e.request_id for e in result.errors] == ["a"]
    assert "scheduled with 2 tokens" in result.errors[0].message

    d = _driver(model_dir)
    d.add("a", PROMPT, sampling=GREEDY_PEN)
    first = d.runner.execute(d.plan({"a": None}))
    plan = d.plan({"a": FEED}, feed={"a"})
    d.accept(first)
    wrong_token = _replace(plan, token_ids=int32([7]))  # a marked row ignores the entry
    fed = d.runner.execute(wrong_token)
    ref = _driver(model_dir)
    ref.add("a", PROMPT, sampling=GREEDY_PEN)
    ref_results = _run_script(ref, [{"a": None}, {"a": FEED}], pipelined=False)
    _same_results(fed, ref_results[1])
# --------------------------------------------------------------------------- the process


def _prefill_plan(step_id: int, prompt: list[int], sampling=SamplingParams(temperature=0.0),
                  deadline_s: float = 0.0) -> StepPlan:
    n = len(prompt)
    return StepPlan(
        step_id=step_id,
        new_requests=[NewRequest(request_id="r", prompt_token_ids=int32(prompt),
                                 output_token_ids=int32([]), sampling=sampling)],
        request_ids=["r"], num_computed_tokens=int32([0]), num_new_tokens=int32([n]),
        do_sample=np.array([1], np.uint8), token_ids=int32(prompt), positions=int32(range(n)),
        slot_mapping=np.arange(16, 16 + n, dtype=np.int64), block_table_starts=int32([0]),
        block_table_lens=int32([1]), block_table_ids=int32([1]), deadline_s=deadline_s)


def _decode_plan(step_id: int, position: int, token: int = -1,
                 deadline_s: float = 0.0) -> StepPlan:
    """A decode of request "r" (block 1, so position < 16); marked when token is -1."""
    return StepPlan(
        step_id=step_id, request_ids=["r"], num_computed_tokens=int32([position]),
        num_new_tokens=int32([1]), do_sample=np.array([1], np.uint8),
        feed_sampled=np.array([token == -1], np.uint8), token_ids=int32([token]),
        positions=int32([position]), slot_mapping=np.array([16 + position], np.int64),
        block_table_starts=int32([1]), block_table_lens=int32([0]), block_table_ids=int32([]),
        deadline_s=deadline_s)


def _back_to_back(router: FakeRouter, ident: bytes, prompt: list[int]) -> list[StepResult]:
    """Steps 10-13 of request "r" (its prefill, then three decodes fed the executor's own
    samples) sent without waiting; their results, as they come."""
    plans = [_prefill_plan(10, prompt)] + [_decode_plan(10 + i, 4 + i) for i in (1, 2, 3)]
    for plan in plans:
        router.send(ident, plan)
    return [router.recv(timeout_s=30, want=StepResult)[1] for _ in plans]


def _register(router: FakeRouter, executor_id: str) -> bytes:
    ident, hello = router.recv(want=Hello)
    assert hello.executor_id == executor_id
    router.send(ident, Welcome(executor_id=executor_id, accepted=True))
    return ident


def test_process_answers_plans_sent_back_to_back_in_order(model_dir, monkeypatch):
    """Four plans go out without waiting: a prefill and three decodes fed the executor's own
    samples. Results come back in plan order, with the greedy tokens of a depth-1 run of the
    same model in this process, and the executor never waited for a plan: small gap_s.
    SIGTERM then sends the goodbye (after the results) and exits 0."""
    prompt = [0, 17, 250, 33, 9]
    ref = _driver(model_dir)
    ref.add("r", prompt)
    ref.generate(["r"], 4)

    router = FakeRouter()
    monkeypatch.delenv("PAGEDSERVE_OVERLAP_STEPS", raising=False)  # the CPU default: gaps
    proc = _start(model_dir, router.address, "--executor-id", "ex-p")
    try:
        ident = _register(router, "ex-p")
        results = _back_to_back(router, ident, prompt)
        assert [r.step_id for r in results] == [10, 11, 12, 13]
        assert all(not r.errors and r.request_ids == ["r"] for r in results)
        assert [int(r.token_ids[0]) for r in results] == ref.seqs["r"].outputs
        gaps = [r.gap_s for r in results]
        print(f"gap_s per step (ms): {[round(g * 1e3, 3) for g in gaps]}; "
              f"forward_s (ms): {[round(r.forward_s * 1e3, 3) for r in results]}")
        assert gaps[0] == 0.0  # first step after registration
        assert all(0 < g < 0.05 for g in gaps[1:]), gaps  # no round trip in any of them

        proc.send_signal(signal.SIGTERM)
        goodbye_ident, goodbye = router.recv(timeout_s=10, want=Shutdown)
        assert goodbye.executor_id == "ex-p" and goodbye_ident == ident
        assert proc.wait(timeout=20) == 0
        err = proc.stderr.read()  # the process ends with os._exit: its logs still flushed
        assert "stopping: handing my requests back" in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        router.close()


def test_step_past_its_deadline_silences_heartbeats_until_it_ends(model_dir, monkeypatch):
    """PAGEDSERVE_FAULT_SLEEP_IN_STEP=21:1.5 sleeps 1.5 s inside step 21, whose deadline is
    0.2 s: no heartbeat leaves while the step is past its deadline (about 5 would at the
    0.25 s interval), one ERROR line says so, heartbeats resume once it ends, and the
    router's Shutdown(exit=False) (it declared the executor dead) makes it register again."""
    router = FakeRouter()
    monkeypatch.setenv("PAGEDSERVE_FAULT_SLEEP_IN_STEP", "21:1.5")
    proc = _start(model_dir, router.address, "--executor-id", "ex-d",
                  "--heartbeat-timeout", "1.0")
    try:
        ident = _register(router, "ex-d")
        router.send(ident, _prefill_plan(20, [0, 17, 250], deadline_s=5.0))
        _, first = router.recv(timeout_s=30, want=StepResult)
        assert not first.errors
        hb_ident = router.recv(timeout_s=5, want=Heartbeat)[0]
        router.send(ident, _decode_plan(21, 3, deadline_s=0.2))
        _, result = router.recv(timeout_s=30, want=StepResult)
        assert result.step_id == 21 and not result.errors and result.forward_s >= 1.5
        deadline = time.monotonic() + 5
        while router.heartbeats[-1][1].steps_done < 2:  # they resume after the step
            router.recv(timeout_s=max(0.1, deadline - time.monotonic()), want=Heartbeat)
        # steps_done says which side of step 21's end a beat left from: the last beat
        # during the step left before its deadline (0.2 s in), the next after it ended
        # (1.5 s in or later); without the rule they are 0.25 s apart.
        during = [hb.time_s for _, hb in router.heartbeats if hb.steps_done == 1]
        after = [hb.time_s for _, hb in router.heartbeats if hb.steps_done == 2]
        assert min(after) - max(during) > 0.9, (during, after)

        router.send(hb_ident, Shutdown(reason="declared dead", exit=False))
        ident = _register(router, "ex-d")
        router.send(ident, _prefill_plan(0, [0, 5, 6]))
        _, again = router.recv(timeout_s=30, want=StepResult)
        assert not again.errors and again.request_ids == ["r"]
        router.send(ident, Shutdown(reason="test over", exit=True))
        assert proc.wait(timeout=20) == 0
        stderr = proc.stderr.read()
        assert stderr.count("overran its deadline") == 1, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        router.close()


def test_plans_prepared_on_the_main_thread_answer_the_same(model_dir, monkeypatch):
    """PAGEDSERVE_PLAN_PREP=main (the I/O thread only decodes; the main thread runs
    `precompute` with the plan): plans sent back to back get the same tokens as a depth-1
    run; a value other than io or main stops the executor at start (exit code 2), as does
    a bad PAGEDSERVE_DECODE_FUSED_ROPE, _TRITON_GEMM, PAGEDSERVE_GRAPH_FEED,
    PAGEDSERVE_MIXED_DECODE_SPLIT, PAGEDSERVE_CPU_PACKED_WEIGHTS or
    PAGEDSERVE_CPU_ROW_PADDING."""
    prompt = [0, 17, 250, 33, 9]
    ref = _driver(model_dir)
    ref.add("r", prompt)
    ref.generate(["r"], 4)
    router = FakeRouter()
    monkeypatch.setenv("PAGEDSERVE_PLAN_PREP", "main")
    monkeypatch.setenv("PAGEDSERVE_OVERLAP_STEPS", "1")  # the GPU's loop, on a CPU
    proc = _start(model_dir, router.address, "--executor-id", "ex-main")
    try:
        ident = _register(router, "ex-main")
        results = _back_to_back(router, ident, prompt)
        assert [r.step_id for r in results] == [10, 11, 12, 13]
        assert all(not r.errors for r in results)
        assert [int(r.token_ids[0]) for r in results] == ref.seqs["r"].outputs
    finally:
        proc.kill()
        proc.wait()
        router.close()
    assert "PAGEDSERVE_PLAN_PREP=main: plans prepared on the main thread" in proc.stderr.read()
    # A bad value of any A/B switch read at start (PAGEDSERVE_DECODE_FUSED_ROPE,
    # _TRITON_GEMM: kernels/host_math.py; PAGEDSERVE_GRAPH_FEED: executor/graph_feed.py)
    # stops the executor with exit code 2.
    for env, message in [({"PAGEDSERVE_PLAN_PREP": "both"},
                          "PAGEDSERVE_PLAN_PREP='both': expected io or main"),
                         ({"PAGEDSERVE_PLAN_PREP": "io",
                           "PAGEDSERVE_DECODE_FUSED_ROPE": "on"},
                          "PAGEDSERVE_DECODE_FUSED_ROPE='on': expected 0 or 1"),
                         ({"PAGEDSERVE_DECODE_FUSED_ROPE": "0",
                           "PAGEDSERVE_DECODE_TRITON_GEMM": "qkv,lm_head"},
                          "PAGEDSERVE_DECODE_TRITON_GEMM='qkv,lm_head': expected 0, 1 or a "
                          "comma list of qkv, o, gate_up, down"),
                         ({"PAGEDSERVE_DECODE_TRITON_GEMM": "0",
                           "PAGEDSERVE_GRAPH_FEED": "off"},
                          "PAGEDSERVE_GRAPH_FEED='off': expected 0 or 1"),
                         ({"PAGEDSERVE_GRAPH_FEED": "1",
                           "PAGEDSERVE_MIXED_DECODE_SPLIT": "2"},
                          "PAGEDSERVE_MIXED_DECODE_SPLIT='2': expected 0 or 1"),
                         ({"PAGEDSERVE_MIXED_DECODE_SPLIT": "0",
                           "PAGEDSERVE_CPU_PACKED_WEIGHTS": "yes"},
                          "PAGEDSERVE_CPU_PACKED_WEIGHTS='yes': expected 0 or 1"),
                         ({"PAGEDSERVE_CPU_PACKED_WEIGHTS": "1",
                           "PAGEDSERVE_CPU_ROW_PADDING": "on"},
                          "PAGEDSERVE_CPU_ROW_PADDING='on': expected 0 or 1")]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        bad = _start(model_dir, "tcp://127.0.0.1:9", "--executor-id", "ex-bad")
        try:
            assert bad.wait(timeout=60) == 2
            assert message in bad.stderr.read()
        finally:
            if bad.poll() is None:
                bad.kill()
            bad.wait()
