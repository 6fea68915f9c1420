"""What the executor does between two steps (executor/model_runner.py, `RequestRows`): block
tables kept as rows of columns and changed by scatter, the marked decodes fed from the
previous step's pending tokens, and those tokens appended to the sampling states only once
the next forward is launched. Checked against the planner's own view (Driver) and the
one-plan-at-a-time run: the exact batch tensors, the outputs every sampler call sees, the
tokens, and the rows a finished request hands to the next one."""

from __future__ import annotations

import hypothesis.strategies as st
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from pagedserve.executor.host_pool import HostPool
from pagedserve.executor.runner_setup import build_runner
from pagedserve.protos.wire import SamplingParams, StepPlan, StepResult
from test_executor_support import Driver

from pagedserve.tinymodels import build_model

BS = 8
GREEDY = SamplingParams(temperature=0.0)
SEEDED_PEN = SamplingParams(temperature=1.0, top_p=0.9, seed=77, repetition_penalty=1.3,
                            frequency_penalty=0.4, logprobs=2)
FEED = "feed"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("gap") / "llama", "llama",
                       initializer_range=0.05)


class Spy:
    """Records, per executed step, the batch tensors of its forward and the output tokens
    each sampling state holds when the sampler reads it."""

    def __init__(self, runner) -> None:
        self.batches: list[dict[str, list]] = []
        self.sampled_outputs: list[list[list[int]]] = []
        forward, sampler = runner._forward, runner.sampler

        def spy_forward(batch):
            self.batches.append({
                "input_ids": batch.input_ids.tolist(),
                "positions": batch.positions.tolist(),
                "slot_mapping": batch.attn.slot_mapping.tolist(),
                "block_tables": batch.attn.block_tables.tolist(),
                "seq_lens": batch.attn.seq_lens.tolist(),
            })
            return forward(batch)

        class SpySampler:
            def launch(_, logits, states, grammar_bits=None, argmax=None, plain=None):
                self.sampled_outputs.append([s.output_token_ids.tolist() for s in states])
                return sampler.launch(logits, states, grammar_bits, argmax=argmax, plain=plain)

        runner._forward, runner.sampler = spy_forward, SpySampler()


def _driver(model_dir) -> Driver:
    return Driver(build_runner(str(model_dir), num_gpu_blocks=96, num_cpu_blocks=8,
                               block_size=BS, progress=False))


def _replace(plan: StepPlan, **changes) -> StepPlan:
    new = msgspec.structs.replace(plan, **changes)
    new.validate()
    return new


def _padded(tables: list[list[int]]) -> list[list[int]]:
    width = max(map(len, tables))
    return [t + [0] * (width - len(t)) for t in tables]


def _run(model_dir, prompts, sampling, script, pipelined: bool):
    """Run ``script`` (per step: ([(request id, tokens | None | FEED)] in batch order,
    finished ids)) at depth 1 or 2 (plans built before the previous result is accepted,
    FEED rows marked, plan-only inputs prepared ahead), checking after each step that the
    forward saw the planner's block tables and the sampler saw every output accepted so far.
    Returns the results and the spied batches."""
    d = _driver(model_dir)
    spy = Spy(d.runner)
    for rid, prompt in prompts.items():
        d.add(rid, prompt, sampling=sampling[rid])
    results, pending = [], None
    for schedule, finished in script:
        feed = {r for r, n in schedule if n == FEED} if pipelined else set()
        if pending is not None and not pipelined:
            d.accept(pending)
        plan = d.plan({r: None if n == FEED else n for r, n in schedule}, feed=feed)
        if finished:
            plan = _replace(plan, finished_ids=finished)
        tables = [list(d.seqs[r].table) for r, _ in schedule]
        ahead = d.runner.precompute(plan) if pipelined else None
        if pending is not None and pipelined:
            d.accept(pending)
        seen_before = len(spy.batches)
        pending = d.runner.execute(plan, ahead)
        assert not pending.errors, pending.errors
        assert len(spy.batches) == seen_before + 1
        assert spy.batches[-1]["block_tables"] == _padded(tables)
        if pending.request_ids:
            assert spy.sampled_outputs[-1] == [d.seqs[r].outputs for r in pending.request_ids]
        results.append(pending)
    d.accept(pending)
    for rid in d.runner.requests:  # reading a state applies the pending tokens
        assert d.runner.requests[rid].sampling.output_token_ids.tolist() == d.seqs[rid].outputs
        assert d.runner.block_table(rid) == d.seqs[rid].table
    return results, spy.batches


