"""The GPU check's bookkeeping on CPU (scripts/gpu_check.py, gpu_check.sh, gpu_wheels.py):
argument parsing, which stage runs next, what a dry run records, steps run with their
output read back (benchmark lines, pytest counts, a failure, a timeout), the report merged
across stages, a seed report and a corrupt one. Steps are replaced by tiny Python commands:
nothing here needs CUDA, a model or the network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _line(**record) -> str:
    return f"print({json.dumps(json.dumps(record))})"


ENV = _line(bench="gpu_check", case="env", ok=True, torch="2.11.0", device="FakeGPU")
BENCH = _line(bench="kernels_bench", case="decode/b1", latency_us_p50=12.5, copy_bw_ratio=0.9)
PYTEST = ("print('tests/test_k.py ...F'); print('FAILED tests/test_k.py::test_x - boom'); "
          "print('1 failed, 3 passed, 2 skipped in 0.50s'); raise SystemExit(1)")


def _fake_plan(steps_by_stage):
    def plan(name, ctx):
        return steps_by_stage[name]
    return plan


def _run(tmp_path, *args) -> int:
    return gpu_check.main([str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"),
                           "--site", "none", *args])


def _report(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / gpu_check.REPORT).read_text())


def test_arguments_and_next_stage():
    args = gpu_check.parse_args(["out"])
    assert (args.stage, args.dry_run, args.small, args.budget_s) == (None, False, False, 540.0)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["out", "--stage", "nope"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args([])
    stages = {"kernels": {"status": "failed"}, "executor": {"status": "running"},
              "cluster": {"status": "passed"}}
    # A failed stage has run; one left running (a call cut off) or a dry run has not.
    assert gpu_check.next_stage({"stages": stages}) == "executor"
    stages["executor"]["status"] = "dry-run"
    assert gpu_check.next_stage({"stages": stages}) == "executor"
    stages["executor"]["status"] = "passed"
    assert gpu_check.next_stage({"stages": stages}) == "throughput"
    stages["throughput"] = {"status": "passed"}
    assert gpu_check.next_stage({"stages": stages}) is None


def test_dry_run_records_every_stage_and_runs_nothing(tmp_path, capsys):
    for stage in gpu_check.STAGES:
        assert _run(tmp_path, "--dry-run", "--stage", stage) == 0
    report = _report(tmp_path)
    assert list(report["stages"]) == list(gpu_check.STAGES)
    for stage, entry in report["stages"].items():
        assert entry["status"] == "dry-run"
        assert list(entry["steps"])[0] == "env"
        for step in entry["steps"].values():
            assert step["status"] == "dry-run"
            scripts = [Path(a) for a in step["argv"] if a.endswith(".py")]
            assert scripts and all(p.is_file() for p in scripts), (stage, step["argv"])
    kernels = report["stages"]["kernels"]["steps"]
    assert "gpu" in kernels["pytest_gpu"]["argv"]
    assert str(ROOT / "tests" / "test_kernels_gpu.py") in kernels["pytest_gpu"]["argv"]
    assert report["stages"]["kernels"]["env"]["PAGEDSERVE_HTTP_PORT"] == "-1"
    assert not (tmp_path / "out" / "kernels.log").exists()
    # Dry runs do not count as done: with no --stage the first stage comes again.
    capsys.readouterr()
    assert _run(tmp_path, "--dry-run") == 0
    assert "[kernels] would run pytest_gpu" in capsys.readouterr().out


def test_steps_run_results_read_back_and_stages_merged(tmp_path, monkeypatch, capsys):
    plan = {
        "kernels": [
            gpu_check.Step("env", _py(ENV), 20, required=True),
            gpu_check.Step("bench", _py(BENCH + "; print('not json {'); print('{\"x\": 1}')"), 20),
            gpu_check.Step("pytest_gpu", _py(PYTEST), 20, reads="pytest"),
            gpu_check.Step("slow", _py("import time; print('started', flush=True); "
                                       "time.sleep(30)"), 0.5),
        ],
        "executor": [gpu_check.Step("env", _py(ENV), 20, required=True),
                     gpu_check.Step("bench", _py(BENCH), 20)],
    }
    monkeypatch.setattr(gpu_check, "plan_stage", _fake_plan(plan))
    assert _run(tmp_path, "--stage", "kernels") == 1
    out = capsys.readouterr().out
    assert "== kernels: FAILED" in out and "1 failed, 3 passed, 2 skipped" in out
    entry = _report(tmp_path)["stages"]["kernels"]
    steps = entry["steps"]
    assert entry["status"] == "failed" and entry["wall_s"] < 15
    assert steps["env"]["status"] == "passed"
    assert steps["bench"]["records"] == [{"bench": "kernels_bench", "case": "decode/b1",
                                          "latency_us_p50": 12.5, "copy_bw_ratio": 0.9}]
    assert steps["pytest_gpu"]["status"] == "failed" and steps["pytest_gpu"]["rc"] == 1
    assert steps["pytest_gpu"]["pytest"] == {"failed": 1, "passed": 3, "skipped": 2}
    assert steps["pytest_gpu"]["failures"] == ["FAILED tests/test_k.py::test_x - boom"]
    assert steps["slow"]["status"] == "timeout" and steps["slow"]["wall_s"] < 10
    assert steps["slow"]["tail"] == ["started"]
    assert _report(tmp_path)["env"] == {"ok": True, "torch": "2.11.0", "device": "FakeGPU"}
    log = (tmp_path / "out" / "kernels.log").read_text()
    assert "=== pytest_gpu:" in log and "=== slow: timeout" in log and "== kernels: FAILED" in log

    # No --stage: kernels has run (failed), so executor is next; kernels stays in the report.
    assert _run(tmp_path) == 0
    report = _report(tmp_path)
    assert report["stages"]["executor"]["status"] == "passed"
    assert report["stages"]["kernels"]["steps"]["pytest_gpu"]["pytest"]["passed"] == 3
    assert gpu_check.next_stage(report) == "cluster"
    capsys.readouterr()
    assert _run(tmp_path, "--list") == 0
    listing = capsys.readouterr().out
    assert "kernels      failed" in listing and "cluster      -" in listing


def test_required_step_failure_and_spent_budget_leave_steps_not_run(tmp_path, monkeypatch):
    plan = {"cluster": [gpu_check.Step("env", _py("raise SystemExit(3)"), 20, required=True),
                        gpu_check.Step("check", _py(BENCH), 20)],
            "throughput": [gpu_check.Step("bench", _py(BENCH), 20)]}
    monkeypatch.setattr(gpu_check, "plan_stage", _fake_plan(plan))
    assert _run(tmp_path, "--stage", "cluster") == 1
    steps = _report(tmp_path)["stages"]["cluster"]["steps"]
    assert (steps["env"]["status"], steps["env"]["rc"]) == ("failed", 3)
    assert steps["check"]["status"] == "not-run"
    assert _run(tmp_path, "--stage", "throughput", "--budget-s", "0") == 1
    step = _report(tmp_path)["stages"]["throughput"]["steps"]["bench"]
    assert step == {"argv": plan["throughput"][0].argv, "status": "not-run",
                    "error": "stage budget spent"}


def test_a_step_cut_by_the_stage_budget_says_so(tmp_path, monkeypatch):
    """A step stopped because the stage's budget ran out (its set-up steps count) is told
    apart from one that outlived its own limit (a hang)."""
    sleep = _py("import time; time.sleep(30)")
    plan = {"cluster": [gpu_check.Step("env", _py(ENV), 20, required=True),
                        gpu_check.Step("long", sleep, 60)],
            "throughput": [gpu_check.Step("hangs", sleep, 0.5)]}
    monkeypatch.setattr(gpu_check, "plan_stage", _fake_plan(plan))
    assert _run(tmp_path, "--stage", "cluster", "--budget-s", "6") == 1
    long = _report(tmp_path)["stages"]["cluster"]["steps"]["long"]
    assert long["status"] == "timeout" and long["wall_s"] < 10
    assert long["error"].startswith("cut by the stage budget (--budget-s): ")
    assert long["error"].endswith("the step may take 60")
    assert "cut by the stage budget" in (tmp_path / "out" / "cluster.log").read_text()
    assert _run(tmp_path, "--stage", "throughput", "--budget-s", "60") == 1
    hangs = _report(tmp_path)["stages"]["throughput"]["steps"]["hangs"]
    assert hangs["status"] == "timeout" and "error" not in hangs


def test_steps_picks_some_keeps_the_others_and_the_stage_is_partial(tmp_path, monkeypatch,
                                                                    capsys):
    plan = {"throughput": [gpu_check.Step("env", _py(ENV), 20, required=True),
                           gpu_check.Step("a", _py(BENCH), 20),
                           gpu_check.Step("b", _py(_line(bench="x", case="b1")), 20),
                           gpu_check.Step("c", _py("raise SystemExit(1)"), 20)]}
    monkeypatch.setattr(gpu_check, "plan_stage", _fake_plan(plan))
    # a name the stage lacks: an error naming the stage's steps
    with pytest.raises(SystemExit, match="no step nope .*its steps: env, a, b, c"):
        _run(tmp_path, "--stage", "throughput", "--steps", "a,nope")
    assert _run(tmp_path, "--stage", "throughput", "--steps", "a", "--dry-run") == 0
    assert list(_report(tmp_path)["stages"]["throughput"]["steps"]) == ["env", "a"]
    # one call runs a (and env): partial, not done
    assert _run(tmp_path, "--stage", "throughput", "--steps", "a") == 0
    entry = _report(tmp_path)["stages"]["throughput"]
    assert entry["status"] == "partial"
    assert {n: r["status"] for n, r in entry["steps"].items()} == {
        "env": "passed", "a": "passed", "b": "not-run", "c": "not-run"}
    assert entry["steps"]["b"]["error"] == "not selected (--steps)"
    done = {name: {"status": "passed"} for name in gpu_check.STAGES}
    assert gpu_check.next_stage({"stages": {**done, "throughput": entry}}) == "throughput"
    # the next call runs b: a's record is kept, the stage is still partial (c)
    assert _run(tmp_path, "--stage", "throughput", "--steps", "b") == 0
    entry = _report(tmp_path)["stages"]["throughput"]
    assert entry["status"] == "partial"
    assert entry["steps"]["a"]["records"][0]["case"] == "decode/b1"
    assert entry["steps"]["b"]["records"] == [{"bench": "x", "case": "b1"}]
    # c fails: the stage failed (it has run), a and b kept
    assert _run(tmp_path, "--stage", "throughput", "--steps", "c") == 1
    entry = _report(tmp_path)["stages"]["throughput"]
    assert entry["status"] == "failed" and entry["steps"]["a"]["status"] == "passed"
    assert "== throughput: FAILED" in capsys.readouterr().out


def test_seed_report_and_corrupt_report(tmp_path, monkeypatch):
    seed = tmp_path / "seed.json"
    seed.write_text(json.dumps({"version": 1, "env": {"torch": "2.11.0"},
                                "stages": {"kernels": {"status": "passed", "steps": {}}}}))
    monkeypatch.setattr(gpu_check, "plan_stage",
                        _fake_plan({"executor": [gpu_check.Step("bench", _py(BENCH), 20)]}))
    assert _run(tmp_path, "--seed-report", str(seed)) == 0
    report = _report(tmp_path)
    assert report["stages"]["kernels"]["status"] == "passed"
    assert report["stages"]["executor"]["status"] == "passed"
    assert report["env"] == {"torch": "2.11.0"}

    monkeypatch.undo()  # the real plans again
    path = tmp_path / "out" / gpu_check.REPORT
    path.write_text("{ cut off")
    assert _run(tmp_path, "--dry-run") == 0
    assert (tmp_path / "out" / "gpu_report.json.corrupt").read_text() == "{ cut off"
    assert list(_report(tmp_path)["stages"]) == ["kernels"]


def test_shell_wrapper(tmp_path):
    script = str(ROOT / "scripts" / "gpu_check.sh")
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
    usage = subprocess.run(["bash", script], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "usage" in usage.stderr
    done = subprocess.run(["bash", script, str(tmp_path / "o"), "--stage", "cluster",
                           "--dry-run", "--work-dir", str(tmp_path / "w")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "[cluster] would run bf16_migration" in done.stdout


def test_calls_wrapper_runs_stages_in_one_folder_and_returns_what_ran(tmp_path):
    """scripts/gpu_calls.sh: stages one after another into one report, copied out with a
    tarball of the rest; a malformed call refused; stages stopped at the call's seconds
    still leave what they wrote in the out folder."""
    script = str(ROOT / "scripts" / "gpu_calls.sh")
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
           "GPU_CALLS_WORK": str(tmp_path / "w")}
    usage = subprocess.run(["bash", script, str(tmp_path / "o")], capture_output=True,
                           text=True, env=env)
    assert usage.returncode == 2 and "usage" in usage.stderr
    out = tmp_path / "o"
    done = subprocess.run(["bash", script, str(out), "120", "kernels:pytest_gpu:200",
                           "executor:executor_bench,executor_bench_fp8_kv:100", "--",
                           "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "gpu_report.json").read_text())
    assert set(report["stages"]) == {"kernels", "executor"}
    assert (out / "rest.tgz").exists()
    bad = subprocess.run(["bash", script, str(tmp_path / "b"), "60", "kernels:pytest_gpu"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 1 and "expected STAGE:STEP" in bad.stderr
    slow = tmp_path / "slow.sh"  # a gpu_check that writes its log, then outlives the call
    slow.write_text("#!/bin/sh\necho started > \"$2/kernels.log\"\nsleep 30\n")
    slow.chmod(0o755)
    cut_out = tmp_path / "c"
    start = time.monotonic()
    cut = subprocess.run(["bash", script, str(cut_out), "2", "kernels:pytest_gpu:200"],
                         capture_output=True, text=True, env={**env, "PYTHON": str(slow)},
                         timeout=60)
    assert cut.returncode == 1 and time.monotonic() - start < 20
    assert (cut_out / "kernels.log").read_text() == "started\n"


def test_wheel_selection():
    names = gpu_wheels.first_names(ROOT / "pyproject.toml")
    for name in ("pyzmq", "msgspec", "grpcio-health-checking", "grpcio-reflection", "gguf",
                 "grpcio", "protobuf"):
        assert name in names
    for name in ("torch", "transformers", "triton", "numpy", "jinja2", "aiohttp"):
        assert name not in names
    assert len(set(names)) == len(names)


def test_bf16_judged_by_hf_bf16_drift_from_fp32():
    """gpu_cluster's bf16 rule: the tie is the largest float32 top-two gap where HF bf16
    itself left float32's path; an early divergence everywhere fails."""
    import gpu_cluster

    refs32 = [([1, 2, 3, 4], [5.0, 0.3, 2.0, 1.0]), ([7, 8, 9, 10], [4.0, 3.0, 0.9, 2.0])]
    refs16 = [([1, 2, 3, 4], [0.0] * 4), ([7, 8, 0, 0], [0.0] * 4)]  # one drift, gap 0.9
    noise = gpu_cluster.bf16_noise(refs16, refs32, floor=0.5)
    assert noise == {"hf_bf16_exact": 1, "hf_bf16_first_diff_p50": 3.0, "hf_bf16_diffs": 1,
                     "hf_bf16_max_gap": 0.9, "tie": 0.9}
    tie_ok = gpu_cluster.judge_bf16([[1, 2, 3, 4], [7, 8, 1, 1]], refs32, noise)
    assert tie_ok["ok"] and tie_ok["matched"] == 1 and tie_ok["tie_accepted"] == 1
    decisive = gpu_cluster.judge_bf16([[1, 2, 9, 4], [7, 8, 9, 10]], refs32, noise)
    # gap 2.0 > 2 x 0.9: an outlier, whatever the count
    assert not decisive["ok"] and decisive["mismatched"] == 1 and decisive["outliers"] == [2.0]
    # Within the tie, but early: a median first difference of 2.5 < half of 6.
    early = gpu_cluster.judge_bf16([[1, 5, 3, 4], [7, 8, 9, 10]],
                                   [(refs32[0][0], [5.0, 0.3, 2.0, 1.0]), refs32[1]],
                                   {**noise, "hf_bf16_first_diff_p50": 6.0})
    assert early["tie_accepted"] == 1 and early["first_diff_p50"] == 2.5
    assert early["ok"] is False


