"""Overlapped steps (ModelRunner.submit / collect; the GPU default, turned on here on a
CPU): a sampling step left in flight while the next is launched gives exactly the depth-1
results, in order; its result is handed out before the next step's sampling; a step's
sampling goes before the previous read-back only when that read would wait and no row reads
the appended tokens; a row dropped meanwhile waits for the tokens; and the executor process
answers in order whether the next plan comes first or the device's end of the step does. The scripts, drivers and plans are
tests/test_executor_pipeline.py's."""

from __future__ import annotations

import signal

import pytest
from pagedserve.protos.wire import SamplingParams, Shutdown, StepResult
from test_executor_pipeline import (
    FEED,
    GREEDY_PEN,
    OTHER,
    PROMPT,
    SCRIPT,
    SEEDED_PEN,
    THIRD,
    _back_to_back,
    _decode_plan,
    _driver,
    _register,
    _run_script,
    _same_results,
)
from test_executor_process import FakeRouter, _start
from test_executor_support import Driver

from pagedserve.tinymodels import build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("overlap") / "llama", "llama",
                       initializer_range=0.05)


def _run_script_overlapped(driver: Driver, script) -> list[StepResult]:
    """``script`` as the executor process runs it: `submit` leaves each sampling step in
    flight and returns the previous step's result once the next forward is launched; the
    plan after is built from that result (depth 2), `collect` takes the last."""
    results = []
    driver.runner.overlap_steps = True  # as on a GPU
    for schedule in script:
        feed = {r for r, n in schedule.items() if n == FEED}
        plan = driver.plan({r: None if n == FEED else n for r, n in schedule.items()},
                           feed=feed)
        ahead = driver.runner.precompute(plan)
        ready = driver.runner.submit(plan, ahead)
        for result in ready:
            driver.accept(result)
        results += ready
    last = driver.runner.collect()
    assert last is not None and driver.runner.collect() is None
    driver.accept(last)
    return results + [last]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_overlapped_steps_give_exactly_the_depth_1_results(model_dir, device):
    """Steps left in flight (the next one fed from the device's tokens and launched before
    the previous tokens are read back): the same results, in order, as depth 1; every step
    after the first returned only once the next was submitted. On CUDA (float32) this is
    the executor's own mode; on a CPU the test turns it on."""
    runs = {}
    for overlapped in (False, True):
        d = _driver(model_dir, device)
        d.add("a", PROMPT, sampling=GREEDY_PEN)
        d.add("b", OTHER, sampling=SEEDED_PEN, sample_index=1)
        d.add("c", THIRD, sampling=SEEDED_PEN)
        runs[overlapped] = d, (_run_script_overlapped(d, SCRIPT) if overlapped
                               else _run_script(d, SCRIPT, False))
    (d1, depth1), (d2, overlapped) = runs[False], runs[True]
    assert [r.step_id for r in overlapped] == [r.step_id for r in depth1]
    for a, b in zip(depth1, overlapped, strict=True):
        _same_results(a, b)
        assert not b.errors
    for rid in "abc":
        assert d2.seqs[rid].outputs == d1.seqs[rid].outputs
        assert d2.runner.requests[rid].sampling.output_token_ids.tolist() == d2.seqs[rid].outputs


def test_overlapped_step_result_waits_for_the_next_submit(model_dir):
    """submit() of a sampling step returns nothing new; the next submit returns it (before
    its own, which stays in flight); a finished request dropped meanwhile keeps its row
    until the tokens are read; collect() ends it."""
    d = _driver(model_dir)
    d.runner.overlap_steps = True  # as on a GPU
    d.add("a", PROMPT)
    d.add("b", OTHER)
    first = d.plan({"a": None, "b": None})
    assert d.runner.submit(first) == []
    assert d.runner.inflight_step == (first.step_id, first.deadline_s)
    second = d.plan({"a": 1, "b": 1}, feed={"a", "b"})
    ready = d.runner.submit(second)
    assert [r.step_id for r in ready] == [first.step_id]
    d.accept(ready[0])
    free = d.runner.rows.num_free
    # b ends while second (which sampled it) is in flight: its row is released only once
    # second's tokens are read back, inside this submit (after third's forward is launched).
    third = d.plan({"a": 1}, feed={"a"}, finished_ids=["b"])
    ready = d.runner.submit(third)
    assert [r.step_id for r in ready] == [second.step_id]
    assert ready[0].request_ids == ["a", "b"] and not ready[0].errors
    assert d.runner.rows.num_free == free + 1 and "b" not in d.runner.requests
    d.accept(ready[0])
    last = d.runner.collect()
    assert last.step_id == third.step_id and last.request_ids == ["a"]
    assert d.runner.collect() is None and d.runner.inflight_step is None
    d.accept(last)
    fourth = d.plan({"a": 1})
    assert d.runner.submit(fourth) == []
    with pytest.raises(RuntimeError):  # execute() is for one step at a time
        d.runner.execute(fourth)
    assert d.runner.collect().step_id == fourth.step_id


def test_previous_result_goes_out_before_the_next_sampling(model_dir):
    """With `result_ready` set (the executor process), a step read back after the next
    launch is handed out at once, before the next step's sampling starts (which may wait
    for the device) and before its tokens are appended to the sampling states (the router
    plans from the result), not when submit() returns."""
    d = _driver(model_dir)
    d.runner.overlap_steps = True
    events = []
    outputs_at_result = []

    def result_ready(result):
        events.append(("result", result.step_id))
        outputs_at_result.append(d.runner.requests["a"]._sampling.num_output_tokens)

    d.runner.result_ready = result_ready
    launch = d.runner.sampler.launch

    def spy_launch(logits, states, grammar_bits=None, argmax=None, plain=None):
        events.append(("sample", None))
        return launch(logits, states, grammar_bits, argmax=argmax, plain=plain)

    d.runner.sampler.launch = spy_launch
    d.add("a", PROMPT)
    first = d.plan({"a": None})
    assert d.runner.submit(first) == []
    second = d.plan({"a": 1}, feed={"a"})
    assert d.runner.submit(second) == []
    assert events == [("sample", None), ("result", first.step_id), ("sample", None)]
    assert outputs_at_result == [0]  # first's token appended after its result went out
    assert d.runner.requests["a"]._sampling.num_output_tokens == 1  # second still in flight
    assert d.runner.collect().step_id == second.step_id