def _same_results(a: StepResult, b: StepResult) -> None:
    assert (a.step_id, a.request_ids, a.errors) == (b.step_id, b.request_ids, b.errors)
    for name in ("token_ids", "logprobs", "top_counts", "top_token_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@st.composite
def scripts(draw):
    """Requests arriving, prefilling in chunks, decoding (FEED when they sampled in the step
    before), sitting steps out, finishing (their rows go to later requests), in batch orders
    that change from step to step or stay (the fast path)."""
    num = draw(st.integers(1, 6))
    prompts = {f"r{i}": draw(st.lists(st.integers(0, 499), min_size=1, max_size=20))
               for i in range(num)}
    sampling = {r: draw(st.sampled_from([GREEDY, SEEDED_PEN])) for r in prompts}
    arrive = {r: draw(st.integers(0, 4)) if r != "r0" else 0 for r in prompts}
    wants = {r: draw(st.integers(1, 5)) for r in prompts}
    computed = dict.fromkeys(prompts, 0)
    outputs = dict.fromkeys(prompts, 0)
    sampled_last: set[str] = set()
    done: set[str] = set()
    script, order = [], []
    for step in range(draw(st.integers(2, 12))):
        active = [r for r in prompts if arrive[r] <= step and r not in done]
        finished = [r for r in active if outputs[r] >= wants[r]]
        active = [r for r in active if r not in finished]
        done.update(finished)
        if not active:
            if finished:
                break
            continue
        if draw(st.booleans()):  # a new order; else the last one, with newcomers at the end
            order = draw(st.permutations(active))
        else:
            order = [r for r in order if r in active] + [r for r in active if r not in order]
        chosen = [r for r in order if draw(st.integers(0, 4))] or order[:1]
        schedule, sampled = [], set()
        for r in chosen:
            left = len(prompts[r]) - computed[r]
            if left:
                n = draw(st.integers(1, left))
                computed[r] += n
                schedule.append((r, n))
                if n == left:
                    sampled.add(r)
            else:
                schedule.append((r, FEED if r in sampled_last else None))
                sampled.add(r)
        for r in sampled:
            outputs[r] += 1
        sampled_last = sampled
        script.append((schedule, finished))
    return prompts, sampling, script


@settings(max_examples=30, deadline=None)
@given(case=scripts())
def test_random_schedules_give_depth_1_tensors_and_tokens(model_dir, case):
    prompts, sampling, script = case
    depth1, batches1 = _run(model_dir, prompts, sampling, script, pipelined=False)
    depth2, batches2 = _run(model_dir, prompts, sampling, script, pipelined=True)
    assert batches2 == batches1  # the fed input ids are the ones depth 1 reads from plans
    for a, b in zip(depth1, depth2, strict=True):
        _same_results(a, b)


def test_a_row_handed_to_a_new_request_carries_nothing_over(model_dir):
    """a finishes in the plan that registers c, which takes a's row while a's last token is
    still pending: c marked to be fed (a router bug) gets an error, never a's token; b, fed
    beside it, gets its own; c's table is only its own."""
    d = _driver(model_dir)
    d.add("a", [1, 2, 3])
    d.add("b", [4, 5, 6, 7])
    d.add("c", [9])
    first = d.runner.execute(d.plan({"a": None, "b": None}))
    row_of_a = d.runner.requests["a"].row
    plan = d.plan({"b": FEED, "c": None}, feed={"b"})
    plan = _replace(plan, finished_ids=["a"], feed_sampled=np.array([1, 1], np.uint8))
    d.accept(first)
    result = d.runner.execute(plan)
    assert [e.request_id for e in result.errors] == ["c"]
    assert "sampled nothing in step 0" in result.errors[0].message
    assert result.request_ids == ["b"] and set(d.runner.requests) == {"b"}
    # Once more, c valid this time: it takes a's row (the lowest free) and only its table.
    d = _driver(model_dir)
    d.add("a", [1, 2, 3])
    d.add("b", [4, 5, 6, 7])
    d.add("c", [9])
    first = d.runner.execute(d.plan({"a": None, "b": None}))
    plan = _replace(d.plan({"b": FEED, "c": None}, feed={"b"}), finished_ids=["a"])
    d.accept(first)
    result = d.runner.execute(plan)
    assert not result.errors and result.request_ids == ["b", "c"]
    assert d.runner.requests["c"].row == row_of_a
    assert d.runner.block_table("c") == d.seqs["c"].table
    d.accept(result)  # c's one output, none of a's
    assert d.runner.requests["c"].sampling.output_token_ids.tolist() == d.seqs["c"].outputs
    assert len(d.seqs["c"].outputs) == 1


def test_a_shorter_table_is_zero_padded_in_the_batch(model_dir):
    """A table replaced from its start by fewer blocks (a swap-in that drops a spare block)
    holds exactly the new ids: the batch pads it with zeros, not with its old last block."""
    d = _driver(model_dir)
    spy = Spy(d.runner)
    d.add("a", list(range(1, 10)), shared_blocks=[5, 6, 7])  # 9 tokens, a spare 3rd block
    d.add("b", list(range(20, 40)))  # 20 tokens: 3 blocks
    d.step({"a": None, "b": None})
    assert d.runner.block_table("a") == [5, 6, 7]
    seq = d.seqs["a"]
    seq.table, seq.synced = [40, 41], 0  # the executor is sent [40, 41] from 0
    d.step({"b": None, "a": None})
    assert d.runner.block_table("a") == [40, 41]
    assert spy.batches[-1]["block_tables"] == [d.seqs["b"].table, [40, 41, 0]]


def test_pending_tokens_reach_the_states_before_anything_reads_them(model_dir):
    """The tokens of a step are appended once the next forward is launched; reading a
    state first, or forking, or resetting, sees them applied (or dropped with the state)."""
    d = _driver(model_dir)
    d.add("a", [3, 1, 4, 1, 5], sampling=SEEDED_PEN)
    result = d.step({"a": None})
    assert d.runner._pending.states  # not appended yet ...
    state = d.runner.requests["a"].sampling  # ... until read
    assert not d.runner._pending.states
    assert state.output_token_ids.tolist() == [int(result.token_ids[0])]
    d.step({"a": None})
    d.fork("a", "b", sample_index=1)  # the fork copies a's outputs, the pending one too
    d.step({"a": None, "b": None})
    assert d.seqs["b"].outputs[:2] == d.seqs["a"].outputs[:2]
    assert (d.runner.requests["b"].sampling.output_token_ids.tolist()
            == d.seqs["b"].outputs)
    d.runner.reset()
    assert not d.runner.requests and d.runner.rows.num_free == d.runner.rows.capacity
    assert not d.runner._pending.states


def test_a_step_is_freed_once_the_next_forward_is_launched(model_dir):
    """Freeing a step's plan, inputs and batch waits for the next forward (out of the gap);
    a reset drops them."""
    d = _driver(model_dir)
    d.add("a", [3, 1, 4, 1, 5])
    first = d.plan({"a": None})
    d.accept(d.runner.execute(first))
    assert d.runner._retired[0] is first
    launched = []
    forward = d.runner._forward

    def spy(batch):
        launched.append(d.runner._retired)
        return forward(batch)

    d.runner._forward = spy
    second = d.plan({"a": None})
    d.accept(d.runner.execute(second))
    assert len(launched) == 1 and launched[0][0] is first  # still held at the launch
    assert d.runner._retired[0] is second
    d.runner.reset()
    assert d.runner._retired is None


def test_executor_bench_gap_cases_run():
    """benchmarks/executor_bench.py --gap (the in-process measure of this gap) still runs:
    both cases, every figure, no step error (a short run; no timing asserted)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "executor_bench.py"), "--gap",
         "--gap-steps", "8"], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [r["case"] for r in lines] == ["cpu_tiny_gap_b32", "cpu_tiny_gap_b256"]
    for r in lines:
        assert r["steps"] == 3 and r["gap_ms_p50"] > 0 and r["forward_ms_p50"] > 0
        assert len(r["tokens_crc32"]) == 8


def test_executor_bench_pipelined_loop_samples_what_sequential_steps_do(model_dir):
    """executor_bench's pipelined loops (the GPU check's `..._pipelined_..._graphs` and
    `..._serve_loop_..._graphs` cases) over take-over decodes marked feed_sampled: every
    step runs without an error and samples the same tokens as the same plans executed one
    by one."""
    import sys
    import zlib
    from pathlib import Path

    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import executor_steps

    def runner():
        return build_runner(str(model_dir), num_gpu_blocks=4 * 4 + 8, num_cpu_blocks=0,
                            block_size=16, max_model_len=1024, progress=False)

    def plans(vocab):
        return executor_steps.decode_plans(4, 33, 16, 12, vocab, feed=True)

    pipelined = runner()
    run = executor_steps.pipelined_steps(pipelined, plans(pipelined.vocab_size), warmup=3)
    assert len(run["periods"]) == len(run["gaps"]) == 9
    sequential, tokens = runner(), []
    with torch.inference_mode():
        for plan in plans(sequential.vocab_size):
            result = sequential.execute(plan)
            assert not result.errors, result.errors
            tokens.append(result.token_ids)
    crc = f"{zlib.crc32(np.concatenate(tokens).tobytes()):08x}"
    assert run["tokens_crc32"] == crc
    # The executor process's waiting rule (serve_loop_steps), steps one at a time (the CPU
    # default) and overlapped (each left in flight until the next plan or its StepDone).
    for overlap in (False, True):
        served = runner()
        served.overlap_steps = overlap
        run = executor_steps.serve_loop_steps(served, plans(served.vocab_size), warmup=3)
        assert len(run["periods"]) == len(run["gaps"]) == 9
        assert run["tokens_crc32"] == crc, overlap


class _ClockEvent:
    """A CUDA timing event's stand-in on a CPU: `record()` reads a clock the test moves;
    `elapsed_time` is in milliseconds, as torch.cuda.Event's."""

    clock = 0.0

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self) -> None:
        self.at = _ClockEvent.clock

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _ClockEvent) -> float:
        assert self.at is not None and end.at is not None, "an event never recorded"
        return (end.at - self.at) * 1e3


