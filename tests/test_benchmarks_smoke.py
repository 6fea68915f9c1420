"""Smoke tests for the router benchmarks: each script runs in its quick setting and prints
JSON lines with the keys DESIGN §8 and benchmarks/README.md promise. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert lines, proc.stderr[-2000:]
    for line in lines:
        assert line["bench"] == Path(script).stem
        assert isinstance(line["case"], str) and line["case"]
    return lines


def test_scheduler_bench_quick():
    lines = _run("scheduler_bench.py", "--quick")
    by_case = {r["case"]: r for r in lines}
    assert set(by_case) == {"W1", "W2", "W3", "W1_x4", "W2_x4", "W3_x4"}
    keys = ("workload", "step_us_p50", "step_us_p90", "wall_s", "preemptions",
            "prefix_hit_rate", "num_steps", "router_tok_per_s")
    for r in lines:
        for k in keys:
            assert k in r, (r["case"], k)
        assert r["step_us_p50"] > 0 and r["num_steps"] > 0
        assert 0.0 <= r["prefix_hit_rate"] <= 1.0
    # Every request ran to max_tokens: 32 x 256, 64 x 32, 32 x 512 output tokens.
    assert by_case["W1"]["generated_tokens"] == 32 * 256
    assert by_case["W2"]["generated_tokens"] == 64 * 32
    assert by_case["W3"]["generated_tokens"] == 32 * 512
    assert by_case["W1"]["preemptions"] == 0 and by_case["W3"]["preemptions"] > 0
    assert by_case["W2"]["prefix_hit_rate"] > 0.5  # the shared 1,024-token prefix hits
    assert by_case["W1_x4"]["num_executors"] == 4 and "round_us_p50" in by_case["W1_x4"]


def test_hop_bench_quick():
    lines = _run("hop_bench.py", "--quick")
    by_case = {r["case"]: r for r in lines}
    assert set(by_case) == {"codec", "frames", "zmq_sync_ping", "zmq_sync", "router_link"}
    for case in ("zmq_sync_ping", "zmq_sync", "router_link"):
        r = by_case[case]
        assert r["rtt_us_p50"] > 0 and r["rtt_us_p99"] >= r["rtt_us_p50"]
        assert r["iterations"] == 200
    codec = by_case["codec"]
    for k in ("plan_encode_us_p50", "plan_decode_us_p50", "result_decode_us_p50",
              "plan_bytes", "result_bytes"):
        assert codec[k] > 0
    frames = by_case["frames"]
    assert frames["frames_per_message"] == 3  # routing id, header, the arrays' frame
    for way in ("multipart", "zmq_io"):
        assert frames[f"{way}_send_us_p50"] > 0 and frames[f"{way}_recv_us_p50"] > 0


def test_step_overhead_quick_fake():
    """The fake-executor case (router + 1 wire fake executor, no torch): the step trace and
    the CPU probes are read and every promised figure is there (~5 s)."""
    lines = _run("step_overhead.py", "--quick", "--fake-only")
    assert [r["case"] for r in lines] == ["fake_e1_r8_d2"]
    r = lines[0]
    for k in ("itl_ms_p50", "forward_ms_p50", "gap_ms_p50", "gap_ms_p99", "idle_ms_p50",
              "output_tok_per_s", "tokens_per_chunk", "router_cpu_ms_per_step",
              "text_cpu_ms_per_step",
              "plan_cpu_ms_per_step", "edge_cpu_ms_per_step", "loop_other_cpu_ms_per_step",
              "threads_cpu_ms_per_step", "gc_cpu_ms_per_step", "gc_pause_ms_max"):
        assert r[k] is not None, k
    assert len(r["gc_collections"]) == 3 and r["gc_tracked_objects"] > 0
    assert r["router_event_loop"].split(".")[0] in ("uvloop", "asyncio")
    assert r["steps"] > 0 and r["forward_ms_p50"] >= 20.0 and r["gap_reported"]
    assert r["tokens_per_chunk"] >= 1.0
    assert "stream_errors" not in r


def test_step_overhead_clients_in_processes():
    """--client-procs 2: the streams from two spawned processes, every stream's tokens
    collected back, the output counted as from one process."""
    lines = _run("step_overhead.py", "--quick", "--fake-only", "--client-procs", "2",
                 "--client-channels", "2")
    assert [r["case"] for r in lines] == ["fake_e1_r8_d2_c2_p2"]
    r = lines[0]
    assert r["client_procs"] == 2 and "stream_errors" not in r
    assert r["output_tok_per_s"] > 0 and r["steps"] > 0
    # each token the executor sampled in the window reached a client (the window's edges
    # can split a step from its tokens: a few percent either way)
    assert abs(r["output_tok_per_s"] - r["trace_tok_per_s"]) <= 0.1 * r["trace_tok_per_s"]
    assert 0 < r["client_loop_cpu_util_ratio"] <= r["client_cpu_util_ratio"]


def test_engine_bench_quick():
    """The in-process engine at full speed: every stream decodes, the windows are timed."""
    lines = _run("engine_bench.py", "--streams", "8", "--steps", "100", "--window", "50")
    assert [r["case"] for r in lines] == ["engine_s8"]
    r = lines[0]
    assert r["running"] == 8 and r["steps"] >= 100
    assert len(r["engine_us_per_step_windows"]) == 2 and r["engine_us_per_step_p50"] > 0
    # into an EdgeHub's forwarding channels: Outputs messages, the tokens in their columns
    (r,) = _run("engine_bench.py", "--streams", "8", "--steps", "100", "--window", "50",
                "--sink", "hub")
    assert r["case"] == "engine_s8_hub" and r["running"] == 8
    assert r["hub_messages"] > 0 and r["hub_column_tokens"] >= 8 * 100
    # --churn: about one request ends, and a new one is admitted, a step
    (r,) = _run("engine_bench.py", "--streams", "8", "--steps", "100", "--window", "50",
                "--churn")
    assert r["case"] == "engine_s8_churn" and r["steps"] >= 100
    assert r["requests_admitted"] >= 8 + 80


def test_structured_bench_quick(tmp_path):
    from pagedserve.tinymodels import build_model
    model = build_model(tmp_path / "m", "llama")
    lines = _run("structured_bench.py", "--model", str(model), "--batches", "1,4",
                 "--reps", "2", "--advance", "3")
    by_case = {r["case"]: r for r in lines}
    assert by_case["vocab_index"]["vocab"] == 512
    for fmt in ("json_schema", "json_object", "regex", "choice"):
        for b in (1, 4):
            mask, sampler = by_case[f"mask_{fmt}_b{b}"], by_case[f"sampler_{fmt}_b{b}"]
            assert mask["fill_us_p50"] > 0 and mask["apply_us_p50"] > 0
            assert sampler["constrained_us_p50"] > 0 and sampler["plain_us_p50"] > 0


def test_feature_soak_short():
    """With weight updates under the load too (waiting, then by a retract pause)."""
    lines = _run("feature_soak.py", "--duration", "4", "--executors", "1", "--clients", "3",
                 "--weight-updates", "1")
    [summary] = lines
    assert summary["case"] == "summary" and summary["ok"], summary
    assert summary["requests"] > 0 and summary["blocks_leaked"] == 0
    assert summary["counts"]["weights/update_weights_from_disk/200"] >= 2
    assert summary["counts"]["weights/pause_generation/200"] >= 1


def test_http_soak_short():
    """With a client of stored and background Responses beside the others."""
    lines = _run("http_soak.py", "--duration", "4", "--executors", "1", "--clients", "4",
                 "--responses", "1")
    [summary] = lines
    assert summary["case"] == "summary" and summary["ok"], summary
    endings = {key.split("/")[1] for key in summary["counts"]}
    assert {"unary", "stream", "drop", "chain", "poll"} <= endings
    assert summary["blocks_leaked"] == 0


def test_responses_bench_store_case():
    (line,) = _run("responses_bench.py", "--cases", "store_ops", "--ops", "50")
    assert line["case"] == "store_ops" and line["ops"] == 50 and line["record_bytes"] > 0
    assert sorted(line["put"]) == sorted(line["get"]) == ["max_ms", "p50_ms"]


def test_kernels_bench_layer_and_tune_cases_dry_run():
    """The fused layer kernels' cases, the decode and prefill launch sweeps and the sampling
    kernels run end to end through the interpreter (figures are meaningless there; a GPU gives them)."""
    records = _run("kernels_bench.py", "--dry-run", "--cases", "layer,prefill_tune,tune,sampling")
    cases = {r["case"]: r for r in records}
    top_p = cases["top_p/v600/r4/unresolved4"]
    assert top_p["kernel_latency_us_p50"] > 0 and top_p["sort_latency_us_p50"] > 0
    assert cases["argmax/v600/r4"]["speedup_ratio"] > 0
    assert cases["draw/v600/r4"]["latency_us_p50"] > 0
    assert cases["top_p_parts/v600/r4"]["topk256_latency_us_p50"] > 0
    decode = cases["tune/qwen2.5_0.5b/b2/ctx600"]
    assert set(decode["splits"]) == {"1", "2", "1_n128", "2_n128", "2_n128_fused"}
    assert decode["default_latency_us_p50"] > 0 and decode["rule_splits"] == 2
    tune = cases["prefill_tune/qwen2.5_0.5b/b2/q19"]
    assert set(tune["configs"]) == {"r64_n64_w4_s2", "r64_n64_w4_s3"}
    assert tune["default_latency_us_p50"] > 0 and tune["best"] in tune["configs"]
    assert {"layer/rms_norm_residual/t4", "layer/rotary_embedding/t4", "layer/silu_and_mul/t4",
            "layer/layer_set/t4", "layer/rotary_and_cache/t4"} <= set(cases)
    assert tune["default"] == "r64_n64_w4"  # the launcher's own choice for float32 (dry run)
    assert cases["layer/rotary_and_cache/t4"]["two_launches_latency_us_p50"] > 0
    assert all(r["latency_us_p50"] > 0 and r["fused_speedup_ratio"] > 0
               for r in records if r["case"].startswith("layer/"))


def test_kernels_bench_decode_tail_and_rope_cases_dry_run():
    """The decode kernel at contexts ending inside a tile and on one (four launch variants
    and a copy of the same bytes), through a graph-wide table (its splits mostly empty),
    and the rotary in the decode launch, through the interpreter."""
    records = _run("kernels_bench.py", "--dry-run", "--cases",
                   "decode_tail,decode_rope,decode_wide")
    cases = {r["case"]: r for r in records}
    assert {"decode_tail/qwen2.5_0.5b/b2/ctx64", "decode_tail/qwen2.5_0.5b/b2/ctx101",
            "decode_rope/qwen2.5_0.5b/b2/ctx40", "decode_wide/qwen2.5_0.5b/b2/ctx40"} <= set(cases)
    wide = cases["decode_wide/qwen2.5_0.5b/b2/ctx40"]
    assert (wide["exact_num_splits"], wide["wide_num_splits"]) == (1, 4)
    assert wide["wide_vs_exact_ratio"] > 0 and wide["exact_latency_us_p50"] > 0
    for r in records:
        if r["case"].startswith("decode_tail/"):
            assert all(r[k] > 0 for k in ("latency_us_p50", "every_tile_latency_us_p50",
                                          "n64_latency_us_p50", "n64_every_tile_latency_us_p50",
                                          "same_size_copy_gb_per_s", "copy_bw_ratio_same_size"))
    assert cases["decode_rope/qwen2.5_0.5b/b2/ctx40"]["two_launches_latency_us_p50"] > 0


def test_executor_bench_profile_on_cpu(tmp_path):
    """--profile's per-step operator table (on a GPU: device kernels, in the GPU check), and
    the pipelined loop's trace: host phases per step, nested as they run, and the trace."""
    records = {r["case"]: r for r in _run("executor_bench.py", "--cpu-only", "--steps", "6",
                                           "--profile", "--trace-dir", str(tmp_path))}
    trace = records["trace_cpu_tiny_b128_pipelined"]
    host = trace["host_us_per_step"]
    assert trace["steps"] == 3 and trace["step_us_mean"] > 0
    assert {"submit", "prepare", "forward_launch", "logits_launch", "sampler_launch",
            "append_tokens", "read_back", "loop_other_us"} <= set(host)
    inside = host["prepare"] + host["forward_launch"] + host["sampler_launch"]
    assert 0 < inside < host["submit"] <= trace["step_us_mean"] * 1.05
    assert (tmp_path / "trace_cpu_tiny_b128_pipelined.json.gz").stat().st_size > 1000
    prof = records["profile_cpu_tiny_b128"]
    assert prof["steps"] == 3 and prof["kernels_per_step"] > 10
    assert prof["top"] and all(t["name"].startswith("aten::") for t in prof["top"])
    host = records["host_profile_cpu_tiny_b128"]
    assert host["steps"] == 3 and host["calls_per_step"] > 100 and len(host["top"]) == 15
    assert {"cpu_tiny_decode_b1", "cpu_tiny_decode_b128"} <= set(records)
    # the mixed steps (a 32-token prompt beside 32 decodes): kernels, host, own loop
    mixed = "cpu_tiny_b32_mixed_chunk32"
    assert records[f"profile_{mixed}"]["steps"] == 3
    assert records[f"host_profile_{mixed}"]["calls_per_step"] > 100
    loop = records[f"serve_loop_{mixed}"]
    assert loop["steps"] == 3 and loop["prefill_tokens"] == 32 and loop["forward_us_p50"] > 0
    assert loop["step_us_mean"] > 0 and loop["vs_decode_step_ratio"] > 0