def test_bf16_beyond_the_tie_judged_by_how_often():
    """First differences past HF bf16's largest gap (but within twice it) pass while HF
    bf16's own spread makes that count likely, and fail when it does not."""
    import math

    import gpu_cluster

    assert gpu_cluster.beyond_max_p(18, 18, 0) == 1.0
    assert gpu_cluster.beyond_max_p(18, 18, 1) == 0.5
    assert gpu_cluster.beyond_max_p(18, 18, 4) == math.comb(18, 4) / math.comb(36, 4)  # 0.052
    assert gpu_cluster.beyond_max_p(18, 18, 5) < 0.05
    assert gpu_cluster.beyond_max_p(3, 0, 1) == 0.0  # HF bf16 never differed: none allowed

    # 18 prompts of 4 tokens; float32's gaps 1.0 everywhere but at position 2 of prompt i,
    # where HF bf16 differs at gap 1 + i / 100 (the largest 1.17).
    refs32 = [([1, 2, 3, 4], [1.0, 1.0, 1.0 + i / 100, 1.0]) for i in range(18)]
    refs16 = [([1, 2, 0, 0], [0.0] * 4) for _ in range(18)]
    noise = gpu_cluster.bf16_noise(refs16, refs32, floor=0.5)
    assert noise["tie"] == 1.17 and noise["hf_bf16_diffs"] == 18
    for beyond, ok in ((1, True), (4, True), (5, False)):
        # Ours differs at position 2 too, the first `beyond` prompts at gap 1.2 (past 1.17).
        refs = [([1, 2, 3, 4], [1.0, 1.0, 1.2 if i < beyond else 1.0, 1.0]) for i in range(18)]
        verdict = gpu_cluster.judge_bf16([[1, 2, 9, 9]] * 18, refs, noise)
        assert verdict["beyond_tie"] == beyond and verdict["ok"] is ok, verdict
        assert verdict["tie_accepted"] == 18 - beyond and not verdict["outliers"]