def test_gap_is_the_device_idle_between_steps_when_steps_overlap(model_dir):
    """On a GPU, with steps overlapped, gap_s is read on the device's clock: from the event
    after the previous step's work to the one before this forward, so the device's idle time
    shows even though the previous step is still unread (in flight) at each launch. Here the
    events read a clock the test moves: the previous step's forward ends at 10 s (the
    sampler's own event is CUDA-only, so the forward's end event stands for it), and the
    next forward starts 0.25 s (idle) or 0 s (queued behind) later."""
    driver = _driver(model_dir)
    runner = driver.runner
    runner.overlap_steps = True  # a CPU runs each forward as it is launched: force it
    clock_at_launch: list[float] = []

    forward = runner._forward

    def launch() -> None:  # just before the forward's first event: it starts then
        _ClockEvent.clock = clock_at_launch.pop(0)

    def timed_forward(batch):
        hidden = forward(batch)
        _ClockEvent.clock += 0.002  # it takes 2 ms
        return hidden

    runner.before_forward = launch
    runner.host_pool = pool = HostPool(runner.device, new_event=_ClockEvent)
    runner._forward = timed_forward
    for rid, prompt in {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12]}.items():
        driver.add(rid, prompt)
    clock_at_launch += [10.0 - 0.002, 10.25, 10.252, 10.254 + 0.1, 10.356 + 0.5]
    results = runner.submit(driver.plan({"a": None, "b": None}))
    assert results == []  # left in flight
    for _ in range(4):
        ready = runner.submit(driver.plan({"a": None, "b": None}, feed={"a", "b"}))
        for result in ready:
            driver.accept(result)
        results += ready
    results.append(runner.collect())
    assert [r.step_id for r in results] == [0, 1, 2, 3, 4]
    assert not any(r.errors for r in results)
    gaps = [round(r.gap_s, 6) for r in results]
    # 0: the first step; 0.25 s idle; queued right behind (0); 0.1 s and 0.5 s idle.
    assert gaps == [0.0, 0.25, 0.0, 0.1, 0.5], gaps
    assert [round(r.forward_s, 6) for r in results] == [0.002] * 5
    # A step's events come back to the pool once the step after it is read back (its gap
    # read from them; given back earlier, step 4 would re-record step 2's end before step
    # 3's gap is read from it): step 0's when step 1 was read back (inside step 2's
    # submit), in time for step 3 to time its forward with them, step 1's for step 4;
    # steps 2 and 3's came back by the end (step 4, the last, keeps its own).
    assert pool.made_events == 6 and len(pool._events) == 4