def test_cancel_bench_small():
    records = _run("cancel_bench.py", "--streams", "8", "--tokens", "40")
    (case,) = records
    assert case["case"] == "s8_t40" and case["tokens_median"] >= 40
    assert case["blocks_held"] > 0 and case["all_free_after_s"] > 0


def test_steady_serving_small(tmp_path):
    """Both runs (pieces, then PAGEDSERVE_MIXED_GRAPHS=0) serve every request in full; on a
    CPU neither has graphs, so the figures say nothing here."""
    from pagedserve.tinymodels import build_model

    model = build_model(tmp_path / "tiny", "qwen2")
    records = {r["case"]: r for r in _run("steady_serving.py", "--model-dir", str(model),
                                           "--small", "--log-dir", str(tmp_path / "logs"))}
    assert records["summary"]["ok"], records
    for case in ("steady_pieces", "steady_eager"):
        assert records[case]["completed"] == 16 and records[case]["failed"] == 0
    assert (tmp_path / "logs" / "steady_eager.log").is_file()


def test_launch_overhead_runs():
    records = {r["case"]: r for r in _run("launch_overhead.py", "--calls", "50")}
    assert set(records) == {"paged_attention_decode", "paged_attention_prefill",
                            "rotary_embedding_and_cache", "rms_norm_residual", "silu_and_mul",
                            "argmax_rows", "keyed_draw"}
    assert all(r["us_per_call"] > 0 for r in records.values())