def test_bf16_logprob_drift_against_hf_bf16():
    """Teacher-forced drift from float32: ours may be at most 1.5x HF bf16's."""
    import types

    import gpu_cluster
    import numpy as np

    hf32 = [np.array([-1.0, -2.0, -0.5]), np.array([-3.0])]
    hf16 = [np.array([-1.1, -2.1, -0.4]), np.array([-3.1])]  # drift 0.1 everywhere

    def client(values):
        entries = iter(values)
        return types.SimpleNamespace(score=lambda seq: types.SimpleNamespace(
            prompt_logprobs=[types.SimpleNamespace(logprob=v) for v in next(entries)]))

    close = gpu_cluster.logprob_drift(client([[-1.05, -2.1, -0.45], [-3.2]]), [[1], [2]],
                                      hf32, hf16)
    assert close["ok"] and close["positions"] == 4
    assert close["drift_mean"] == pytest.approx(0.1, abs=1e-6)
    far = gpu_cluster.logprob_drift(client([[-1.5, -2.5, -1.0], [-3.5]]), [[1], [2]],
                                    hf32, hf16)
    assert not far["ok"] and far["drift_vs_hf_ratio"] == pytest.approx(5.0)
    short = gpu_cluster.logprob_drift(client([[-1.0], [-3.0]]), [[1], [2]], hf32, hf16)
    assert short == {"ok": False, "error": "prompt_logprobs of the wrong length"}


