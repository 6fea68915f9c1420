"""The executor's profiling window (executor/step_trace.py): PAGEDSERVE_TORCH_PROFILER_DIR
and _STEPS read from the environment, a real executor process profiling a window of steps
sent back to back (its Chrome trace and summary, the same tokens as without it), and a
profiler whose export fails switching itself off without stopping the serving. (Moved out
of test_executor_pipeline.py, whose process helpers it uses.)"""

from __future__ import annotations

import pytest
from pagedserve.executor.runner_setup import build_runner
from test_executor_pipeline import _back_to_back, _driver, _register
from test_executor_process import FakeRouter, _start

from pagedserve.tinymodels import build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("prof") / "llama", "llama",
                       initializer_range=0.05)


def test_profiler_window_from_the_environment():
    """PAGEDSERVE_TORCH_PROFILER_DIR / _STEPS (executor/step_trace.py): unset is off; the
    default window is 100:20; a malformed or out-of-range window is a one-line error."""
    from pathlib import Path

    from pagedserve.executor.step_trace import profiler_from_env

    assert profiler_from_env({}) is None
    assert profiler_from_env({"PAGEDSERVE_TORCH_PROFILER_STEPS": "1:2"}) is None
    env = {"PAGEDSERVE_TORCH_PROFILER_DIR": "/tmp/p"}
    assert profiler_from_env(env) == (Path("/tmp/p"), 100, 20)
    assert profiler_from_env({**env, "PAGEDSERVE_TORCH_PROFILER_STEPS": "7:3"}) == (
        Path("/tmp/p"), 7, 3)
    for bad in ("7", "a:b", "7:0", "-1:4", "1:2:3"):
        with pytest.raises(ValueError, match="PAGEDSERVE_TORCH_PROFILER_STEPS") as info:
            profiler_from_env({**env, "PAGEDSERVE_TORCH_PROFILER_STEPS": bad})
        assert "\n" not in str(info.value)


def test_process_profiles_a_window_of_steps(model_dir, monkeypatch, tmp_path):
    """With PAGEDSERVE_TORCH_PROFILER_DIR the executor profiles steps 11-12 (of 10-13 sent
    back to back), writes their Chrome trace and a summary once step 13's plan comes, and
    answers every plan as without it (same tokens)."""
    import gzip
    import json

    prompt = [0, 17, 250, 33, 9]
    ref = _driver(model_dir)
    ref.add("r", prompt)
    ref.generate(["r"], 4)
    router = FakeRouter()
    monkeypatch.setenv("PAGEDSERVE_TORCH_PROFILER_DIR", str(tmp_path / "prof"))
    monkeypatch.setenv("PAGEDSERVE_TORCH_PROFILER_STEPS", "11:2")
    proc = _start(model_dir, router.address, "--executor-id", "ex-prof")
    try:
        ident = _register(router, "ex-prof")
        results = _back_to_back(router, ident, prompt)
        assert [r.step_id for r in results] == [10, 11, 12, 13]
        assert [int(r.token_ids[0]) for r in results] == ref.seqs["r"].outputs
        trace = tmp_path / "prof" / "ex-prof-steps11-12.json.gz"
        summary = json.loads((tmp_path / "prof" / "ex-prof-steps11-12.summary.json")
                             .read_text())
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
        names = {e.get("name") for e in events}
        assert {"phase::submit", "phase::prepare", "phase::forward_launch",
                "phase::sampler_launch"} <= names
        assert summary["executor"] == "ex-prof" and summary["steps"] == 2
        assert (summary["first_step"], summary["last_step"]) == (11, 12)
        host = summary["host_us_per_step"]
        assert 0 < host["forward_launch"] < host["submit"] <= summary["step_us_mean"]
    finally:
        proc.kill()
        proc.wait()
        router.close()


def test_a_failing_profiler_switches_itself_off(model_dir, monkeypatch, tmp_path):
    """The profiling window never stops serving: an error while writing its trace is
    logged, the runner's methods are put back and profiling stays off."""
    from pagedserve.executor import step_trace

    runner = build_runner(str(model_dir), num_gpu_blocks=16, num_cpu_blocks=0, block_size=16,
                          progress=False)
    submit = runner.submit
    profiler = step_trace.StepProfiler(runner, tmp_path, first=1, count=1, name="ex")

    def broken(prof, path):
        raise RuntimeError("no trace today")

    monkeypatch.setattr(step_trace, "export_trace", broken)
    profiler.before_step(0)
    profiler.before_step(1)  # starts: the runner's methods wrapped
    assert runner.submit != submit
    profiler.before_step(2)  # stops: the export fails
    assert profiler.done and runner.submit == submit and not list(tmp_path.iterdir())
    profiler.before_step(3)  # and stays off
    assert runner.submit == submit