def test_host_sync_bench_runs():
    """On a CPU the buffer cases alone (no events, nothing pinned)."""
    records = {r["case"]: r for r in _run("host_sync_bench.py", "--calls", "50")}
    assert set(records) == {"tokens_copy_fresh", "tokens_copy_pooled"}
    assert all(r["us_per_call"] > 0 and r["device"] == "cpu" for r in records.values())


def test_detok_bench_quick(tmp_path):
    """The text path's cases on the tiny byte-level tokenizer: every case makes the same
    text (stop strings that never match hold nothing back at the end)."""
    from pagedserve.tinymodels import build_tokenizer
    build_tokenizer(tmp_path)
    lines = _run("detok_bench.py", "--model-dir", str(tmp_path), "--reps", "1")
    assert [r["case"] for r in lines] == ["push", "append", "append_stops2"]
    assert all(r["concatenating_decoder"] and r["tokens"] > 1000 for r in lines)
    assert len({r["text_crc32"] for r in lines}) == 1


def test_predicted_outputs_bench_replay(tmp_path):
    """The replay part on the tiny tokenizer: every edit under every mode; the prediction
    takes fewer decodes than the lookup alone, which takes fewer than none, and the
    identity edit's prediction drafts are never rejected."""
    from pagedserve.tinymodels import build_tokenizer
    build_tokenizer(tmp_path)
    lines = _run("predicted_outputs_bench.py", "--model", str(tmp_path))
    rows = {(r["edit"], r["mode"]): r for r in lines}
    edits = ("identity", "rename", "insert", "delete", "annotate")
    assert set(rows) == {(e, m) for e in edits for m in ("none", "lookup", "prediction",
                                                          "both")}
    for e in edits:
        none, lookup, pred = (rows[e, m]["decodes"] for m in ("none", "lookup", "prediction"))
        assert pred < lookup < none == rows[e, "none"]["output_tokens"] - 3
    assert rows["identity", "prediction"]["drafts_rejected"] == 0