def test_a_step_runs_with_its_own_environment(tmp_path, monkeypatch):
    """Step.env reaches that step's process only (the throughput stage's one-step-at-a-time
    comparison sets PAGEDSERVE_OVERLAP_STEPS=0 for its executors), and is recorded."""
    show = ("import json, os; print(json.dumps({'bench': 'x', 'case': 'env_seen', "
            "'overlap': os.environ.get('PAGEDSERVE_OVERLAP_STEPS')}))")
    plan = {"throughput": [gpu_check.Step("plain", _py(show), 20),
                           gpu_check.Step("off", _py(show), 20,
                                          env={"PAGEDSERVE_OVERLAP_STEPS": "0"})]}
    real = gpu_check.plan_stage("throughput", gpu_check.Context(tmp_path, tmp_path))
    assert [s.env for s in real if s.name == "step_overhead_no_overlap"] == [
        {"PAGEDSERVE_OVERLAP_STEPS": "0"}]
    monkeypatch.delenv("PAGEDSERVE_OVERLAP_STEPS", raising=False)
    monkeypatch.setattr(gpu_check, "plan_stage", _fake_plan(plan))
    assert _run(tmp_path, "--stage", "throughput") == 0
    steps = _report(tmp_path)["stages"]["throughput"]["steps"]
    log = (tmp_path / "out" / "throughput.log").read_text()
    assert '"overlap": null' in log and '"overlap": "0"' in log
    assert "env" not in steps["plain"] and steps["off"]["env"] == {"PAGEDSERVE_OVERLAP_STEPS": "0"}