def test_a_steady_decode_step_takes_the_previous_steps_device_tokens_as_its_input_ids(
        model_dir):
    """With the previous step in flight, a step whose every token is a marked decode fed in
    the order that step sampled them uses that step's token tensor on the device as its
    input ids (no index list sent, no scatter); a step with any other row scatters into
    its own; the tokens are those of one step at a time."""
    prompts = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12], "c": [3, 4]}
    ref = _driver(model_dir)
    for rid, prompt in prompts.items():
        ref.add(rid, prompt)
    ref.generate(["a", "b"], 5)
    ref.generate(["c"], 1)

    driver = _driver(model_dir)
    runner = driver.runner
    runner.overlap_steps = True
    shared: list[bool] = []
    forward = runner._forward

    def spy(batch):
        shared.append(batch.input_ids is runner._pending.device_tokens)
        return forward(batch)

    runner._forward = spy
    for rid, prompt in prompts.items():
        driver.add(rid, prompt)
    ready = runner.submit(driver.plan({"a": None, "b": None}))
    for schedule, feed in [({"a": 1, "b": 1}, {"a", "b"}),  # steady: shared
                           ({"a": 1, "b": 1}, {"a", "b"}),
                           ({"b": 1, "a": 1}, {"a", "b"}),  # another order: scattered
                           ({"a": 1, "b": 1, "c": None}, {"a", "b"})]:  # a prompt too
        ready += runner.submit(driver.plan(schedule, feed=feed))
        for result in ready:
            driver.accept(result)
        ready = []
    driver.accept(runner.collect())
    assert shared == [False, True, True, False, False]
    assert {rid: driver.seqs[rid].outputs for rid in prompts} == (
        {rid: ref.seqs[rid].outputs for rid in prompts})