def test_lora_load_bench_executor_case(tmp_path):
    """The executor's side of loading adapters while serving, on the tiny model."""
    from pagedserve.tinymodels import build_model
    model = build_model(tmp_path / "m", "llama")
    (line,) = _run("lora_load_bench.py", "--model", str(model), "--cycles", "2",
                   "--cases", "executor_ops")
    assert line["case"] == "executor_ops" and line["cycles"] == 2
    assert {k: sorted(line[k]) for k in ("load", "read_alone", "unload")} == {
        k: ["max_ms", "p50_ms"] for k in ("load", "read_alone", "unload")}


def test_weight_update_bench_executor_case(tmp_path):
    """The executor's side of a weight update, on the tiny model (copies of its weights)."""
    from pagedserve.tinymodels import build_model
    model = build_model(tmp_path / "m", "llama")
    (line,) = _run("weight_update_bench.py", "--model", str(model), "--cycles", "2",
                   "--cases", "executor_ops")
    assert line["case"] == "executor_ops" and line["cycles"] == 4
    assert sorted(line["check"]) == sorted(line["load"]) == ["max_ms", "p50_ms"]
    assert line["parameters"] > 0 and line["load_gb_per_s"] > 0


def test_executor_host_virtual_device():
    """The executor process on the virtual device: every decode step runs as a fed graph
    (its ids the previous step's tokens, left on the "device"), the figures are there, and
    a device slower than the host is kept busy."""
    lines = _run("executor_host.py", "--rows", "8", "--depths", "2", "--steps", "60",
                 "--warmup", "10", "--device-ms", "0,3", "--phases")
    assert [r["case"] for r in lines] == ["b8_d2_dev0ms", "b8_d2_dev3ms"]
    for r in lines:
        assert r["steps"] == 50
        # Every one of the 59 decode steps ran as a fed graph.
        assert sum(r["fed_steps"]) == 59, r
        for key in ("step_us_p50", "step_us_mean", "device_idle_us_p50", "host_cpu_us_per_step",
                    "main_cpu_us_per_step", "io_cpu_us_per_step", "switches_per_step"):
            assert r[key] is not None and r[key] >= 0, (r["case"], key)
        # --phases: the executor's own timers, a plan's worth, on the thread they run on
        phases = r["phases_cpu_wall_calls_per_step"]
        for thread, labels in (("main", ("execute", "prepare", "forward", "read_back")),
                               ("io", ("decode", "precompute", "encode", "send"))):
            for label in labels:
                cpu, wall, calls = phases[thread][label]
                assert 0 < cpu <= wall * 1.5 + 50 and calls > 0.5, (thread, label)
    fast, slow = lines
    assert fast["busy_ratio"] is None and fast["wake_late_us_p50"] is None
    # A 3 ms device step is far slower than the host's work: it paces the steps, and each
    # step is launched before the one in flight is read back, so its ids are that step's
    # tokens left on the device (all but the first decode's: the prompts' step's tokens,
    # sampled eagerly, are copied in). With an instant device the step in flight is often
    # read back first (ids from the host: the stage). Under a full suite's load the host
    # now and then finishes a step's read-back before the next launch anyway (54 of 59 in
    # one run): most, not all.
    assert 0.5 < slow["busy_ratio"] <= 1.0 and slow["step_us_mean"] >= 3000 * 0.95
    assert slow["fed_steps"][1] >= 45, slow
    # A step still running when the main thread has no plan to wait on is answered through
    # the flight watch (its thread woke a step); one the device is done with, at once (an
    # instant device: no watch thread at all).
    assert slow["watch_switches_per_step"] >= 1, slow
    assert not fast.get("watch_switches_per_step"), fast