def test_process_with_overlapped_steps_answers_in_order(model_dir, monkeypatch):
    """The executor process with steps left in flight (PAGEDSERVE_OVERLAP_STEPS=1, the GPU
    default, here on a CPU): plans sent back to back, then one at a time after each result
    (so each step in flight is answered when its device work is done, not when a plan
    comes): every result in order with the depth-1 tokens, none held back."""
    prompt = [0, 17, 250, 33, 9]
    ref = _driver(model_dir)
    ref.add("r", prompt)
    ref.generate(["r"], 7)

    monkeypatch.setenv("PAGEDSERVE_OVERLAP_STEPS", "1")
    router = FakeRouter()
    proc = _start(model_dir, router.address, "--executor-id", "ex-o")
    try:
        ident = _register(router, "ex-o")
        results = _back_to_back(router, ident, prompt)
        for i in (4, 5, 6):  # one plan at a time: no next plan to wait for
            router.send(ident, _decode_plan(10 + i, 4 + i))
            results.append(router.recv(timeout_s=30, want=StepResult)[1])
        assert [r.step_id for r in results] == list(range(10, 17))
        assert all(not r.errors and r.request_ids == ["r"] for r in results)
        assert [int(r.token_ids[0]) for r in results] == ref.seqs["r"].outputs
        proc.send_signal(signal.SIGTERM)
        router.recv(timeout_s=10, want=Shutdown)
        assert proc.wait(timeout=20) == 0
        err = proc.stderr.read()
        assert "overlapped steps on" in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        router.close()


@pytest.mark.gpu
def test_sampling_before_the_read_back_on_a_busy_gpu(model_dir):
    """On CUDA with every row plain greedy, a step whose previous step is still running on
    the device launches its sampling before reading that step back (ModelRunner
    ._sample_first): a spin kernel ahead of each forward keeps the device busy; the tokens
    are depth 1's."""
    import torch

    runs = {}
    for overlapped in (False, True):
        d = _driver(model_dir, "cuda")
        d.add("a", PROMPT)
        d.add("b", OTHER)
        d.add("c", THIRD)
        if overlapped:
            forward = d.runner._forward

            def busy_forward(batch, forward=forward):
                torch.cuda._sleep(20_000_000)  # ~10 ms of device time
                return forward(batch)

            d.runner._forward = busy_forward
        runs[overlapped] = d, (_run_script_overlapped(d, SCRIPT) if overlapped
                               else _run_script(d, SCRIPT, False))
    (d1, _), (d2, overlapped) = runs[False], runs[True]
    assert d2.runner.sampled_first_steps > 0
    assert not any(r.errors for r in overlapped)
    for rid in "abc":
        assert d2.seqs[rid].outputs == d1.seqs[rid].outputs


class _SampledEvent:
    """A sampled step's CUDA event stand-in on a CPU: `query()` answers whether the device
    has reached it (``done``); waiting on it returns at once."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("sampling, device_done, sample_first", [
    (SamplingParams(temperature=0.0), False, True),  # the read-back would wait, every row plain: sample first
    (SamplingParams(temperature=0.0), True, False),  # the previous step already done: its result first
    (SEEDED_PEN, False, False),  # penalties read the appended tokens: after them
])
def test_sampling_goes_before_the_read_back_only_when_that_waits_and_rows_are_plain(
        model_dir, sampling, device_done, sample_first):
    """With steps overlapped, each step's sampling is launched before the previous step is
    read back only when that read would wait for the device and no row's sampling reads the
    tokens it appends; the tokens are those of one step at a time either way."""
    prompts = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12]}
    ref = _driver(model_dir)
    for rid, prompt in prompts.items():
        ref.add(rid, prompt, sampling)
    ref.generate(list(prompts), 4)

    driver = _driver(model_dir)
    runner = driver.runner
    runner.overlap_steps = True  # a CPU runs each step as it is launched: force the overlap
    order: list[str] = []
    sampler, resolve = runner.sampler, runner._pending.resolve

    class Recorder:
        def launch(_, logits, states, grammar_bits=None, argmax=None, plain=None):
            order.append("sample")
            out = sampler.launch(logits, states, grammar_bits, argmax=argmax, plain=plain)
            out._event = _SampledEvent(device_done)
            return out

    def read_back() -> None:
        order.append("read_back")
        resolve()

    runner.sampler, runner._pending.resolve = Recorder(), read_back
    for rid, prompt in prompts.items():
        driver.add(rid, prompt, sampling)
    assert runner.submit(driver.plan({"a": None, "b": None})) == []
    results = []
    for _ in range(3):
        order.clear()
        ready = runner.submit(driver.plan({"a": None, "b": None}, feed={"a", "b"}))
        assert order == (["sample", "read_back"] if sample_first else ["read_back", "sample"])
        for result in ready:
            driver.accept(result)
        results += ready
    driver.accept(runner.collect())
    assert not any(r.errors for r in results)
    assert {rid: driver.seqs[rid].outputs for rid in prompts} == (
        {rid: ref.seqs[rid].outputs for rid in prompts})