def test_the_runner_counts_the_requests_that_are_not_plain_greedy(model_dir):
    """runner_requests keeps the count of requests whose sampling is not plain greedy
    through adds, forks, drops and a reset; while it is 0 the runner tells the sampler
    every row is plain (no walk over the rows), else leaves it to look."""
    driver = _driver(model_dir)
    runner = driver.runner
    told: list = []
    launch = runner.sampler.launch

    def spy(logits, states, grammar_bits=None, argmax=None, plain=None):
        told.append(plain)
        return launch(logits, states, grammar_bits, argmax=argmax, plain=plain)

    runner.sampler.launch = spy
    driver.add("a", [5, 6, 7])
    driver.add("b", [8, 9])
    driver.step({"a": None, "b": None})
    assert runner._not_plain == 0 and told == [True]
    driver.add("c", [10, 11, 12], sampling=SEEDED_PEN)
    driver.step({"a": None, "c": None})
    assert runner._not_plain == 1 and told[-1] is None
    driver.fork("c", "c2", 1)
    driver.step({"a": None, "c": None, "c2": None})
    assert runner._not_plain == 2 and told[-1] is None
    driver.step({"a": None, "b": None}, finished_ids=["c"])
    assert runner._not_plain == 1 and told[-1] is None  # c2 is still held
    driver.step({"a": None}, finished_ids=["c2", "b"])
    assert runner._not_plain == 0 and told[-1] is True
    assert sorted(runner.requests) == ["a"]
    driver.add("d", [13, 14], sampling=SEEDED_PEN)
    driver.step({"d": None})
    assert runner._not_plain == 1
    runner.reset()
    assert runner._not_plain == 0 and not runner.requests