def test_pytest_output_read_back_with_the_slowest_tests():
    lines = ["..F.", "============ slowest 15 durations ============",
             "41.20s call     tests/test_cuda_graphs.py::test_graphs_equal_eager[bf16]",
             "3.05s setup    tests/test_kernels_gpu.py::test_decode_gpu[64-8]",
             "FAILED tests/test_k.py::test_x - boom",
             "1 failed, 226 passed, 3 skipped in 160.41s (0:02:40)"]
    out = gpu_check.read_output("pytest", lines)
    assert out["pytest"] == {"failed": 1, "passed": 226, "skipped": 3}
    assert out["failures"] == ["FAILED tests/test_k.py::test_x - boom"]
    assert out["slowest"] == lines[2:4]
    assert "slowest" not in gpu_check.read_output("pytest", lines[:1] + lines[4:])


def test_a_started_server_dies_with_the_process_that_started_it(tmp_path):
    """serve_process's children (a session of their own, out of a killed step's process
    group) are killed when their parent dies: a stand-in parent starts `sleep` the way
    ServeProcess starts serve, prints its pid and is SIGKILLed."""
    parent_code = (
        "import functools, os, subprocess, sys, time\n"
        f"sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
        "from serve_process import _die_with_parent\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True,\n"
        "                     preexec_fn=functools.partial(_die_with_parent, os.getpid()))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                              text=True)
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # running
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:  # reaped by init, or a zombie until then
            if f.read().split()[2] == "Z":
                return
        time.sleep(0.05)
    os.kill(child, 9)
    raise AssertionError("the child outlived its parent")


def test_env_stops_a_stage_on_a_device_others_hold(monkeypatch, capsys):
    """The env step fails (the stage stops) when less than half the device is free before
    it starts, naming the processes holding it: a stray server from an earlier step."""
    import types

    import gpu_steps
    import torch

    props = types.SimpleNamespace(name="FakeGPU", major=9, minor=0,
                                  multi_processor_count=132, total_memory=80 << 30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_steps, "_gpu_processes", lambda: "4242, python3, 65536 MiB")
    args = types.SimpleNamespace(small=False)
    for free, rc in ((70 << 30, 0), (12 << 30, 1)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i, f=free: (f, 80 << 30))
        assert gpu_steps.cmd_env(args) == rc
        out, err = capsys.readouterr()
        record = json.loads(out.splitlines()[-1])
        assert record["free_memory_gib"] == free / 2**30 and record["ok"] is (rc == 0)
        assert ("other processes hold it: 4242, python3, 65536 MiB" in err) is (rc == 1)