def test_sampler_memory_bench_cases_in_process():
    """Two of its cases in this process (the script runs each in a fresh one): 48 rows
    sampled the costliest way whole and in chunks of 16 give the same tokens."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import sampler_memory_bench as bench
    finally:
        sys.path.pop(0)
    whole = bench.child("smollm2-135m", 48, 48, "costliest", as_executor=False)
    chunked = bench.child("smollm2-135m", 48, 16, "costliest", as_executor=False)
    assert whole["case"] == "costliest_48_by_48" and chunked["case"] == "costliest_48_by_16"
    assert whole["tokens_digest"] == chunked["tokens_digest"]
    for r in (whole, chunked):
        assert r["bench"] == "sampler_memory_bench" and r["ms"] > 0
        assert r["peak_mib"] >= r["kept_mib"] - 1 and set(r) >= {"peak_mib", "kept_mib"}


def test_row_padding_bench_on_the_tiny_model(tmp_path):
    """A pass at every row count and decode steps padded and not (on a CPU that packs
    bfloat16; elsewhere one `skipped` line), on the tiny model."""
    from pagedserve.tinymodels import build_model
    model = build_model(tmp_path / "m", "llama")
    lines = _run("row_padding_bench.py", "--model", str(model), "--batches", "1,3",
                 "--repeats", "1")
    if lines[0]["case"] == "skipped":
        return
    assert [r["case"] for r in lines] == [f"pass_rows_{r}" for r in range(1, 9)] + [
        "decode_b1", "decode_b3"]
    assert all(r["pass_ms_p50"] > 0 for r in lines[:8])
    for r in lines[8:]:
        assert r["padded_step_ms_p50"] > 0 and r["unpadded_step_ms_p50"] > 0
        assert all(1 <= int(rows) < to <= 8 for rows, to in r["table"].items())
